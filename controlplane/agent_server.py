"""The controller's side of AgentService: one bidi stream per node agent.

Per stream, a named receiver thread reads the agent's messages. An event batch is
validated and turned into rows right there (``ingest.prepare``), then queued for the
store's single writer (``IngestWriter``), which commits it idempotently, keyed by
(agent_id, epoch, seq), and acks it after the commit. A batch that fails validation is
recorded as dropped and acked as rejected, in its place in the stream's order.
An optional observer (the controller's watchdog) sees every valid batch's rows on the
receiver thread before they are queued; it must be cheap, and its errors are logged,
never allowed to break ingest. Node checks (``on_node_check``, the controller's
``node_checks.NodeChecks.observe``) are handed each known-answer GEMM result of a valid
batch, with the stream's node, once the batch is queued; their errors are logged too.
Heartbeats update the node's liveness and health samples; DropReports (events an agent
lost) are stored in ``ingest_drops``. The response generator sends the Welcome, the
acks and any commands posted for that node.

Refusals never crash anything and are counted in ``fleet_ingest_errors_total``: a
missing or wrong token (UNAUTHENTICATED), bytes that are not an AgentMessage
(INVALID_ARGUMENT), a message over the size limit (RESOURCE_EXHAUSTED, by gRPC itself),
a stream that breaks the protocol (INVALID_ARGUMENT), an invalid batch (rejected ack).

``AgentRegistry`` is what the rest of the controller sees: which nodes have a live
agent, when each was last heard from, and a way to send a command to a node.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from fleet.controlplane.auth import tokens_equal
from fleet.controlplane.errors import UnavailableError
from fleet.controlplane.metrics import ControllerMetrics
from fleet.controlplane.store import HealthRecord, Store
from fleet.controlplane.store.ingest import InvalidBatch, PreparedBatch, count_events, prepare
from fleet.controlplane.store.writer import IngestWriter, Item

#: What the AgentService deserializer returns for bytes that are not an AgentMessage,
#: and for a message over the size limit.
MALFORMED = object()
OVERSIZED = object()
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.contract import TOKEN_METADATA_KEY

log = logging.getLogger(__name__)

#: Sees each valid batch's rows: (node name of the agent, rows). Called on a receiver thread.
BatchObserver = Callable[[str, PreparedBatch], None]
#: Takes one node check result: (node name of the agent, its "gemm" SdcCheckEvent).
NodeCheckSink = Callable[[str, events_pb2.SdcCheckEvent], None]


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
    failed: bool = False
    #: Set when the stream must end: the agent went away, or ``fail`` was called.
    done: threading.Event = field(default_factory=threading.Event)
    status: tuple[grpc.StatusCode, str] | None = None

    def ack(self, msg: agent_pb2.ControllerMessage) -> None:
        self.outbox.put(msg)

    def fail(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """End this stream with ``code`` (the agent reconnects and resends what is unacked)."""
        if not self.failed:
            self.failed = True
            self.status = (code, reason)
            log.warning("agent %s: closing its stream (%s): %s", self.agent_id, code.name, reason)
        self.done.set()


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
    """Accepts agent streams, queues their batches for the writer, relays commands.

    Owns the ``IngestWriter``; ``close()`` commits what is queued and stops it.
    ``observer`` (optional) is shown every batch that passed validation, before the
    writer gets it; ``on_node_check`` (optional) every node check result in one."""

    def __init__(self, store: Store, registry: AgentRegistry, token: str, controller_id: str,
                 metrics: ControllerMetrics | None = None, observer: BatchObserver | None = None,
                 on_node_check: NodeCheckSink | None = None) -> None:
        self._store = store
        self._registry = registry
        self._token = token
        self._controller_id = controller_id
        self.metrics = metrics or ControllerMetrics()
        self.writer = IngestWriter(store, self.metrics)
        self._observer = observer
        self._observer_failed = False
        self._on_node_check = on_node_check

    def close(self) -> None:
        """Commit what is queued, stop the writer and the metrics endpoint, if served."""
        self.writer.close()
        self.metrics.close()

    def _refuse(self, context: grpc.ServicerContext, reason: str, code: grpc.StatusCode,
                detail: str) -> None:
        self.metrics.errors.labels(reason).inc()
        context.abort(code, detail)

    def Connect(
        self, request_iterator: Iterator[agent_pb2.AgentMessage], context: grpc.ServicerContext
    ) -> Iterator[agent_pb2.ControllerMessage]:
        metadata = dict(context.invocation_metadata())
        if not tokens_equal(metadata.get(TOKEN_METADATA_KEY), self._token):
            self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                         f"missing or wrong {TOKEN_METADATA_KEY}")
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        if first is MALFORMED:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message is not an AgentMessage")
        if first is OVERSIZED:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the first message is over the size limit")
        if first.WhichOneof("msg") != "hello" or not first.hello.node_name:
            self._refuse(context, "protocol", grpc.StatusCode.INVALID_ARGUMENT,
                         "the first message must be a Hello with node_name")
        hello = first.hello
        if not tokens_equal(hello.token, self._token):
            self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                         "wrong token in Hello")

        session = AgentSession(
            agent_id=hello.agent_id or f"agent-{hello.node_name}",
            node_name=hello.node_name,
            epoch=hello.epoch,
            local_address=hello.local_address,
        )
        self._store.upsert_node(hello.node_name, hello.ray_node_id, hello.hostname, "{}")
        committed = self._store.committed_seq(session.agent_id, session.epoch)
        self._registry.attach(session)
        self.metrics.agents.inc()
        log.info("agent %s connected (epoch %d, committed seq %d)", session.agent_id, session.epoch, committed)

        done = session.done
        receiver = threading.Thread(
            target=self._receive,
            args=(request_iterator, session),
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
            if session.status is not None:
                context.abort(*session.status)
        finally:
            done.set()
            self._registry.detach(session)
            self.metrics.agents.dec()
            log.info("agent %s disconnected", session.agent_id)

    def _receive(self, request_iterator: Iterator[agent_pb2.AgentMessage],
                 session: AgentSession) -> None:
        try:
            for msg in request_iterator:
                session.last_heard = time.monotonic()
                if msg is MALFORMED:
                    session.fail("a message is not an AgentMessage", grpc.StatusCode.INVALID_ARGUMENT)
                    return
                if msg is OVERSIZED:
                    session.fail("a message is over the size limit", grpc.StatusCode.RESOURCE_EXHAUSTED)
                    return
                kind = msg.WhichOneof("msg")
                if kind == "batch":
                    if not self._queue_batch(session, msg.batch):
                        return
                elif kind == "heartbeat":
                    h = msg.heartbeat.host
                    self.writer.put_health(HealthRecord(
                        session.node_name, msg.heartbeat.time_ns, h.cpu_percent, h.load1,
                        h.mem_used_bytes, h.mem_total_bytes, h.workers_alive))
                elif kind == "drop":
                    self._record_agent_drop(session, msg.drop)
                else:
                    self.metrics.errors.labels("protocol").inc()
                    session.fail(f"unexpected {kind or 'empty'} message after the Hello",
                                 grpc.StatusCode.INVALID_ARGUMENT)
                    return
        except grpc.RpcError:
            pass  # the agent went away; it resends unacked batches on reconnect
        except Exception:
            log.exception("agent %s: receiving failed; closing its stream", session.agent_id)
            session.fail("the controller failed to read the stream")
        finally:
            session.done.set()

    def _queue_batch(self, session: AgentSession, batch: agent_pb2.EventBatch) -> bool:
        if batch.agent_id != session.agent_id or batch.epoch != session.epoch:
            self.metrics.errors.labels("protocol").inc()
            session.fail(f"batch for {batch.agent_id}/{batch.epoch} on the stream of "
                         f"{session.agent_id}/{session.epoch}", grpc.StatusCode.INVALID_ARGUMENT)
            return False
        try:
            rows, rejected = prepare(batch.events), ""
        except InvalidBatch as exc:
            rows, rejected = None, str(exc)
        if rows is not None and self._observer is not None:
            self._observe(session, rows)
        item = Item(session, batch.epoch, batch.seq, rows, count_events(batch.events), rejected)
        while not self.writer.put(item, timeout_s=0.5):
            if session.done.is_set():
                return False
        if rows is not None and rows.sdc and self._on_node_check is not None:
            self._node_checks(session, batch.events)
        return True

    def _node_checks(self, session: AgentSession, events: Iterable[events_pb2.Event]) -> None:
        for event in events:
            if event.WhichOneof("kind") != "sdc" or event.sdc.kind != "gemm":
                continue
            try:
                self._on_node_check(session.node_name, event.sdc)  # type: ignore[misc]
            except Exception:
                log.exception("agent %s: handling a node check failed (ingest goes on)", session.agent_id)

    def _observe(self, session: AgentSession, rows: PreparedBatch) -> None:
        try:
            self._observer(session.node_name, rows)  # type: ignore[misc]
        except Exception:
            # the first failure with its traceback; a broken observer must not flood the log
            if not self._observer_failed:
                self._observer_failed = True
                log.exception("agent %s: the batch observer failed (ingest goes on)", session.agent_id)
            else:
                log.debug("agent %s: the batch observer failed again", session.agent_id, exc_info=True)

    def _record_agent_drop(self, session: AgentSession, drop: agent_pb2.DropReport) -> None:
        self.metrics.dropped.labels("agent").inc(drop.events)
        log.error("agent %s lost %d events (batches %d-%d): %s", session.agent_id, drop.events,
                  drop.first_seq, drop.last_seq, drop.reason)
        self._store.record_drop(session.agent_id, session.node_name, drop.epoch, drop.first_seq,
                                drop.last_seq, drop.events, drop.reason, "agent")
