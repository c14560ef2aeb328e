"""Per-rank collective traces in the compact form the diagnosis engine reads.

A ``TraceSet`` holds, for every rank, its collectives per process group as parallel
lists ordered by sequence number (``GroupOps``), its point-to-point ops, and what the
rank knows of its groups (description, members). Op signatures (op, sizes, dtypes) are
interned into one ``SignatureTable`` so that comparing two ranks' collective N is an
integer comparison, and comparing whole histories is a list comparison in C: that is
what makes 512 ranks x 2000 entries an affair of a second.

Two producers fill it, through ``TraceBuilder``: native flight-recorder dumps
(``controlplane.diagnosis.dumps``) and the store (``controlplane.diagnosis.source``, over
any ``TraceSource``). Both hand over canonical op and dtype names (``fleet.proto.vocab``):
the dump reader makes them so as it reads, the store's rows are canonical already.

Invariants:
  * ``GroupOps.seqs`` is strictly ascending. Entries that share a sequence number
    (ops inside a coalesced group) are merged into one ``coalesced`` signature.
  * Ranks are global ranks. Point-to-point peers are converted from group-local to
    global ranks when the group's members are known.
  * Nothing here imports torch, Ray or gRPC.
"""

from __future__ import annotations

import bisect
import math
from array import array
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

class Signature(NamedTuple):
    """What every member of a group must agree on for one collective. A named tuple, not
    a dataclass: a 512-rank MoE job has ~10^5 distinct ones (an all_to_all's splits
    change every step), and a tuple is made from its key for a fraction of the cost."""

    op: str
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]

    def describe(self) -> str:
        """One short human form, e.g. ``all_reduce [[10]] float32``."""
        sizes = [list(s) for s in self.input_sizes] if self.input_sizes else [list(s) for s in self.output_sizes]
        dtypes = ",".join(sorted(set(self.input_dtypes) | set(self.output_dtypes))) or "-"
        return f"{self.op} {sizes} {dtypes}"


_make_signature = Signature._make


class SignatureTable:
    """Interns signatures: equal signatures get equal small integer ids."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.sigs: list[Signature] = []

    def intern(self, op: str, input_sizes: Iterable[Iterable[int]], output_sizes: Iterable[Iterable[int]],
               input_dtypes: Iterable[str], output_dtypes: Iterable[str]) -> int:
        """The id of this signature (new or existing). Names are taken as given: producers
        pass canonical ones (``fleet.proto.vocab``), made so where the data came in."""
        key = (op, tuple(tuple(int(d) for d in s) for s in input_sizes),
               tuple(tuple(int(d) for d in s) for s in output_sizes),
               tuple(input_dtypes), tuple(output_dtypes))
        return self.intern_key(key)

    def intern_key(self, key: tuple) -> int:
        """The id of a signature given as its field tuple."""
        sid = self.ids.get(key)
        if sid is None:
            sid = self.ids[key] = len(self.sigs)
            self.sigs.append(_make_signature(key))
        return sid

    def merge(self, first: int, second: int) -> int:
        """The signature of a coalesced group: both ops' sizes and dtypes, in order."""
        a, b = self.sigs[first], self.sigs[second]
        ops = a.op.removeprefix("coalesced(").removesuffix(")").split("+") + [b.op]
        return self.intern_key((f"coalesced({'+'.join(ops)})", a.input_sizes + b.input_sizes,
                                a.output_sizes + b.output_sizes, a.input_dtypes + b.input_dtypes,
                                a.output_dtypes + b.output_dtypes))


