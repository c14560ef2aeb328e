"""The agent's one bidirectional gRPC stream to the controller.

Outbound: Hello, then event batches, drop reports and heartbeats. Inbound: Welcome,
Acks, Commands.

Delivery invariant: an event leaves the agent only after the controller acked the batch
holding it, i.e. after the store committed it, or after the controller rejected that
batch as malformed (``Ack.rejected``: counted, logged, never resent). Batches carry
(agent_id, epoch, seq); after a reconnect every unacked batch is sent again, and the
controller's idempotent ingest drops the ones it already has.

Write-ahead log (with a spill folder, ``settings.wal``): ``submit`` returns only once the
events are written to the folder's log (``agent.spool``), so the agent can answer the
worker that sent them; every batch is cut to a file there, and also kept in memory while
``memory_max_bytes`` allows. A later process of the same agent (a new epoch) adopts what
this one left: it resends those batches first, under their own (agent_id, epoch, seq),
which the controller commits at most once, and knows which worker reports they hold
(``durable``), so a worker's retry of one is answered without taking its events again.

Bounds. A batch holds at most ``batch_max_events`` events and ``batch_max_bytes`` of
them (a single larger event goes alone). Unacked batches stay in memory up to
``memory_max_bytes`` (plus the batch being filled, under ``batch_max_bytes``) and on
disk up to ``spill_max_bytes`` (with the log, every batch is on disk; without it, only
those that do not fit in memory); past both, ``submit`` blocks (bounded) so the workers
keep their events: backpressure, never a drop for being slow. A log write that fails
(disk full) leaves those events in memory only, counted in ``stats()["unlogged_events"]``. The stream itself is paced by gRPC
flow control: the outbound generator is pulled for the next message only once the
previous one was written, and only then sends (or, for a partial batch older than
``batch_interval_s``, cuts) the next batch. Full batches are cut as they fill, so the
memory/spill bounds hold while the controller is away.

Loss is explicit: a batch whose spill write fails (ENOSPC, EFBIG, EIO...), or whose
spill file cannot be read back, and an event larger than the controller's message
limit, are dropped, counted, logged once per burst, and reported to the controller in a
``DropReport`` that stays queued until written to a stream.

Partition (the chaos fault): ``partition(duration_s)`` blocks the stream both ways for
that long, as if the network to the controller were cut. Nothing is sent (no batches,
heartbeats or drop reports, and no (re)connect), nothing received is acted on (acks and
commands wait in gRPC's buffers), while ``submit`` keeps taking events into memory and
spill as usual. The controller sees the agent fall silent. When it ends, the stream
carries on, or, if it broke meanwhile, the uplink reconnects and resends what is
unacked; the delivery invariant above holds throughout.

Events are serialized once, in ``submit``; a batch is kept (and spilled) as the bytes of
its ``EventBatch``, built by concatenation (protobuf's encoding of a repeated message
field is the concatenation of its elements), and sent without re-encoding.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from fleet.agent.backoff import reconnect_delays
from fleet.agent.settings import AgentSettings
from fleet.agent.spool import Predecessor, Spool
from fleet.proto import agent_pb2, events_pb2
from fleet.proto.contract import (
    AGENT_MESSAGE_BATCH_TAG,
    CONNECT_METHOD_PATH,
    EVENT_BATCH_EVENTS_TAG,
    EVENT_BATCH_MARKS_TAG,
    MESSAGE_HEADROOM_BYTES,
    TOKEN_METADATA_KEY,
    encode_varint,
)
from fleet.proto.tls import TlsFiles, channel_credentials

log = logging.getLogger(__name__)

#: Drops closer together than this form one burst, logged once.
DROP_BURST_GAP_S = 10.0
#: A large job's agent (``collective_fronts``) sends its heartbeat, with its host's
#: health, at least this often while its batches keep the stream busy (seconds).
QUIET_HEALTH_INTERVAL_S = 10.0

_HEARTBEAT = object()


def _length_delimited(tag: bytes, data: bytes) -> bytes:
    """One length-delimited field: its key (from ``fleet.proto.contract``), length, bytes."""
    return tag + encode_varint(len(data)) + data


@dataclass
class _Batch:
    """One unacked batch: its EventBatch bytes in memory, the file they are in, or both."""

    seq: int
    n_events: int
    size: int
    data: bytes | None = None
    path: Path | None = None
    epoch: int = 0          # a predecessor's epoch (0: this process's own batch)


class _Conn:
    """Per-stream state of the outbound generator."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.cursor = 0             # highest seq sent on this stream
        self.stale_sent = (0, 0)    # (epoch, seq) of the last predecessor's batch sent
        self.next_heartbeat = 0.0
        self.last_heartbeat = 0.0


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
        settings: AgentSettings | None = None,
        reconnect_max_s: float = 2.0,
        tls: TlsFiles | None = None,
        on_ack: Callable[[int, int], None] | None = None,
    ) -> None:
        """``settings``: batching, buffering, heartbeats (None: ``AgentSettings``' defaults);
        an empty ``settings.spill_dir``: no spill, ``submit`` blocks once
        ``memory_max_bytes`` is unacked. ``on_ack(seq, n_events)`` runs on the stream's
        thread after each commit."""
        settings = settings if settings is not None else AgentSettings()
        if settings.batch_max_events < 1 or settings.batch_max_bytes < 1:
            raise ValueError("batch_max_events and batch_max_bytes must be positive")
        if settings.max_message_bytes <= MESSAGE_HEADROOM_BYTES:
            raise ValueError(f"max_message_bytes must exceed {MESSAGE_HEADROOM_BYTES}")
        spill_dir = settings.spill_dir or None
        self._address = controller_address
        self._token = token
        self._hello = hello
        self._hello_msg = b""   # encoded in start(): the caller may fill in the Hello until then
        self._on_command = on_command
        self._heartbeat = heartbeat
        self._batch_max_events = settings.batch_max_events
        self._batch_max_bytes = settings.batch_max_bytes
        self._batch_interval_s = settings.batch_interval_s
        self._heartbeat_interval_s = settings.heartbeat_interval_s
        # a large job's agent sends a heartbeat only when its stream fell quiet, and for its
        # host's health every QUIET_HEALTH_INTERVAL_S: a batch a second says "alive" already,
        # and the controller keeps one health sample per node every ~10 s at that scale
        self._quiet_heartbeats = settings.collective_fronts
        self._memory_max = settings.memory_max_bytes
        self._spill_max = settings.spill_max_bytes if spill_dir is not None else 0
        self._max_event_bytes = settings.max_message_bytes - MESSAGE_HEADROOM_BYTES
        self._reconnect_max_s = reconnect_max_s
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._on_ack = on_ack
        self._spool = Spool(spill_dir, hello.agent_id, hello.epoch) if spill_dir is not None else None
        self._wal = self._spool is not None and settings.wal and self._spill_max > 0

        self._cond = threading.Condition()
        # events not yet in a batch, each already encoded as an EventBatch.events field
        # (and after each submission's events, its ReportMark, encoded as an EventBatch.marks field)
        self._pending: list[bytes] = []
        self._pending_events = 0
        self._pending_bytes = 0
        self._wal_ok = True           # the log of the batch being filled holds all of it
        self._mem_only_bytes = 0      # batches in memory that the log could not take
        # predecessors' unacked batches, oldest first, and the worker reports they hold
        self._stale: list[_Batch] = []
        self._durable: dict[str, int] = {}
        self._pending_since = 0.0
        self._unacked: collections.OrderedDict[int, _Batch] = collections.OrderedDict()
        self._unacked_events = 0
        self._mem_bytes = 0
        self._spill_bytes = 0
        self._spilled = 0
        self._seq = 0
        # DropReports not yet written to a stream; the head one may be in flight
        self._drops: collections.deque[agent_pb2.DropReport] = collections.deque()
        self._drop_in_flight: agent_pb2.DropReport | None = None
        self._last_drop_at = -DROP_BURST_GAP_S   # monotonic time of the latest drop
        self._drops_unlogged = 0
        self._flushing = 0
        self._partition_until = 0.0   # monotonic; the stream is blocked until then
        self._closing = False
        self._stopped = threading.Event()
        self._welcomed = threading.Event()
        self._call: grpc.Call | None = None
        self.reconnects = 0
        self.partitions = 0
        self.acked_events = 0
        self.dropped_events = 0
        self.dropped_batches = 0
        self.rejected_events = 0
        self.unlogged_events = 0      # taken while the write-ahead log could not be written
        self.resent_events = 0        # predecessors' events committed through this process
        self._thread = threading.Thread(
            target=self._run, name=f"fleet-agent-uplink-{hello.node_name}", daemon=True
        )

    # -- public ---------------------------------------------------------------------

    def start(self) -> Uplink:
        self._hello_msg = agent_pb2.AgentMessage(hello=self._hello).SerializeToString()
        if self._spool is not None:
            self._adopt_stale()
        self._thread.start()
        return self

    def submit(self, events: list[events_pb2.Event], timeout_s: float = 30.0,
               mark: agent_pb2.ReportMark | None = None, urgent: bool = False) -> None:
        """Queue events for the controller; with the write-ahead log, they are on disk
        when this returns. ``mark``: the worker report they came from (see ``durable``).
        ``urgent``: the batch holding them goes out now, not after ``batch_interval_s``
        (what a diagnosis waits for, e.g. a trace pull's answer).

        Blocks while memory and spill are both full; TimeoutError after ``timeout_s``
        (or once closed): then none of ``events`` was taken and the caller keeps them.
        """
        fields = [_length_delimited(EVENT_BATCH_EVENTS_TAG, e.SerializeToString()) for e in events]
        too_big = [len(f) for f in fields if len(f) > self._max_event_bytes]
        if too_big:
            fields = [f for f in fields if len(f) <= self._max_event_bytes]
        mark_field = _length_delimited(EVENT_BATCH_MARKS_TAG, mark.SerializeToString() if mark else b"")
        incoming = sum(len(f) for f in fields) + len(mark_field)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._room_for(incoming):
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    raise TimeoutError(
                        "uplink is closed" if self._closing else
                        "controller is not acknowledging batches (memory and spill are full)"
                    )
                self._cond.wait(left)
            if self._closing:
                raise TimeoutError("uplink is closed")
            if too_big:
                self._drop(0, 0, len(too_big), f"{len(too_big)} event(s) of up to {max(too_big)} bytes exceed "
                           f"the controller's message limit ({self._max_event_bytes} bytes per event)")
            if not fields:
                return
            self._log(fields, mark_field)
            if not self._pending:
                self._pending_since = time.monotonic()
            if urgent:
                self._pending_since = time.monotonic() - self._batch_interval_s
            self._pending.extend(fields)
            self._pending.append(mark_field)
            self._pending_events += len(fields)
            self._pending_bytes += incoming
            while self._pending_events and (self._pending_events >= self._batch_max_events
                                            or self._pending_bytes >= self._batch_max_bytes):
                self._cut()
            self._cond.notify_all()

    def durable(self, reporter: str, report_id: int) -> bool:
        """True if a predecessor of this agent already made that worker report durable
        (its events are resent from the log; the worker's retry must not add them again)."""
        return bool(reporter) and report_id <= self._durable.get(reporter, 0)

    def wait_welcomed(self, timeout_s: float) -> bool:
        """True once the controller accepted this agent's Hello."""
        return self._welcomed.wait(timeout_s)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is committed (or rejected, or dropped
        and its DropReport written to the stream)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._pending or self._unacked or self._drops or self._stale:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.05))
            finally:
                self._flushing -= 1
        return True

    def partition(self, duration_s: float) -> None:
        """Cut this agent off from the controller for ``duration_s`` seconds (> 0): see
        the module docstring. A partition already in effect is extended, never shortened."""
        if not duration_s > 0:
            raise ValueError(f"a partition lasts > 0 s, not {duration_s}")
        with self._cond:
            self._partition_until = max(self._partition_until, time.monotonic() + duration_s)
            self.partitions += 1
            self._cond.notify_all()
        log.warning("partitioned from the controller for %.1f s (chaos fault): sending and receiving "
                    "nothing, buffering workers' events", duration_s)

    def end_partition(self) -> None:
        """End a partition now (no-op when there is none)."""
        with self._cond:
            self._partition_until = 0.0
            self._cond.notify_all()

    def partitioned(self) -> bool:
        """True while a partition blocks the stream."""
        with self._cond:
            return time.monotonic() < self._partition_until

    @property
    def backlog(self) -> int:
        """Events not yet acknowledged by the controller."""
        with self._cond:
            return self._held_events()

    def stats(self) -> dict[str, int]:
        """Counters since start: events acked, dropped (spill failed, too large), rejected
        by the controller; what is buffered now (events; batches and bytes on disk)."""
        with self._cond:
            return {
                "acked_events": self.acked_events,
                "backlog": self._held_events(),
                "memory_bytes": self._mem_bytes + self._pending_bytes,
                "spilled_batches": self._spilled,
                "spilled_bytes": self._spill_bytes,
                "dropped_events": self.dropped_events,
                "dropped_batches": self.dropped_batches,
                "rejected_events": self.rejected_events,
                "unlogged_events": self.unlogged_events,
                "resent_events": self.resent_events,
                "stale_batches": len(self._stale),
                "reconnects": self.reconnects,
                "partitions": self.partitions,
            }

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """End any partition, flush (bounded), then stop the stream and its thread. What
        is still unacked then is lost (logged); spill files are deleted."""
        self.end_partition()
        if self._thread.is_alive():
            self.flush(flush_timeout_s)
        with self._cond:
            self._closing = True
            self._stopped.set()   # under the lock: a thread blocked by a partition wakes
            self._cond.notify_all()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.ident is not None:   # not when closed without being started
            self._thread.join(timeout=5)
        with self._cond:
            lost = self._held_events()
            if lost or self._drops:
                log.error("closing with %d event(s) not acknowledged by the controller and %d drop "
                          "report(s) unsent; they are lost", lost, len(self._drops))
            self._unacked.clear()
            self._pending.clear()
            self._stale.clear()
            self._mem_bytes = self._spill_bytes = self._pending_bytes = self._spilled = 0
            self._pending_events = self._mem_only_bytes = 0
            if self._spool is not None:
                self._spool.close()

    def __enter__(self) -> Uplink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- buffering (all under self._cond) ---------------------------------------------

    def _held_events(self) -> int:
        """Events not yet acknowledged: pending, this process's batches, predecessors'."""
        return self._pending_events + self._unacked_events + sum(b.n_events for b in self._stale)

    def _room_for(self, incoming: int) -> bool:
        queued = self._pending_bytes + incoming
        if self._wal:
            # everything unacked is on disk (memory copies are a cache), except what the
            # log could not take
            if (self._spill_bytes + queued <= self._spill_max
                    and self._mem_only_bytes + queued <= self._memory_max):
                return True
        elif self._mem_bytes + queued <= self._memory_max or self._spill_bytes + queued <= self._spill_max:
            return True
        # alone, one oversized submission is taken (else it would wait forever)
        return not self._pending and not self._unacked

    def _log(self, fields: list[bytes], mark_field: bytes) -> None:
        """Append one submission to the write-ahead log (under the lock)."""
        if not self._wal:
            return
        if self._wal_ok:
            assert self._spool is not None
            try:
                self._spool.append(self._seq + 1, b"".join(fields) + mark_field)
                return
            except OSError as exc:
                self._wal_ok = False
                log.error("write-ahead log write failed (%s): events are kept in memory only until the "
                          "next batch is cut; an agent killed meanwhile loses them", _oserror_text(exc))
        self.unlogged_events += len(fields)

    def _cut(self) -> _Batch | None:
        """Make the next batch of pending events; keep it in memory, on disk, or both.

        None when it could be kept nowhere (the batch is then dropped and reported)."""
        n, size, k = 0, 0, 0
        for f in self._pending:
            if f[:1] == EVENT_BATCH_EVENTS_TAG:  # an event (marks ride along, 0 events)
                if n >= self._batch_max_events or (n and size + len(f) > self._batch_max_bytes):
                    break
                n += 1
            size += len(f)
            k += 1
        fields = self._pending[:k]
        del self._pending[:k]
        self._pending_events -= n
        self._pending_bytes -= size
        if self._pending:
            self._pending_since = time.monotonic()
        self._seq += 1
        header = agent_pb2.EventBatch(
            agent_id=self._hello.agent_id, epoch=self._hello.epoch, seq=self._seq
        ).SerializeToString()
        data = header + b"".join(fields)
        batch = _Batch(seq=self._seq, n_events=n, size=len(data))
        fits_memory = self._mem_bytes + batch.size <= self._memory_max
        if self._wal:
            assert self._spool is not None
            failure, was_ok = "", self._wal_ok
            try:
                batch.path, self._wal_ok = self._spool.cut(batch.seq, n, data, b"".join(self._pending))
            except OSError as exc:
                failure = _oserror_text(exc)
                self._wal_ok = False
            if batch.path is not None:
                self._spill_bytes += batch.size
                self._spilled += 1
                if fits_memory:
                    batch.data = data
                    self._mem_bytes += batch.size
            elif self._mem_only_bytes + batch.size <= self._memory_max:
                if was_ok:  # once per run of failures, not once per batch
                    log.error("write-ahead log: batch %d (%d events) is in memory only (%s), and so are the "
                              "next ones until a write succeeds", batch.seq, n, failure)
                self.unlogged_events += n
                batch.data = data
                self._mem_bytes += batch.size
                self._mem_only_bytes += batch.size
            else:
                self._drop(batch.seq, batch.seq, n, f"write-ahead log write failed ({failure}) and memory is full")
                return None
            self._unacked[batch.seq] = batch
            self._unacked_events += n
            return batch
        fits_spill = self._spill_bytes + batch.size <= self._spill_max
        if fits_memory or not fits_spill:
            batch.data = data
            self._mem_bytes += batch.size
        else:
            assert self._spool is not None  # fits_spill implies a spill folder
            try:
                batch.path = self._spool.write(batch.seq, n, data)
            except OSError as exc:
                self._drop(batch.seq, batch.seq, n, f"spill write failed: {_oserror_text(exc)}")
                return None
            self._spill_bytes += batch.size
            self._spilled += 1
        self._unacked[batch.seq] = batch
        self._unacked_events += n
        return batch

    def _forget(self, batch: _Batch) -> None:
        """Release one batch's memory and file (it left ``_unacked`` or ``_stale``)."""
        if not batch.epoch:
            self._unacked_events -= batch.n_events
        if batch.path is not None:
            assert self._spool is not None
            self._spool.remove(batch.path)
            self._spill_bytes -= batch.size
            self._spilled -= 1
        if batch.data is not None:
            self._mem_bytes -= batch.size
            if batch.path is None:
                self._mem_only_bytes -= batch.size

    def _drop(self, first_seq: int, last_seq: int, n_events: int, reason: str) -> None:
        """Count lost events, log the first of a burst, queue (or extend) a DropReport."""
        self.dropped_events += n_events
        self.dropped_batches += 1 if first_seq else 0
        now = time.monotonic()
        if now - self._last_drop_at > DROP_BURST_GAP_S:
            earlier = f" ({self._drops_unlogged} more drop(s) since the last message)" if self._drops_unlogged else ""
            log.error("dropping %d event(s) (batch seq %d): %s%s; the drops that follow within %.0f s are "
                      "counted in stats() and reported to the controller, not logged",
                      n_events, first_seq, reason, earlier, DROP_BURST_GAP_S)
            self._drops_unlogged = 0
        else:
            self._drops_unlogged += 1
        self._last_drop_at = now
        last = self._drops[-1] if self._drops else None
        if (last is not None and last is not self._drop_in_flight and first_seq
                and last.last_seq + 1 == first_seq and last.reason == reason):
            last.last_seq = last_seq
            last.events += n_events
        else:
            self._drops.append(agent_pb2.DropReport(
                agent_id=self._hello.agent_id, epoch=self._hello.epoch, first_seq=first_seq,
                last_seq=last_seq, events=n_events, reason=reason, time_ns=time.time_ns(),
            ))
        self._cond.notify_all()

    def report_loss(self, n_events: int, reason: str) -> None:
        """Record events lost before they reached this agent (e.g. a worker's buffer
        overflowed): counted, logged, and sent to the controller as a DropReport."""
        with self._cond:
            self._drop(0, 0, n_events, reason)

    def _adopt_stale(self) -> None:
        """Take over what earlier processes of this agent left: their batches go out first."""
        assert self._spool is not None
        for pred in self._spool.take_stale():
            self._adopted(pred)

    def _adopted(self, pred: Predecessor) -> None:
        for reporter, report_id in pred.reports.items():
            self._durable[reporter] = max(report_id, self._durable.get(reporter, 0))
        events = sum(b.n_events for b in pred.batches)
        if pred.batches:
            log.warning("an earlier run of %s (epoch %d) left %d batch(es) (%d events) unacknowledged; "
                        "resending them", self._hello.agent_id, pred.epoch, len(pred.batches), events)
        if pred.torn_events:
            log.info("an earlier run of %s (epoch %d) died writing %d event(s) it never acknowledged to "
                     "their worker, which sends them again", self._hello.agent_id, pred.epoch, pred.torn_events)
        with self._cond:
            for b in pred.batches:
                self._stale.append(_Batch(seq=b.seq, n_events=b.n_events, size=b.size, path=b.path,
                                          epoch=b.epoch))
                self._spill_bytes += b.size
                self._spilled += 1

    # -- stream ---------------------------------------------------------------------

    def _channel(self) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(self._address, self._credentials)
        return grpc.insecure_channel(self._address)

    def _await_partition_end(self) -> bool:
        """Block while partitioned; False if the uplink stopped meanwhile."""
        with self._cond:
            while not self._stopped.is_set():
                left = self._partition_until - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
        return False

    def _run(self) -> None:
        delays = reconnect_delays(max_s=self._reconnect_max_s)
        while self._await_partition_end():
            try:
                with self._channel() as channel:
                    connect = channel.stream_stream(
                        CONNECT_METHOD_PATH,
                        request_serializer=None,  # the generator yields encoded AgentMessages
                        response_deserializer=agent_pb2.ControllerMessage.FromString,
                    )
                    conn = _Conn()
                    with self._cond:
                        # an unconfirmed DropReport of an earlier stream is sent again
                        self._drop_in_flight = None
                    self._call = connect(
                        self._outbound(conn), metadata=((TOKEN_METADATA_KEY, self._token),)
                    )
                    try:
                        for i, msg in enumerate(self._call):
                            if not self._await_partition_end():
                                break
                            if i == 0:  # the controller answered: the next break starts over
                                delays = reconnect_delays(max_s=self._reconnect_max_s)
                            self._inbound(msg)
                    finally:
                        with self._cond:
                            conn.done.set()
                            self._cond.notify_all()
            except grpc.RpcError as exc:
                if self._stopped.is_set():
                    break
                code = exc.code() if hasattr(exc, "code") else None
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    log.error("controller refused this agent: %s", exc.details())
                else:
                    details = exc.details() if hasattr(exc, "details") else ""
                    log.warning("stream to controller broke (%s: %s); reconnecting", code, details)
            except Exception:  # the uplink thread must never die silently
                log.exception("uplink error; reconnecting")
            if self._stopped.wait(next(delays)):  # jittered: see agent/backoff.py
                break
            with self._cond:
                self.reconnects += 1

    def _outbound(self, conn: _Conn) -> Iterator[bytes]:
        if not self._await_partition_end():
            return
        yield self._hello_msg
        while True:
            item = self._next_out(conn)
            if item is None:
                return
            if item is _HEARTBEAT:
                yield agent_pb2.AgentMessage(heartbeat=self._heartbeat()).SerializeToString()
            elif isinstance(item, bytes):
                yield item
            else:
                assert isinstance(item, _Batch) and item.path is not None
                try:
                    data = Spool.read(item.path)
                except OSError as exc:
                    self._spill_lost(item, exc)
                    continue
                yield _length_delimited(AGENT_MESSAGE_BATCH_TAG, data)

    def _next_out(self, conn: _Conn) -> object | None:
        """The next message for this stream: encoded bytes, a spilled _Batch to read,
        _HEARTBEAT, or None once the stream is over. Waits (bounded) for one."""
        with self._cond:
            if conn.done.is_set() or self._stopped.is_set():
                return None
            if self._drop_in_flight is not None:
                # gRPC pulls the next message only after the previous one was written. A
                # report whose stream broke before that is sent again, so the controller
                # may see it twice; (agent_id, epoch, first_seq) identifies it.
                if self._drops and self._drops[0] is self._drop_in_flight:
                    self._drops.popleft()
                self._drop_in_flight = None
                self._cond.notify_all()
            while True:
                if conn.done.is_set() or self._stopped.is_set():
                    return None
                now = time.monotonic()
                if now < self._partition_until:
                    self._cond.wait(self._partition_until - now)
                    continue
                if self._drops:
                    self._drop_in_flight = self._drops[0]
                    return agent_pb2.AgentMessage(drop=self._drop_in_flight).SerializeToString()
                if now >= conn.next_heartbeat:
                    conn.next_heartbeat = now + self._heartbeat_interval_s
                    conn.last_heartbeat = now
                    return _HEARTBEAT
                stale = self._next_stale(conn)
                if stale is not None:
                    return stale
                batch = self._next_unacked(conn.cursor)
                if batch is None and self._pending and (
                    self._flushing or self._closing or now - self._pending_since >= self._batch_interval_s
                ):
                    batch = self._cut()
                    if batch is None:
                        continue  # dropped; its DropReport goes first
                if batch is not None:
                    conn.cursor = batch.seq
                    if self._quiet_heartbeats:
                        conn.next_heartbeat = min(now + self._heartbeat_interval_s + self._batch_interval_s,
                                                  conn.last_heartbeat + QUIET_HEALTH_INTERVAL_S)
                    if batch.data is None:
                        return batch
                    return _length_delimited(AGENT_MESSAGE_BATCH_TAG, batch.data)
                wait = conn.next_heartbeat - now
                if self._pending:
                    wait = min(wait, self._pending_since + self._batch_interval_s - now)
                self._cond.wait(max(wait, 0.001))

    def _next_stale(self, conn: _Conn) -> _Batch | None:
        """The next predecessor's batch this stream has not sent (they go first, in order)."""
        for b in self._stale:
            if (b.epoch, b.seq) > conn.stale_sent:
                conn.stale_sent = (b.epoch, b.seq)
                return b
        return None

    def _next_unacked(self, cursor: int) -> _Batch | None:
        """The unacked batch with the lowest seq above ``cursor``."""
        if not self._unacked:
            return None
        seq = max(cursor + 1, next(iter(self._unacked)))
        while seq <= self._seq:
            batch = self._unacked.get(seq)
            if batch is not None:
                return batch
            seq += 1
        return None

    def _spill_lost(self, batch: _Batch, exc: OSError) -> None:
        with self._cond:
            if batch.epoch:
                if batch not in self._stale:
                    return  # acked while we read it
                self._stale.remove(batch)
            elif self._unacked.get(batch.seq) is not batch:
                return  # acked while we read it
            else:
                del self._unacked[batch.seq]
            self._forget(batch)
            self._drop(batch.seq, batch.seq, batch.n_events, f"spill read failed: {_oserror_text(exc)}")

    def _inbound(self, msg: agent_pb2.ControllerMessage) -> None:
        kind = msg.WhichOneof("msg")
        if kind == "ack":
            if msg.ack.epoch != self._hello.epoch:
                self._stale_acked(msg.ack)
                return
            if msg.ack.rejected:
                self._rejected(msg.ack.seq, msg.ack.rejected)
            else:
                self._acked_through(msg.ack.seq)
        elif kind == "command":
            self._on_command(msg.command)
        elif kind == "welcome":
            # batches the controller committed before this stream need no resend
            self._acked_through(msg.welcome.committed_seq)
            self._welcomed.set()

    def _acked_through(self, seq: int) -> None:
        acked: list[tuple[int, int]] = []
        with self._cond:
            while self._unacked and next(iter(self._unacked)) <= seq:
                _, batch = self._unacked.popitem(last=False)
                self._forget(batch)
                self.acked_events += batch.n_events
                acked.append((batch.seq, batch.n_events))
            self._cond.notify_all()
        if self._on_ack is not None:
            for s, n in acked:
                try:
                    self._on_ack(s, n)
                except Exception:
                    log.exception("on_ack hook failed")

    def _stale_acked(self, ack: agent_pb2.Ack) -> None:
        """A predecessor's batches committed (through ``ack.seq``) or one rejected."""
        with self._cond:
            done = [b for b in self._stale if b.epoch == ack.epoch
                    and (b.seq == ack.seq if ack.rejected else b.seq <= ack.seq)]
            if not done:
                return
            self._stale = [b for b in self._stale if b not in done]
            for b in done:
                self._forget(b)
                if ack.rejected:
                    self.rejected_events += b.n_events
                else:
                    self.resent_events += b.n_events
                    self.acked_events += b.n_events
            if self._spool is not None and not any(b.epoch == ack.epoch for b in self._stale):
                self._spool.release(ack.epoch)
            self._cond.notify_all()
        if ack.rejected:
            log.error("controller rejected batch %d of an earlier run (epoch %d) as malformed: %s; it is "
                      "not resent", ack.seq, ack.epoch, ack.rejected)

    def _rejected(self, seq: int, reason: str) -> None:
        with self._cond:
            batch = self._unacked.pop(seq, None)
            if batch is None:
                return
            self._forget(batch)
            self.rejected_events += batch.n_events
            self._cond.notify_all()
        log.error("controller rejected batch %d (%d events) as malformed: %s; it is not resent",
                  seq, batch.n_events, reason)


def _oserror_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name} ({text})" if name else text
