"""Ships this rank's events to its node agent and hands back the agent's commands.

``Reporter`` owns one background daemon thread (``fleet-reporter-r{rank}``) and one
insecure gRPC channel to ``spec.agent_address``. Every ``spec.report_interval_s`` the
thread takes everything buffered by ``emit`` and sends it in one
``NodeAgent.Report(WorkerReport)`` call (collectives packed into one column block,
``fleet.proto.columns``), then passes each returned ``Command`` to
``on_command``. It calls even with nothing to send, so commands still arrive. Status
and checkpoint events are sent at once instead of waiting for the next report.
The event sources (``add_source``: the native flight-recorder ring, the process-group
watch) run on a second thread (``fleet-sources-r{rank}``) on their own, shorter,
intervals, so a Report call that waits on a slow or restarting agent (up to
``call_timeout_s``) or a command being handled never delays a read of the ring: a
256-entry ring holds about a second of a busy rank's collectives. Reports and source
polls fall on multiples of their interval on the wall clock (see ``_next_tick``).

Cost: a Report call costs the worker ~0.5 ms of CPU and its agent ~0.7 ms (measured
on the 2-core development machine), against ~1 us per event, so the report interval,
not the event count, sets the cost of shipping.

Invariants:
  * ``emit`` never blocks on the network; it is safe from any thread.
  * The thread keeps running while the main thread sits inside a collective (gloo
    releases the GIL), which is exactly when the events matter.
  * Nothing is lost on a failed send: the same report (same events, same
    ``report_id``) is sent again next tick, before anything newer. An agent that wrote
    it to its write-ahead log and died before answering left the number there, and its
    successor answers the retry without taking the events twice. The buffer of events
    not yet in a report is bounded (``max_buffered``); beyond it the oldest events are
    dropped and counted in ``dropped``, which every report carries (with what the
    sources lost, e.g. ring entries overwritten unread) so that the agent records the
    loss with the controller.
  * The thread never dies silently: each tick's errors are caught and logged.

With ``agent_address`` empty/None the reporter runs no thread and discards events
(unit tests, or torchrun without an agent).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from fleet.proto import agent_pb2, agent_pb2_grpc, columns, events_pb2
from fleet.workers.spec import WorkerSpec

if TYPE_CHECKING:
    from fleet.workers.native_fr import NativeFlightTail

log = logging.getLogger(__name__)

CommandHandler = Callable[[events_pb2.Command], None]

#: Events per Report call; keeps each message far below gRPC's 4 MiB default limit.
MAX_EVENTS_PER_REPORT = 5_000

#: Event kinds reported at once: the controller's view of the job's state hangs on them.
_URGENT = frozenset({"status", "checkpoint"})


class Reporter:
    """Buffered, background event shipping for one rank (a context manager)."""

    def __init__(self, spec: WorkerSpec, on_command: CommandHandler | None = None, *,
                 call_timeout_s: float = 2.0, max_buffered: int = 100_000) -> None:
        self.spec = spec
        self.on_command = on_command
        self.call_timeout_s = call_timeout_s
        self.max_buffered = max_buffered
        self.sent = 0            # events acknowledged by the agent
        self.dropped = 0         # events discarded (buffer full, or discard mode)
        self.send_failures = 0   # Report calls that failed
        self.commands_received = 0
        self.cpu_s = 0.0         # CPU seconds the reporter thread used (set when it ends)
        self._buffer: deque[events_pb2.Event] = deque()
        self._inflight = 0  # events taken from the buffer by the call in progress
        # this process's reports: "<pid>-<random>", numbered 1, 2, ...; a report that
        # failed waits in _retry (with its event count) and goes again, unchanged
        self.reporter_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._report_id = 0
        self._retry: tuple[agent_pb2.WorkerReport, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._wake_sources = threading.Event()
        self._closed = False
        self._final_deadline = 0.0  # monotonic seconds; set by close()
        self._channel: grpc.Channel | None = None
        self._stub: agent_pb2_grpc.NodeAgentStub | None = None
        self._thread: threading.Thread | None = None
        # (poll, interval_s, next due), run on the sources thread; and the sources' own
        # counts of events they lost before emitting them (reported with ``dropped``)
        self._sources: list[list] = []
        self._source_failing: set[int] = set()
        self._source_losses: list[Callable[[], int]] = []
        self._sources_thread: threading.Thread | None = None
        if spec.agent_address:
            # a restarted agent serves the same address: find it within a second, not
            # after gRPC's default reconnect backoff (up to two minutes)
            self._channel = grpc.insecure_channel(spec.agent_address, options=[
                ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)])
            self._stub = agent_pb2_grpc.NodeAgentStub(self._channel)
            self._thread = threading.Thread(
                target=self._loop, name=f"fleet-reporter-r{spec.rank}", daemon=True)
            self._thread.start()
            self._sources_thread = threading.Thread(
                target=self._source_loop, name=f"fleet-sources-r{spec.rank}", daemon=True)
            self._sources_thread.start()

    @property
    def enabled(self) -> bool:
        """True when events go to an agent, False in discard mode."""
        return self._thread is not None

    @property
    def pending(self) -> int:
        """Events buffered and not yet acknowledged by the agent."""
        with self._lock:
            return len(self._buffer) + self._inflight + (self._retry[1] if self._retry else 0)

    def emit(self, event: events_pb2.Event) -> None:
        """Queue ``event`` for the next report. Thread-safe; never blocks on I/O."""
        if self._thread is None or self._closed:
            self.dropped += 1
            return
        with self._lock:
            if len(self._buffer) >= self.max_buffered:
                self._buffer.popleft()
                self.dropped += 1
            self._buffer.append(event)
        if event.WhichOneof("kind") in _URGENT:
            self._wake.set()

    def add_source(self, poll: Callable[..., object], interval_s: float,
                   lost: Callable[[], int] | None = None) -> None:
        """Call ``poll()`` on the sources thread every ``interval_s`` seconds, and
        ``poll(force=True)`` once more at close; it emits events itself. Used for the
        native flight recorder, whose ring must be read while the training thread is
        stuck in a collective. ``lost()``: how many events the source lost so far before
        it could emit them; reports carry it in ``dropped_events``."""
        with self._lock:
            self._sources.append([poll, interval_s, 0.0])
            if lost is not None:
                self._source_losses.append(lost)
        self._wake_sources.set()

    def follow(self, tail: NativeFlightTail) -> None:
        """Read the native flight recorder's ring through ``tail`` (every probe interval,
        once more at close) and report the entries it lost."""
        self.add_source(tail.poll, tail.probe_interval_s, lost=lambda: tail.lost)

    @property
    def lost(self) -> int:
        """Events this rank lost before they reached the agent: dropped from the buffer,
        plus what the sources lost (ring entries overwritten unread)."""
        return self.dropped + sum(count() for count in self._source_losses)

    def _source_loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    due = min((src[2] for src in self._sources), default=time.monotonic() + 1.0)
                self._wake_sources.wait(max(0.0, due - time.monotonic()))
                self._wake_sources.clear()
                if self._stop.is_set():
                    break
                self._poll_sources()
        except BaseException:
            log.exception("reporter sources thread crashed")
            raise

    def _poll_sources(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            sources = list(enumerate(self._sources))
        for i, src in sources:
            poll, interval_s, due = src
            if not force and now < due:
                continue
            src[2] = _next_tick(interval_s)
            try:
                if force:
                    poll(force=True)
                else:
                    poll()
                self._source_failing.discard(i)
            except Exception as exc:  # noqa: BLE001 - a source must not stop the reports
                if i not in self._source_failing:
                    log.warning("reporter: event source %r failed: %s", poll, _describe(exc))
                self._source_failing.add(i)

    def flush_soon(self) -> None:
        """Ask the thread to report now instead of at the next interval."""
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is buffered (bounded by ``timeout_s`` seconds), then stop the thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._final_deadline = time.monotonic() + timeout_s
            self._stop.set()
            self._wake.set()
            self._wake_sources.set()
            self._thread.join(timeout=timeout_s + self.call_timeout_s)
            if self._thread.is_alive():
                log.warning("reporter thread %s did not stop within %.1fs", self._thread.name, timeout_s)
            left = self.pending
            if left:
                log.warning("reporter closing with %d unsent events", left)
        if self._channel is not None:
            self._channel.close()
        if self.dropped and self.enabled:
            log.warning("reporter dropped %d events (buffer limit %d)", self.dropped, self.max_buffered)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the thread ------------------------------------------------------------------

    def _loop(self) -> None:
        failing = False
        next_report = _next_tick(self.spec.report_interval_s)
        try:
            while not self._stop.is_set():
                woken = self._wake.wait(max(0.0, next_report - time.monotonic()))
                self._wake.clear()
                if self._stop.is_set():
                    break
                if not woken and time.monotonic() < next_report:
                    continue
                next_report = _next_tick(self.spec.report_interval_s)
                try:
                    self._send_all()
                    if failing:
                        log.info("reporter reconnected to agent %s", self.spec.agent_address)
                    failing = False
                except Exception as exc:  # noqa: BLE001 - the thread must survive anything
                    # Log the first failure of a run of failures, not one line per tick.
                    if not failing:
                        log.warning("reporter: report to %s failed (%s); retrying every %.2fs",
                                    self.spec.agent_address, _describe(exc), self.spec.report_interval_s)
                    failing = True
            self._final_flush()
            self.cpu_s = time.thread_time()
        except BaseException:
            log.exception("reporter thread crashed")
            raise

    def _final_flush(self) -> None:
        deadline = self._final_deadline
        self._wake.clear()
        if self._sources_thread is not None:  # its last poll ends before the final one
            self._sources_thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._poll_sources(force=True)
        while time.monotonic() < deadline:
            try:
                # Never let one slow call run past the deadline close() promised.
                self._send_all(min(self.call_timeout_s, max(0.05, deadline - time.monotonic())))
                return
            except Exception as exc:  # noqa: BLE001
                log.warning("reporter: final flush failed (%s)", _describe(exc))
                # Short pause so an agent that is restarting can come back before the deadline.
                self._wake.wait(min(self.spec.report_interval_s, max(0.0, deadline - time.monotonic())))

    def _send_all(self, timeout_s: float | None = None) -> None:
        """Send the report that failed last time, if any, then every buffered event (in
        chunks); at least one call even if there are none.

        ``timeout_s`` bounds each call (default ``call_timeout_s``)."""
        timeout_s = timeout_s or self.call_timeout_s
        if self._retry is not None:
            report, n = self._retry
            try:
                self._send(report, n, timeout_s)
            except BaseException:   # it stays for the next tick
                self.send_failures += 1
                raise
            with self._lock:
                self._retry = None
        while True:
            with self._lock:
                n = min(len(self._buffer), MAX_EVENTS_PER_REPORT)
                batch = [self._buffer.popleft() for _ in range(n)]
                self._inflight = n
            self._report_id += 1
            report = agent_pb2.WorkerReport(
                job_id=self.spec.job_id, attempt=self.spec.attempt, rank=self.spec.rank,
                events=columns.pack_events(batch), dropped_events=self.lost,
                reporter=self.reporter_id, report_id=self._report_id)
            try:
                self._send(report, n, timeout_s)
            except BaseException:
                with self._lock:   # at once: ``pending`` counts these events once
                    self._inflight = 0
                    self._retry = (report, n)
                self.send_failures += 1
                raise
            with self._lock:
                self._inflight = 0
            if n < MAX_EVENTS_PER_REPORT:
                return

    def _send(self, report: agent_pb2.WorkerReport, n: int, timeout_s: float) -> None:
        assert self._stub is not None
        reply = self._stub.Report(report, timeout=timeout_s)
        self.sent += n
        for cmd in reply.commands:
            self.commands_received += 1
            if cmd.rank not in (-1, self.spec.rank):
                log.warning("ignoring command %s addressed to rank %d", cmd.command_id, cmd.rank)
                continue
            if self.on_command is None:
                continue
            try:
                self.on_command(cmd)
            except Exception:  # noqa: BLE001 - a bad command must not stop reporting
                log.exception("command handler failed for command %s", cmd.command_id)


def _next_tick(interval_s: float) -> float:
    """Monotonic time of the next multiple of ``interval_s`` on the wall clock.

    Every rank on a host (and on NTP-synced hosts) then reads its ring and reports at
    the same moments: in a synchronous job the short pauses this causes overlap instead
    of adding up, since a rank paused alone holds up all the others."""
    return time.monotonic() + interval_s - time.time() % interval_s


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
