"""Which nodes an attempt uses, and in which order: a pure decision over the alive nodes,
the store's quarantine list and, when cluster.yaml has one, the topology. No Ray, no
store: the controller passes what it sees.

Rank r runs on ``nodes[r // ranks_per_node]``, so the order is the layout. Without a
topology the first healthy nodes are taken in the order given (the orchestrator lists
them by name). With one (``topology.Topology``), the groups that talk most stay on one
node, then in one rack (``workers/parallel.py``'s layout: an expert-parallel group is
``ep_size`` consecutive ranks; the dense data-parallel group, and HSDP's replica groups,
span every node):

* as few racks as possible: racks with the most healthy nodes are filled first;
* an EP group that spans nodes (``ep_size > ranks_per_node``) gets nodes of one rack:
  each rack gives whole groups' worth of nodes before any rack gives a partial one;
* a rack's nodes are consecutive in rank order (racks that give only whole groups come
  first, so every group stays aligned to them); nodes of no known rack come last.

Invariants: a quarantined or down node is never chosen; the decision depends only on
its inputs, so placement is stable from attempt to attempt while nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fleet.controlplane.topology import LinkPath

#: Most nodes a reason names one by one (then the count).
_NAMES_SHOWN = 6
#: Most rack stretches and split EP groups a decision describes one by one.
_LINES_SHOWN = 16


class RackMap(Protocol):
    """What placement needs of ``topology.Topology``."""

    def rack_of(self, node: str) -> str | None: ...

    def path(self, nodes: Sequence[str]) -> LinkPath | None: ...


@dataclass(frozen=True)
class JobLayout:
    """How an attempt's ranks form process groups: ``ranks_per_node`` consecutive ranks
    per node, expert-parallel groups of ``ep_size`` consecutive ranks, and the dense
    data-parallel mode (``fsdp``, ``ddp``, ``hsdp``; empty for a program of the user's,
    whose only known group is the world)."""

    ranks_per_node: int
    ep_size: int = 1
    data_parallel: str = ""

    @property
    def nodes_per_block(self) -> int:
        """Nodes that hold whole EP groups and nothing else: ``lcm(ep, ranks_per_node) /
        ranks_per_node`` (1 when EP groups fit in a node)."""
        if self.ep_size <= 1:
            return 1
        return math.lcm(self.ep_size, self.ranks_per_node) // self.ranks_per_node


@dataclass(frozen=True)
class PlacementDecision:
    """``nodes``: the chosen nodes, in rank order, or empty when there are not enough;
    ``reason`` says why not, or that the job shrank (shown to the user); ``reasons``: with
    a topology, why these nodes in this order (stored as the attempt's placement action)."""

    nodes: tuple[str, ...]
    reason: str = ""
    reasons: tuple[str, ...] = ()


def choose_nodes(alive: Sequence[str], quarantined: Mapping[str, str], needed: int,
                 down: Mapping[str, str] | None = None, minimum: int | None = None, *,
                 topology: RackMap | None = None, layout: JobLayout | None = None) -> PlacementDecision:
    """``needed`` alive nodes that are neither quarantined nor down (both map a node to its
    reason): the first ones, or, with a ``topology``, those ``arrange`` picks for
    ``layout`` in its order. With ``minimum`` < ``needed`` (shrinking data parallelism is
    allowed), as many as there are once at least ``minimum`` are usable."""
    down = down or {}
    healthy = [n for n in alive if n not in quarantined and n not in down]
    if len(healthy) >= needed:
        count, reason = needed, ""
    elif minimum is not None and minimum <= len(healthy):
        count, reason = len(healthy), f"shrunk to {len(healthy)} of {needed} node(s)"
    else:
        out = [f"{n} ({quarantined[n]})" for n in alive if n in quarantined]
        reason = (f"the job needs {needed} healthy node(s) and {len(healthy)} of the "
                  f"{len(alive)} alive are; quarantined: {', '.join(out) or 'none'}")
        if down:
            reason += "; down: " + ", ".join(f"{n} ({why})" for n, why in down.items())
        return PlacementDecision((), reason)
    if topology is None:
        return PlacementDecision(tuple(healthy[:count]), reason)
    layout = layout or JobLayout(ranks_per_node=1)
    nodes = arrange(healthy, count, topology, layout)
    return PlacementDecision(nodes, reason, explain(nodes, topology, layout))


def arrange(healthy: Sequence[str], count: int, topology: RackMap, layout: JobLayout) -> tuple[str, ...]:
    """``count`` of the ``healthy`` nodes (in their given order within a rack), ordered by
    rack as the module docstring says. ``count`` is a multiple of ``layout.nodes_per_block``
    whenever the world size is a multiple of ``ep_size`` (cluster.yaml checks that)."""
    block = layout.nodes_per_block
    by_rack: dict[str | None, list[str]] = {}
    for n in healthy:
        by_rack.setdefault(topology.rack_of(n), []).append(n)
    first = {rack: i for i, rack in enumerate(by_rack)}
    # most whole blocks first, then most nodes, then the order the nodes came in; no rack: last
    racks = sorted(by_rack, key=lambda r: (r is None, -(len(by_rack[r]) // block), -len(by_rack[r]), first[r]))
    take = dict.fromkeys(racks, 0)
    left = count - count % block
    for r in racks:  # whole blocks
        k = min(len(by_rack[r]) // block * block, left)
        take[r], left = k, left - k
    left += count % block
    # then partial blocks: from racks already used (fullest leftovers first), then new ones
    spare = sorted(racks, key=lambda r: (r is None, take[r] == 0, -(len(by_rack[r]) - take[r]), first[r]))
    for r in spare:
        k = min(len(by_rack[r]) - take[r], left)
        take[r], left = take[r] + k, left - k
    used = [r for r in racks if take[r]]
    # racks giving whole blocks only come first: the EP groups stay aligned to them
    used.sort(key=lambda r: (r is None, take[r] % block != 0, racks.index(r)))
    return tuple(n for r in used for n in by_rack[r][:take[r]])


def explain(nodes: Sequence[str], topology: RackMap, layout: JobLayout) -> tuple[str, ...]:
    """Why ``nodes`` in this order, one line per rack stretch and per group kind, e.g.
    ``ranks 0-7 (EP groups 0-3) on rack r1: node-0, node-1`` and ``dense FSDP group (ranks
    0-15) spans racks r1, r2: its slowest link is rack r2 uplink (800 Gbit/s)``."""
    if not nodes:
        return ()
    rpn, ep = layout.ranks_per_node, max(layout.ep_size, 1)
    world = len(nodes) * rpn
    lines: list[str] = []
    stretches: list[tuple[str | None, list[str], int]] = []  # rack, its nodes, first node index
    for i, n in enumerate(nodes):
        rack = topology.rack_of(n)
        if stretches and stretches[-1][0] == rack:
            stretches[-1][1].append(n)
        else:
            stretches.append((rack, [n], i))
    for rack, members, start in stretches[:_LINES_SHOWN]:
        lo, hi = start * rpn, (start + len(members)) * rpn - 1
        first, last = lo // ep, hi // ep
        groups = "" if ep <= 1 else f" (EP group {first})" if first == last else f" (EP groups {first}-{last})"
        where = f"on rack {rack}" if rack is not None else "on nodes of no known rack"
        lines.append(f"ranks {_span(lo, hi)}{groups} {where}: {_names(members)}")
    if len(stretches) > _LINES_SHOWN:
        lines.append(f"... and {len(stretches) - _LINES_SHOWN} more rack stretch(es)")
    if ep > 1:
        lines.extend(_ep_lines(nodes, topology, layout))
    kind = {"fsdp": "dense FSDP group", "ddp": "dense DDP group"}.get(layout.data_parallel, "world group")
    if layout.data_parallel == "hsdp":
        lines.append(f"HSDP (sharded inside each node, replicated across them) {_reach(nodes, topology)}")
    else:
        lines.append(f"{kind} (ranks {_span(0, world - 1)}) {_reach(nodes, topology)}")
    return tuple(lines)


def _ep_lines(nodes: Sequence[str], topology: RackMap, layout: JobLayout) -> list[str]:
    """Where the EP groups are: inside a node, inside one rack each, or which span racks."""
    rpn, ep = layout.ranks_per_node, layout.ep_size
    count = len(nodes) * rpn // ep
    spans = [tuple(dict.fromkeys(nodes[r // rpn] for r in range(g * ep, (g + 1) * ep))) for g in range(count)]
    if all(len(s) == 1 for s in spans):
        return [f"EP groups ({ep} ranks each) stay inside a node"]
    racks_of = [{topology.rack_of(n) for n in s} for s in spans]
    split = [g for g, racks in enumerate(racks_of) if len(spans[g]) > 1 and (len(racks) > 1 or None in racks)]
    if not split:
        widest = max(len(s) for s in spans)
        return [f"EP groups ({ep} ranks each) span up to {widest} nodes, each group inside one rack"]
    out = [f"{len(split)} of {count} EP group(s) cross racks (no rack had room for them whole)"]
    for g in split[:_LINES_SHOWN]:
        out.append(f"EP group {g} (ranks {_span(g * ep, (g + 1) * ep - 1)}) {_reach(spans[g], topology)}")
    return out


def _reach(nodes: Sequence[str], topology: RackMap) -> str:
    """How far a group over ``nodes`` reaches and its slowest link."""
    racks = list(dict.fromkeys(topology.rack_of(n) for n in nodes))
    if len(set(nodes)) == 1:
        where = f"stays on {nodes[0]}"
    elif racks == [None]:
        where = f"spans {len(set(nodes))} nodes of no known rack"
    elif len(racks) == 1:
        where = f"stays in rack {racks[0]}"
    else:
        where = "spans racks " + ", ".join("(no rack)" if r is None else r for r in racks)
    path = topology.path(nodes)
    return f"{where}: its slowest link is {path.link}" if path else f"{where} (link bandwidths not given)"


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _names(nodes: Sequence[str]) -> str:
    if len(nodes) <= _NAMES_SHOWN:
        return ", ".join(nodes)
    return f"{', '.join(nodes[:3])}, ... {nodes[-1]} ({len(nodes)} nodes)"
