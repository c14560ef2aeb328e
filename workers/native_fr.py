"""Tail of PyTorch's native flight recorder: every collective the process issues.

PyTorch records each collective and point-to-point op of every process group in a ring
buffer (``TORCH_FR_BUFFER_SIZE`` entries) inside the backend, including the ones FSDP,
DDP, expert-parallel all_to_all and torch.distributed.checkpoint issue internally,
which no Python-level wrapper sees. ``NativeFlightTail.poll`` dumps that ring
(``torch._C._distributed_c10d._dump_fr_trace``), and turns entries it has not shipped
yet into ``CollectiveEvent``s: ``started`` when an entry first appears unfinished,
``completed`` once it is retired. The reporter thread calls ``poll`` on its own
schedule, so entries keep flowing while the training thread is blocked inside a
collective — the moment they matter most.

How the two sources merge (native entries are the source of truth):
  * group, sequence number (``collective_seq_id``; point-to-point ops use
    ``p2p_seq_id`` under the group name suffixed ``:p2p``), op, sizes and dtypes come
    from the native entry; the enter time is its ``time_created_ns``.
  * gloo records no completion time. For ops issued through ``FlightRecorder``'s
    wrappers, the wrapper's measured exit time is attached by matching group and
    ``enter <= time_created_ns <= exit``; for every other op the exit time is when the
    tail first saw it retired (at most one poll interval late) and the event says
    ``exit_estimated``.
  * the training step of an entry is the step whose start preceded ``time_created_ns``.

Entries overwritten in the ring before a poll saw them are counted in ``lost``.
"""

from __future__ import annotations

import bisect
import collections
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fleet_proto import events_pb2

log = logging.getLogger(__name__)

Sink = Callable[[events_pb2.Event], None]

_dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)

#: Native dtype names (e.g. "Float") as torch's Python names, for events that also
#: come from the Python wrappers.
_DTYPES = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
}


def available() -> bool:
    """True when this torch build can dump its flight recorder."""
    return _dump is not None


