"""The desync verdict: which rank, in which collective, and why.

``diagnose(traces)`` matches every rank's collectives by (process group, sequence
number) and point-to-point ops by (source, destination, n-th op between the pair), and
reports findings with evidence:

  * ``missing`` — members of a group that never entered collective N while others
    entered it and wait; ``stuck`` — a member that entered N and never completed it
    while another member did (a hung kernel, a failed device; read from ``pg_status``
    counters where the dump keeps no entries); ``no_trace`` — members without a trace
    while the present ones wait (or timed out) in a group they belong to;
    ``p2p_unmatched`` — a send or recv still open without its partner's op.
  * ``op_mismatch`` / ``size_mismatch`` / ``dtype_mismatch`` — members that entered
    collective N with another op, shape or dtype than the majority of the group;
    ``extra`` — a minority issued a collective the majority never did;
    ``p2p_mismatch`` — a recv from a peer that never sends to that rank (or the
    reverse).
  * ``cycle`` — ranks that wait on each other across groups (a deadlock).
  * ``straggler`` — a member that arrives last at most of the group's collectives.

Deciding (``controlplane.diagnosis.verdict``): nobody is assumed right. Mismatches are
decided by majority within the group (a tie names both sides); the culprits are the
ranks a finding blames that wait on nobody in the wait-for graph across all groups, so
consequences (ranks blocked by others, a minority "ahead" of a blocked majority) are
not blamed, and independent faults are all named.

Where things are: ``membership`` (groups and their members, inferred for gloo dumps
and ranks without a file), ``waits`` (where each rank stands), ``checks`` (the per-group
checks), ``p2p``, ``verdict``. Everything is pure Python over ``TraceSet``; timestamps
compared across hosts assume synchronised clocks (stragglers only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fleet.controlplane.diagnosis.checks import Analysis, DiagnosisConfig, Finding, _ranks
from fleet.controlplane.diagnosis.membership import GroupInfo, group_infos, group_order
from fleet.controlplane.diagnosis.p2p import check_p2p
from fleet.controlplane.diagnosis.traces import TraceSet
from fleet.controlplane.diagnosis.verdict import HANG_KINDS, MISMATCH_KINDS, decide

__all__ = ["HANG_KINDS", "MISMATCH_KINDS", "Diagnosis", "DiagnosisConfig", "Finding", "GroupInfo",
           "Wavefront", "diagnose", "group_infos", "wavefront"]


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
        culprits = set(self.culprit_ranks)
        return {
            "source": self.source,
            "attempt": self.attempt,
            "verdict": self.verdict,
            "culprit_ranks": self.culprit_ranks,
            "summary": self.summary,
            "findings": [{**f.to_json(), "role": "cause" if set(f.ranks) & culprits else "consequence"}
                         for f in self.findings],
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
    a = Analysis(traces, config, now_ns, set(missing))
    for g in groups:
        a.check_waits(g)
        a.check_signatures(g)
        a.check_stragglers(g)
    check_p2p(a)
    a.check_unrecorded()
    culprits, verdict = decide(a)
    if not present or not any(t.entries or t.status for t in traces.ranks.values()):
        verdict = "empty"
    # causes first: the findings that blame only culprits, then those that blame some,
    # then the waits they explain
    named = set(culprits)
    findings = sorted(a.findings, key=lambda f: 0 if f.ranks and set(f.ranks) <= named
                      else 1 if set(f.ranks) & named else 2)
    blocked = {(w, f.group) for f in findings for w in f.waiting}
    waves = [replace(w, waiting=True) if (w.rank, w.group) in blocked else w for w in wavefront(traces)]
    return Diagnosis(
        source=traces.source, attempt=traces.attempt, verdict=verdict, culprit_ranks=culprits,
        findings=findings, ranks=sorted(present), missing_ranks=missing, groups=groups,
        wavefront=waves, summary=_summary(verdict, culprits, findings, missing),
    )


def wavefront(traces: TraceSet) -> list[Wavefront]:
    """Last entered and last completed collective of every rank in every group."""
    rows = []
    table = traces.table.sigs
    for rank in sorted(traces.ranks):
        t = traces.ranks[rank]
        for name, ops in sorted(t.groups.items(), key=lambda kv: group_order(kv[0])):
            if not ops.seqs:
                continue
            last_done = 0
            for i in range(len(ops.seqs) - 1, -1, -1):
                if ops.done[i]:
                    last_done = ops.seqs[i]
                    break
            rows.append(Wavefront(rank, name, ops.seqs[-1], table[ops.sigs[-1]].op, last_done,
                                  not ops.done[-1]))
        for name, st in sorted(t.status.items(), key=lambda kv: group_order(kv[0])):
            if name not in t.groups and not st.counts_p2p and st.enqueued > 0:  # counters only
                rows.append(Wavefront(rank, name, st.enqueued, "?", max(st.completed, 0),
                                      st.completed < st.enqueued))
    return rows


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
