"""The controller's side of AgentService: one bidi stream per node agent.

Per stream, a named receiver thread reads the agent's messages: event batches are
committed to the store (idempotently, keyed by (agent_id, epoch, seq)) and acked only
after the commit; heartbeats update the node's liveness and health samples. The
response generator sends the Welcome, the acks and any commands posted for that node.

``AgentRegistry`` is what the rest of the controller sees: which nodes have a live
agent, when each was last heard from, and a way to send a command to a node.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from controlplane.auth import TOKEN_METADATA_KEY, tokens_equal
from controlplane.errors import UnavailableError
from controlplane.store import Store
from fleet_proto import agent_pb2, agent_pb2_grpc, events_pb2

log = logging.getLogger(__name__)


@dataclass
class AgentSession:
    """One connected agent stream."""

    agent_id: str
    node_name: str
    epoch: int
    local_address: str
    outbox: queue.Queue[agent_pb2.ControllerMessage] = field(default_factory=queue.Queue)
    last_heard: float = field(default_factory=time.monotonic)
    connected: bool = True
    batches: int = 0
    events: int = 0
    duplicates: int = 0


class AgentRegistry:
    """Live agent sessions by node name (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._sessions: dict[str, AgentSession] = {}

    def attach(self, session: AgentSession) -> None:
        with self._lock:
            old = self._sessions.get(session.node_name)
            if old is not None:
                old.connected = False
            self._sessions[session.node_name] = session
            self._lock.notify_all()

    def detach(self, session: AgentSession) -> None:
        with self._lock:
            session.connected = False
            self._lock.notify_all()

    def connected_nodes(self) -> set[str]:
        with self._lock:
            return {n for n, s in self._sessions.items() if s.connected}

    def session(self, node_name: str) -> AgentSession | None:
        with self._lock:
            return self._sessions.get(node_name)

    def wait_for(self, nodes: set[str], timeout_s: float) -> set[str]:
        """Wait until every node in ``nodes`` has a connected agent; return the missing ones."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                missing = nodes - {n for n, s in self._sessions.items() if s.connected}
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._lock.wait(min(left, 0.5))

    def send(self, node_name: str, command: events_pb2.Command) -> None:
        session = self.session(node_name)
        if session is None or not session.connected:
            raise UnavailableError(f"node {node_name} has no connected agent")
        session.outbox.put(agent_pb2.ControllerMessage(command=command))

    def silent_for(self, now: float) -> dict[str, float]:
        """Seconds since each connected agent was last heard from (monotonic clock)."""
        with self._lock:
            return {n: now - s.last_heard for n, s in self._sessions.items() if s.connected}


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """Accepts agent streams, commits their batches, acks them, relays commands."""

    def __init__(self, store: Store, registry: AgentRegistry, token: str, controller_id: str) -> None:
        self._store = store
        self._registry = registry
        self._token = token
        self._controller_id = controller_id

    def Connect(
        self, request_iterator: Iterator[agent_pb2.AgentMessage], context: grpc.ServicerContext
    ) -> Iterator[agent_pb2.ControllerMessage]:
        metadata = dict(context.invocation_metadata())
        if not tokens_equal(metadata.get(TOKEN_METADATA_KEY), self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-fleet-token")
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        if first.WhichOneof("msg") != "hello" or not first.hello.node_name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Hello with node_name")
        hello = first.hello
        if not tokens_equal(hello.token, self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong token in Hello")

        session = AgentSession(
            agent_id=hello.agent_id or f"agent-{hello.node_name}",
            node_name=hello.node_name,
            epoch=hello.epoch,
            local_address=hello.local_address,
        )
        self._store.upsert_node(hello.node_name, hello.ray_node_id, hello.hostname, "{}")
        committed = self._store.committed_seq(session.agent_id, session.epoch)
        self._registry.attach(session)
        log.info("agent %s connected (epoch %d, committed seq %d)", session.agent_id, session.epoch, committed)

        done = threading.Event()
        receiver = threading.Thread(
            target=self._receive,
            args=(request_iterator, session, context, done),
            name=f"fleet-agent-rx-{session.node_name}",
            daemon=True,
        )
        receiver.start()
        yield agent_pb2.ControllerMessage(
            welcome=agent_pb2.Welcome(controller_id=self._controller_id, committed_seq=committed)
        )
        try:
            while not done.is_set() and context.is_active():
                try:
                    yield session.outbox.get(timeout=0.1)
                except queue.Empty:
                    continue
            # drain acks produced just before the stream ended
            while not session.outbox.empty() and context.is_active():
                yield session.outbox.get_nowait()
        finally:
            done.set()
            self._registry.detach(session)
            log.info("agent %s disconnected", session.agent_id)

    def _receive(
        self,
        request_iterator: Iterator[agent_pb2.AgentMessage],
        session: AgentSession,
        context: grpc.ServicerContext,
        done: threading.Event,
    ) -> None:
        try:
            for msg in request_iterator:
                session.last_heard = time.monotonic()
                kind = msg.WhichOneof("msg")
                if kind == "batch":
                    self._ingest(session, msg.batch)
                elif kind == "heartbeat":
                    h = msg.heartbeat.host
                    self._store.record_health(
                        session.node_name, msg.heartbeat.time_ns, h.cpu_percent, h.load1,
                        h.mem_used_bytes, h.mem_total_bytes, h.workers_alive,
                    )
        except grpc.RpcError:
            pass  # the agent went away; it resends unacked batches on reconnect
        except Exception:
            log.exception("agent %s: ingest failed; closing its stream", session.agent_id)
            context.cancel()
        finally:
            done.set()

    def _ingest(self, session: AgentSession, batch: agent_pb2.EventBatch) -> None:
        if batch.agent_id != session.agent_id or batch.epoch != session.epoch:
            log.warning("agent %s sent a batch for %s/%d; ignored", session.agent_id, batch.agent_id, batch.epoch)
            return
        fresh = self._store.record_batch(batch.agent_id, batch.epoch, batch.seq, batch.events)
        session.batches += 1
        if fresh:
            session.events += len(batch.events)
        else:
            session.duplicates += 1
        session.outbox.put(agent_pb2.ControllerMessage(ack=agent_pb2.Ack(epoch=batch.epoch, seq=batch.seq)))
