"""When a rank writes its flight-recorder dump on its own: a stall, SIGUSR1, a PG timeout.

A hung rank never reaches ``FlightHandle.close()``, so ``record_collectives(dump_dir=...)``
runs one ``DumpWatch``: a named daemon thread ("fleet-fr-dump-watch") that writes the
rank's dump

  * when the rank stalls: no ``step()`` and no change of the native recorder's per-group
    counters (a collective enqueued or completed) for ``stall_dump_s``, while a process
    group exists; once per stall episode, re-armed when progress resumes;
  * on SIGUSR1, also while the main thread is blocked inside a collective in C++: the
    signal's C-level handler writes its number to ``signal.set_wakeup_fd``'s socket,
    which this thread reads (a Python-level handler alone would only run once the main
    thread returns to the interpreter). The Python handler installed for SIGUSR1 only
    calls the previous one, and bytes for other signals are forwarded to a previous
    wakeup fd, so asyncio and the user's handlers keep working;
  * shortly before a pending collective's process-group timeout (its ``timeout_ms``
    from ``time_created_ns``), before NCCL's watchdog aborts the process or gloo raises
    in the training thread; once per entry.

Cost: every ``watch_interval_s`` the thread takes the native probe (per-group counters,
a few us). It reads the whole ring (milliseconds for a large ring, GIL held) only to
learn pending entries and their deadlines: once the counters have been quiet for the
read delay (one interval at first, then up to 30 s, a quarter of the shortest timeout
seen), at most once per read delay while they keep changing, and to confirm an entry
is still pending at its dump time. Counters that did not move since a read need no
new read: entries can only retire meanwhile.

The first dump with stack traces in a process costs about a second (torch sets up its
symbolizer); the thread pays it once, when its first read finds an entry, so a dump
that must land before a timeout takes milliseconds.

Invariants: every decision below is a pure function of (now, what was read, policy)
(``pending_entries``, ``timeout_lead_s``, ``read_delay_s``); the thread never dies
silently (a failing probe or dump is logged and the next tick runs); ``close()`` joins
the thread with a bound and puts back the SIGUSR1 handler and the wakeup fd it found
(only from the main thread, and only where they are still ours).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fleet.proto.flight_record import entry_done, entry_seq
from fleet.workers import native_fr

log = logging.getLogger(__name__)

THREAD_NAME = "fleet-fr-dump-watch"
#: Longest wait before the ring is read to learn the deadlines of pending entries.
MAX_READ_DELAY_S = 30.0
_STOP = b"\0"  # no signal has number 0


@dataclasses.dataclass(frozen=True)
class DumpPolicy:
    """When a rank with a ``dump_dir`` writes its dump on its own (seconds).

    ``stall_dump_s``: dump after this long without a ``step()`` or any collective
    progress (None = never). ``dump_on_signal``: dump on SIGUSR1 (needs the main
    thread). ``dump_before_timeout_s``: dump this long before a pending collective
    reaches its process-group timeout, but never earlier than half that timeout.
    ``watch_interval_s``: how often the watcher looks (shorter than ``stall_dump_s``).
    """

    stall_dump_s: float | None = 120.0
    dump_on_signal: bool = True
    dump_before_timeout_s: float = 5.0
    watch_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.stall_dump_s is not None and not (_is_number(self.stall_dump_s) and self.stall_dump_s > 0):
            raise ValueError(f"stall_dump_s must be a positive number of seconds or None, got {self.stall_dump_s!r}")
        if not isinstance(self.dump_on_signal, bool):
            raise ValueError(f"dump_on_signal must be True or False, got {self.dump_on_signal!r}")
        if not (_is_number(self.dump_before_timeout_s) and self.dump_before_timeout_s >= 0):
            raise ValueError("dump_before_timeout_s must be a number of seconds >= 0, "
                             f"got {self.dump_before_timeout_s!r}")
        if not (_is_number(self.watch_interval_s) and self.watch_interval_s > 0):
            raise ValueError(f"watch_interval_s must be a positive number of seconds, got {self.watch_interval_s!r}")
        if self.stall_dump_s is not None and self.watch_interval_s >= self.stall_dump_s:
            raise ValueError(f"watch_interval_s ({self.watch_interval_s}) must be shorter than "
                             f"stall_dump_s ({self.stall_dump_s})")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


@dataclasses.dataclass(frozen=True)
class Pending:
    """An entry of the ring not finished yet, and when to dump for its timeout."""

    record_id: int
    group: str
    seq: int
    op: str
    is_p2p: bool
    timeout_s: float
    deadline_ns: int    # wall clock (``time.time_ns``), as ``time_created_ns``
    dump_at_ns: int

    def reason(self, now_ns: int) -> str:
        """Why a dump is written now, e.g. "collective 12 of group 0 (all_reduce)
        reaches its 600 s timeout in 5 s"."""
        what = "p2p op" if self.is_p2p else "collective"
        left = (self.deadline_ns - now_ns) / 1e9
        when = f"in {_secs(left)} s" if left >= 0 else f"{_secs(-left)} s ago"
        verb = "reaches" if left >= 0 else "reached"
        return (f"{what} {self.seq} of group {self.group} ({self.op}) {verb} its "
                f"{_secs(self.timeout_s)} s timeout {when}")


