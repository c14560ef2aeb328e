"""The per-group checks of a diagnosis: who waits on whom, who disagrees, who is late.

``Analysis`` collects findings and the wait-for edges they imply
(``controlplane.diagnosis.waits`` says what a wait is). Per process group:

  * ``check_waits`` — every rank waiting in the group, and whom on: members that never
    entered the collective (``missing``), members that entered an earlier or the same
    one and never completed it while another member did (``stuck``), else members
    without a trace (``no_trace``). A minority ahead of a majority that stands together
    is kept as a candidate ``extra``; the verdict decides whether the majority never
    issued that collective (the minority is wrong) or is blocked elsewhere (the
    minority only waits).
  * ``check_signatures`` — members that entered collective N with another op, shape or
    dtype than the majority of the group. Sizes follow each op's rules: all_gather's
    output is the input times the group, rooted ops carry tensors on the root only,
    all_to_all may split unevenly (only the totals must agree), coalesced ops compare
    every member op. The other members of such a collective wait on the ones blamed.
  * ``check_stragglers`` — a member that arrives last at most of the group's
    collectives, with its median lateness behind the median member.

Point-to-point ops are checked in ``controlplane.diagnosis.p2p``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from fleet.controlplane.diagnosis.membership import GroupInfo
from fleet.controlplane.diagnosis.traces import GroupOps, Signature, TraceSet
from fleet.controlplane.diagnosis.waits import Front, front, last_group


@dataclass(frozen=True)
class DiagnosisConfig:
    """Thresholds of the analysis."""

    straggler_min_share: float = 0.5     # arrives last at least this often ...
    straggler_min_seqs: int = 20         # ... over at least this many collectives ...
    straggler_min_lateness_ms: float = 5.0  # ... and this late (median) behind the median member
    straggler_window: int = 500          # newest collectives of a group considered
    max_findings_per_group: int = 10
    settle_s: float = 3.0                # live traces: a wait younger than this is in flight


@dataclass(frozen=True)
class Finding:
    kind: str
    group: str
    seq: int
    ranks: list[int]                     # the ranks this finding blames
    detail: str
    waiting: list[int] = field(default_factory=list)  # ranks blocked by them

    def to_json(self) -> dict[str, Any]:
        out = {"kind": self.kind, "group": self.group, "seq": self.seq, "ranks": self.ranks,
               "detail": self.detail}
        if self.waiting:
            out["waiting_ranks"] = self.waiting
        return out


@dataclass(frozen=True)
class ExtraCandidate:
    """A minority (``front``) waits in collective ``seq`` that a majority (``behind``),
    all standing at ``seq - 1``, never entered."""

    group: GroupInfo
    seq: int
    front: list[int]
    behind: list[int]
    op: str


#: The rank an unrecorded op waits on: somebody the dump cannot name.
UNKNOWN = -1


class Analysis:
    """Findings and wait-for edges over one ``TraceSet``."""

    def __init__(self, traces: TraceSet, config: DiagnosisConfig, now_ns: int | None,
                 missing: set[int]) -> None:
        self.traces = traces
        self.sigs: list[Signature] = traces.table.sigs
        self.config = config
        self.now_ns = now_ns
        self.missing = missing
        self.findings: list[Finding] = []
        self.waits: dict[int, set[int]] = defaultdict(set)  # waiter -> awaited
        self.extra: list[ExtraCandidate] = []
        self.last_group = {r: last_group(t) for r, t in traces.ranks.items()}
        self._compat_cache: dict[tuple[int, int], str | None] = {}
        self._canon: list[int] = []

    def add(self, finding: Finding) -> None:
        """Keep a finding; its waiting ranks wait on the ranks it blames."""
        self.findings.append(finding)
        for w in finding.waiting:
            self.waits[w].update(r for r in finding.ranks if r != w)

    def check_unrecorded(self) -> None:
        """Ranks blocked in an op the dump does not record: gloo keeps no point-to-point
        entries, but its ``pg_status`` counts them, so a group whose counters show an op
        enqueued and not completed while every recorded entry there is retired means the
        rank waits in a send or recv. Whom on, the dump cannot say; the rank is not a
        root cause (it waits on ``UNKNOWN``)."""
        by_group: dict[str, list[int]] = defaultdict(list)
        for r, t in self.traces.ranks.items():
            for name, st in t.status.items():
                if not st.counts_p2p or st.enqueued <= st.completed:
                    continue
                ops = t.groups.get(name)
                if ops is not None and ops.seqs and not all(ops.done):
                    continue
                by_group[name].append(r)
        for name, ranks in sorted(by_group.items()):
            for r in ranks:
                self.waits[r].add(UNKNOWN)
            self.findings.append(Finding(
                "p2p_unrecorded", name, 0, [],
                f"{_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in an op the dump does not record "
                f"on group {name} (its counters show one enqueued and not completed while every recorded "
                f"entry is retired: gloo records no send/recv), on a peer the dump cannot name",
                sorted(ranks)))

    # -- positions ---------------------------------------------------------------------

    def fronts(self, g: GroupInfo) -> dict[int, Front]:
        """Every present member's position in ``g``; a member with nothing there stands
        at 0 when it must have been in it (declared, or its ring never wrapped)."""
        out = {}
        for r in g.members:
            t = self.traces.ranks.get(r)
            if t is None:
                continue
            f = front(t, g.name, self.last_group.get(r))
            if f is not None:
                out[r] = f
            elif g.name in t.group_ranks or (t.first_record == 0 and t.entries and g.name not in t.p2p):
                out[r] = Front(0, None, False, False, False)
        return out

    def ops(self, g: GroupInfo) -> dict[int, GroupOps]:
        return {r: o for r in g.members if (t := self.traces.ranks.get(r)) is not None
                and (o := t.groups.get(g.name)) is not None and o.seqs}

    def _in_flight(self, ops: dict[int, GroupOps], seq: int) -> bool:
        """Live traces only: the newest entry of collective ``seq`` is younger than the
        settle time, so a wait in it may simply be in progress."""
        if self.now_ns is None:
            return False
        newest = 0
        for o in ops.values():
            i = o.index(seq)
            if i is not None:
                newest = max(newest, o.enter_ns[i])
        return self.now_ns - newest < self.config.settle_s * 1e9

    # -- who waits on whom ---------------------------------------------------------------

    def check_waits(self, g: GroupInfo) -> None:
        fronts = self.fronts(g)
        if not fronts:
            return
        ops = self.ops(g)
        completed = {r: f.completed for r, f in fronts.items()}
        best = sorted(completed, key=completed.__getitem__)[-2:]  # the two furthest

        def done_by_others(r: int, seq: int) -> bool:
            other = best[-1] if best[-1] != r else (best[0] if len(best) > 1 else r)
            return other != r and completed[other] >= seq

        # entered and never completed while another member completed it, and nobody is
        # missing from it (an op a rooted peer got through waits on that missing rank)
        low = min(f.entered for f in fronts.values())
        stuck = {r: f.open for r, f in fronts.items()
                 if f.open is not None and f.open <= low and done_by_others(r, f.open)
                 and not self._in_flight(ops, f.open)}
        # members that never entered a collective others entered (completed or not: a
        # collective cannot finish without every member, so those that passed it timed
        # out or were let through by a rooted op), by that collective
        top = max(f.entered for f in fronts.values())
        behind: dict[int, list[int]] = defaultdict(list)
        for r, f in fronts.items():
            if f.entered < top and r not in stuck:
                behind[f.entered + 1].append(r)
        if self._extra_candidate(g, fronts, behind, ops):
            behind.clear()
        for seq, culprits in sorted(behind.items()):
            if self._in_flight(ops, seq):
                continue
            waiters = sorted(w for w, f in fronts.items() if f.entered >= seq and w not in stuck)
            op = self._describe_at(ops, waiters[0], seq)
            their = "; ".join(self._last_op(r, g.name, ops.get(r)) for r in culprits[:4])
            self.add(Finding(
                "missing", g.name, seq, sorted(culprits),
                f"{_ranks(culprits)} never entered collective {seq} ({op}) of group {g.label()}; "
                f"{_ranks(waiters)} entered it. {their}", waiters))
        for r, seq in sorted(stuck.items()):
            waiters = sorted(w for w, f in fronts.items()
                             if w not in stuck and f.wait_seq is not None and f.wait_seq > seq)
            done_by = sorted(m for m in fronts if m != r and completed[m] >= seq)
            op = self._describe_at(ops, r, seq)
            how = "by its counters" if fronts[r].from_status else "in its dump"
            self.add(Finding(
                "stuck", g.name, seq, [r],
                f"rank {r} entered collective {seq} ({op}) of group {g.label()} and never completed it "
                f"({how}), while {_ranks(done_by)} completed it: a hung kernel or a failed device",
                waiters))
        absent = sorted(r for r in g.members if r in self.missing)
        if behind or stuck or not absent:
            return
        # every present member stands at the same collective: the members without a trace
        # are blamed when the present ones wait in it (or timed out in it)
        waiters = sorted(r for r, f in fronts.items() if f.wait_seq == top)
        if len(waiters) != len(fronts) or self._in_flight(ops, top):
            return
        op = self._describe_at(ops, waiters[0], top)
        if all(fronts[w].open is not None for w in waiters):
            how = "waits in"
        elif all(fronts[w].open is not None or fronts[w].timed_out for w in waiters):
            how = "waits or timed out in"
        else:
            how = ("stopped at (its last entry, retired: gloo marks an op that failed because a peer "
                   "died like a completed one)")
        self.add(Finding(
            "no_trace", g.name, top, absent,
            f"{_ranks(absent)} left no trace; every other member of group {g.label()} {how} "
            f"collective {top} ({op})", waiters))

    def _extra_candidate(self, g: GroupInfo, fronts: dict[int, Front], behind: dict[int, list[int]],
                         ops: dict[int, GroupOps]) -> bool:
        """A majority standing together one collective short of a minority that entered it."""
        if len(behind) != 1:
            return False
        seq, majority = next(iter(behind.items()))
        ahead = sorted(r for r in fronts if r not in majority)
        if len(majority) <= len(ahead) or self._in_flight(ops, seq):
            return False
        self.extra.append(ExtraCandidate(g, seq, ahead, sorted(majority),
                                         self._describe_at(ops, ahead[0], seq)))
        return True

    def _describe_at(self, ops_by_rank: dict[int, GroupOps], rank: int, seq: int) -> str:
        ops = ops_by_rank.get(rank)
        i = ops.index(seq) if ops else None
        return self.sigs[ops.sigs[i]].describe() if ops is not None and i is not None else "?"

    def _last_op(self, rank: int, group: str, ops: GroupOps | None) -> str:
        if ops is None or not ops.seqs:
            return f"rank {rank} issued nothing on this group"
        state = "completed" if ops.done[-1] else "not completed"
        return f"rank {rank}'s last there: {ops.seqs[-1]} {self.sigs[ops.sigs[-1]].op}, {state}"

    # -- do the members agree ----------------------------------------------------------

    def check_signatures(self, g: GroupInfo) -> None:
        ops_by_rank = self.ops(g)
        if len(ops_by_rank) < 2:
            return
        lo = max(o.seqs[0] for o in ops_by_rank.values())
        hi = min(o.seqs[-1] for o in ops_by_rank.values())
        top = max(o.seqs[-1] for o in ops_by_rank.values())
        checked: set[int] = set()
        budget = [self.config.max_findings_per_group]
        if lo <= hi:
            canon = self._canonical()
            histories = {r: tuple(map(canon.__getitem__, self._column(o, o.sigs, lo, hi, -1)))
                         for r, o in ops_by_rank.items()}
            ref_key, _ = Counter(histories.values()).most_common(1)[0]
            for r, hist in histories.items():
                if hist == ref_key or budget[0] <= 0:
                    continue
                for i, (a, b) in enumerate(zip(hist, ref_key)):
                    if a != b and (lo + i) not in checked:
                        checked.add(lo + i)
                        if self._judge(g, ops_by_rank, lo + i, budget) and r in self._blamed_at(g.name, lo + i):
                            break
                    if budget[0] <= 0:
                        break
            if len(ops_by_rank) == len(g.members) and any(self.sigs[x].op == "all_to_all" for x in set(ref_key) if x >= 0):
                self._check_all_to_all_totals(g, ops_by_rank, lo, hi, checked, budget)
        # beyond the common range only some members entered: compare those
        for seq in range(max(hi + 1, lo), min(top, hi + 64) + 1):
            if seq not in checked and budget[0] > 0:
                self._judge(g, ops_by_rank, seq, budget)

    def _blamed_at(self, group: str, seq: int) -> set[int]:
        return {r for f in self.findings if f.group == group and f.seq == seq for r in f.ranks}

    def _judge(self, g: GroupInfo, ops_by_rank: dict[int, GroupOps], seq: int, budget: list[int]) -> bool:
        """Compare every member's collective ``seq``; add a finding when they disagree."""
        at: dict[int, int] = {}
        open_at: set[int] = set()
        for r, o in ops_by_rank.items():
            i = o.index(seq)
            if i is not None:
                at[r] = o.sigs[i]
                if not o.done[i]:
                    open_at.add(r)
        distinct = set(at.values())
        if len(at) < 2 or len(distinct) == 1:
            return False
        sigs = self.sigs
        if all(sigs[s].op == "all_to_all" for s in distinct) and len(
                {(sigs[s].input_dtypes, sigs[s].output_dtypes) for s in distinct}) == 1:
            return self._check_all_to_all(g, ops_by_rank, seq, budget)  # uneven splits: only totals matter
        # classes of mutually compatible signatures, biggest first
        classes: list[tuple[int, list[int]]] = []  # (representative sig, ranks)
        for r in sorted(at):
            for rep, members in classes:
                if self._compat(rep, at[r]) is None:
                    members.append(r)
                    break
            else:
                classes.append((at[r], [r]))
        if len(classes) == 1:
            if self.sigs[classes[0][0]].op == "all_to_all":
                return self._check_all_to_all(g, ops_by_rank, seq, budget)
            return False
        classes.sort(key=lambda c: -len(c[1]))
        tie = len(classes[1][1]) == len(classes[0][1])
        for rep, members in (classes if tie else classes[1:]):
            other_rep, others = classes[1] if rep == classes[0][0] else classes[0]
            kind = self._compat(other_rep, rep) or "op_mismatch"
            note = " (no majority: either side may be wrong)" if tie else ""
            self.add(Finding(
                kind, g.name, seq, sorted(members),
                f"{_ranks(members)} entered {self.sigs[rep].describe()} as collective {seq} of group "
                f"{g.label()} where {_ranks(others)} entered {self.sigs[other_rep].describe()}{note}",
                [] if tie else sorted(r for r in others if r in open_at)))
            budget[0] -= 1
        return True

    def _canonical(self) -> list[int]:
        """Signature id -> the id histories compare: an all_to_all's splits may differ per
        rank (only the group's totals must agree, ``_check_all_to_all_totals``), so its
        sizes are left out; every other signature is itself. The last slot maps a gap
        (-1) to itself."""
        table = self.traces.table
        if len(self._canon) != len(table.sigs) + 1:
            canon = []
            for i in range(len(table.sigs)):  # interning below appends: those map to themselves
                sig = table.sigs[i]
                canon.append(table.intern_key(("all_to_all", (), (), sig.input_dtypes, sig.output_dtypes))
                             if sig.op == "all_to_all" else i)
            canon.extend(range(len(canon), len(table.sigs)))
            canon.append(-1)
            self._canon = canon
        return self._canon

    def _check_all_to_all_totals(self, g: GroupInfo, ops_by_rank: dict[int, GroupOps], lo: int, hi: int,
                                 checked: set[int], budget: list[int]) -> None:
        """Per collective, what the members send in total must equal what they receive
        (``GroupOps.delta``), summed over the group in one pass per rank."""
        rows = [self._column(o, o.delta, lo, hi, 0) for o in ops_by_rank.values()]
        for i, total in enumerate(map(sum, zip(*rows))):
            if total and (lo + i) not in checked and budget[0] > 0:
                checked.add(lo + i)
                self._check_all_to_all(g, ops_by_rank, lo + i, budget)

    @staticmethod
    def _column(o: GroupOps, values, lo: int, hi: int, gap: int) -> list[int]:  # noqa: ANN001 (list or array)
        """``values`` (one of ``o``'s parallel lists) for sequence numbers lo..hi, ``gap``
        where ``o`` has none."""
        if o.consecutive:
            return list(values[lo - o.seqs[0]:hi - o.seqs[0] + 1])
        return [values[i] if (i := o.index(s)) is not None else gap for s in range(lo, hi + 1)]

    def _compat(self, a: int, b: int) -> str | None:
        key = (a, b)
        if key not in self._compat_cache:
            self._compat_cache[key] = _incompatibility(self.sigs[a], self.sigs[b])
        return self._compat_cache[key]

    def _check_all_to_all(self, g: GroupInfo, ops_by_rank: dict[int, GroupOps], seq: int,
                          budget: list[int]) -> bool:
        at = {r: o.delta[j] for r, o in ops_by_rank.items() if (j := o.index(seq)) is not None}
        total = sum(at.values())
        if len(at) < len(g.members) or total == 0:
            return False
        self.add(Finding(
            "size_mismatch", g.name, seq, sorted(at),
            f"all_to_all {seq} of group {g.label()}: the members send {abs(total)} elements "
            f"{'more' if total > 0 else 'fewer'} than they receive in total; the splits disagree"))
        budget[0] -= 1
        return True

    # -- who is late -------------------------------------------------------------------

    def check_stragglers(self, g: GroupInfo) -> None:
        cfg = self.config
        ops_by_rank = self.ops(g)
        if len(ops_by_rank) < 3:
            return
        lo = max(o.seqs[0] for o in ops_by_rank.values())
        hi = min(o.seqs[-1] for o in ops_by_rank.values())
        lo = max(lo, hi - cfg.straggler_window + 1)
        if hi - lo + 1 < cfg.straggler_min_seqs:
            return
        ranks = sorted(ops_by_rank)
        if not all(ops_by_rank[r].consecutive for r in ranks):
            return
        cols = zip(*[ops_by_rank[r].enter_ns[lo - ops_by_rank[r].seqs[0]:hi - ops_by_rank[r].seqs[0] + 1]
                     for r in ranks])
        last_count: Counter[int] = Counter()
        lateness: dict[int, list[int]] = defaultdict(list)
        n = 0
        mid = len(ranks) // 2
        for col in cols:
            n += 1
            latest = max(col)
            i = col.index(latest)
            last_count[i] += 1
            lateness[i].append(latest - sorted(col)[mid])
        for i, count in last_count.most_common(2):
            share = count / n
            late_ms = median(lateness[i]) / 1e6
            if share >= max(cfg.straggler_min_share, 2 / len(ranks)) and late_ms >= cfg.straggler_min_lateness_ms:
                r = ranks[i]
                self.add(Finding(
                    "straggler", g.name, hi, [r],
                    f"rank {r} arrived last at {share:.0%} of the last {n} collectives of group "
                    f"{g.label()}, a median {late_ms:.1f} ms after the median member"))


def _incompatibility(a: Signature, b: Signature) -> str | None:
    """Why two members' entries for one collective cannot belong together, or None."""
    if a.op != b.op:
        return "op_mismatch"
    for x, y in ((a.input_dtypes, b.input_dtypes), (a.output_dtypes, b.output_dtypes)):
        if x and y and set(x) != set(y):
            return "dtype_mismatch"
    op = a.op
    if op == "all_to_all":
        return None  # uneven splits are legal; totals are checked across the group
    compare_in = op not in ("scatter",)
    compare_out = op not in ("gather",)
    if compare_in and a.input_sizes and b.input_sizes and a.input_sizes != b.input_sizes:
        return "size_mismatch"
    if compare_out and a.output_sizes and b.output_sizes and a.output_sizes != b.output_sizes:
        return "size_mismatch"
    return None


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"{len(ranks)} ranks ({', '.join(map(str, ranks[:6]))}, ...)"
    return "ranks " + ", ".join(map(str, ranks))
