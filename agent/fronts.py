"""FrontKeeper: a node agent's view of where its ranks stand in each process group, for
jobs that send collective fronts instead of every collective (``AgentSettings.collective_fronts``).

The agent gives it every ``CollectiveColumns`` block its workers report (``add``) and
sends, with each report it forwards, the fronts that changed (``take``): one
``fleet.proto.fronts.FrontRow`` per (job, attempt, rank, group) whose front moved. The
raw rows stay here, the newest ``ring_entries`` per (rank, group), until the controller
asks for them with a ``TracePull`` (``pull``).

A front (per job, attempt, rank, group):
- ``entered_seq``: the highest seq seen in any row (a "completed" row of a seq never seen
  "started" enters it too); ``entered_ns``, ``op``, ``signature``, ``step`` and
  ``group_size`` are those of that seq's first row;
- ``completed_seq``: the highest seq seen in a "completed" or "failed" row (ops complete in
  order within a group, so every seq below it is done too); ``completed_ns`` its exit_ns;
- ``entered``: how far ``entered_seq`` advanced since the row last taken (seqs are
  consecutive, so this counts ops entered, including any whose rows the worker dropped).
Fronts never move back: a row repeated (a worker resending a report the agent could not
forward) or late changes nothing.

Bounded memory: (ranks x groups x ``ring_entries``) raw rows, for the newest attempt of
each job only: the first row of a newer attempt of a job forgets every older attempt of it
(their rows and fronts), and rows of an older attempt than the newest seen are ignored.
The ring keeps rows in arrival order and drops the oldest arrival (a rank reports a
group's rows in seq order, so that is the lowest seq); a late row of a seq older than
every kept one is not kept.

Thread-safe: one lock around each call (the agent's gRPC threads add and take together).
Pure Python and protobuf: no gRPC here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from fleet.proto import events_pb2
from fleet.proto.fronts import FrontRow, pack, signature, unpack

#: Rows per (rank, group) a ``TracePull`` gets when its ``last`` is 0.
DEFAULT_PULL_LAST = 64
#: Distinct (op, sizes, dtypes) texts whose signature is remembered; a job repeats a few hundred.
_SIGNATURES_MAX = 8192
_DONE = ("completed", "failed")


class _Track:
    """One (job, attempt, rank, group): its ring of raw rows and its front."""

    __slots__ = ("job_id", "attempt", "rank", "group", "ring", "entered_seq", "entered_row",
                 "completed_seq", "completed_ns", "taken_seq")

    def __init__(self, job_id: str, attempt: int, rank: int, group: str) -> None:
        self.job_id, self.attempt, self.rank, self.group = job_id, attempt, rank, group
        # seq -> [group_size, op, in_sizes, in_dtypes, out_sizes, out_dtypes, enter_ns, exit_ns, state, step,
        #         exit_estimated, duration_ns, timing] (the strings as they arrived)
        self.ring: dict[int, list] = {}
        self.entered_seq = 0
        self.entered_row: list | None = None
        self.completed_seq = 0
        self.completed_ns = 0
        self.taken_seq = 0   # entered_seq when this track's row was last taken


class FrontKeeper:
    """The fronts and raw-row rings of one agent's ranks (see the module docstring)."""

    def __init__(self, ring_entries: int = 1024) -> None:
        """``ring_entries``: raw rows kept per (job, attempt, rank, group), >= 1."""
        if ring_entries < 1:
            raise ValueError(f"ring_entries must be >= 1, not {ring_entries}")
        self._ring_entries = ring_entries
        self._lock = threading.Lock()
        self._attempts: dict[str, int] = {}                                 # job -> newest attempt
        self._tracks: dict[tuple[str, int], dict[tuple[int, str], _Track]] = {}  # (job, attempt) -> tracks
        self._dirty: set[_Track] = set()
        self._signatures: dict[tuple[str, str, str, str, str], int] = {}

    def add(self, block: events_pb2.CollectiveColumns) -> None:
        """Take a worker's block of collectives (rows as ``fleet.proto.columns`` packs them)."""
        s = list(block.strings)
        cap = self._ring_entries
        done = {i for i, text in enumerate(s) if text in _DONE}
        n = len(block.job_id)
        durations = block.duration_ns or [0] * n   # an older worker sends none: not measured
        timings = block.timing or [0] * n
        rows = zip(block.job_id, block.attempt, block.rank, block.group, block.group_size, block.seq, block.op,
                   block.input_sizes, block.input_dtypes, block.output_sizes, block.output_dtypes, block.enter_ns,
                   block.exit_ns, block.state, block.step, block.exit_estimated, durations, timings)
        with self._lock:
            by_job: dict[tuple[int, int], dict[tuple[int, str], _Track] | None] = {}
            dirty = self._dirty
            for j, a, r, g, gs, seq, op, isz, idt, osz, odt, enter, exit_, st, step, est, dur, tm in rows:
                tracks = by_job.get((j, a), False)
                if tracks is False:
                    tracks = by_job[(j, a)] = self._tracks_of(s[j], a)
                if tracks is None:   # an older attempt than the newest seen
                    continue
                group = s[g]
                t = tracks.get((r, group))
                if t is None:
                    t = tracks[(r, group)] = _Track(s[j], a, r, group)
                ring = t.ring
                kept = ring.get(seq)
                finished = st in done
                if kept is None:
                    kept = [gs, s[op], s[isz], s[idt], s[osz], s[odt], enter, exit_, s[st], step, est, dur, tm]
                    if len(ring) < cap:
                        ring[seq] = kept
                    elif seq > next(iter(ring)):   # else: a late row of a seq the ring dropped
                        del ring[next(iter(ring))]
                        ring[seq] = kept
                elif finished and kept[8] not in _DONE:
                    kept[7], kept[8], kept[10], kept[11], kept[12] = exit_, s[st], est, dur, tm
                if seq > t.entered_seq:
                    t.entered_seq, t.entered_row = seq, kept
                    dirty.add(t)
                if finished and seq > t.completed_seq:
                    t.completed_seq, t.completed_ns = seq, exit_
                    dirty.add(t)

    def _tracks_of(self, job_id: str, attempt: int) -> dict[tuple[int, str], _Track] | None:
        """The tracks of (job, attempt), made when new; None for an attempt older than the
        newest seen, whose rows are ignored. A newer attempt forgets the older ones."""
        newest = self._attempts.get(job_id)
        if newest is not None and attempt < newest:
            return None
        if newest is not None and attempt > newest:
            self._tracks.pop((job_id, newest), None)
            self._dirty.difference_update([t for t in self._dirty if t.job_id == job_id and t.attempt < attempt])
        self._attempts[job_id] = attempt
        return self._tracks.setdefault((job_id, attempt), {})

    def take(self) -> events_pb2.CollectiveFronts | None:
        """The fronts that changed since the previous ``take`` (None when none did)."""
        with self._lock:
            if not self._dirty:
                return None
            dirty, self._dirty = self._dirty, set()
            rows = [self._row(t) for t in dirty]
            for t in dirty:
                t.taken_seq = t.entered_seq
        return pack(rows)

    def _row(self, t: _Track) -> FrontRow:
        gs, op, isz, idt, osz, odt, enter, _exit, _state, step, *_ = t.entered_row
        key = (op, isz, idt, osz, odt)
        sig = self._signatures.get(key)
        if sig is None:
            if len(self._signatures) >= _SIGNATURES_MAX:
                self._signatures.clear()
            sig = self._signatures[key] = signature(*key)
        return FrontRow(t.job_id, t.attempt, t.rank, t.group, gs, t.entered_seq, t.completed_seq, enter,
                        t.completed_ns, op, sig, step, t.entered_seq - t.taken_seq)

    def untake(self, block: events_pb2.CollectiveFronts) -> None:
        """Put back the rows of a ``take`` that could not be sent: the next ``take`` returns
        them again (as they are then), ``entered`` counting from before the lost one."""
        with self._lock:
            for row in unpack(block):
                seq, entered = row.entered_seq, row.entered
                t = self._tracks.get((row.job_id, row.attempt), {}).get((row.rank, row.group))
                if t is not None:
                    t.taken_seq = min(t.taken_seq, seq - entered)
                    self._dirty.add(t)

    def pull(self, p: events_pb2.TracePull) -> events_pb2.CollectiveColumns:
        """The newest ``p.last`` (0: ``DEFAULT_PULL_LAST``) kept rows of each of ``p.ranks``
        (empty: every rank; ranks this agent has nothing of are skipped) in each of
        ``p.groups`` (empty: every group) of ``p.job_id`` attempt ``p.attempt``, in seq order
        per (rank, group), as one block (empty when this agent keeps nothing of them)."""
        last = p.last if p.last > 0 else DEFAULT_PULL_LAST
        ranks, groups = set(p.ranks), set(p.groups)
        with self._lock:
            tracks = self._tracks.get((p.job_id, p.attempt), {})
            chosen = [(key, t) for key, t in tracks.items()
                      if (not ranks or key[0] in ranks) and (not groups or key[1] in groups)]
            picked = [(t, seq, list(t.ring[seq])) for _, t in sorted(chosen, key=lambda kt: kt[0])
                      for seq in sorted(t.ring)[-last:]]
        return _block(picked)


