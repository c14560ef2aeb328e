"""The controller's side of silent data corruption: which layouts have copies to compare,
and what the workers' triage says.

Proof of SDC is a comparison between copies of the training state that must be bitwise
identical (workers/sdc.py fingerprints them after the optimizer step). Only some layouts
have such copies: DDP replicates everything; HSDP shards inside a node and replicates
across nodes; FSDP over every rank shards everything once, so no rank holds a copy of
another's state (``copies_problem`` says why a layout has none). The controller refuses
what cannot be checked there (cluster.yaml, ``fleet inject-fault --kind sdc``) and sends
checks only to layouts with copies (``launch.worker_specs``).

A triage ends in one "verdict" row (the SDC event contract): its ``value`` is the verdict
(``VERDICTS``), its ``rank`` the suspect, its ``step`` the first bad step and its ``detail``
a JSON object. ``SdcVerdict.from_row`` parses one, tolerating a detail that is not the
expected JSON (the text becomes the evidence): a worker's report must never break the
controller. A persistent verdict reaches the controller as the ranks' ``SdcError``
(``SdcFailure`` here, the plain values the runtime hands over); the others are seen by the
watchdog in the store. ``sdc_section`` is what `fleet report` and `fleet replay` show of a
job's checks and SDC incidents. Pure: no store, no Ray, no gRPC.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: A triage's outcomes: the corruption did not repeat when the step was re-executed (the
#: state was rolled back in memory), it repeated (the suspect's node is faulty), no
#: majority decides between two copies, or a trigger's replay found nothing wrong.
VERDICTS = ("transient", "persistent", "ambiguous", "clean")
#: The detector of an SDC incident is ``sdc_<verdict>``.
PERSISTENT_DETECTOR = "sdc_persistent"
#: Transient (or ambiguous) SDC incidents on one node within ``policy.quarantine_window_s``
#: that quarantine it: one may be a cosmic ray; a second on the same node is its hardware.
SDC_RECURRENCE = 2


def detector_of(verdict: str) -> str:
    """The incident detector name of a verdict (``sdc_transient`` ...)."""
    return f"sdc_{verdict}"


def copies_problem(data_parallel: str, world: int, nodes: int, program: bool = False) -> str | None:
    """Why a job laid out as ``data_parallel`` over ``world`` ranks on ``nodes`` nodes has no
    copy of its training state to compare (one clause, for an error message); None when it has."""
    if program:
        return ("a job.entrypoint program has no fleet fingerprints to compare "
                "(they are the built-in trainer's)")
    if world < 2:
        return "a 1-rank world has no second copy of its state to compare"
    if data_parallel == "fsdp":
        return ("data_parallel fsdp shards the training state once over all ranks, so no rank holds a "
                "copy of another's (use ddp, or hsdp on 2+ nodes)")
    if data_parallel == "hsdp" and nodes < 2:
        return ("data_parallel hsdp on 1 node has no replica (hsdp copies each shard onto every other node: "
                "it needs 2+ nodes)")
    return None


@dataclass(frozen=True)
class SdcFailure:
    """A rank's ``workers.failures.SdcError`` as the runtime hands it over: the first bad
    step, the suspect rank, the verdict, the newest verified step and the triage in one line."""

    step: int
    rank: int
    verdict: str
    rollback_step: int
    evidence: str


class VerdictRow(Protocol):
    """What a "verdict" row carries (``store.SdcCheckRecord``)."""

    id: int
    attempt: int
    rank: int | None
    step: int
    value: str
    expected: str
    detail: str


@dataclass(frozen=True)
class SdcVerdict:
    """One triage, parsed from its verdict row (see the module docstring)."""

    attempt: int
    step: int                  # the first bad step
    suspect: int               # -1: no suspect was found
    verdict: str               # one of VERDICTS (or what the worker sent)
    expected: str = ""         # the majority digest
    suspects: tuple[int, ...] = ()
    state: str = ""            # weights | optimizer | weights+optimizer | loss
    replays: int = 0
    rollback_step: int | None = None
    triage: tuple[str, ...] = ()
    evidence: str = ""
    row_id: int = 0

    @classmethod
    def from_row(cls, row: VerdictRow) -> SdcVerdict:
        """Parse ``row``; a detail that is not a JSON object becomes the evidence."""
        try:
            detail = json.loads(row.detail) if row.detail else {}
        except ValueError:
            detail = None
        if not isinstance(detail, dict):
            detail = {"evidence": row.detail}
        suspect = row.rank if row.rank is not None and row.rank >= 0 else -1
        suspects = tuple(_ints(detail.get("suspects"))) or ((suspect,) if suspect >= 0 else ())
        first = _int(detail.get("first_bad_step"))
        rollback = _int(detail.get("rollback_step"))
        triage = detail.get("triage")
        return cls(
            attempt=row.attempt, step=first if first is not None else row.step, suspect=suspect,
            verdict=row.value, expected=row.expected, suspects=suspects, state=str(detail.get("state") or ""),
            replays=_int(detail.get("replays")) or 0, rollback_step=rollback,
            triage=tuple(str(t) for t in triage) if isinstance(triage, list) else (),
            evidence=str(detail.get("evidence") or ""), row_id=row.id)

    def describe(self, node: str = "") -> str:
        """The incident evidence: first bad step, suspect, triage, verdict, rollback point."""
        who = f"rank {self.suspect}" + (f" on {node}" if node else "") if self.suspect >= 0 else "no rank"
        what = f" in its {self.state}" if self.state else ""
        text = f"{self.verdict} silent data corruption first seen at step {self.step}{what}: suspect {who}"
        if self.evidence:
            text += f"; {self.evidence}"
        if self.triage:
            text += "; triage: " + "; ".join(self.triage)
        replays = f" after {self.replays} replay(s)" if self.replays else ""
        if self.rollback_step is not None:
            text += f"; rolled back to step {self.rollback_step}{replays}"
        elif replays:
            text += f";{replays}"
        return text

    def to_json(self, node: str = "") -> dict[str, Any]:
        """The report's form of this verdict (``node``: the suspect's, from the placement)."""
        return {"attempt": self.attempt, "first_bad_step": self.step, "suspect_rank": self.suspect,
                "suspect_node": node, "suspects": list(self.suspects), "verdict": self.verdict,
                "state": self.state, "replays": self.replays, "rollback_step": self.rollback_step,
                "triage": list(self.triage), "evidence": self.evidence}


class CheckRow(VerdictRow, Protocol):
    """An SDC check row (``store.SdcCheckRecord``)."""

    kind: str
    ok: bool


class SdcIncidentRow(Protocol):
    """An incident row (``store.IncidentRecord``)."""

    attempt: int
    kind: str
    rank: int | None
    node: str | None
    detector: str
    evidence: str


def sdc_section(checks: Sequence[CheckRow], incidents: Sequence[SdcIncidentRow],
                nodes: Mapping[int, Mapping[int, str]]) -> dict[str, Any]:
    """A job's SDC checks and incidents as a JSON-ready dict.

    ``checks``: its SDC check rows; ``incidents``: its incidents (other kinds are skipped);
    ``nodes``: attempt -> rank -> node (the placement: verdict rows name no node).
    Counts: ``fingerprint_checks`` (checked steps: one per (attempt, step) with fingerprints),
    ``fingerprints`` (rows), ``mismatches`` (checked steps where some copy disagreed),
    ``triggers``, ``replays``. ``verdicts``: every triage, clean ones included. ``incidents``:
    each SDC incident with the fields of its triage's verdict (first bad step, suspect rank
    and node, state, replays, triage, rollback point; None where no verdict row matches it)."""
    fingerprints = [c for c in checks if c.kind == "fingerprint"]
    checked = {(c.attempt, c.step) for c in fingerprints}
    mismatched = {(c.attempt, c.step) for c in fingerprints if not c.ok}
    verdicts = [SdcVerdict.from_row(c) for c in checks if c.kind == "verdict"]

    def node_of(v: SdcVerdict) -> str:
        return nodes.get(v.attempt, {}).get(v.suspect, "") if v.suspect >= 0 else ""

    unmatched = list(verdicts)
    out_incidents = []
    for i in incidents:
        if i.kind != "sdc":
            continue
        rank = -1 if i.rank is None else i.rank
        match = next((v for v in unmatched if v.attempt == i.attempt and v.suspect == rank
                      and detector_of(v.verdict) == i.detector), None)
        if match is not None:
            unmatched.remove(match)
            fields = match.to_json(i.node or node_of(match))
        else:
            fields = {k: None for k in SdcVerdict(0, 0, -1, "").to_json()} | {
                "attempt": i.attempt, "suspect_rank": rank, "suspect_node": i.node or "",
                "verdict": i.detector.removeprefix("sdc_")}
        out_incidents.append({**fields, "detector": i.detector, "incident_evidence": i.evidence})
    return {
        "fingerprint_checks": len(checked), "fingerprints": len(fingerprints), "mismatches": len(mismatched),
        "triggers": sum(1 for c in checks if c.kind == "trigger"),
        "replays": sum(1 for c in checks if c.kind == "replay"),
        "verdicts": [v.to_json(node_of(v)) for v in verdicts],
        "incidents": out_incidents,
    }


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _ints(values: Any) -> Sequence[int]:
    if not isinstance(values, list):
        return ()
    return [v for v in (_int(x) for x in values) if v is not None]
