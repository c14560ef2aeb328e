"""The desync verdict: which rank, in which collective, and why.

``diagnose(traces)`` matches every rank's collectives by (process group, sequence
number) and reports findings with evidence:

  * ``missing`` — members of a group that never entered collective N while others
    entered it and wait: the hang. ``extra`` — the opposite, when the ranks that went
    ahead are the minority: they issued a collective the majority never did.
  * ``op_mismatch`` / ``size_mismatch`` / ``dtype_mismatch`` — members that entered
    collective N with a different op, shape or dtype than the majority of the group.
    Sizes follow each op's rules: all_gather's output is the input times the group,
    rooted ops carry tensors on the root only, all_to_all may split unevenly (only the
    totals must agree), coalesced ops compare every member op.
  * ``p2p_unmatched`` — a send or recv still pending without its partner's op.
  * ``no_trace`` — members without a trace while every present member waits.
  * ``cycle`` — ranks that wait on each other across groups (a deadlock).
  * ``straggler`` — a member that arrives last at most of the group's collectives, with
    its median lateness behind the median member.

Deciding: nobody is assumed right. Mismatches are decided by majority within the
group (a tie names both sides). Hangs are decided by who waits on whom: every finding
adds "waiter -> awaited" edges, and the culprits are the awaited ranks that wait on
nobody, so a rank stuck in a sub-group is not blamed for the world-group hang it
causes downstream. Verdict precedence: ``mismatch`` (the cause of most hangs) over
``hang`` over ``straggler`` over ``ok``.

Sub-groups have their own sequence numbers; members come from the traces (declared by
the backend or the worker, else inferred from who used the group). Everything here is
pure Python over ``TraceSet``; timestamps compared across hosts assume synchronised
clocks (stragglers only).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from fleet.controlplane.diagnosis.traces import GroupOps, Signature, TraceSet

MISMATCH_KINDS = frozenset({"op_mismatch", "size_mismatch", "dtype_mismatch", "extra"})
HANG_KINDS = frozenset({"missing", "p2p_unmatched", "no_trace", "cycle"})


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
class GroupInfo:
    name: str
    desc: str
    members: tuple[int, ...]
    declared: bool                       # members from the backend/worker, not inferred

    def label(self) -> str:
        return f"{self.name} ({self.desc})" if self.desc and self.desc != self.name else self.name


@dataclass(frozen=True)
class Wavefront:
    """Where one rank stands in one group."""

    rank: int
    group: str
    last_entered: int
    last_entered_op: str
    last_completed: int
    waiting: bool                        # its last collective never finished, or a finding says it waits

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "group": self.group, "last_entered_seq": self.last_entered,
                "last_entered_op": self.last_entered_op, "last_completed_seq": self.last_completed,
                "waiting": self.waiting}


@dataclass
class Diagnosis:
    source: str
    attempt: int | None
    verdict: str                         # "ok" | "hang" | "mismatch" | "straggler" | "empty"
    culprit_ranks: list[int]
    findings: list[Finding]
    ranks: list[int]                     # ranks with a trace
    missing_ranks: list[int]             # expected ranks without one
    groups: list[GroupInfo]
    wavefront: list[Wavefront]
    summary: str

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "attempt": self.attempt,
            "verdict": self.verdict,
            "culprit_ranks": self.culprit_ranks,
            "summary": self.summary,
            "findings": [f.to_json() for f in self.findings],
            "ranks": self.ranks,
            "missing_ranks": self.missing_ranks,
            "groups": [{"group": g.name, "desc": g.desc, "ranks": list(g.members),
                        "members_declared": g.declared} for g in self.groups],
            "wavefront": [w.to_json() for w in self.wavefront],
        }


def diagnose(traces: TraceSet, config: DiagnosisConfig = DiagnosisConfig(),
             now_ns: int | None = None) -> Diagnosis:
    """The verdict over ``traces``. ``now_ns`` marks live traces (a running attempt):
    waits younger than ``config.settle_s`` are then treated as in flight, not as hangs."""
    groups = group_infos(traces)
    present = set(traces.ranks)
    expected = set(present)
    for g in groups:
        expected.update(g.members)
    missing = sorted(expected - present)
    a = _Analysis(traces, config, now_ns, set(missing))
    for g in groups:
        a.check_frontier(g)
        a.check_signatures(g)
        a.check_stragglers(g)
    a.check_p2p()
    culprits, verdict = a.decide()
    if not present or not any(t.entries for t in traces.ranks.values()):
        verdict = "empty"
    blocked = {(w, f.group, f.seq) for f in a.findings for w in f.waiting}
    waves = [replace(w, waiting=True) if (w.rank, w.group, w.last_entered) in blocked else w
             for w in wavefront(traces)]
    return Diagnosis(
        source=traces.source, attempt=traces.attempt, verdict=verdict, culprit_ranks=culprits,
        findings=a.findings, ranks=sorted(present), missing_ranks=missing, groups=groups,
        wavefront=waves, summary=_summary(verdict, culprits, a.findings, missing),
    )


def group_infos(traces: TraceSet) -> list[GroupInfo]:
    """Every process group seen, with its members (declared when any rank declared them)."""
    declared: dict[str, set[int]] = defaultdict(set)
    used: dict[str, set[int]] = defaultdict(set)
    desc: dict[str, str] = {}
    for rank, t in traces.ranks.items():
        for name, members in t.group_ranks.items():
            declared[name].update(members)
        for name in (*t.groups, *t.p2p):
            used[name].add(rank)
        for name, d in t.group_desc.items():
            if d and d != "undefined":
                desc.setdefault(name, d)
            else:
                desc.setdefault(name, "")
    out = []
    for name in sorted(set(declared) | set(used), key=_group_order):
        members = declared.get(name)
        inferred = set(used[name])
        if not members and desc.get(name) == "default_pg":
            # the world is 0..N-1: N is at least the highest rank seen, and an all_gather
            # tells N exactly (its output is N inputs), so trailing missing files show too
            inferred.update(range(max(max(inferred) + 1, _gather_factor(traces, name))))
        out.append(GroupInfo(name, desc.get(name, ""), tuple(sorted(members or inferred)), bool(members)))
    return out


def _gather_factor(traces: TraceSet, group: str) -> int:
    """The group size an all_gather of ``group`` implies (0 if none was recorded)."""
    sigs = traces.table.sigs
    for t in traces.ranks.values():
        ops = t.groups.get(group)
        if not ops:
            continue
        for sid in set(ops.sigs[-200:]):
            sig = sigs[sid]
            if sig.op == "all_gather" and len(sig.input_sizes) == 1 and len(sig.output_sizes) == 1:
                n_in, n_out = _numel(sig.input_sizes), _numel(sig.output_sizes)
                if n_in and n_out % n_in == 0:
                    return n_out // n_in
        return 0
    return 0


def _group_order(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def wavefront(traces: TraceSet) -> list[Wavefront]:
    """Last entered and last completed collective of every rank in every group."""
    rows = []
    table = traces.table.sigs
    for rank in sorted(traces.ranks):
        for name, ops in sorted(traces.ranks[rank].groups.items(), key=lambda kv: _group_order(kv[0])):
            if not ops.seqs:
                continue
            last_done = 0
            for i in range(len(ops.seqs) - 1, -1, -1):
                if ops.done[i]:
                    last_done = ops.seqs[i]
                    break
            rows.append(Wavefront(rank, name, ops.seqs[-1], table[ops.sigs[-1]].op, last_done,
                                  not ops.done[-1]))
    return rows


class _Analysis:
    def __init__(self, traces: TraceSet, config: DiagnosisConfig, now_ns: int | None,
                 missing: set[int]) -> None:
        self.traces = traces
        self.sigs: list[Signature] = traces.table.sigs
        self.config = config
        self.now_ns = now_ns
        self.missing = missing
        self.findings: list[Finding] = []
        self.waits: dict[int, set[int]] = defaultdict(set)  # waiter -> awaited
        self._compat_cache: dict[tuple[int, int], str | None] = {}
        self._numel_cache: dict[tuple[int, bool], int] = {}

    # -- who entered how far -----------------------------------------------------------

    def _ops(self, g: GroupInfo) -> dict[int, GroupOps]:
        out = {}
        for r in g.members:
            t = self.traces.ranks.get(r)
            if t is None:
                continue
            ops = t.groups.get(g.name)
            if ops is not None and ops.seqs:
                out[r] = ops
            elif g.name in t.group_ranks or (t.first_record == 0 and t.entries and g.name not in t.p2p):
                out[r] = GroupOps()  # a declared member, or the ring never wrapped: it issued nothing here
        return out

    def _in_flight(self, ops_by_rank: dict[int, GroupOps], seq: int) -> bool:
        if self.now_ns is None:
            return False
        newest = max((o.enter_ns[i] for o in ops_by_rank.values() if (i := o.index(seq)) is not None), default=0)
        return self.now_ns - newest < self.config.settle_s * 1e9

    def check_frontier(self, g: GroupInfo) -> None:
        ops_by_rank = self._ops(g)
        if not ops_by_rank:
            return
        last = {r: (o.seqs[-1] if o.seqs else 0) for r, o in ops_by_rank.items()}
        front_seq = max(last.values())
        front = sorted(r for r, s in last.items() if s == front_seq)
        behind = sorted(r for r, s in last.items() if s < front_seq)
        absent = sorted(set(g.members) - set(ops_by_rank))
        if not behind:
            self._check_absent(g, ops_by_rank, front_seq, front, absent)
            return
        # a minority ahead of a majority that stands together issued something extra; with
        # the others spread over several collectives (a rooted op such as broadcast lets
        # some ranks through while one never came), the ranks behind are judged instead
        if len(behind) > len(front) and len({last[r] for r in behind}) == 1:
            seq = max(last[r] for r in behind) + 1
            op = self._describe_at(ops_by_rank, front[0], seq)
            self._add(Finding(
                "extra", g.name, seq, front,
                f"{_ranks(front)} entered collective {seq} ({op}) of group {g.label()}, which the "
                f"majority ({_ranks(behind)}) never issued"))
            return
        by_seq: dict[int, list[int]] = defaultdict(list)
        for r in behind:
            by_seq[last[r] + 1].append(r)
        for seq, culprits in sorted(by_seq.items()):
            if self._in_flight(ops_by_rank, seq):
                continue
            waiting = sorted(r for r, s in last.items() if s >= seq)
            op = self._describe_at(ops_by_rank, waiting[0], seq)
            their = "; ".join(self._last_op(r, g.name, ops_by_rank[r]) for r in culprits[:4])
            self._add(Finding(
                "missing", g.name, seq, culprits,
                f"{_ranks(culprits)} never entered collective {seq} ({op}) of group {g.label()}; "
                f"{_ranks(waiting)} entered it and {'waits' if len(waiting) == 1 else 'wait'}. {their}", waiting))

    def _check_absent(self, g: GroupInfo, ops_by_rank: dict[int, GroupOps], seq: int,
                      front: list[int], absent: list[int]) -> None:
        """Every present member is at the same collective: blame members without a trace
        only when the present ones are still waiting in it."""
        no_trace = [r for r in absent if r in self.missing]
        if not no_trace or not front:
            return
        pending = [r for r in front if ops_by_rank[r].seqs and not ops_by_rank[r].done[-1]]
        if len(pending) != len(front) or self._in_flight(ops_by_rank, seq):
            return
        op = self._describe_at(ops_by_rank, front[0], seq)
        self._add(Finding(
            "no_trace", g.name, seq, no_trace,
            f"{_ranks(no_trace)} left no trace; every other member of group {g.label()} waits in "
            f"collective {seq} ({op})", front))

    def _describe_at(self, ops_by_rank: dict[int, GroupOps], rank: int, seq: int) -> str:
        ops = ops_by_rank.get(rank)
        i = ops.index(seq) if ops else None
        return self.sigs[ops.sigs[i]].describe() if i is not None else "?"

    def _last_op(self, rank: int, group: str, ops: GroupOps) -> str:
        if not ops.seqs:
            return f"rank {rank} issued nothing on this group"
        state = "completed" if ops.done[-1] else "not completed"
        return f"rank {rank}'s last there: {ops.seqs[-1]} {self.sigs[ops.sigs[-1]].op}, {state}"

    # -- do the members agree ----------------------------------------------------------

    def check_signatures(self, g: GroupInfo) -> None:
        ops_by_rank = {r: o for r, o in self._ops(g).items() if o.seqs}
        if len(ops_by_rank) < 2:
            return
        lo = max(o.seqs[0] for o in ops_by_rank.values())
        hi = min(o.seqs[-1] for o in ops_by_rank.values())
        top = max(o.seqs[-1] for o in ops_by_rank.values())
        checked: set[int] = set()
        budget = [self.config.max_findings_per_group]
        if lo <= hi:
            histories: dict[int, tuple[int, ...]] = {}
            for r, o in ops_by_rank.items():
                histories[r] = self._slice(o, lo, hi)
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
        # beyond the common range only some members entered: compare those
        for seq in range(max(hi + 1, lo), min(top, hi + 64) + 1):
            if seq not in checked and budget[0] > 0:
                self._judge(g, ops_by_rank, seq, budget)

    @staticmethod
    def _slice(o: GroupOps, lo: int, hi: int) -> tuple[int, ...]:
        if o.consecutive:
            base = o.seqs[0]
            return tuple(o.sigs[lo - base:hi - base + 1])
        out = []
        for s in range(lo, hi + 1):
            i = o.index(s)
            out.append(o.sigs[i] if i is not None else -1)
        return tuple(out)

    def _blamed_at(self, group: str, seq: int) -> set[int]:
        return {r for f in self.findings if f.group == group and f.seq == seq for r in f.ranks}

    def _judge(self, g: GroupInfo, ops_by_rank: dict[int, GroupOps], seq: int, budget: list[int]) -> bool:
        """Compare every member's collective ``seq``; add a finding when they disagree."""
        at: dict[int, int] = {}
        for r, o in ops_by_rank.items():
            i = o.index(seq)
            if i is not None:
                at[r] = o.sigs[i]
        distinct = set(at.values())
        if len(at) < 2 or len(distinct) == 1:
            return False
        sigs = self.sigs
        if all(sigs[s].op == "all_to_all" for s in distinct) and len(
                {(sigs[s].input_dtypes, sigs[s].output_dtypes) for s in distinct}) == 1:
            return self._check_all_to_all(g, at, seq, budget)  # uneven splits: only totals matter
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
                return self._check_all_to_all(g, at, seq, budget)
            return False
        classes.sort(key=lambda c: -len(c[1]))
        tie = len(classes[1][1]) == len(classes[0][1])
        for rep, members in (classes if tie else classes[1:]):
            other_rep, others = classes[1] if rep == classes[0][0] else classes[0]
            kind = self._compat(other_rep, rep) or "op_mismatch"
            note = " (no majority: either side may be wrong)" if tie else ""
            self._add(Finding(
                kind, g.name, seq, sorted(members),
                f"{_ranks(members)} entered {self.sigs[rep].describe()} as collective {seq} of group "
                f"{g.label()} where {_ranks(others)} entered {self.sigs[other_rep].describe()}{note}"))
            budget[0] -= 1
        return True

    def _numel(self, sig: int, inputs: bool) -> int:
        key = (sig, inputs)
        n = self._numel_cache.get(key)
        if n is None:
            n = self._numel_cache[key] = _numel(self.sigs[sig].input_sizes if inputs else self.sigs[sig].output_sizes)
        return n

    def _compat(self, a: int, b: int) -> str | None:
        key = (a, b)
        if key not in self._compat_cache:
            self._compat_cache[key] = _incompatibility(self.sigs[a], self.sigs[b])
        return self._compat_cache[key]

    def _check_all_to_all(self, g: GroupInfo, at: dict[int, int], seq: int, budget: list[int]) -> bool:
        numel = self._numel
        sent = sum(numel(s, True) for s in at.values())
        received = sum(numel(s, False) for s in at.values())
        if len(at) < len(g.members) or sent == received:
            return False
        self._add(Finding(
            "size_mismatch", g.name, seq, sorted(at),
            f"all_to_all {seq} of group {g.label()}: the members send {sent} elements in total but "
            f"receive {received}; the splits disagree"))
        budget[0] -= 1
        return True

    # -- who is late -------------------------------------------------------------------

    def check_stragglers(self, g: GroupInfo) -> None:
        cfg = self.config
        ops_by_rank = {r: o for r, o in self._ops(g).items() if o.seqs}
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
                self._add(Finding(
                    "straggler", g.name, hi, [r],
                    f"rank {r} arrived last at {share:.0%} of the last {n} collectives of group "
                    f"{g.label()}, a median {late_ms:.1f} ms after the median member"))

    # -- point to point ----------------------------------------------------------------

    def check_p2p(self) -> None:
        posted: dict[tuple[str, int, int, str], list] = defaultdict(list)  # (group, src, dst, kind)
        for rank, t in self.traces.ranks.items():
            for group, ops in t.p2p.items():
                for op in ops:
                    src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                    posted[(group, src, dst, op.kind)].append(op)
        pairs = {(g, s, d) for g, s, d, _ in posted}
        for group, src, dst in sorted(pairs):
            sends = posted.get((group, src, dst, "send"), [])
            recvs = posted.get((group, src, dst, "recv"), [])
            for snd, rcv in zip(sends, recvs):
                a, b = self.sigs[snd.sig], self.sigs[rcv.sig]
                if a.input_sizes and b.output_sizes and a.input_sizes != b.output_sizes:
                    self._add(Finding("size_mismatch", group, snd.seq, [src, dst],
                                      f"rank {src} sends {list(map(list, a.input_sizes))} to rank {dst}, "
                                      f"which receives {list(map(list, b.output_sizes))}"))
                    break
            extra, kind, waiter, culprit = ((sends[len(recvs):], "send", src, dst) if len(sends) > len(recvs)
                                            else (recvs[len(sends):], "recv", dst, src))
            pending = [op for op in extra if not op.done]
            if not pending:
                continue
            partner = "has no trace" if culprit in self.missing else (
                "never posted the matching recv" if kind == "send" else "never sent")
            self._add(Finding(
                "p2p_unmatched", group, pending[0].seq, [culprit],
                f"rank {waiter} waits in {kind} #{pending[0].seq} with rank {culprit}, which {partner}",
                [waiter]))

    # -- verdict -----------------------------------------------------------------------

    def decide(self) -> tuple[list[int], str]:
        mism = [f for f in self.findings if f.kind in MISMATCH_KINDS]
        if mism:
            return sorted({r for f in mism for r in f.ranks}), "mismatch"
        hang = [f for f in self.findings if f.kind in HANG_KINDS]
        if hang:
            awaited = {r for f in hang for r in f.ranks}
            roots = sorted(r for r in awaited if not self.waits.get(r))
            if not roots:
                cycle = sorted(r for r in awaited if self._in_cycle(r))
                roots = cycle or sorted(awaited)
                self._add(Finding("cycle", "", 0, roots,
                                  f"{_ranks(roots)} wait on each other across groups (a deadlock)"))
            return roots, "hang"
        slow = [f for f in self.findings if f.kind == "straggler"]
        if slow:
            return sorted({r for f in slow for r in f.ranks}), "straggler"
        return [], "ok"

    def _in_cycle(self, start: int) -> bool:
        seen, stack = set(), list(self.waits.get(start, ()))
        while stack:
            r = stack.pop()
            if r == start:
                return True
            if r not in seen:
                seen.add(r)
                stack.extend(self.waits.get(r, ()))
        return False

    def _add(self, finding: Finding) -> None:
        """Keep a finding; its waiting ranks wait on the ranks it blames."""
        self.findings.append(finding)
        for w in finding.waiting:
            self.waits[w].update(finding.ranks)


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


def _numel(sizes: tuple[tuple[int, ...], ...]) -> int:
    return sum(math.prod(s) for s in sizes)


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"{len(ranks)} ranks ({', '.join(map(str, ranks[:6]))}, ...)"
    return "ranks " + ", ".join(map(str, ranks))


def _summary(verdict: str, culprits: list[int], findings: list[Finding], missing: list[int]) -> str:
    note = f" (no trace from {_ranks(missing)})" if missing else ""
    if verdict == "empty":
        return f"no collectives recorded{note}"
    if verdict == "ok":
        return f"ok: every group's members agree and none is waiting on another{note}"
    kinds = {"straggler"} if verdict == "straggler" else (MISMATCH_KINDS if verdict == "mismatch" else HANG_KINDS)
    relevant = [f for f in findings if f.kind in kinds] or findings
    # lead with the finding that blames exactly the culprits (the root, not a downstream wait)
    first = next((f for f in relevant if f.ranks and set(f.ranks) <= set(culprits)), relevant[0])
    return f"{verdict}: culprit {_ranks(culprits)}. {first.detail}{note}"
