"""Collective bandwidth of a stored attempt: the analytics of ``diagnosis.bandwidth`` fed
with what the store knows about the run.

``attempt_bandwidth`` takes an attempt's traces (the ones its diagnosis was built from),
its step rows and its placement, and returns ``analyse``'s JSON plus, per group, the
link it crosses. Two things come from the run rather than the traces:

  * each rank's window for time shares: from the start of its first stored step to the
    end of its last (``StepRecord.end_ns - step_time_s``), so a group's share is of the
    rank's training time; a rank without steps keeps the traces' own window;
  * each group's slowest link: the job's ``topology`` (its cluster.yaml section, stored
    with the job) over the nodes of the group's members. Racks that only Ray node labels
    named are not known here (no labels are stored): such groups show no utilization.

Pure over its inputs: no store, Ray or gRPC (``replay.py`` and ``report.py`` read).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fleet.controlplane.diagnosis.bandwidth import analyse
from fleet.controlplane.diagnosis.traces import TraceSet
from fleet.controlplane.errors import FleetError
from fleet.controlplane.topology import LinkPath, Topology, TopologyConfig

log = logging.getLogger(__name__)


def job_topology(config_json: str, nodes: Iterable[str]) -> Topology | None:
    """The topology a job was started with, over ``nodes`` (None: it had none, or it no
    longer reads: an old job's stored config)."""
    from fleet.controlplane.runtime import NodeInfo

    try:
        section = json.loads(config_json or "{}").get("topology")
        if not section:
            return None
        config = TopologyConfig.model_validate(section)
        known = sorted(set(nodes) | {n for _, n in config.listed_nodes()})
        return config.resolve([NodeInfo(n, "", "", 0.0) for n in known])
    except (ValueError, TypeError, AttributeError, FleetError) as exc:
        log.debug("the job's topology does not read (%s): no utilization", exc)
        return None


def step_windows(steps: Iterable[Any]) -> dict[int, tuple[int, int]]:
    """Per rank, (start of its first step, end of its last), host-clock ns."""
    out: dict[int, tuple[int, int]] = {}
    for s in steps:
        start, end = s.end_ns - int(s.step_time_s * 1e9), s.end_ns
        have = out.get(s.rank)
        out[s.rank] = (start, end) if have is None else (min(have[0], start), max(have[1], end))
    return out


def group_paths(traces: TraceSet, rank_node: Mapping[int, str], topology: Topology | None) -> dict[str, LinkPath]:
    """Each group's slowest link (groups whose members' nodes or links are not known are left out)."""
    if topology is None:
        return {}
    members: dict[str, set[int]] = {}
    for t in traces.ranks.values():
        for name in t.groups:
            declared = t.group_ranks.get(name)
            members.setdefault(name, set()).update(declared if declared else (t.rank,))
    out = {}
    for name, ranks in members.items():
        nodes = [rank_node.get(r) for r in ranks]
        if None in nodes:
            continue
        path = topology.path(nodes)  # type: ignore[arg-type]
        if path is not None:
            out[name] = path
    return out


def attempt_bandwidth(traces: TraceSet, steps: Iterable[Any], rank_node: Mapping[int, str],
                      topology: Topology | None) -> dict[str, Any]:
    """``analyse``'s JSON for one attempt, each group row with ``link`` (the slowest link
    it crosses, or None) and ``scope`` (node / rack / cross-rack, or None)."""
    paths = group_paths(traces, rank_node, topology)
    out = analyse(traces, windows_ns=step_windows(steps) or None,
                  link_bps={g: p.bandwidth_bps for g, p in paths.items()}).to_json()
    for row in out["rows"] + out["groups"]:
        path = paths.get(row["group"])
        row["link"], row["scope"] = (path.link, path.scope) if path is not None else (None, None)
    return out


def stored_attempt_bandwidth(store: Any, job_id: str, attempt: int) -> dict[str, Any] | None:
    """``attempt_bandwidth`` of a stored attempt (``store``: the Store; read through its
    domain methods); None for an attempt of a large job, whose raw collectives stayed on
    the agents (its fronts carry no durations)."""
    from fleet.controlplane.diagnosis.source import attempt_traces

    if store.count_fronts_of(job_id, attempt):
        return None
    placed = {r.rank: r.node for r in store.ranks(job_id, attempt)}
    traces = attempt_traces(store, job_id, attempt)
    return attempt_bandwidth(traces, store.steps(job_id, attempt=attempt), placed,
                             job_topology(store.get_job(job_id).config_json, placed.values()))