def _secs(s: float) -> str:
    return f"{s:.0f}" if s >= 10 or s == int(s) else f"{s:.1f}"


def timeout_lead_s(timeout_s: float, dump_before_timeout_s: float) -> float:
    """How long before a ``timeout_s`` deadline to dump: ``dump_before_timeout_s``, but
    at most half the timeout, so a short timeout does not dump at every collective."""
    return min(dump_before_timeout_s, timeout_s / 2)


def pending_entries(entries: Iterable[Mapping[str, Any]], dump_before_timeout_s: float) -> list[Pending]:
    """The ring's unfinished entries that have a timeout, with their dump times."""
    out = []
    for e in entries:
        timeout_ms = e.get("timeout_ms") or 0
        created = e.get("time_created_ns") or 0
        if entry_done(e) or timeout_ms <= 0 or created <= 0:
            continue
        timeout_s = timeout_ms / 1000
        deadline = int(created + timeout_ms * 1_000_000)
        pg = e.get("process_group") or ("?",)
        out.append(Pending(
            record_id=int(e["record_id"]), group=str(pg[0]), seq=entry_seq(e),
            op=str(e.get("profiling_name") or "?").split(":", 1)[-1], is_p2p=bool(e.get("is_p2p")),
            timeout_s=timeout_s, deadline_ns=deadline,
            dump_at_ns=deadline - int(timeout_lead_s(timeout_s, dump_before_timeout_s) * 1e9)))
    return out


def read_delay_s(policy: DumpPolicy, shortest_timeout_s: float | None) -> float:
    """How long the counters may stay quiet (or keep changing) before the ring is read
    for pending entries: long enough to stay cheap, short enough that an entry is
    known well before its dump time."""
    if shortest_timeout_s is None:
        return policy.watch_interval_s
    lead = timeout_lead_s(shortest_timeout_s, policy.dump_before_timeout_s)
    return min(MAX_READ_DELAY_S, max(policy.watch_interval_s, (shortest_timeout_s - lead) / 4))


@dataclasses.dataclass(frozen=True)
class AutoDump:
    """An automatic dump: why, where, what was pending in it, and the rank's progress
    then (``step()`` calls, collectives enqueued over all groups)."""

    reason: str
    path: Path
    pending: tuple[Pending, ...]
    steps: int
    enqueued: int


def enqueued(status: Mapping[str, Any]) -> int:
    """Collectives (and, for gloo, p2p ops) enqueued over all groups of a probe."""
    return sum(int(s.get("last_enqueued_collective", 0)) for s in status.values())


def keep_auto_dump(last: AutoDump | None, now_ns: int, steps: int, enqueued_now: int) -> str | None:
    """Why ``close()`` should keep ``last`` instead of overwriting it, or None.

    gloo marks a collective that timed out ``retired``, like one that completed: a dump
    written after the timeout would show it finished. So the automatic dump stays when a
    collective pending in it was due for its timeout dump by now, and the rank made no
    progress since (no step, nothing enqueued; a timeout moves neither).
    """
    if last is None or steps != last.steps or enqueued_now != last.enqueued:
        return None
    due = [p for p in last.pending if p.dump_at_ns <= now_ns]
    if not due:
        return None
    p = min(due, key=lambda p: p.deadline_ns)
    return (f"kept the dump written for {last.reason!r}: {'p2p op' if p.is_p2p else 'collective'} "
            f"{p.seq} of group {p.group} was pending in it near its timeout, and nothing progressed since")


