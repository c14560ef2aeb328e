"""Live collective performance: each process group's bus bandwidth and arrival skew, and
the slow_comm detector judged on them.

``CommTracker`` matches one attempt's completed collectives across the members of each
group by (group, seq). Once every member (``group_size``) reported one, it becomes a
``CommSample``:

  * ``t_s``: the smallest measured duration among the members. The member that entered
    last waits on nobody, so its duration is the transfer itself; the others' include
    their wait for it. It needs no clock agreement between hosts. Only when EVERY member
    measured the collective (wire timing ``wrapper`` or ``nccl``); never exit - enter.
    ``async`` durations (issue to the Work's completion) are not rated: they include the
    ops queued before it on the same stream and overlap compute, so they would report a
    healthy link as slow.
  * ``busbw = S / t x bus_factor``, bytes/s, with nccl-tests' S and factor
    (``diagnosis.bandwidth``): comparable with the slowest link the group crosses.
  * ``skew_s``: first to last member entering it (hosts' clocks: their offset shows as skew);
    ``last_rank``: the member that entered last (lowest rank on a tie).

``judge_slow_comm`` (pure) flags a group whose window of samples shows a late rank, or a
median busbw below ``detect.slow_comm.min_utilization`` of ``topology.path(...)``, and
names the likely cause (``SlowComm.cause``): ``late_rank``, ``slow_node``, ``cross_rack``
or ``slow_group`` (below its links with no single node or rack link to blame).
``SlowCommMonitor`` is what the watchdog keeps per attempt: a tracker plus when it was last
judged. The metrics (``collective_metrics``) keep a tracker of their own and publish
``median_busbw``/``median_skew_s`` of its windows.

Invariants: work per row is O(1) (a sample costs O(members) once per collective); memory
is bounded: at most ``max_open`` collectives missing members (a rank that died leaves
them; the oldest go first), as many recently completed keys (a row sent again does not
reopen one), ``window`` samples per group, ``MAX_NAMES`` parsed size strings.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any, Protocol

from fleet.controlplane.config import SlowCommSettings
from fleet.controlplane.detectors import Incident
from fleet.controlplane.diagnosis.bandwidth import bus_factor, message_bytes
from fleet.proto.flight_record import P2P_SUFFIX
from fleet.proto.kinds import IncidentKind, Timing

#: Collectives still missing members kept at most (oldest dropped first).
MAX_OPEN = 4096
#: Distinct (op, sizes, dtypes, group size) whose message size is remembered; past it the
#: cache starts over.
MAX_NAMES = 4096
#: Seconds between two judgements of the live detector (it judges only after new samples).
JUDGE_EVERY_S = 1.0
#: Timings whose durations are rated (see the module docstring for ``async``).
RATED_TIMINGS = frozenset({Timing.WRAPPER.wire, Timing.NCCL.wire})


class LinkPath(Protocol):
    """The slowest link a group crosses (``controlplane.topology.LinkPath``)."""

    bandwidth_bps: float    # bytes/s
    link: str               # e.g. "rack r2 uplink (800 Gbit/s)"
    scope: str              # "node" | "rack" | "cross-rack"
    racks: tuple[str, ...]


class Topology(Protocol):
    """What the detector asks of ``controlplane.topology.Topology``."""

    def path(self, nodes: Iterable[str]) -> LinkPath | None: ...

    def rack_of(self, node: str) -> str | None: ...


@dataclass(frozen=True, slots=True)
class CommSample:
    """One collective of one group once every member completed it."""

    group: str
    seq: int
    op: str                 # canonical
    nbytes: int | None      # nccl-tests' S, bytes (the largest member's); None: not rated
    n: int                  # members
    t_s: float | None       # smallest measured duration, s; None: not measured on every member
    busbw: float | None     # bytes/s; None without t_s or nbytes
    skew_s: float           # first to last member entering it, s
    last_rank: int          # the member that entered last


class _Open:
    """A collective some members have not completed yet."""

    __slots__ = ("size", "op", "nbytes", "ranks", "first_ns", "last_ns", "last_rank", "dur_ns", "measured")

    def __init__(self, size: int, op: str) -> None:
        self.size, self.op, self.nbytes = size, op, None
        self.ranks: set[int] = set()
        self.first_ns = self.last_ns = self.last_rank = -1
        self.dur_ns, self.measured = 0, True


class CommTracker:
    """One attempt's completed collectives, matched per (group, seq) into each group's
    window of ``CommSample`` (not thread-safe: one owner)."""

    def __init__(self, job_id: str, attempt: int, window: int, max_open: int = MAX_OPEN) -> None:
        self.job_id, self.attempt = job_id, attempt
        self._window, self._max_open = window, max_open
        self._open: dict[tuple[str, int], _Open] = {}
        self._closed: dict[tuple[str, int], None] = {}
        self._sizes: dict[tuple, int | None] = {}
        #: group -> its newest ``window`` samples, oldest first
        self.windows: dict[str, collections.deque[CommSample]] = {}
        #: group -> its members' global ranks, sorted (those that completed its newest sample)
        self.members: dict[str, tuple[int, ...]] = {}
        #: samples completed so far (a judge can skip when it has not changed)
        self.completed = 0

    @property
    def open(self) -> int:
        """Collectives waiting for members."""
        return len(self._open)

    def add(self, rows: Iterable[Any]) -> int:
        """Fold collective rows (``store.CollectiveRow``s: any job or attempt; only this
        attempt's completed ones count); the number of samples they completed."""
        before, job, attempt, add = self.completed, self.job_id, self.attempt, self.add_entry
        for r in rows:
            if r.state == "completed" and r.attempt == attempt and r.job_id == job:
                add(r.group, r.seq, r.group_size, r.rank, r.op, r.input_sizes, r.input_dtypes, r.output_sizes,
                    r.output_dtypes, r.enter_ns, r.duration_ns or 0, r.timing)
        return self.completed - before

    def add_entry(self, group: str, seq: int, group_size: int, rank: int, op: str, input_sizes: str,
                  input_dtypes: str, output_sizes: str, output_dtypes: str, enter_ns: int, duration_ns: int,
                  timing: int) -> None:
        """One member's completion of collective ``seq`` of ``group`` (sizes and dtypes as
        JSON text; ``duration_ns`` 0: not measured). Point-to-point groups (their seqs count
        per pair) and single-member groups are left out; a member's second row changes nothing."""
        key = (group, seq)
        if group_size < 2 or key in self._closed or group.endswith(P2P_SUFFIX):
            return
        entry = self._open.get(key)
        if entry is None:
            if len(self._open) >= self._max_open:
                del self._open[next(iter(self._open))]
            entry = self._open[key] = _Open(group_size, op)
        elif rank in entry.ranks:
            return
        entry.ranks.add(rank)
        nbytes = self._nbytes(op, input_sizes, input_dtypes, output_sizes, output_dtypes, group_size)
        if nbytes is not None and (entry.nbytes is None or nbytes > entry.nbytes):
            entry.nbytes = nbytes  # all_to_all's uneven splits: the largest member's send
        if entry.first_ns < 0 or enter_ns < entry.first_ns:
            entry.first_ns = enter_ns
        if enter_ns > entry.last_ns or (enter_ns == entry.last_ns and rank < entry.last_rank):
            entry.last_ns, entry.last_rank = enter_ns, rank
        if duration_ns > 0 and timing in RATED_TIMINGS:
            entry.dur_ns = duration_ns if not entry.dur_ns else min(entry.dur_ns, duration_ns)
        else:
            entry.measured = False
        if len(entry.ranks) >= entry.size:
            self._complete(key, entry)

    def _complete(self, key: tuple[str, int], e: _Open) -> None:
        del self._open[key]
        self._closed[key] = None
        if len(self._closed) > self._max_open:
            del self._closed[next(iter(self._closed))]
        group = key[0]
        t_s = e.dur_ns / 1e9 if e.measured and e.dur_ns else None
        factor = bus_factor(e.op, e.size)
        busbw = e.nbytes / t_s * factor if t_s and e.nbytes and factor else None
        window = self.windows.get(group)
        if window is None:
            window = self.windows[group] = collections.deque(maxlen=self._window)
        window.append(CommSample(group, key[1], e.op, e.nbytes, e.size, t_s, busbw,
                                 (e.last_ns - e.first_ns) / 1e9, e.last_rank))
        if len(self.members.get(group, ())) != len(e.ranks):
            self.members[group] = tuple(sorted(e.ranks))
        self.completed += 1

    def _nbytes(self, op: str, input_sizes: str, input_dtypes: str, output_sizes: str, output_dtypes: str,
                group_size: int) -> int | None:
        """nccl-tests' S of one member's row, its JSON text parsed once per distinct value."""
        key = (op, input_sizes, input_dtypes, output_sizes, output_dtypes, group_size)
        try:
            return self._sizes[key]
        except KeyError:
            pass
        if len(self._sizes) >= MAX_NAMES:
            self._sizes.clear()
        try:
            size = message_bytes(op, json.loads(input_sizes), json.loads(input_dtypes), json.loads(output_sizes),
                                 json.loads(output_dtypes), group_size)
        except (ValueError, TypeError):  # ingest validated the text: a shape it let through is not rated
            size = None
        self._sizes[key] = size
        return size



#: Fewest collectives with skew >= ``skew_s`` a window needs before it can name a late rank.
MIN_SKEWED = 4
#: A window rates utilization when at least 1/this of it is measured samples of >= min_bytes.
MIN_RATED_SHARE = 4

# -- summaries (the metrics and the detector) -------------------------------------------------

def median_busbw(samples: Iterable[CommSample], op: str | None = None) -> float | None:
    """Median bus bandwidth of the measured samples (of ``op`` only, if given), bytes/s;
    None without any."""
    rated = [s.busbw for s in samples if s.busbw is not None and (op is None or s.op == op)]
    return median(rated) if rated else None


def median_skew_s(samples: Iterable[CommSample]) -> float | None:
    """Median arrival skew of the samples, seconds; None without any."""
    skews = [s.skew_s for s in samples]
    return median(skews) if skews else None


# -- the detector -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SlowComm:
    """One slow_comm finding. ``cause``: late_rank | slow_node | cross_rack | slow_group;
    ``subject``: the late rank, the slow node, or the group; an attempt fires each
    ``key`` once."""

    cause: str
    subject: str
    incident: Incident

    @property
    def key(self) -> tuple[str, str]:
        return self.cause, self.subject


@dataclass(frozen=True)
class _View:
    """What one group's full window says."""

    group: str
    samples: list[CommSample]
    ranks: tuple[int, ...]
    nodes: frozenset[str]
    path: LinkPath | None
    busbw: float | None        # median, bytes/s, of the window's measured samples of >= min_bytes
    utilization: float | None  # busbw / path.bandwidth_bps
    below: bool
    skew_s: float              # median skew of the skewed samples (>= skew_s), else of all
    late_rank: int | None      # the member last in >= late_share of the skewed samples
    late_count: int            # ... skewed samples it entered last
    skewed: int                # samples with skew >= skew_s


def judge_slow_comm(windows: Mapping[str, Sequence[CommSample]], members: Mapping[str, Sequence[int]],
                    nodes: Sequence[str], topology: Topology | None, cfg: SlowCommSettings) -> list[SlowComm]:
    """The slow_comm findings of each group's newest ``cfg.window`` samples (fewer: not judged).

    ``members``: group -> its global ranks; ``nodes[r]``: rank r's node; ``topology`` None:
    utilization is unknown and only skew is judged. A group is

      * late (``late_rank``): at least ``MIN_SKEWED`` of the window's collectives have a
        skew >= ``skew_s`` and one member entered last in >= ``late_share`` of those: that
        rank and its node (one finding per rank, naming each group it is late in);
      * below its floor: the median busbw of the window's measured samples of >=
        ``min_bytes`` (at least 1/``MIN_RATED_SHARE`` of the window) is below
        ``min_utilization`` x the slowest link of its path (``min_utilization`` 0 or no
        path: never). Blamed on a node (``slow_node``) when it is the group's only node,
        or when it is in two or more groups below the floor and in none of the healthy
        groups of their sizes (and no other node is in exactly the same groups);
        otherwise on the group: ``cross_rack`` when its path crosses racks, else
        ``slow_group`` (no node is named: rank -1, node "")."""
    views = [_view(g, list(w)[-cfg.window:], tuple(members.get(g, ())), nodes, topology, cfg)
             for g, w in sorted(windows.items()) if len(w) >= cfg.window]
    found = _late_ranks([v for v in views if v.late_rank is not None], nodes, cfg)
    below = [v for v in views if v.below]
    healthy = [v for v in views if v.utilization is not None and not v.below]
    found += _slow_nodes(below, healthy, nodes, cfg)
    explained = {v.group for f in found if f.cause == "slow_node" for v in below if f.subject in v.nodes}
    for v in below:
        if v.group in explained:
            continue
        assert v.path is not None and v.utilization is not None
        if v.path.scope == "cross-rack":
            racks = ", ".join(v.path.racks)
            why = f"the group spans racks {racks} and no single node explains it: the cross-rack link"
            cause = "cross_rack"
        else:
            why = f"no single node explains it: the group's own links ({v.path.scope} scope)"
            cause = "slow_group"
        found.append(SlowComm(cause, v.group, Incident(
            IncidentKind.SLOW_COMM, "slow_comm", -1, "",
            f"{_describe(v)}: {_rate(v)}, below detect.slow_comm.min_utilization {cfg.min_utilization:g}; {why}")))
    return found


def _view(group: str, samples: list[CommSample], ranks: tuple[int, ...], nodes: Sequence[str],
          topology: Topology | None, cfg: SlowCommSettings) -> _View:
    on = frozenset(nodes[r] for r in ranks if 0 <= r < len(nodes))
    path = topology.path(sorted(on)) if topology is not None and on else None
    busbw = utilization = None
    # only messages large enough to be bandwidth-bound say anything about a link: a small
    # one's busbw is its latency, far below any link's bandwidth on a healthy fabric
    rated = [s for s in samples if s.busbw is not None and (s.nbytes or 0) >= cfg.min_bytes]
    if len(rated) * MIN_RATED_SHARE >= len(samples):
        busbw = median_busbw(rated)
        if path is not None and path.bandwidth_bps > 0 and busbw is not None:
            utilization = busbw / path.bandwidth_bps
    below = utilization is not None and cfg.min_utilization > 0 and utilization < cfg.min_utilization
    # a rank late once per step makes one skewed collective of the step; the others it
    # then joins on time: judged over the skewed ones, so a window of several steps shows it
    skewed = [s for s in samples if s.skew_s >= cfg.skew_s]
    rank, count = collections.Counter(s.last_rank for s in skewed or samples).most_common(1)[0]
    late = len(skewed) >= MIN_SKEWED and count >= cfg.late_share * len(skewed)
    skew = median(s.skew_s for s in skewed or samples)
    return _View(group, samples, ranks, on, path, busbw, utilization, below, skew, rank if late else None,
                 count if skewed else 0, len(skewed))


def _late_ranks(late: list[_View], nodes: Sequence[str], cfg: SlowCommSettings) -> list[SlowComm]:
    """One finding per late rank, on the group it is latest in, naming the others."""
    by_rank: dict[int, list[_View]] = {}
    for v in late:
        if v.late_rank is not None:
            by_rank.setdefault(v.late_rank, []).append(v)
    found = []
    for rank, views in sorted(by_rank.items()):
        views.sort(key=lambda v: (-v.late_count, -v.skew_s, v.group))
        node = nodes[rank] if 0 <= rank < len(nodes) else ""
        worst = views[0]
        rate = f"{_rate(worst)}; " if worst.utilization is not None else ""
        evidence = (f"{_describe(worst)}: {rate}rank {rank} ({node or 'no node'}) entered last in "
                    f"{worst.late_count} of the {worst.skewed} collectives of the last {len(worst.samples)} "
                    f"whose arrival skew was >= detect.slow_comm.skew_s {cfg.skew_s:g} s (median "
                    f"{worst.skew_s:.2f} s): a late rank, the others wait for it")
        if len(views) > 1:
            evidence += "; also last in " + ", ".join(
                f"group {v.group} ({v.late_count}/{v.skewed})" for v in views[1:])
        found.append(SlowComm("late_rank", str(rank),
                              Incident(IncidentKind.SLOW_COMM, "slow_comm", rank, node, evidence)))
    return found


def _slow_nodes(below: list[_View], healthy: list[_View], nodes: Sequence[str],
                cfg: SlowCommSettings) -> list[SlowComm]:
    """Nodes that explain groups below the floor, the node in the most of them first."""
    found, left = [], list(below)
    while left:
        on: dict[str, list[_View]] = {}
        for v in left:
            for node in v.nodes:
                on.setdefault(node, []).append(v)
        candidates = []
        for node, views in sorted(on.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            sizes = {len(v.ranks) for v in views}
            peers = [h for h in healthy if len(h.ranks) in sizes]
            alone = [v.group for v in views if len(v.nodes) == 1]
            # with no healthy group to compare with, a node in every slow group may just be
            # the fabric's victim: not blamed
            if alone or (len(views) >= 2 and peers and not any(node in h.nodes for h in peers)):
                candidates.append((node, views, len(peers), alone))
        if not candidates:
            break
        node, views, peers, alone = candidates[0]
        groups = {v.group for v in views}
        if not alone and any({v.group for v in c[1]} == groups for c in candidates[1:]):
            break  # nodes always in the same groups: no telling which
        ranks = [r for r, n in enumerate(nodes) if n == node]
        why = ((f"group {alone[0]} runs" if len(alone) == 1 else f"groups {', '.join(alone)} run") + " on it alone"
               if alone else
               f"it is in all {len(views)} groups below detect.slow_comm.min_utilization "
               f"{cfg.min_utilization:g} and in none of the {peers} healthy groups of their size")
        parts = "; ".join(f"{_describe(v)}: {_rate(v)}" for v in views)
        found.append(SlowComm("slow_node", node, Incident(
            IncidentKind.SLOW_COMM, "slow_comm", ranks[0] if ranks else -1, node,
            f"{node}: {why}: a slow node (its links or NIC); {parts}")))
        left = [v for v in left if v.group not in groups]
    return found


# -- evidence text ----------------------------------------------------------------------------

def _describe(v: _View) -> str:
    """``group 3 (all_gather 4.0 MiB over ranks 0-7)``: the window's most frequent op and size."""
    kinds = collections.Counter((s.op, s.nbytes) for s in v.samples)
    (op, nbytes), _ = kinds.most_common(1)[0]
    what = op if nbytes is None else f"{op} {format_bytes(nbytes)}"
    if len(kinds) > 1:
        what += " and others"
    return f"group {v.group} ({what} over ranks {format_ranks(v.ranks)})"


def _rate(v: _View) -> str:
    """``median busbw 11.2 GB/s = 0.28 of rack r2 uplink (800 Gbit/s)``."""
    assert v.busbw is not None and v.path is not None and v.utilization is not None
    return f"median busbw {format_rate(v.busbw)} = {v.utilization:.2f} of {v.path.link}"


def format_bytes(n: float) -> str:
    """Binary units: ``4.0 MiB``, ``512 B``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """``11.2 GB/s`` (decimal, as link rates are quoted), ``850.0 MB/s`` below 1 GB/s."""
    return f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.1f} MB/s"


def format_ranks(ranks: Sequence[int]) -> str:
    """``0-7``, ``0, 2, 4``, ``0-3, 8-11``."""
    if not ranks:
        return "unknown"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# -- live -------------------------------------------------------------------------------------

class SlowCommMonitor:
    """The watchdog's slow_comm state for one attempt: its tracker, judged at most every
    ``JUDGE_EVERY_S`` and only after new samples (not thread-safe: the watchdog's thread)."""

    def __init__(self, job_id: str, attempt: int, nodes: Sequence[str], topology: Topology | None,
                 cfg: SlowCommSettings) -> None:
        self.tracker = CommTracker(job_id, attempt, cfg.window)
        self._nodes, self._topology, self._cfg = list(nodes), topology, cfg
        self._judged = 0          # tracker.completed when last judged
        self._due = 0.0           # monotonic

    def add(self, rows: Iterable[Any]) -> None:
        """Fold a batch's collective rows (``store.CollectiveRow``)."""
        self.tracker.add(rows)

    def judge(self, now: float | None = None) -> list[SlowComm]:
        """Findings, when due (``now``: monotonic seconds); an empty list otherwise."""
        now = time.monotonic() if now is None else now
        t = self.tracker
        if now < self._due or t.completed == self._judged:
            return []
        self._due, self._judged = now + JUDGE_EVERY_S, t.completed
        return judge_slow_comm(t.windows, t.members, self._nodes, self._topology, self._cfg)
