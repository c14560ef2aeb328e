"""Which nodes an attempt may use: a pure decision over the alive nodes and the store's
quarantine list. No Ray, no store: the controller passes what it sees.

Invariant: a quarantined node is never chosen. Nodes are taken in the order given (the
orchestrator lists them by name), so placement is stable from attempt to attempt while
nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PlacementDecision:
    """``nodes``: the chosen nodes, in order, or empty when there are not enough;
    ``reason`` says why not (shown to the user while the controller waits)."""

    nodes: tuple[str, ...]
    reason: str = ""


def choose_nodes(alive: Sequence[str], quarantined: Mapping[str, str], needed: int) -> PlacementDecision:
    """The first ``needed`` alive nodes that are not quarantined (``quarantined`` maps a
    node to its reason)."""
    healthy = [n for n in alive if n not in quarantined]
    if len(healthy) >= needed:
        return PlacementDecision(tuple(healthy[:needed]))
    out = [f"{n} ({quarantined[n]})" for n in alive if n in quarantined]
    return PlacementDecision((), f"the job needs {needed} healthy node(s) and {len(healthy)} of the "
                                 f"{len(alive)} alive are; quarantined: {', '.join(out) or 'none'}")
