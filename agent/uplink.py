"""The agent's one bidirectional gRPC stream to the controller.

Outbound: Hello, then event batches and heartbeats. Inbound: Welcome, Acks, Commands.

Delivery invariant: an event leaves the agent's memory only after the controller acked
the batch holding it, i.e. after the store committed it. Batches carry
(agent_id, epoch, seq); after a reconnect every unacked batch is sent again, and the
controller's idempotent ingest drops the ones it already has. Memory is bounded by
``max_unacked_batches``; past that ``submit`` blocks (backpressure to the workers'
Report calls) instead of dropping.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from fleet_proto import agent_pb2, agent_pb2_grpc, events_pb2

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-fleet-token"


class Uplink:
    """Streams events to the controller; hands inbound commands to ``on_command``."""

    def __init__(
        self,
        *,
        controller_address: str,
        token: str,
        hello: agent_pb2.Hello,
        on_command: Callable[[events_pb2.Command], None],
        heartbeat: Callable[[], agent_pb2.Heartbeat],
        batch_max_events: int = 2000,
        batch_interval_s: float = 0.2,
        heartbeat_interval_s: float = 1.0,
        max_unacked_batches: int = 1024,
        reconnect_max_s: float = 2.0,
    ) -> None:
        self._address = controller_address
        self._token = token
        self._hello = hello
        self._on_command = on_command
        self._heartbeat = heartbeat
        self._batch_max = batch_max_events
        self._batch_interval_s = batch_interval_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._max_unacked = max_unacked_batches
        self._reconnect_max_s = reconnect_max_s

        self._cond = threading.Condition()
        self._pending: list[events_pb2.Event] = []          # not yet in a batch
        self._unacked: collections.OrderedDict[int, agent_pb2.EventBatch] = collections.OrderedDict()
        self._seq = 0
        self._closing = False
        self._stopped = threading.Event()
        self._connected = threading.Event()
        self._welcomed = threading.Event()
        self.reconnects = 0
        self.acked_events = 0
        self._thread = threading.Thread(
            target=self._run, name=f"fleet-agent-uplink-{hello.node_name}", daemon=True
        )

    # -- public ---------------------------------------------------------------------

    def start(self) -> Uplink:
        self._thread.start()
        return self

    def submit(self, events: list[events_pb2.Event], timeout_s: float = 30.0) -> None:
        """Queue events for the controller. Blocks (bounded) while too much is unacked."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._unacked) >= self._max_unacked and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("controller is not acknowledging batches")
                self._cond.wait(left)
            self._pending.extend(events)
            self._cond.notify_all()

    def wait_welcomed(self, timeout_s: float) -> bool:
        """True once the controller accepted this agent's Hello."""
        return self._welcomed.wait(timeout_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is committed by the controller."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.notify_all()
            while self._pending or self._unacked:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    @property
    def backlog(self) -> int:
        """Events not yet acknowledged by the controller."""
        with self._cond:
            return len(self._pending) + sum(len(b.events) for b in self._unacked.values())

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Flush (bounded), then stop the stream and its thread."""
        if self._thread.is_alive():
            self.flush(flush_timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._stopped.set()
        call = getattr(self, "_call", None)
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5)

    # -- stream ---------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set():
            try:
                with grpc.insecure_channel(self._address) as channel:
                    stub = agent_pb2_grpc.AgentServiceStub(channel)
                    conn_done = threading.Event()
                    self._call = stub.Connect(
                        self._outbound(conn_done),
                        metadata=((TOKEN_METADATA_KEY, self._token),),
                    )
                    try:
                        for msg in self._call:
                            backoff = 0.1
                            self._inbound(msg)
                    finally:
                        conn_done.set()
                        self._connected.clear()
            except grpc.RpcError as exc:
                if self._stopped.is_set():
                    break
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("controller refused this agent: %s", exc.details())
                else:
                    log.warning("stream to controller broke (%s); reconnecting", code)
            except Exception:  # the uplink thread must never die silently
                log.exception("uplink error; reconnecting")
            if self._stopped.wait(backoff):
                break
            backoff = min(backoff * 2, self._reconnect_max_s)
            self.reconnects += 1

    def _outbound(self, conn_done: threading.Event) -> Iterator[agent_pb2.AgentMessage]:
        yield agent_pb2.AgentMessage(hello=self._hello)
        with self._cond:
            resend = list(self._unacked.values())
        for batch in resend:
            yield agent_pb2.AgentMessage(batch=batch)
        self._connected.set()
        next_heartbeat = time.monotonic()
        while not conn_done.is_set() and not self._stopped.is_set():
            now = time.monotonic()
            if now >= next_heartbeat:
                next_heartbeat = now + self._heartbeat_interval_s
                yield agent_pb2.AgentMessage(heartbeat=self._heartbeat())
            batch = self._cut_batch(timeout_s=min(self._batch_interval_s, next_heartbeat - now))
            if batch is not None:
                yield agent_pb2.AgentMessage(batch=batch)

    def _cut_batch(self, timeout_s: float) -> agent_pb2.EventBatch | None:
        """Wait up to timeout_s for events; return the next batch, or None."""
        with self._cond:
            if len(self._pending) < self._batch_max and not self._closing:
                self._cond.wait_for(
                    lambda: len(self._pending) >= self._batch_max or self._closing,
                    timeout=max(timeout_s, 0.0),
                )
            if not self._pending or len(self._unacked) >= self._max_unacked:
                return None
            events, self._pending = self._pending[: self._batch_max], self._pending[self._batch_max :]
            self._seq += 1
            batch = agent_pb2.EventBatch(
                agent_id=self._hello.agent_id, epoch=self._hello.epoch, seq=self._seq, events=events
            )
            self._unacked[self._seq] = batch
            return batch

    def _inbound(self, msg: agent_pb2.ControllerMessage) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "ack":
            if msg.ack.epoch != self._hello.epoch:
                return
            with self._cond:
                while self._unacked and next(iter(self._unacked)) <= msg.ack.seq:
                    _, batch = self._unacked.popitem(last=False)
                    self.acked_events += len(batch.events)
                self._cond.notify_all()
        elif kind == "command":
            self._on_command(msg.command)
        elif kind == "welcome":
            self._welcomed.set()
