"""The cluster's network: cluster.yaml's ``topology:`` section, resolved against the live nodes.

``TopologyConfig`` is the section as written (bandwidths in Gbit/s, racks listing their
nodes). ``TopologyConfig.resolve(nodes)`` checks it against the nodes Ray reports and
gives a ``Topology``: each node's rack (listed in ``racks``, else the node's Ray label
``rack_label``, else none) and the link bandwidths in bytes/s. ``Topology.path(nodes)``
is the slowest link a process group over those nodes crosses; placement
(``placement.py``) and the slow_comm detector judge by it.

The link model is deliberately simple: ranks on one node talk over the intra-node
fabric (NVLink, shared memory); a group spanning nodes of one rack is limited by the
node links (every node has the same NIC bandwidth); a group spanning racks also crosses
each of those racks' uplinks to the spine.

Invariants: a node is in at most one rack of ``racks``; for a local cluster every listed
node exists (``node-0 .. node-{ray.nodes-1}``, checked when the file is parsed); for an
attached cluster that is checked when Ray is up (``resolve``), with the same one-line
error naming the file, line and key (``locate`` keeps the lines from the parse).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictStr, field_validator, model_validator

from fleet.controlplane.errors import ConfigError

if TYPE_CHECKING:
    from fleet.controlplane.runtime import NodeInfo

#: Bytes per second in one Gbit/s (the file's unit).
BYTES_PER_GBIT = 1e9 / 8
#: Most node names an unknown-node error lists.
_NAMES_SHOWN = 8


class KeyedError(ValueError):
    """A validator's problem with a key below its own: ``loc`` is that key's path relative
    to the model being validated (``config.validate_cluster_data`` appends it to the
    error's key, so the message names, and the line points at, the exact entry)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


Gbps = Annotated[float, Field(gt=0, le=1e7)]
_Name = Annotated[StrictStr, Field(min_length=1, max_length=253)]


@dataclass
class _Written:
    """Where each node entry of ``racks`` is written (key below ``topology`` -> e.g.
    ``cluster.yaml:12``). Not part of the config's value: it never makes two configs unequal."""

    at: dict[tuple[str | int, ...], str] = field(default_factory=dict, compare=False)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RackConfig(_Section):
    """One rack: its nodes and, optionally, its own uplink bandwidth."""

    nodes: list[_Name] = Field(
        default_factory=list, description="Names of the nodes in this rack, as `fleet nodes` lists them.")
    uplink_gbps: Gbps | None = Field(
        None, description="This rack's link to the spine, Gbit/s (default: topology.rack_uplink_gbps).")


class TopologyConfig(_Section):
    """The network the job runs on: link bandwidths and which node is in which rack."""

    intra_node_gbps: Gbps | None = Field(
        None, description="Bandwidth between two ranks of one node (NVLink, shared memory), Gbit/s. Unset: "
        "not known (a group inside one node is not rated).")
    node_gbps: Gbps | None = Field(
        None, description="Each node's network link (its NIC), Gbit/s. Unset: not known (a group spanning "
        "nodes is not rated).")
    rack_uplink_gbps: Gbps | None = Field(
        None, description="A rack's link to the spine, Gbit/s: the default of every rack (racks.<name>."
        "uplink_gbps overrides it). Unset: a group spanning racks is rated only where each of its racks "
        "gives its own.")
    rack_label: StrictStr | None = Field(
        "fleet.rack", min_length=1,
        description="The Ray node label naming the rack of a node that `racks` does not list (`ray start "
        "--labels fleet.rack=r1`); null: labels are not read. A node in neither has no rack.")
    racks: dict[_Name, RackConfig] = Field(
        default_factory=dict,
        description="Racks by name, each `{nodes: [NODE, ...], uplink_gbps: G}` (both optional), e.g. "
        "`{r1: {nodes: [node-0, node-1]}, r2: {nodes: [node-2, node-3], uplink_gbps: 800}}`. A node is in "
        "one rack at most; placement fills as few racks as it can.")

    _written: _Written = PrivateAttr(default_factory=_Written)

    @field_validator("racks", mode="before")
    @classmethod
    def _numbered_racks(cls, racks: Any) -> Any:
        # YAML reads `racks: {1: ...}` as an integer key; a rack may well be named by number
        if isinstance(racks, dict):
            return {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v for k, v in racks.items()}
        return racks

    @model_validator(mode="after")
    def _one_rack_per_node(self) -> TopologyConfig:
        first: dict[str, str] = {}
        for loc, node in self.listed_nodes():
            rack = str(loc[1])
            if node in first:
                raise KeyedError(loc, f"{node} is already in rack {first[node]}")
            first[node] = rack
        return self

    def listed_nodes(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Every node entry of ``racks`` in file order: (its key below ``topology``, the name)."""
        return [(("racks", rack, "nodes", i), node)
                for rack, conf in self.racks.items() for i, node in enumerate(conf.nodes)]

    def unknown_node(self, names: Collection[str]) -> tuple[tuple[str | int, ...], str] | None:
        """The first node entry not in ``names`` (the cluster's nodes) and the problem, or None."""
        known = set(names)
        for loc, node in self.listed_nodes():
            if node not in known:
                shown = ", ".join(list(names)[:_NAMES_SHOWN])
                if len(names) > _NAMES_SHOWN:
                    shown += f", ... ({len(names)} in all)"
                return loc, f"unknown node {node!r}; the cluster's nodes: {shown or 'none'}"
        return None

    def locate(self, where: Callable[[tuple[str | int, ...]], str]) -> None:
        """Remember where each node entry is written (``where(loc)``: e.g. ``cluster.yaml:12``,
        ``loc`` below ``topology``), for ``check_nodes`` once the cluster's nodes are known."""
        self._written = _Written({loc: where(loc) for loc, _ in self.listed_nodes()})

    def check_nodes(self, names: Collection[str]) -> None:
        """Raise ``ConfigError`` (``<file>:<line>: topology.racks.<r>.nodes.<i>: unknown node 'x';
        the cluster's nodes: ...``) when ``racks`` lists a node not in ``names``."""
        found = self.unknown_node(names)
        if found is None:
            return
        loc, problem = found
        where = self._written.at.get(loc, "cluster.yaml")
        raise ConfigError(f"{where}: topology.{'.'.join(str(p) for p in loc)}: {problem}",
                          hint="`fleet nodes` lists the cluster's nodes; a rack lists them by those names")

    def resolve(self, nodes: Sequence[NodeInfo]) -> Topology:
        """The topology over the cluster's ``nodes`` (``check_nodes`` first): each node's rack
        from ``racks``, else its ``rack_label`` Ray label; bandwidths in bytes/s."""
        self.check_nodes([n.name for n in nodes])
        rack_of = {node: str(loc[1]) for loc, node in self.listed_nodes()}
        if self.rack_label is not None:
            for n in nodes:
                label = n.labels.get(self.rack_label)
                if n.name not in rack_of and label:
                    rack_of[n.name] = label
        return Topology(
            rack_of_node=rack_of,
            intra_node_bps=_bps(self.intra_node_gbps),
            node_bps=_bps(self.node_gbps),
            rack_uplink_bps=_bps(self.rack_uplink_gbps),
            uplink_bps={r: b for r, conf in self.racks.items() if (b := _bps(conf.uplink_gbps)) is not None},
        )


def _bps(gbps: float | None) -> float | None:
    return None if gbps is None else gbps * BYTES_PER_GBIT


def gbit_text(bps: float) -> str:
    """``bps`` (bytes/s) as the file writes it, e.g. ``800 Gbit/s``."""
    return f"{bps / BYTES_PER_GBIT:g} Gbit/s"


@dataclass(frozen=True)
class LinkPath:
    """The slowest link a process group crosses.

    ``bandwidth_bps``: bytes/s; ``link``: which link, for people (``rack r2 uplink (800
    Gbit/s)``); ``scope``: ``node`` (one node), ``rack`` (nodes of one rack, or of a cluster
    without racks) or ``cross-rack``; ``racks``: the racks the group spans, by name."""

    bandwidth_bps: float
    link: str
    scope: str
    racks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Topology:
    """The resolved topology: node -> rack, and link bandwidths in bytes/s (None: not given)."""

    rack_of_node: Mapping[str, str] = field(default_factory=dict)
    intra_node_bps: float | None = None
    node_bps: float | None = None
    rack_uplink_bps: float | None = None          # every rack's, unless uplink_bps names it
    uplink_bps: Mapping[str, float] = field(default_factory=dict)

    def rack_of(self, node: str) -> str | None:
        """The node's rack; None when neither ``racks`` nor its Ray label names one."""
        return self.rack_of_node.get(node)

    def uplink_of(self, rack: str) -> float | None:
        """The rack's uplink bandwidth, bytes/s; None when not given."""
        return self.uplink_bps.get(rack, self.rack_uplink_bps)

    def path(self, nodes: Iterable[str]) -> LinkPath | None:
        """The slowest link a group spanning ``nodes`` crosses: one node, the intra-node
        fabric; one rack (or a cluster without racks), the node links; several racks, the
        node links and each rack's uplink (an uplink on a tie: it is the shared one). None
        when a needed bandwidth is not given, or a node's rack is not known while others' are."""
        names = sorted(set(nodes))
        if not names:
            return None
        if len(names) == 1:
            rack = self.rack_of(names[0])
            if self.intra_node_bps is None:
                return None
            return LinkPath(self.intra_node_bps, f"intra-node ({gbit_text(self.intra_node_bps)})", "node",
                            (rack,) if rack else ())
        racks = {self.rack_of(n) for n in names}
        if self.node_bps is None:
            return None
        node_link = f"node link ({gbit_text(self.node_bps)})"
        if None in racks:
            if self.rack_of_node:  # somewhere else in the cluster: its uplinks are unknown
                return None
            return LinkPath(self.node_bps, node_link, "rack", ())
        spanned = tuple(sorted(r for r in racks if r is not None))
        if len(spanned) == 1:
            return LinkPath(self.node_bps, node_link, "rack", spanned)
        uplinks = [(b, r) for r in spanned if (b := self.uplink_of(r)) is not None]
        if len(uplinks) < len(spanned):
            return None
        slowest, rack = min(uplinks)
        if self.node_bps < slowest:
            return LinkPath(self.node_bps, node_link, "cross-rack", spanned)
        return LinkPath(slowest, f"rack {rack} uplink ({gbit_text(slowest)})", "cross-rack", spanned)


def local_node_names(count: int) -> list[str]:
    """The node names of a local cluster of ``count`` simulated nodes (``orchestrator``'s)."""
    return [f"node-{i}" for i in range(count)]


def as_keyed(exc: Any) -> tuple[str | int, ...]:
    """The extra key path a validation error's cause names (``KeyedError``), else ()."""
    return exc.loc if isinstance(exc, KeyedError) else ()
