"""Tail of PyTorch's native flight recorder: every collective the process issues.

PyTorch records each collective and point-to-point op of every process group in a ring
buffer (``TORCH_FR_BUFFER_SIZE`` entries) inside the backend, including the ones FSDP,
DDP, expert-parallel all_to_all and torch.distributed.checkpoint issue internally,
which no Python-level wrapper sees. ``NativeFlightTail.poll`` reads that ring
(``torch._C._distributed_c10d._dump_fr_trace``) and turns entries it has not shipped
yet into ``CollectiveEvent``s: ``started`` when an entry first appears unfinished,
``completed`` once it is retired (an entry already retired when first seen yields only
the ``completed`` event). Before a group's first event it emits one
``ProcessGroupInfo`` (name, description, member global ranks), because gloo dumps carry
an empty ``pg_config``. The reporter thread calls ``poll`` on its own schedule, so
entries keep flowing while the training thread is blocked inside a collective — the
moment they matter most.

How the two sources merge (native entries are the source of truth):
  * group, sequence number (``collective_seq_id``; point-to-point ops use
    ``p2p_seq_id`` under the group name suffixed ``:p2p``), op, sizes and dtypes come
    from the native entry; the enter time is its ``time_created_ns``. How an entry is
    read (completion, numbering, dtype names) is ``fleet.proto.flight_record``'s, shared
    with the dump reader; the op is shipped as the backend names it (without the
    ``gloo:`` prefix) and made canonical where it enters the store.
  * gloo records no completion time (``state`` stays ``scheduled``; ``retired`` is the
    completion signal). For ops issued through ``torch.distributed``'s Python functions,
    ``workers.collective_timing`` (installed by the tail) reports the call's measured
    window to ``timed`` -- a blocking call's return, an async op's Work completion --
    and the entry takes the window of its group issued last before ``time_created_ns``:
    its exit time, ``duration_ns`` and ``timing``. A retired entry whose async window is
    still open waits for it (``PENDING_NS`` at most). For every other op the exit time is
    when the tail first saw it retired (at most one poll late), the event says
    ``exit_estimated`` and has no duration.
  * NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``: the entry's ``duration_ms`` (device
    timing) is the duration (``timing`` nccl), its ``time_discovered_completed_ns`` the exit.
  * the training step of an entry is the step whose start preceded ``time_created_ns``
    (``step_started``).
  * entries recorded before the tail was created (an earlier process group in the
    same process) are not shipped.

What a poll costs, and how it is kept small (measured on torch 2.13, gloo, CPU):
  * A full dump rebuilds the *whole* ring every time (3-4 us per ring entry, GIL held)
    and unpickling it costs 1-3 us per entry, however few are new: ~5.5 ms for a ring
    of 1000, ~1.6 ms for 256. ``onlyActive=True`` is no
    cheaper for gloo: it drops entries whose completion was *discovered* through a
    device event, which gloo never records, so it returns the same entries. The ring
    size (``fr_buffer_entries``) is therefore the main cost knob: it only has to hold
    what arrives between two polls.
  * A dump without collectives (``includeCollectives=False``, ~5 us with unpickling)
    returns per-group ``pg_status`` (last enqueued / completed sequence number).
    ``poll`` takes that probe first and skips the full dump when nothing was enqueued
    or completed since the last one and no entry is still open (idle phases, a rank
    stuck in a collective). Open entries force reads because gloo only bumps
    ``last_completed_collective`` when the next op is enqueued. The probe's enqueue
    counts also tell how fast the ring fills: when the entries not yet read reach half
    the ring, ``poll`` reads before the interval is up, so a small ring (a few hundred
    entries: about twice what arrives in one poll interval) does not overflow; the tail
    warns when a read finds the ring three quarters full of unread entries.
  * gloo in torch 2.13 records no point-to-point ops (send/recv) in the ring at all;
    backends that do (NCCL) ship them under ``<group>:p2p``.
  * Unpickling a dump allocates tens of thousands of short-lived containers. With the
    cyclic GC on, that churn promotes them and periodically triggers a *full*
    collection of the training process (~160 ms with the GIL held on the example
    model, stalling every rank waiting on this one); the dump is therefore read and
    converted with the cyclic GC paused (the objects die by reference counting).
  * Conversion reuses a template ``Event`` per distinct (group, op, shapes, dtypes).

Entries overwritten in the ring before a poll saw them are counted in ``lost`` and
logged.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import gc
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fleet.proto import events_pb2
from fleet.proto.flight_record import dtype_names, entry_done, entry_seq, p2p_group
from fleet.proto.kinds import Timing
from fleet.workers import collective_timing

log = logging.getLogger(__name__)

Sink = Callable[[events_pb2.Event], None]

_WRAPPER, _ASYNC, _NCCL = Timing.WRAPPER.wire, Timing.ASYNC.wire, Timing.NCCL.wire
#: How long a retired entry waits for its async op's completion callback (ns).
PENDING_NS = 1_000_000_000

#: The final read waits up to this many times this long for open entries to retire.
_FINAL_RETRIES, _FINAL_RETRY_S = 5, 0.02
#: Read the ring at least this often even when the probe sees no change (insurance for
#: ops a backend records without moving its per-group counters).
_MAX_SKIP_S = 5.0

_dump_gloo = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
_dump_nccl = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)  # CUDA builds only
_dump = _dump_gloo if _dump_gloo is not None else _dump_nccl


def _native_dump(**kw: bool) -> bytes:
    """The ring of this process's backend: NCCL keeps its own recorder
    (``_dump_nccl_trace``, same format); gloo and others use ``_dump_fr_trace``.
    (The NCCL path follows torch's documented API; no GPU has exercised it here.)"""
    if _dump_nccl is not None and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return _dump_nccl(**kw)
    assert _dump is not None
    return _dump(**kw)

def available() -> bool:
    """True when this torch build can dump its flight recorder."""
    return _dump is not None


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC (process-wide) for a short, allocation-heavy section."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _probe() -> dict[str, Any]:
    """Per-group sequence counters of the native recorder, without its entries (~3 us)."""
    assert _dump is not None
    return pickle.loads(_native_dump(includeCollectives=False, includeStackTraces=False,
                              onlyActive=False)).get("pg_status", {})


def dump_bytes(include_stack_traces: bool = False) -> bytes:
    """The whole native ring as torch's pickled dump (format 2.x: ``version``,
    ``pg_config``, ``pg_status``, ``entries``), as ``torchfrtrace`` and
    ``fleet replay --dumps`` read it."""
    if _dump is None:
        raise RuntimeError("this torch build has no native flight recorder")
    return _native_dump(includeCollectives=True, includeStackTraces=include_stack_traces, onlyActive=False)


def read_ring() -> dict[str, Any]:
    """``dump_bytes()`` unpickled (no stack traces), with the cyclic GC paused."""
    with _gc_paused():
        return pickle.loads(dump_bytes())


class NativeFlightTail:
    """Ships the native flight recorder's entries of one rank as CollectiveEvents.

    ``ring_entries`` is the ring size (``TORCH_FR_BUFFER_SIZE``; 0 = unknown): with it,
    ``poll`` reads the ring early when it is half full of unread entries.
    ``poll_interval_s`` bounds how long a new entry waits for a read. Call ``poll``
    every ``probe_interval_s``: a poll with nothing due costs one probe (~20 us), and
    frequent probes are what lets a small ring be read before it overflows.
    """

    #: Longest gap between probes, seconds (the ring is read early when half full).
    PROBE_INTERVAL_S = 0.1

    def __init__(self, job_id: str, attempt: int, rank: int, sink: Sink, *,
                 ring_entries: int = 0, poll_interval_s: float = 0.5) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.rank = rank
        self.sink = sink
        self.ring_entries = ring_entries
        self.poll_interval_s = poll_interval_s
        self.lost = 0                  # entries overwritten before a poll saw them
        self.shipped = 0               # events emitted (collectives and group infos)
        self.collectives = 0           # distinct entries turned into CollectiveEvents
        self.dumps = 0                 # full reads of the ring
        self.skipped = 0               # polls answered by the probe alone
        self.dump_cpu_s = 0.0          # CPU seconds spent reading and converting dumps
        self.max_unread = 0            # most entries found unread at one dump
        self._lock = threading.Lock()  # poll runs on the reporter thread and at close
        # every record id below this is finished, lost, or an earlier process group's
        # (record ids are process-wide, and the ring outlives a destroyed group)
        self._next_record = _ring_end()
        self._warned_full = False
        self._summarized = False
        self._open: dict[int, events_pb2.Event] = {}   # started, not yet retired
        self._status: dict[str, Any] | None = None      # probe taken with the last dump
        self._enqueued_at_dump = 0     # sum of the groups' enqueue counters then
        self._last_dump = 0.0          # monotonic seconds
        self._step_starts: list[tuple[int, int]] = []  # (start_ns, step), ascending
        # per group, in issue order: [enter_ns, exit_ns (0 while an async op runs), Timing wire]
        self._windows: dict[str, collections.deque[list[int]]] = collections.defaultdict(
            lambda: collections.deque(maxlen=4096))
        # the training thread adds windows (``timed``) while the reporter's reads look them up
        # (``_window``): a deque iterated by one thread and changed by another raises
        self._windows_lock = threading.Lock()
        self._pending_since: dict[int, int] = {}  # record id -> when first seen retired, window open
        collective_timing.install(self.timed)
        self._groups: dict[str, tuple[int, events_pb2.Event | None]] = {}  # name -> (size, info)
        self._templates: dict[tuple, events_pb2.Event] = {}
        self._members: dict[str, tuple[list[int], str]] = {}  # live groups seen: (ranks, desc)
        self._live_count = -1

    @property
    def probe_interval_s(self) -> float:
        """How often to call ``poll`` (seconds)."""
        return min(self.PROBE_INTERVAL_S, self.poll_interval_s)

    # -- called by the training thread ---------------------------------------------------

    def step_started(self, step: int, start_ns: int | None = None) -> None:
        """Mark the start of training step ``step`` (entries after it belong to it)."""
        self._step_starts.append((start_ns or time.time_ns(), step))
        if len(self._step_starts) > 100_000:
            del self._step_starts[:50_000]

    def timed(self, group: str, enter_ns: int, exit_ns: int, timing: int = _WRAPPER) -> None:
        """The measured window of one op issued on ``group`` (``workers.collective_timing``;
        any thread). An async op reports twice: at issue with ``exit_ns`` 0, then done."""
        with self._windows_lock:
            windows = self._windows[group]
            if exit_ns and timing == _ASYNC:
                for w in reversed(windows):  # its issue is recent: a short scan from the end
                    if w[0] == enter_ns and w[1] == 0:
                        w[1] = exit_ns
                        return
            windows.append([enter_ns, exit_ns, timing])

    # -- called by the reporter thread ---------------------------------------------------

    def counters(self) -> dict[str, float]:
        """Ring records seen, lost to overwrite, collectives converted, events emitted,
        full dumps, probe-only polls and the CPU seconds the dumps took."""
        return {"fr_records": self._next_record, "fr_lost": self.lost,
                "fr_collectives": self.collectives, "fr_shipped": self.shipped,
                "fr_dumps": self.dumps, "fr_skipped_polls": self.skipped,
                "fr_dump_cpu_s": round(self.dump_cpu_s, 4), "fr_max_unread": self.max_unread}

    def poll(self, force: bool = False) -> int:
        """Ship entries not shipped yet; returns how many events were emitted.

        Reads the whole ring only when the probe says something changed and either
        ``poll_interval_s`` passed since the last read, the ring is half full of unread
        entries, or ``force`` (the final read before the process group goes away: it
        also waits briefly for entries still open to retire, since gloo retires a
        finished op asynchronously)."""
        if _dump is None:
            return 0
        emitted = self._poll(force)
        if force:
            for _ in range(_FINAL_RETRIES):
                if not self._open:
                    break
                time.sleep(_FINAL_RETRY_S)
                emitted += self._poll(force)
            if not self._summarized:
                self._summarized = True
                log.info("flight-recorder tail of rank %d: %s", self.rank, self.counters())
        return emitted

    def _poll(self, force: bool) -> int:
        with self._lock:
            self._snapshot_groups()
            try:
                status = _probe()
            except Exception as exc:  # noqa: BLE001 - a failed dump must not kill the reporter
                log.warning("flight-recorder probe failed: %s", exc)
                return 0
            now = time.monotonic()
            if not force:
                idle = now - self._last_dump < _MAX_SKIP_S
                if status == self._status and not self._open and idle:
                    self.skipped += 1
                    return 0
                unread = _enqueued(status) - self._enqueued_at_dump
                half_full = self.ring_entries and unread * 2 >= self.ring_entries
                # half a probe early still counts as due: reads stay on the report
                # cadence instead of drifting a probe later every time
                due = self.poll_interval_s - self.probe_interval_s / 2
                if now - self._last_dump < due and not half_full:
                    self.skipped += 1
                    return 0
            t0 = time.thread_time()
            try:
                with _gc_paused():
                    try:
                        raw = _native_dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
                        entries = pickle.loads(raw).get("entries", [])
                    except Exception as exc:  # noqa: BLE001
                        log.warning("flight-recorder dump failed: %s", exc)
                        return 0
                    self._status, self._enqueued_at_dump, self._last_dump = status, _enqueued(status), now
                    self.dumps += 1
                    return self._ingest(entries, time.time_ns())
            finally:
                self.dump_cpu_s += time.thread_time() - t0

    def _ingest(self, entries: list[dict[str, Any]], now_ns: int) -> int:
        shipped_before = self.shipped  # _group ships ProcessGroupInfos on its own
        emitted = 0
        if entries:
            first = entries[0]["record_id"]
            if first > self._next_record:
                n = first - self._next_record
                self.lost += n
                log.warning("flight recorder ring overwrote %d entries before they were shipped "
                            "(%d lost so far); raise TORCH_FR_BUFFER_SIZE", n, self.lost)
                self._next_record = first
            # open entries that fell out of the ring finished long ago
            for rid in [r for r in self._open if r < first]:
                self.sink(self._finished(self._open.pop(rid), now_ns))
                emitted += 1
            unread = entries[-1]["record_id"] + 1 - self._next_record
            self.max_unread = max(self.max_unread, unread)
            if self.ring_entries and unread * 4 > self.ring_entries * 3 and not self._warned_full:
                self._warned_full = True
                log.warning("flight recorder ring was %d/%d full of unread entries at a read; "
                            "raise TORCH_FR_BUFFER_SIZE before entries are lost", unread, self.ring_entries)
        for e in entries:
            rid = e["record_id"]
            started = self._open.get(rid)
            done = entry_done(e)
            if started is not None:
                finished = self._finished(started, now_ns, e, rid) if done else None
                if finished is not None:
                    self.sink(finished)
                    del self._open[rid]
                    emitted += 1
                continue
            if rid < self._next_record:
                continue
            # an entry counts as read only once it is shipped (or has nothing to ship): a
            # read that fails half way leaves the rest for the next one, nothing is skipped
            event = self._convert(e)
            if event is None:
                self._next_record = rid + 1
                continue
            finished = self._finished(event, now_ns, e, rid) if done else None
            if finished is not None:
                self.sink(finished)
            else:
                event.collective.state = "started"
                self.sink(event)
                # the sink may keep the message: the completion will be a copy
                self._open[rid] = event
            self._next_record = rid + 1
            self.collectives += 1
            emitted += 1
        self.shipped += emitted
        return self.shipped - shipped_before

    def _finished(self, started: events_pb2.Event, now_ns: int, entry: dict[str, Any] | None = None,
                  rid: int = -1) -> events_pb2.Event | None:
        """The completion of ``started`` (a new message when ``started`` was shipped), with
        its measured duration: NCCL's device timing (the entry's ``duration_ms``), else the
        window a wrapper timed. None while the op's async window is still open (its Work's
        completion callback has not run yet; ``PENDING_S`` at most, then not measured)."""
        c = started.collective
        nccl_ms = entry.get("duration_ms") if entry is not None else None
        window = None
        if not nccl_ms:
            window = self._window(c.group, c.enter_ns)
            if window is not None and window[1] == 0:
                since = self._pending_since.setdefault(rid, now_ns)
                if now_ns - since < PENDING_NS and rid >= 0:
                    return None
                window = None
        self._pending_since.pop(rid, None)
        if c.state == "started":
            done = events_pb2.Event()
            done.CopyFrom(started)
            c = done.collective
        else:
            done = started
        if nccl_ms and isinstance(nccl_ms, (int, float)) and nccl_ms > 0:
            c.duration_ns, c.timing = int(nccl_ms * 1e6), _NCCL
            found = entry.get("time_discovered_completed_ns") if entry is not None else None
            if found:
                c.exit_ns = max(int(found), c.enter_ns)
            else:
                c.exit_ns, c.exit_estimated = max(now_ns, c.enter_ns), True
        elif window is not None:
            c.exit_ns, c.duration_ns, c.timing = window[1], window[1] - window[0], window[2]
        else:
            c.exit_ns, c.exit_estimated = max(now_ns, c.enter_ns), True
        c.state = "completed"
        return done

    def _window(self, group: str, created_ns: int) -> list[int] | None:
        """The timed window that contains an entry created at ``created_ns`` (its exit 0
        while an async op runs), or None."""
        with self._windows_lock:
            return self._window_locked(group, created_ns)

    def _window_locked(self, group: str, created_ns: int) -> list[int] | None:
        windows = self._windows.get(group)
        if not windows:
            return None
        # windows are in issue order; drop those that ended before this entry was created
        while windows and 0 < windows[0][1] < created_ns:
            windows.popleft()
        # the op's own window is the newest issued before its entry was created (the
        # wrapper's clock read precedes the backend's by microseconds)
        found = None
        for w in windows:
            if w[0] > created_ns:
                break
            found = w
        if found is not None and (found[1] == 0 or created_ns <= found[1]):
            return found
        return None

    def _convert(self, e: dict[str, Any]) -> events_pb2.Event | None:
        """A fresh CollectiveEvent for entry ``e`` (state unset), or None when it has no
        sequence number."""
        is_p2p = e["is_p2p"]
        seq = entry_seq(e)
        if seq <= 0:
            return None
        pg = e["process_group"] or ("?", "")
        inputs, outputs = e["input_sizes"], e["output_sizes"]
        key = (pg, is_p2p, e["profiling_name"], tuple(map(tuple, inputs)), tuple(e["input_dtypes"]),
               tuple(map(tuple, outputs)), tuple(e["output_dtypes"]))
        template = self._templates.get(key)
        if template is None:
            template = self._template(e, str(pg[0]), str(pg[1]) if len(pg) > 1 else "", is_p2p)
            if len(self._templates) < 10_000:
                self._templates[key] = template
        event = events_pb2.Event()
        event.CopyFrom(template)
        c = event.collective
        c.seq = seq
        c.enter_ns = e["time_created_ns"] or 0
        i = bisect.bisect_right(self._step_starts, (c.enter_ns, 1 << 62)) - 1
        c.step = self._step_starts[i][1] if i >= 0 else 0
        return event

    def _template(self, e: dict[str, Any], name: str, desc: str, is_p2p: bool) -> events_pb2.Event:
        event = events_pb2.Event()
        c = event.collective
        c.job_id, c.attempt, c.rank = self.job_id, self.attempt, self.rank
        c.group = p2p_group(name) if is_p2p else name
        c.group_size = self._group(name, desc)
        c.op = str(e["profiling_name"]).split(":", 1)[-1]
        for sizes in e["input_sizes"] or []:
            c.input_sizes.add().dims.extend(int(d) for d in sizes)
        c.input_dtypes.extend(dtype_names(e["input_dtypes"]))
        for sizes in e["output_sizes"] or []:
            c.output_sizes.add().dims.extend(int(d) for d in sizes)
        c.output_dtypes.extend(dtype_names(e["output_dtypes"]))
        return event

    def _group(self, name: str, desc: str) -> int:
        """The size of group ``name``; emits its ProcessGroupInfo the first time."""
        known = self._groups.get(name)
        if known is not None:
            return known[0]
        if name not in self._members:
            self._snapshot_groups(force=True)
        ranks, live_desc = self._members.get(name, ([], ""))
        info = events_pb2.Event(group=events_pb2.ProcessGroupInfo(
            job_id=self.job_id, attempt=self.attempt, rank=self.rank, group=name,
            desc=desc or live_desc, ranks=sorted(ranks)))
        self._groups[name] = (len(ranks), info)
        self.sink(info)
        self.shipped += 1
        return len(ranks)

    def _snapshot_groups(self, force: bool = False) -> None:
        """Remember the members of every live group (gloo dumps carry an empty
        ``pg_config`` in torch 2.13), so a group torn down before its entries are read
        still has them. Costs one ``len`` when no group was created since."""
        try:
            names = dist.distributed_c10d._world.pg_names
            if len(names) == self._live_count and not force:
                return
            self._live_count = len(names)
            for pg, name in list(names.items()):
                if name not in self._members:
                    self._members[name] = ([int(r) for r in dist.get_process_group_ranks(pg)],
                                           str(getattr(pg, "group_desc", "") or ""))
        except Exception:  # noqa: BLE001 - private API, groups torn down meanwhile: best effort
            pass


def _ring_end() -> int:
    """One past the newest record id in the ring now (0 when empty or unreadable)."""
    if _dump is None:
        return 0
    try:
        entries = read_ring().get("entries") or []
    except Exception:  # noqa: BLE001 - then everything in the ring counts as ours
        return 0
    return entries[-1]["record_id"] + 1 if entries else 0


def _enqueued(status: dict[str, Any]) -> int:
    return sum(int(s.get("last_enqueued_collective", 0)) for s in status.values())