@dataclass(slots=True)
class GroupOps:
    """One rank's collectives on one group, as parallel lists ascending by ``seqs``.

    ``enter_ns`` is when the rank issued the op; ``exit_ns`` 0 when unknown; ``done`` is
    True once the backend retired the op (for gloo this is also how a timed-out op ends);
    ``delta`` the elements the rank sent minus those it received (non-zero only for an
    all_to_all, whose uneven splits differ per rank while the group's sum must be 0: kept
    per entry so that the signature need not carry the split); ``dur_ns`` the op's measured
    duration (0: not measured) and ``timing`` where it comes from (a
    ``fleet.proto.kinds.Timing`` wire number; 0 = not measured). An estimated exit (gloo's
    native entries: when a poll first saw the op retired) is never a duration.
    """

    seqs: list[int] = field(default_factory=list)
    sigs: list[int] = field(default_factory=list)
    enter_ns: list[int] = field(default_factory=list)
    exit_ns: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    delta: list[int] = field(default_factory=list)
    dur_ns: list[int] = field(default_factory=list)
    timing: list[int] = field(default_factory=list)

    def index(self, seq: int) -> int | None:
        """Position of ``seq`` in the lists, or None."""
        seqs = self.seqs
        if not seqs:
            return None
        i = seq - seqs[0]
        if 0 <= i < len(seqs) and seqs[i] == seq:  # the common, gap-free case
            return i
        i = bisect.bisect_left(seqs, seq)
        return i if i < len(seqs) and seqs[i] == seq else None

    def compact(self) -> None:
        """Switch the lists to typed arrays: a tenth of the memory, and a process pool
        ships them back as raw bytes instead of a million int objects."""
        self.seqs, self.sigs = array("q", self.seqs), array("q", self.sigs)  # type: ignore[assignment]
        self.enter_ns, self.exit_ns = array("q", self.enter_ns), array("q", self.exit_ns)  # type: ignore[assignment]
        self.done = array("b", self.done)  # type: ignore[assignment]
        self.delta = array("q", self.delta)  # type: ignore[assignment]
        self.dur_ns, self.timing = array("q", self.dur_ns), array("b", self.timing)  # type: ignore[assignment]

    @property
    def consecutive(self) -> bool:
        return not self.seqs or self.seqs[-1] - self.seqs[0] + 1 == len(self.seqs)


@dataclass(slots=True)
class P2POp:
    """One send or recv of one rank: ``peer`` is the partner's global rank."""

    kind: str  # "send" | "recv"
    peer: int
    seq: int
    sig: int
    enter_ns: int
    done: bool


@dataclass(frozen=True, slots=True)
class GroupStatus:
    """A rank's own counters for one group (a dump's ``pg_status``): the sequence number
    of the newest collective it enqueued, started and completed (-1: none/unknown).

    They matter where entries are absent: an ``onlyActive`` dump keeps no completed
    entries, and a dump taken while the rank held the GIL keeps none at all. gloo counts
    point-to-point ops in them too (``counts_p2p``), so there they are not collective
    sequence numbers."""

    enqueued: int = -1
    started: int = -1
    completed: int = -1
    counts_p2p: bool = False


@dataclass(slots=True)
class RankTrace:
    rank: int
    source: str = ""                                        # file path, or "store"
    groups: dict[str, GroupOps] = field(default_factory=dict)
    p2p: dict[str, list[P2POp]] = field(default_factory=dict)
    group_desc: dict[str, str] = field(default_factory=dict)
    group_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # declared members
    status: dict[str, GroupStatus] = field(default_factory=dict)          # by group name
    group_timeout_ms: dict[str, int] = field(default_factory=dict)        # the group's PG timeout
    dumped_ns: int = 0                                      # when the dump was written (0: unknown)
    entries: int = 0
    first_record: int = 0                                   # ring position of the first entry


@dataclass
class TraceSet:
    """Every rank's trace of one attempt (or one folder of dumps)."""

    source: str
    ranks: dict[int, RankTrace]
    table: SignatureTable
    attempt: int | None = None
    unreadable: dict[int, str] = field(default_factory=dict)  # rank -> why its trace is missing


