"""Collective bandwidth: how many bytes one collective moves, and the bus-bandwidth factor.

The definitions are nccl-tests' (its PERFORMANCE.md), so a figure here compares with an
``all_reduce_perf`` run on the same links:

  * ``S``, the message size of one rank's collective (``message_bytes``): all_reduce,
    broadcast and reduce: the buffer; all_gather: the whole gathered output (n x one rank's
    input); reduce_scatter: the whole input (n x one rank's output); all_to_all: what one
    rank sends in total; send/recv: the tensor.
  * ``algbw = S / t`` with ``t`` the collective's duration, in bytes/s.
  * ``busbw = algbw x bus_factor(op, n)``: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
    reduce_scatter and all_to_all, 1 for broadcast, reduce and send/recv. It is the rate
    each rank's link carries, comparable across ops and group sizes, and so against the
    link's own rate.

Not rated (``None``): barrier (no payload), gather/scatter and any op not named above, a
coalesced group mixing different collectives (their factors differ), a size with an
unknown dimension (the dump reader keeps an all_to_all's first dimension as -1: its split
changes every step), a dtype without a known width, and an empty payload.

Canonical op names come from ``fleet.proto.vocab``: ``all_gather`` covers both
all_gather_into_tensor (input ``[k]``, output ``[n*k]``) and the list form (n outputs of
``[k]``); ``*_coalesced`` and ``coalesced(a+a)`` rate as their base op over all their tensors.

``analyse(traces)`` applies them to a ``TraceSet``: every collective (group, seq) that
every member of its group recorded, rated with the smallest of its members' measured
durations (the member that entered last waits on nobody, so its duration is the transfer
itself; the earlier ones include their wait, and no host clocks need to agree), and
summed up per (group, op, S) and per group: bandwidths, arrival skew, the rank that is
usually last in, and each member's share of its time spent in the group's collectives.
A duration is only ever a measured one (``GroupOps.dur_ns``): an exit time minus an
enter time is never used, since gloo's exits are estimated by polling.

No torch, Ray or gRPC; numpy, so a million rank-entries take about a second
(``bench_analytics``).
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from fleet.controlplane.diagnosis.traces import GroupOps, RankTrace, SignatureTable, TraceSet
from fleet.proto.flight_record import P2P_SUFFIX
from fleet.proto.kinds import Timing
from fleet.proto.vocab import split_op

#: Bytes per element of each dtype, by torch's Python name (``fleet.proto.vocab.dtype_name``).
#: ``float4_e2m1fn_x2`` packs two values in one element, so its element is one byte.
DTYPE_BYTES: Mapping[str, int] = MappingProxyType({
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "bool": 1, "qint8": 1, "quint8": 1, "qint32": 4,
})

#: Ops whose S is the input buffer; all_gather's is its output, handled on its own.
_INPUT_SIZED = frozenset({"all_reduce", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv"})
_RATED = _INPUT_SIZED | {"all_gather"}

Shape = Sequence[int]


def base_op(op: str) -> str | None:
    """The collective an op rates as: ``all_reduce_coalesced`` and
    ``coalesced(all_reduce+all_reduce)`` -> ``all_reduce``, ``send 0->1`` -> ``send``;
    None for a coalesced group of different collectives."""
    if op.startswith("coalesced(") and op.endswith(")"):
        parts = {_fold(p) for p in op[len("coalesced("):-1].split("+")}
        return parts.pop() if len(parts) == 1 else None
    return _fold(op)


def _fold(op: str) -> str:
    return split_op(op)[0].removesuffix("_coalesced")


def bus_factor(op: str, n: int) -> float | None:
    """busbw / algbw for ``op`` on a group of ``n`` ranks; None for an op that is not rated
    or a group too small to communicate (``n`` < 2, except send/recv: always two ends)."""
    base = base_op(op)
    if base in ("send", "recv"):
        return 1.0
    if base not in _RATED or n < 2:
        return None
    if base == "all_reduce":
        return 2.0 * (n - 1) / n
    if base in ("broadcast", "reduce"):
        return 1.0
    return (n - 1) / n  # all_gather, reduce_scatter, all_to_all


def tensors_bytes(sizes: Iterable[Shape], dtypes: Sequence[str]) -> int | None:
    """Bytes of a list of tensors (shapes, with one dtype each or one for all); None when a
    dimension or a dtype's width is unknown, or the dtypes do not pair with the shapes."""
    shapes = list(sizes)
    if len(dtypes) == len(shapes):
        pairs: Iterable[tuple[Shape, str]] = zip(shapes, dtypes)
    elif len(dtypes) == 1:
        pairs = ((s, dtypes[0]) for s in shapes)
    else:
        return None
    total = 0
    for shape, dtype in pairs:
        width = DTYPE_BYTES.get(dtype)
        if width is None or any(d < 0 for d in shape):
            return None
        total += math.prod(shape) * width
    return total