_warmed = False


def _warm_symbolizer() -> None:
    """Take torch's one-time cost of the first dump with stack traces (about a second:
    it sets up its symbolizer; the GIL is mostly released meanwhile) now, in this
    thread, instead of when a dump must land before a timeout."""
    global _warmed
    if not _warmed:
        _warmed = True
        native_fr.dump_bytes(include_stack_traces=True)


class _SignalHook:
    """SIGUSR1 to a wakeup-fd socket; restores what it replaced. Main thread only."""

    def __init__(self, wakeup_fd: int) -> None:
        self._fd = wakeup_fd
        self._prev_handler = signal.getsignal(signal.SIGUSR1)
        if self._prev_handler is None:
            raise RuntimeError("SIGUSR1 has a handler not installed from Python")
        signal.signal(signal.SIGUSR1, self._handle)
        try:
            self._prev_fd = signal.set_wakeup_fd(wakeup_fd)
        except BaseException:
            signal.signal(signal.SIGUSR1, self._prev_handler)
            raise

    def _handle(self, signum: int, frame: object) -> None:
        # The dump is the watcher's (it saw the wakeup byte); here only chain.
        if callable(self._prev_handler):
            self._prev_handler(signum, frame)

    def forward(self, data: bytes) -> None:
        """Pass wakeup bytes on to the wakeup fd this hook replaced, if any."""
        if self._prev_fd >= 0 and data:
            try:
                os.write(self._prev_fd, data)
            except OSError:
                pass  # the owner closed it or its buffer is full: as a signal would find it

    def restore(self) -> bool:
        """Put back the previous handler and wakeup fd where they are still ours; False
        off the main thread (nothing can be restored there)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGUSR1) == self._handle:
            signal.signal(signal.SIGUSR1, self._prev_handler)
        current = signal.set_wakeup_fd(self._prev_fd)
        if current != self._fd:  # someone replaced ours since: leave theirs
            signal.set_wakeup_fd(current)
        return True


class DumpWatch:
    """The watcher thread of one ``FlightHandle``.

    ``dump(reason)`` writes the dump and returns its path; ``steps()`` is the handle's
    count of ``step()`` calls. Started by the constructor; ``close()`` stops it.
    """

    def __init__(self, policy: DumpPolicy, dump: Callable[[str], Path], steps: Callable[[], int]) -> None:
        self.policy = policy
        self._dump = dump
        self._steps = steps
        self.last_auto: AutoDump | None = None
        self._stopping = False
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)
        self._hook: _SignalHook | None = None
        if policy.dump_on_signal:
            if threading.current_thread() is threading.main_thread():
                try:
                    self._hook = _SignalHook(self._wsock.fileno())
                except (RuntimeError, ValueError, OSError) as exc:
                    log.warning("flight recorder: no dump on SIGUSR1: %s", exc)
            else:
                log.warning("flight recorder: no dump on SIGUSR1: record_collectives() was not "
                            "called from the main thread")
        # what the last tick saw
        self._status: dict[str, Any] | None = None
        self._status_since = 0.0         # monotonic: when the counters last changed
        self._seen_steps = steps()
        self._progress_at = time.monotonic()
        self._stall_dumped = False
        # what the last read of the ring found
        self._read_status: dict[str, Any] | None = None
        self._last_read = float("-inf")
        self._pending: list[Pending] = []
        self._shortest_timeout_s: float | None = None
        self._timeout_dumped: set[int] = set()
        self._probe_failed = False
        self.reads = 0                   # full reads of the ring (the costly part)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def signals(self) -> bool:
        """True while SIGUSR1 dumps are hooked up."""
        return self._hook is not None

    def keep_last_dump(self, now_ns: int, steps: int) -> str | None:
        """``keep_auto_dump`` of the last automatic dump, against a fresh probe."""
        if self.last_auto is None:
            return None
        try:
            status = native_fr._probe()
        except Exception:  # noqa: BLE001 - then write the final dump
            return None
        return keep_auto_dump(self.last_auto, now_ns, steps, enqueued(status))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waits at most ``timeout_s``) and restore signal state."""
        restored = self._hook.restore() if self._hook is not None else True
        if not restored:
            log.warning("flight recorder: close() off the main thread cannot restore SIGUSR1's "
                        "handler and the wakeup fd; they stay installed (dumps on SIGUSR1 stop)")
        self._stopping = True
        try:
            self._wsock.send(_STOP)
        except OSError:
            pass  # buffer full of wakeups: the thread is awake anyway
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("flight recorder: %s still running %.0f s after close()", THREAD_NAME, timeout_s)
        elif restored:
            self._rsock.close()
            self._wsock.close()
        # not restored: the wakeup fd must stay open, or a signal would write to whatever reuses it

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        interval = self.policy.watch_interval_s
        next_tick = time.monotonic()
        while not self._stopping:
            try:
                ready, _, _ = select.select([self._rsock], [], [], max(0.0, next_tick - time.monotonic()))
                if ready and self._wakeups() and not self._stopping:
                    self._auto("SIGUSR1")
                now = time.monotonic()
                if now >= next_tick and not self._stopping:
                    self._tick(now)
                    next_tick = now + interval
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad tick
                log.exception("flight recorder: dump watcher tick failed")
                next_tick = time.monotonic() + interval

    def _wakeups(self) -> bool:
        """Drain the socket; True when SIGUSR1 was among the signals."""
        data = b""
        while True:
            try:
                chunk = self._rsock.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                break
            data += chunk
        if self._hook is not None:
            self._hook.forward(data.replace(_STOP, b""))
        return signal.SIGUSR1 in data

    def _tick(self, now: float) -> None:
        try:
            status = native_fr._probe()
        except Exception as exc:  # noqa: BLE001
            if not self._probe_failed:
                self._probe_failed = True
                log.warning("flight recorder: probe failed (%s); automatic dumps wait for it", exc)
            return
        steps = self._steps()
        if not status or not dist.is_initialized():
            self._progress_at = now  # no process group: nothing can hang
            return
        if status != self._status:
            self._status, self._status_since = status, now
            self._progress_at, self._stall_dumped = now, False
        if steps != self._seen_steps:
            self._seen_steps = steps
            self._progress_at, self._stall_dumped = now, False

        delay = read_delay_s(self.policy, self._shortest_timeout_s)
        if status != self._read_status and (now - self._status_since >= delay or now - self._last_read >= delay):
            self._read(now, status)
        wall = time.time_ns()
        if self._due(wall):
            self._read(now, status)  # entries may have retired since the read that found them
            due = self._due(wall)
            if due:
                self._auto(min(due, key=lambda p: p.deadline_ns).reason(wall), self._pending)
                self._timeout_dumped.update(p.record_id for p in due)

        stall = self.policy.stall_dump_s
        if stall is not None and not self._stall_dumped and now - self._progress_at >= stall:
            self._stall_dumped = True
            self._auto(f"no progress for {_secs(now - self._progress_at)} s "
                       "(no step, no collective enqueued or completed)")

    def _due(self, wall_ns: int) -> list[Pending]:
        return [p for p in self._pending if p.dump_at_ns <= wall_ns and p.record_id not in self._timeout_dumped]

    def _read(self, now: float, status: dict[str, Any]) -> list[Pending]:
        entries = native_fr.read_ring().get("entries") or []
        self.reads += 1
        if entries:
            _warm_symbolizer()
        self._pending = pending_entries(entries, self.policy.dump_before_timeout_s)
        self._timeout_dumped &= {p.record_id for p in self._pending}
        timeouts = [e["timeout_ms"] / 1000 for e in entries if (e.get("timeout_ms") or 0) > 0]
        if timeouts:
            self._shortest_timeout_s = min(timeouts)
        self._read_status, self._last_read = status, now
        return self._pending

    def _auto(self, reason: str, pending: list[Pending] | None = None) -> None:
        try:
            if pending is None:
                pending = self._read(time.monotonic(), self._status or {})
            path = self._dump(reason)
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: try again next time
            log.warning("flight recorder: automatic dump (%s) failed: %s", reason, exc)
            return
        self.last_auto = AutoDump(reason, path, tuple(pending), self._steps(), enqueued(self._status or {}))
        log.warning("flight recorder: wrote %s: %s", path, reason)
