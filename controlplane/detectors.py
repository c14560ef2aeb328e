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

    kind: str          # "crash" | "error" | "hang" | "desync"
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


def attribute_with_trace(incident: Incident, verdict: str, culprit_ranks: Sequence[int], summary: str,
                         nodes: Sequence[str]) -> Incident:
    """Blame the rank the flight recorder names when no process died.

    Ranks that merely raised (a process-group timeout, a closed connection) are usually
    the victims of a rank that hung or called the wrong collective; the desync verdict
    (controlplane/diagnosis) names that rank. A process death stays the cause.
    """
    if incident.kind != "error" or verdict not in ("hang", "mismatch") or not culprit_ranks:
        return incident
    rank = culprit_ranks[0]
    node = nodes[rank] if 0 <= rank < len(nodes) else incident.node
    kind = "hang" if verdict == "hang" else "desync"
    return Incident(kind, "flight-recorder", rank, node,
                    f"{summary} Then: {incident.evidence}")


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