def message_bytes(op: str, input_sizes: Iterable[Shape], input_dtypes: Sequence[str],
                  output_sizes: Iterable[Shape], output_dtypes: Sequence[str], group_size: int) -> int | None:
    """nccl-tests' ``S`` of one rank's collective, in bytes (see the module docstring);
    None when it has no payload or is not rated. ``group_size`` (ranks) is used only when
    the side that defines S was not recorded (all_gather without outputs: n x input;
    reduce_scatter without inputs: n x output)."""
    base = base_op(op)
    if base not in _RATED:
        return None
    ins, outs = list(input_sizes), list(output_sizes)
    if base == "all_gather":
        size = tensors_bytes(outs, output_dtypes) if outs else _times(tensors_bytes(ins, input_dtypes), group_size)
    elif ins:
        size = tensors_bytes(ins, input_dtypes)
    elif base == "reduce_scatter":
        size = _times(tensors_bytes(outs, output_dtypes), group_size)
    else:  # a recorder that kept only the output of an in-place buffer
        size = tensors_bytes(outs, output_dtypes)
    return size if size else None


def _times(size: int | None, n: int) -> int | None:
    return None if size is None or n < 1 else size * n


# --- analytics over a TraceSet ---------------------------------------------------------

_NOT_MEASURED = np.iinfo(np.int64).max
#: A collective whose arrival skew is at least this is skewed (``detect.slow_comm.skew_s``'s
#: default): "last in" is counted over a group's skewed collectives where it has any.
LATE_SKEW_S = 0.1
_WRAPPER, _ASYNC, _NCCL = Timing.WRAPPER.wire, Timing.ASYNC.wire, Timing.NCCL.wire

#: How the member time shares split: what is exposed is known only for blocking calls.
OVERLAP_NOTE = ("exposed: blocking calls timed by fleet's wrappers; overlap-capable: async and NCCL-timed "
                "calls, which may overlap compute (how much is not known)")

_SOURCE_NOTES = {
    Timing.WRAPPER: "wrapper timing (gloo): blocking calls timed by the thread that made them",
    Timing.ASYNC: "async timing: an async_op call's issue to its completion",
    Timing.NCCL: "NCCL device timing (TORCH_NCCL_ENABLE_TIMING=1)",
}
_NONE_NOTE = ("none: gloo records no completion time of its own and NCCL only with TORCH_NCCL_ENABLE_TIMING=1; "
              "bandwidth is not measured")


@dataclass(frozen=True, slots=True)
class BandwidthRow:
    """One (group, op, S): its collectives that every member recorded. Bandwidths in
    bytes/s, times in seconds; None where nothing was measured (never an estimate)."""

    group: str
    desc: str
    group_size: int
    op: str
    bytes: int | None              # S; None: the size is not known (not rated)
    collectives: int
    measured: int                  # with a measured duration on every member
    timing: tuple[Timing, ...]     # sources of the durations used
    t_s: float | None              # mean duration
    algbw_bps: float | None        # sum of S / sum of t (a mean time per byte, as nccl-tests averages)
    busbw_bps: float | None        # algbw x bus_factor
    busbw_p10_bps: float | None
    busbw_p90_bps: float | None
    skew_s: float | None           # median arrival skew: first to last member entering
    skew_p90_s: float | None
    last_rank: int | None          # the member most often last in (ties: lowest rank; see _last_in)
    last_share: float | None       # its share of the collectives counted
    utilization: float | None      # busbw / the group's link bandwidth, when given
    bucketed: bool = False         # all_to_all: S varies with the routing, so ``bytes`` is the upper
                                   # bound of a power-of-two bucket (each collective rated with its own S)