class NativeFlightTail:
    """Ships the native flight recorder's entries of one rank as CollectiveEvents."""

    def __init__(self, job_id: str, attempt: int, rank: int, sink: Sink) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.rank = rank
        self.sink = sink
        self.lost = 0                  # entries overwritten before a poll saw them
        self.shipped = 0
        self._lock = threading.Lock()  # poll runs on the reporter thread and at close
        self._next_record = 0          # every record id below this is finished or lost
        self._open: dict[int, events_pb2.Event] = {}   # started, not yet retired
        self._step_starts: list[tuple[int, int]] = []  # (start_ns, step), ascending
        self._windows: dict[str, collections.deque[tuple[int, int]]] = collections.defaultdict(
            lambda: collections.deque(maxlen=4096))
        self._group_sizes: dict[str, int] = {}

    # -- called by the training thread ---------------------------------------------------

    def step_started(self, step: int, start_ns: int | None = None) -> None:
        """Mark the start of training step ``step`` (entries after it belong to it)."""
        self._step_starts.append((start_ns or time.time_ns(), step))
        if len(self._step_starts) > 100_000:
            del self._step_starts[:50_000]

    def timed(self, group: str, enter_ns: int, exit_ns: int) -> None:
        """Precise timing of one op issued by a Python wrapper on ``group``."""
        self._windows[group].append((enter_ns, exit_ns))

    # -- called by the reporter thread ---------------------------------------------------

    def poll(self) -> int:
        """Ship entries not shipped yet; returns how many events were emitted."""
        if _dump is None or not dist.is_available() or not dist.is_initialized():
            return 0
        with self._lock:
            try:
                trace = pickle.loads(_dump(includeCollectives=True, includeStackTraces=False,
                                           onlyActive=False))
            except Exception as exc:  # noqa: BLE001 - a failed dump must not kill the reporter
                log.warning("flight-recorder dump failed: %s", exc)
                return 0
            return self._ingest(trace.get("entries", []), time.time_ns())

    def _ingest(self, entries: list[dict[str, Any]], now_ns: int) -> int:
        emitted = 0
        if entries:
            first = entries[0]["record_id"]
            if first > self._next_record:
                self.lost += first - self._next_record
                log.warning("flight recorder ring overwrote %d entries before they were shipped; "
                            "raise TORCH_FR_BUFFER_SIZE", first - self._next_record)
                self._next_record = first
            # open entries that fell out of the ring finished long ago
            for rid in [r for r in self._open if r < first]:
                self._emit_done(self._open.pop(rid), now_ns, estimated=True)
                emitted += 1
        for e in entries:
            rid = e["record_id"]
            done = bool(e.get("retired")) or e.get("state") == "completed"
            if rid < self._next_record and rid not in self._open:
                continue
            if rid not in self._open:
                started = self._convert(e)
                if started is None:
                    self._next_record = max(self._next_record, rid + 1)
                    continue
                if not done:
                    self.sink(started)
                    emitted += 1
                self._open[rid] = started
            if done:
                self._emit_done(self._open.pop(rid), now_ns, estimated=True)
                emitted += 1
            self._next_record = max(self._next_record, rid + 1)
        self.shipped += emitted
        return emitted

    def _emit_done(self, started: events_pb2.Event, now_ns: int, estimated: bool) -> None:
        done = events_pb2.Event()
        done.CopyFrom(started)
        c = done.collective
        exit_ns = self._measured_exit(c.group, c.enter_ns)
        if exit_ns is None:
            exit_ns, c.exit_estimated = max(now_ns, c.enter_ns), estimated
        c.exit_ns = exit_ns
        c.state = "completed"
        self.sink(done)

    def _measured_exit(self, group: str, created_ns: int) -> int | None:
        windows = self._windows.get(group)
        if not windows:
            return None
        # windows are in issue order; drop those that ended before this entry was created
        while windows and windows[0][1] < created_ns:
            windows.popleft()
        if windows and windows[0][0] <= created_ns <= windows[0][1]:
            return windows[0][1]
        return None

    def _convert(self, e: dict[str, Any]) -> events_pb2.Event | None:
        pg = e.get("process_group") or ("?", "")
        name = str(pg[0])
        is_p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id") if is_p2p else e.get("collective_seq_id") or 0)
        if seq <= 0:
            return None
        event = events_pb2.Event()
        c = event.collective
        c.job_id, c.attempt, c.rank = self.job_id, self.attempt, self.rank
        c.group = f"{name}:p2p" if is_p2p else name
        c.group_size = self._group_size(name)
        c.seq = seq
        c.op = str(e.get("profiling_name", "")).split(":", 1)[-1]
        for sizes in e.get("input_sizes") or []:
            c.input_sizes.add().dims.extend(int(d) for d in sizes)
        c.input_dtypes.extend(_DTYPES.get(d, str(d).lower()) for d in e.get("input_dtypes") or [])
        for sizes in e.get("output_sizes") or []:
            c.output_sizes.add().dims.extend(int(d) for d in sizes)
        c.output_dtypes.extend(_DTYPES.get(d, str(d).lower()) for d in e.get("output_dtypes") or [])
        c.enter_ns = int(e.get("time_created_ns") or 0)
        c.state = "started"
        i = bisect.bisect_right(self._step_starts, (c.enter_ns, 1 << 62)) - 1
        c.step = self._step_starts[i][1] if i >= 0 else 0
        return event

    def _group_size(self, name: str) -> int:
        size = self._group_sizes.get(name)
        if size is None:
            # gloo dumps carry an empty pg_config in torch 2.13: ask the live groups
            try:
                for pg, pg_name in dist.distributed_c10d._world.pg_names.items():
                    self._group_sizes[pg_name] = dist.get_world_size(pg)
            except Exception:  # noqa: BLE001 - private API; size is informative only
                pass
            size = self._group_sizes.setdefault(name, 0)
        return size
