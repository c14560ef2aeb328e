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


def choose_nodes(alive: Sequence[str], quarantined: Mapping[str, str], needed: int,
                 down: Mapping[str, str] | None = None, minimum: int | None = None) -> PlacementDecision:
    """The first ``needed`` alive nodes that are neither quarantined nor down (both map a
    node to its reason). With ``minimum`` < ``needed`` (shrinking data parallelism is
    allowed), as many as there are once at least ``minimum`` are usable."""
    down = down or {}
    healthy = [n for n in alive if n not in quarantined and n not in down]
    if len(healthy) >= needed:
        return PlacementDecision(tuple(healthy[:needed]))
    if minimum is not None and minimum <= len(healthy):
        return PlacementDecision(tuple(healthy), f"shrunk to {len(healthy)} of {needed} node(s)")
    out = [f"{n} ({quarantined[n]})" for n in alive if n in quarantined]
    reason = (f"the job needs {needed} healthy node(s) and {len(healthy)} of the "
              f"{len(alive)} alive are; quarantined: {', '.join(out) or 'none'}")
    if down:
        reason += "; down: " + ", ".join(f"{n} ({why})" for n, why in down.items())
    return PlacementDecision((), reason)