@dataclass(frozen=True, slots=True)
class MemberShare:
    """One member's time in a group's collectives, as shares of its window (None: nothing
    measured in it, or an empty window)."""

    rank: int
    window_s: float | None
    comm_share: float | None          # all measured durations
    exposed_share: float | None       # Timing.WRAPPER ones: blocking, so exposed
    overlap_capable_share: float | None  # ASYNC / NCCL ones: may overlap compute


@dataclass(frozen=True, slots=True)
class GroupBandwidth:
    """One group's collectives taken together (see ``BandwidthRow`` for units)."""

    group: str
    desc: str
    members: tuple[int, ...]
    collectives: int              # recorded by every member
    incomplete: int               # missing on some member: not rated
    measured: int
    skew_s: float | None
    skew_p90_s: float | None
    last_rank: int | None
    last_share: float | None
    shares: tuple[MemberShare, ...]


@dataclass(frozen=True, slots=True)
class BandwidthReport:
    rows: tuple[BandwidthRow, ...]      # sorted by (group, op, bytes)
    groups: tuple[GroupBandwidth, ...]  # sorted by name
    measured: bool                      # any collective has a measured duration
    timing_note: str                    # where the durations come from, one line

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able data; None is "not measured" / "not known"."""
        rows = []
        for r in self.rows:
            d = {f: getattr(r, f) for f in BandwidthRow.__slots__}
            d["timing"] = [str(t) for t in r.timing]
            rows.append(d)
        groups = []
        for g in self.groups:
            d = {f: getattr(g, f) for f in GroupBandwidth.__slots__}
            d["members"] = list(g.members)
            d["shares"] = [{f: getattr(m, f) for f in MemberShare.__slots__} for m in g.shares]
            groups.append(d)
        return {"measured": self.measured, "timing_note": self.timing_note, "overlap_note": OVERLAP_NOTE,
                "rows": rows, "groups": groups}


def analyse(traces: TraceSet, *, windows_ns: Mapping[int, tuple[int, int]] | None = None,
            link_bps: Mapping[str, float] | None = None) -> BandwidthReport:
    """Bandwidth, arrival skew and time shares of every collective group in ``traces``
    (point-to-point groups left out: their sequence numbers count per pair).

    ``windows_ns``: per global rank, the (start, end) host-clock ns its time shares are
    taken over (default: its first to last collective enter in the trace); ``link_bps``:
    per group, the bandwidth of the slowest link it crosses, bytes/s (for utilization)."""
    windows = _windows(traces, windows_ns or {})
    cache = _SigCache(traces.table)
    rows: list[BandwidthRow] = []
    groups: list[GroupBandwidth] = []
    sources: set[int] = set()
    for name in sorted({g for t in traces.ranks.values() for g in t.groups if not g.endswith(P2P_SUFFIX)}):
        members = _members(traces, name)
        cols = _columns(traces, name, members)
        if cols is None:
            continue
        desc = next((t.group_desc[name] for t in traces.ranks.values() if name in t.group_desc), "")
        link = (link_bps or {}).get(name)
        group, group_rows, used = _analyse_group(name, desc, members, cols, cache, windows, link)
        groups.append(group)
        rows.extend(group_rows)
        sources |= used
    rows.sort(key=lambda r: (r.group, r.op, math.inf if r.bytes is None else r.bytes))
    timings = [Timing.from_wire(w) for w in sorted(sources)]
    note = "; ".join(_SOURCE_NOTES[t] for t in timings if t in _SOURCE_NOTES) or _NONE_NOTE
    return BandwidthReport(tuple(rows), tuple(groups), bool(timings), note)


class _Columns:
    """One group's entries of all its members, concatenated in ascending rank order."""

    __slots__ = ("seq", "sig", "enter", "dur", "timing", "rank")

    def __init__(self, parts: list[tuple[int, GroupOps]]) -> None:
        self.seq = np.concatenate([_np(o.seqs, np.int64) for _, o in parts])
        self.sig = np.concatenate([_np(o.sigs, np.int64) for _, o in parts])
        self.enter = np.concatenate([_np(o.enter_ns, np.int64) for _, o in parts])
        self.dur = np.concatenate([_np(o.dur_ns, np.int64) for _, o in parts])
        self.timing = np.concatenate([_np(o.timing, np.int8) for _, o in parts])
        self.rank = np.repeat(np.array([r for r, _ in parts], dtype=np.int64), [len(o.seqs) for _, o in parts])


