"""When a node is quarantined: a pure decision over the incidents blamed on it.

A hardware fault tends to repeat on the same node; a software fault follows the job.
So a node is quarantined once ``policy.quarantine_after_incidents`` incidents of the
hardware-like kinds (``policy.quarantine_kinds``, by default those whose
``IncidentKind.counts_for_quarantine``) were blamed on it within
``policy.quarantine_window_s``, counted across jobs. The reason names them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fleet.proto.kinds import IncidentKind


class BlamedIncident(Protocol):
    kind: IncidentKind
    node: str | None
    detected_at: float
    job_id: str
    attempt: int
    rank: int | None


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
    since = now - policy.quarantine_window_s
    hits = sorted((i for i in incidents if i.node == node and i.kind in policy.quarantine_kinds
                   and i.detected_at >= since), key=lambda i: i.detected_at)
    if len(hits) < policy.quarantine_after_incidents:
        return QuarantineDecision(
            False, f"{len(hits)} of {policy.quarantine_after_incidents} incidents on {node} "
                   f"in {policy.quarantine_window_s:.0f} s")
    listed = "; ".join(f"{i.kind} of rank {i.rank} ({i.job_id} attempt {i.attempt})" for i in hits)
    return QuarantineDecision(
        True, f"{len(hits)} incidents on {node} within {policy.quarantine_window_s:.0f} s "
              f"(policy: {policy.quarantine_after_incidents}): {listed}")