class TraceBuilder:
    """Accumulates one rank's entries into a ``RankTrace``."""

    def __init__(self, rank: int, table: SignatureTable, source: str = "") -> None:
        self.table = table
        self.trace = RankTrace(rank=rank, source=source)
        self._pending_p2p: list[tuple[str, str, str, int, int, int, bool]] = []

    def declare_group(self, group: str, desc: str = "", ranks: Iterable[int] = (), *,
                      canonical: bool = False) -> None:
        """Record what the rank knows of ``group``: its description and members
        (``canonical``: ``ranks`` is a sorted tuple of ints already, shared as it is)."""
        if desc:
            self.trace.group_desc.setdefault(group, desc)
        members = ranks if canonical else tuple(sorted(int(r) for r in ranks))
        if members:
            self.trace.group_ranks[group] = members

    def add_collective(self, group: str, seq: int, sig: int, enter_ns: int, exit_ns: int, done: bool,
                       delta: int | None = None, dur_ns: int = 0, timing: int = 0) -> None:
        """Append one collective; a repeated ``seq`` joins the previous one (coalescing:
        the group's duration is its longest member's). ``delta`` (see ``GroupOps``)
        defaults to what the signature's sizes say; ``dur_ns``/``timing``: the measured
        duration and its source (0: not measured)."""
        if delta is None:
            s = self.table.sigs[sig]
            delta = a2a_delta(s.op, s.input_sizes, s.output_sizes)
        ops = self.trace.groups.get(group)
        if ops is None:
            ops = self.trace.groups[group] = GroupOps()
        self.trace.entries += 1
        if ops.seqs and seq <= ops.seqs[-1]:
            i = ops.index(seq)
            if i is None:  # out of order: rare; keep the lists sorted
                self._insert(ops, seq, sig, enter_ns, exit_ns, done, delta, dur_ns, timing)
                return
            ops.sigs[i] = self.table.merge(ops.sigs[i], sig)
            ops.done[i] = ops.done[i] and done
            ops.exit_ns[i] = max(ops.exit_ns[i], exit_ns) if ops.done[i] else 0
            ops.delta[i] += delta
            if dur_ns > ops.dur_ns[i]:
                ops.dur_ns[i], ops.timing[i] = dur_ns, timing
            return
        ops.seqs.append(seq)
        ops.sigs.append(sig)
        ops.enter_ns.append(enter_ns)
        ops.exit_ns.append(exit_ns)
        ops.done.append(done)
        ops.delta.append(delta)
        ops.dur_ns.append(dur_ns if dur_ns > 0 else 0)
        ops.timing.append(timing if dur_ns > 0 else 0)

    @staticmethod
    def _insert(ops: GroupOps, seq: int, sig: int, enter_ns: int, exit_ns: int, done: bool, delta: int,
                dur_ns: int, timing: int) -> None:
        i = bisect.bisect_left(ops.seqs, seq)
        measured = dur_ns > 0
        for lst, v in ((ops.seqs, seq), (ops.sigs, sig), (ops.enter_ns, enter_ns),
                       (ops.exit_ns, exit_ns), (ops.done, done), (ops.delta, delta),
                       (ops.dur_ns, dur_ns if measured else 0), (ops.timing, timing if measured else 0)):
            lst.insert(i, v)

    def add_p2p(self, group: str, kind: str, meta: str, seq: int, sig: int, enter_ns: int, done: bool) -> None:
        """A send/recv; ``meta`` is the native ``"src->dst"`` / ``"dst<-src"`` in group ranks."""
        self.trace.entries += 1
        self._pending_p2p.append((group, kind, meta, seq, sig, enter_ns, done))

    def finish(self) -> RankTrace:
        """The trace, with point-to-point peers mapped to global ranks."""
        for group, kind, meta, seq, sig, enter_ns, done in self._pending_p2p:
            peer = _p2p_peer(kind, meta)
            members = self.trace.group_ranks.get(group)
            if members and 0 <= peer < len(members):
                peer = members[peer]
            self.trace.p2p.setdefault(group, []).append(P2POp(kind, peer, seq, sig, enter_ns, done))
        self._pending_p2p.clear()
        return self.trace


def _p2p_peer(kind: str, meta: str) -> int:
    """The partner's group rank from ``"0->1"`` (send) or ``"1<-0"`` (recv); -1 if unknown."""
    try:
        if kind == "send":
            return int(meta.split("->")[1])
        return int(meta.split("<-")[1])
    except (IndexError, ValueError):
        return -1


def a2a_delta(op: str, input_sizes: Iterable[Iterable[int]], output_sizes: Iterable[Iterable[int]]) -> int:
    """Elements sent minus received by one rank's all_to_all (0 for any other op)."""
    if op != "all_to_all":
        return 0
    return sum(math.prod(s) for s in input_sizes) - sum(math.prod(s) for s in output_sizes)