def _np(values: Sequence[int], dtype: type) -> np.ndarray:
    """A list or a ``compact()``ed typed array as a numpy array (an array without a copy)."""
    if isinstance(values, array) and len(values):
        return np.frombuffer(values, dtype=np.dtype(values.typecode)).astype(dtype, copy=False)
    return np.asarray(values, dtype=dtype)


def _members(traces: TraceSet, name: str) -> tuple[int, ...]:
    """The group's declared members (the first declaring rank's), else the ranks that have it."""
    for rank in sorted(traces.ranks):
        declared = traces.ranks[rank].group_ranks.get(name)
        if declared:
            return tuple(sorted(declared))
    return tuple(sorted(r for r, t in traces.ranks.items() if name in t.groups))


def _columns(traces: TraceSet, name: str, members: tuple[int, ...]) -> _Columns | None:
    parts = [(r, traces.ranks[r].groups[name]) for r in members
             if r in traces.ranks and name in traces.ranks[r].groups]
    parts = [(r, o) for r, o in parts if len(o.seqs)]
    return _Columns(parts) if parts else None


def _windows(traces: TraceSet, given: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Each rank's time-share window: the given one, else its first to last collective enter."""
    out: dict[int, tuple[int, int]] = {}
    for rank, trace in traces.ranks.items():
        if rank in given:
            out[rank] = (int(given[rank][0]), int(given[rank][1]))
            continue
        lo, hi = _NOT_MEASURED, -1
        for ops in trace.groups.values():
            enter = _np(ops.enter_ns, np.int64)
            enter = enter[enter > 0]
            if len(enter):
                lo, hi = min(lo, int(enter.min())), max(hi, int(enter.max()))
        if hi >= 0:
            out[rank] = (lo, hi)
    return out


class _SigCache:
    """Per signature id: S for a group size (-1: not rated), and a small op number."""

    def __init__(self, table: SignatureTable) -> None:
        self.table = table
        self.bytes: dict[tuple[int, int], int] = {}
        self.op_ids: dict[str, int] = {}
        self.ops: list[str] = []

    def lookup(self, sig_ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(bytes, op number) arrays indexed by signature id, filled for ``sig_ids``."""
        size = len(self.table.sigs)
        nbytes, ops = np.full(size, -1, dtype=np.int64), np.zeros(size, dtype=np.int64)
        for sid in np.unique(sig_ids).tolist():
            s = self.table.sigs[sid]
            b = self.bytes.get((sid, n))
            if b is None:
                got = message_bytes(s.op, s.input_sizes, s.input_dtypes, s.output_sizes, s.output_dtypes, n)
                b = self.bytes[(sid, n)] = -1 if got is None else got
            nbytes[sid] = b
            op = self.op_ids.get(s.op)
            if op is None:
                op = self.op_ids[s.op] = len(self.ops)
                self.ops.append(s.op)
            ops[sid] = op
        return nbytes, ops


def _analyse_group(name: str, desc: str, members: tuple[int, ...], c: _Columns, cache: _SigCache,
                   windows: Mapping[int, tuple[int, int]], link: float | None
                   ) -> tuple[GroupBandwidth, list[BandwidthRow], set[int]]:
    n = len(members)
    sig_bytes, sig_op = cache.lookup(c.sig, n)
    # one segment per seq; inside it the smallest measured duration first, ties to the
    # lowest rank (the columns are in rank order and lexsort is stable)
    dur_key = np.where(c.dur > 0, c.dur, _NOT_MEASURED)
    order = np.lexsort((dur_key, c.seq))
    seq, rank, enter = c.seq[order], c.rank[order], c.enter[order]
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    counts = np.diff(np.r_[starts, len(seq)])
    complete = counts == n
    first = order[starts]
    measured_members = np.add.reduceat((c.dur[order] > 0).astype(np.int64), starts)
    measured = complete & (measured_members == n)
    t_ns = dur_key[first]
    last_enter = np.maximum.reduceat(enter, starts)
    skew_ns = last_enter - np.minimum.reduceat(enter, starts)
    is_last = enter == np.repeat(last_enter, counts)
    last_rank = np.minimum.reduceat(np.where(is_last, rank, _NOT_MEASURED), starts)
    size = np.maximum.reduceat(sig_bytes[c.sig[order]], starts)
    op = sig_op[c.sig[first]]
    timing = c.timing[first]

    # the complete collectives only, from here on
    keep = np.flatnonzero(complete)
    size, op, timing, skew_ns, last_rank = size[keep], op[keep], timing[keep], skew_ns[keep], last_rank[keep]
    measured, t_ns = measured[keep], t_ns[keep]
    t_s = np.where(measured, t_ns, 0) / 1e9
    skew_s = skew_ns / 1e9

    # rows: (op, S); an all_to_all's S follows the routing and changes every step, so its
    # rows are power-of-two buckets of S (each collective still rated with its own)
    a2a = np.isin(op, [i for i, name in enumerate(cache.ops) if base_op(name) == "all_to_all"]) & (size > 0)
    row_size = np.where(a2a, np.left_shift(1, np.ceil(np.log2(np.maximum(size, 1))).astype(np.int64)), size) \
        if a2a.any() else size
    row_order = np.lexsort((a2a, row_size, op))
    op_s, size_s, a2a_s = op[row_order], row_size[row_order], a2a[row_order]
    boundary = np.r_[True, (op_s[1:] != op_s[:-1]) | (size_s[1:] != size_s[:-1]) | (a2a_s[1:] != a2a_s[:-1])] \
        if len(keep) \
        else np.zeros(0, dtype=bool)
    row_start = np.flatnonzero(boundary)
    row_of = np.empty(len(keep), dtype=np.int64)
    row_of[row_order] = np.cumsum(boundary) - 1
    n_rows = len(row_start)
    factors = np.array([_factor(cache.ops[o], n) for o in op_s[row_start].tolist()], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where(measured & (size > 0), size / np.where(t_s > 0, t_s, 1.0), np.nan)
    busbw = algbw * factors[row_of] if n_rows else algbw
    rated = measured & ~np.isnan(busbw)

    # as nccl-tests reports a size: the bytes over the time, summed over the row's
    # collectives (a mean duration: a heavy tail counts, as it does in a timed loop);
    # the spread is the per-collective busbw's 10th and 90th percentiles
    t_sum = np.bincount(row_of[measured], weights=t_s[measured], minlength=n_rows)
    alg_ok = measured & ~np.isnan(algbw)  # algbw needs no bus factor (a group of one has none)
    s_sum = np.bincount(row_of[alg_ok], weights=size[alg_ok].astype(np.float64), minlength=n_rows)
    st_sum = np.bincount(row_of[alg_ok], weights=t_s[alg_ok], minlength=n_rows)
    bus_q = _grouped_quantiles(row_of[rated], busbw[rated], n_rows, (0.1, 0.9))
    rated_rows = np.bincount(row_of[rated], minlength=n_rows)
    skew_q = _grouped_quantiles(row_of, skew_s, n_rows, (0.5, 0.9))
    last_r, last_c, last_n = _last_in(row_of, last_rank, skew_s, n_rows)
    row_counts = np.bincount(row_of, minlength=n_rows)
    row_measured = np.bincount(row_of[measured], minlength=n_rows)
    row_timings = _timings_per_row(row_of[measured], timing[measured], n_rows)

    rows = []
    for i in range(n_rows):
        k = row_order[row_start[i]]
        algbw_row = s_sum[i] / st_sum[i] if st_sum[i] > 0 else None
        busbw_med = algbw_row * factors[i] if algbw_row is not None and rated_rows[i] else None
        rows.append(BandwidthRow(
            group=name, desc=desc, group_size=n, op=cache.ops[int(op[k])],
            bytes=int(row_size[k]) if row_size[k] >= 0 else None,
            collectives=int(row_counts[i]), measured=int(row_measured[i]), timing=row_timings[i],
            t_s=float(t_sum[i] / row_measured[i]) if row_measured[i] else None,
            algbw_bps=_f(algbw_row) if algbw_row is not None else None, busbw_bps=_f(busbw_med) if busbw_med is not None else None,
            busbw_p10_bps=_f(bus_q[0, i]), busbw_p90_bps=_f(bus_q[1, i]),
            skew_s=_f(skew_q[0, i]), skew_p90_s=_f(skew_q[1, i]),
            last_rank=int(last_r[i]), last_share=float(last_c[i] / last_n[i]),
            utilization=busbw_med / link if busbw_med is not None and link and link > 0 else None,
            bucketed=bool(a2a[k])))

    whole = np.zeros(len(keep), dtype=np.int64)
    g_skew = _grouped_quantiles(whole, skew_s, 1, (0.5, 0.9))
    g_last, g_count, g_n = _last_in(whole, last_rank, skew_s, 1)
    group = GroupBandwidth(
        group=name, desc=desc, members=members, collectives=len(keep), incomplete=int(len(starts) - len(keep)),
        measured=int(measured.sum()), skew_s=_f(g_skew[0, 0]), skew_p90_s=_f(g_skew[1, 0]),
        last_rank=int(g_last[0]) if len(keep) else None,
        last_share=float(g_count[0] / g_n[0]) if len(keep) else None,
        shares=_shares(members, c, windows))
    return group, rows, set(np.unique(timing[measured]).tolist())


def _factor(op: str, n: int) -> float:
    f = bus_factor(op, n)
    return math.nan if f is None else f


def _f(x: float) -> float | None:
    """A numpy figure as a plain float; NaN (nothing to take it over) as None."""
    return None if math.isnan(x) else float(x)


def _grouped_quantiles(group: np.ndarray, values: np.ndarray, n_groups: int, qs: Sequence[float]) -> np.ndarray:
    """Quantiles of ``values`` per group number (numpy's linear interpolation), one sort
    for all groups; shape (len(qs), n_groups), NaN for a group without values."""
    out = np.full((len(qs), n_groups), np.nan)
    if not len(values):
        return out
    v = values[np.lexsort((values, group))]
    counts = np.bincount(group, minlength=n_groups)
    start = np.cumsum(counts) - counts
    has = counts > 0
    c, st = counts[has], start[has]
    for i, q in enumerate(qs):
        pos = q * (c - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, c - 1)
        out[i, has] = v[st + lo] + (v[st + hi] - v[st + lo]) * (pos - lo)
    return out


def _last_in(group: np.ndarray, last_rank: np.ndarray, skew_s: np.ndarray,
             n_groups: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group number: the member most often last in, how often, and out of how many
    collectives: its skewed ones (arrival skew >= ``LATE_SKEW_S``) where it has any, else
    all. A rank late once per step is last in that step's skewed collective; in the others
    the last member is whoever the scheduler made a few microseconds late, which on a
    busy host is any of them, and counted alike they can outnumber it."""
    skewed = skew_s >= LATE_SKEW_S
    every = _most_frequent(group, last_rank, n_groups)
    late = _most_frequent(group[skewed], last_rank[skewed], n_groups)
    n_every = np.bincount(group, minlength=n_groups)
    n_late = np.bincount(group[skewed], minlength=n_groups)
    use = n_late > 0
    return (np.where(use, late[0], every[0]), np.where(use, late[1], every[1]),
            np.maximum(np.where(use, n_late, n_every), 1))


def _most_frequent(group: np.ndarray, values: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group number: its most frequent value (ties: the lowest) and how often it occurs."""
    best, count = np.full(n_groups, -1, dtype=np.int64), np.zeros(n_groups, dtype=np.int64)
    if not len(values):
        return best, count
    pairs, counts = np.unique(np.stack([group, values]), axis=1, return_counts=True)
    pick = np.lexsort((pairs[1], -counts, pairs[0]))
    firsts = pick[np.r_[True, pairs[0][pick][1:] != pairs[0][pick][:-1]]]
    best[pairs[0][firsts]], count[pairs[0][firsts]] = pairs[1][firsts], counts[firsts]
    return best, count


def _timings_per_row(row: np.ndarray, timing: np.ndarray, n_rows: int) -> list[tuple[Timing, ...]]:
    out: list[list[Timing]] = [[] for _ in range(n_rows)]
    if len(row):
        for r, t in np.unique(np.stack([row, timing.astype(np.int64)]), axis=1).T.tolist():
            out[r].append(Timing.from_wire(t))
    return [tuple(t) for t in out]


def _shares(members: tuple[int, ...], c: _Columns, windows: Mapping[int, tuple[int, int]]) -> tuple[MemberShare, ...]:
    """Each member's measured time in the group's collectives entered inside its window."""
    pos = np.searchsorted(np.array(members, dtype=np.int64), c.rank)
    bounds = np.array([windows.get(r, (0, -1)) for r in members], dtype=np.int64).reshape(len(members), 2)
    inside = (c.enter >= bounds[pos, 0]) & (c.enter <= bounds[pos, 1]) & (c.dur > 0)
    k = len(members)

    def total(mask: np.ndarray) -> np.ndarray:
        return np.bincount(pos[mask], weights=c.dur[mask].astype(np.float64), minlength=k)

    measured = np.bincount(pos[inside], minlength=k)
    comm = total(inside)
    exposed = total(inside & (c.timing == _WRAPPER))
    overlap = total(inside & ((c.timing == _ASYNC) | (c.timing == _NCCL)))
    out = []
    for i, r in enumerate(members):
        length = int(bounds[i, 1] - bounds[i, 0])
        ok = length > 0 and measured[i] > 0
        out.append(MemberShare(
            rank=r, window_s=length / 1e9 if length > 0 else None,
            comm_share=float(comm[i] / length) if ok else None,
            exposed_share=float(exposed[i] / length) if ok else None,
            overlap_capable_share=float(overlap[i] / length) if ok else None))
    return tuple(out)


def bench_analytics(n_ranks: int, n_collectives: int, *, seed: int = 0) -> float:
    """Seconds ``analyse`` takes over one world group of ``n_ranks`` ranks with
    ``n_collectives`` measured collectives each (all_reduce and all_gather alternating),
    from ``compact()``ed traces: n_ranks x n_collectives rank-entries."""
    rng = np.random.default_rng(seed)
    table = SignatureTable()
    sigs = np.array([table.intern("all_reduce", [(1 << 20,)], [(1 << 20,)], ["bfloat16"], ["bfloat16"]),
                     table.intern("all_gather", [(1 << 16,)], [(n_ranks << 16,)], ["float32"], ["float32"])])
    seqs = np.arange(1, n_collectives + 1, dtype=np.int64)
    base = seqs * 10_000_000
    ranks = {}
    for r in range(n_ranks):
        ops = GroupOps()
        enter = base + rng.integers(0, 1_000_000, n_collectives)
        dur = rng.integers(500_000, 2_000_000, n_collectives)
        for attr, values, code in (("seqs", seqs, "q"), ("sigs", sigs[seqs % 2], "q"), ("enter_ns", enter, "q"),
                                   ("exit_ns", enter + dur, "q"), ("delta", np.zeros_like(seqs), "q"),
                                   ("dur_ns", dur, "q"), ("done", np.ones(n_collectives, np.int8), "b"),
                                   ("timing", np.full(n_collectives, _NCCL, np.int8), "b")):
            setattr(ops, attr, array(code, values.astype(np.int64 if code == "q" else np.int8).tobytes()))
        ranks[r] = RankTrace(rank=r, groups={"0": ops}, group_ranks={"0": tuple(range(n_ranks))})
    traces = TraceSet(source="bench", ranks=ranks, table=table)
    began = time.perf_counter()
    analyse(traces)
    return time.perf_counter() - began