def _block(rows: Iterable[tuple[_Track, int, list]]) -> events_pb2.CollectiveColumns:
    """A ``CollectiveColumns`` block of kept rows (as ``fleet.proto.columns.pack`` lays one out)."""
    strings: dict[str, int] = {}

    def ix(text: str) -> int:
        i = strings.get(text)
        if i is None:
            i = strings[text] = len(strings)
        return i

    cols: dict[str, list] = {name: [] for name in (
        "job_id", "attempt", "rank", "group", "group_size", "seq", "op", "input_sizes", "input_dtypes",
        "output_sizes", "output_dtypes", "enter_ns", "exit_ns", "state", "step", "exit_estimated",
        "duration_ns", "timing")}
    for t, seq, (gs, op, isz, idt, osz, odt, enter, exit_, state, step, est, dur, tm) in rows:
        for name, value in (("job_id", ix(t.job_id)), ("attempt", t.attempt), ("rank", t.rank),
                            ("group", ix(t.group)), ("group_size", gs), ("seq", seq), ("op", ix(op)),
                            ("input_sizes", ix(isz)), ("input_dtypes", ix(idt)), ("output_sizes", ix(osz)),
                            ("output_dtypes", ix(odt)), ("enter_ns", enter), ("exit_ns", exit_),
                            ("state", ix(state)), ("step", step), ("exit_estimated", est),
                            ("duration_ns", dur), ("timing", tm)):
            cols[name].append(value)
    return events_pb2.CollectiveColumns(strings=list(strings), **cols)
