"""When a node is quarantined: a pure decision over the incidents blamed on it.

A hardware fault tends to repeat on the same node; a software fault follows the job.
So a node is quarantined once ``policy.quarantine_after_incidents`` incidents of the
hardware-like kinds (``policy.quarantine_kinds``, by default those whose
``IncidentKind.counts_for_quarantine``) were blamed on it within
``policy.quarantine_window_s``, counted across jobs. The reason names them.

Silent data corruption has its own rule, since its triage already told transient from
persistent: one persistent SDC incident (detector ``sdc_persistent``: the corruption
repeated when the step was re-executed) quarantines the node at once; transient or
ambiguous ones quarantine it when they recur, ``SDC_RECURRENCE`` within the window; a
single transient one does not. ``quarantine_after_incidents: 0`` turns both rules off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fleet.controlplane.sdc import PERSISTENT_DETECTOR, SDC_RECURRENCE
from fleet.proto.kinds import IncidentKind


class BlamedIncident(Protocol):
    kind: IncidentKind
    node: str | None
    detected_at: float
    job_id: str
    attempt: int
    rank: int | None
    detector: str


class QuarantinePolicy(Protocol):
    quarantine_after_incidents: int
    quarantine_window_s: float
    quarantine_kinds: Sequence[IncidentKind]


@dataclass(frozen=True)
class QuarantineDecision:
    quarantine: bool
    reason: str


def decide_quarantine(now: float, node: str, incidents: Sequence[BlamedIncident],
                      policy: QuarantinePolicy) -> QuarantineDecision:
    """Whether ``node`` must leave placement, given the incidents the store holds."""
    if policy.quarantine_after_incidents <= 0:
        return QuarantineDecision(False, "automatic quarantine is off")
    since, window = now - policy.quarantine_window_s, policy.quarantine_window_s
    recent = sorted((i for i in incidents if i.node == node and i.detected_at >= since), key=lambda i: i.detected_at)
    sdc = [i for i in recent if i.kind == IncidentKind.SDC]
    persistent = [i for i in sdc if i.detector == PERSISTENT_DETECTOR]
    if persistent:
        i = persistent[-1]
        return QuarantineDecision(
            True, f"persistent silent data corruption on {node}: rank {i.rank} ({i.job_id} attempt {i.attempt}) "
                  "computed wrong values again when its step was re-executed (policy: at once)")
    transient = [i for i in sdc if i.detector != PERSISTENT_DETECTOR]
    if len(transient) >= SDC_RECURRENCE:
        return QuarantineDecision(
            True, f"silent data corruption recurred on {node}: {len(transient)} transient incidents within "
                  f"{window:.0f} s (policy: {SDC_RECURRENCE}): {_listed(transient)}")
    hits = [i for i in recent if i.kind in policy.quarantine_kinds]
    if len(hits) < policy.quarantine_after_incidents:
        reason = f"{len(hits)} of {policy.quarantine_after_incidents} incidents on {node} in {window:.0f} s"
        if transient:
            reason += (f"; {len(transient)} transient silent data corruption on {node} (quarantined if it "
                       f"recurs: {SDC_RECURRENCE} within {window:.0f} s)")
        return QuarantineDecision(False, reason)
    return QuarantineDecision(
        True, f"{len(hits)} incidents on {node} within {window:.0f} s "
              f"(policy: {policy.quarantine_after_incidents}): {_listed(hits)}")


def _listed(incidents: Sequence[BlamedIncident]) -> str:
    return "; ".join(f"{i.kind} of rank {i.rank} ({i.job_id} attempt {i.attempt})" for i in incidents)
