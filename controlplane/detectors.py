"""Failure detection and attribution: pure functions over snapshots.

No Ray, no gRPC, no store: callers pass what they observed and get back a decision with
the reason string that is stored and shown to the user.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class ObservedFailure(Protocol):
    """What the orchestrator saw of one rank's bad end."""

    rank: int
    node: str
    actor_died: bool
    error: str


@dataclass(frozen=True)
class Incident:
    """A detected failure, blamed on one rank and node, with evidence."""

    kind: str          # "crash" | "error"
    detector: str
    rank: int
    node: str
    evidence: str


def attribute_failures(failures: Sequence[ObservedFailure]) -> Incident | None:
    """Blame the failure of an attempt on one rank.

    A rank whose process died is the cause; ranks that merely raised (typically a gloo
    "connection closed by peer" because their partner died) are its victims. With
    several deaths, the lowest rank is named and the others are listed as evidence.
    """
    if not failures:
        return None
    died = sorted((f for f in failures if f.actor_died), key=lambda f: f.rank)
    if died:
        culprit = died[0]
        others = [f.rank for f in failures if f.rank != culprit.rank]
        evidence = f"rank {culprit.rank} on {culprit.node}: {culprit.error}"
        if others:
            evidence += f"; then ranks {others} failed"
        return Incident("crash", "crash", culprit.rank, culprit.node, evidence)
    first = min(failures, key=lambda f: f.rank)
    return Incident("error", "crash", first.rank, first.node, f"rank {first.rank} raised: {first.error}")


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    reason: str


def decide_restart(restarts_done: int, max_restarts: int, incident: Incident) -> RestartDecision:
    """Restart the attempt while the restart budget lasts; give up after."""
    if restarts_done < max_restarts:
        return RestartDecision(
            True,
            f"{incident.kind} of rank {incident.rank} on {incident.node}: "
            f"restart {restarts_done + 1} of {max_restarts}",
        )
    return RestartDecision(
        False, f"{incident.kind} of rank {incident.rank} on {incident.node}: "
        f"all {max_restarts} restarts used; giving up",
    )
