"""Topology-aware placement: fewest racks, EP groups inside a rack, racks contiguous in rank
order, never a quarantined or down node, stable while nothing changes; and the controller
places by it and stores why (the attempt's placement action, shown by `fleet report`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.controlplane.config import parse_cluster_yaml
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.placement import JobLayout, PlacementDecision, choose_nodes
from fleet.controlplane.report import load_report
from fleet.controlplane.runtime import NodeInfo
from fleet.controlplane.store import Store
from fleet.controlplane.topology import Topology, TopologyConfig
from tests.unit.test_controller import STEPS, Outcome, Script, cluster_config, in_memory_runtime, store  # noqa: F401

pytestmark = pytest.mark.timeout(60)

#: 3 racks x 4 nodes: r1 = node-0..3, r2 = node-4..7 (a slower uplink), r3 = node-8..11
ALIVE = [f"node-{i}" for i in range(12)]
FSDP = JobLayout(ranks_per_node=2, ep_size=2, data_parallel="fsdp")


def _topology(racks: dict[str, list[str]] | None = None, **gbps: float) -> Topology:
    racks = racks or {"r1": ALIVE[0:4], "r2": ALIVE[4:8], "r3": ALIVE[8:12]}
    conf = TopologyConfig(intra_node_gbps=2400, node_gbps=gbps.get("node", 400), rack_uplink_gbps=1600,
                          racks={r: {"nodes": ns, **({"uplink_gbps": 800} if r == "r2" else {})}
                                 for r, ns in racks.items()})
    return conf.resolve([NodeInfo(n, n, "10.0.0.1", 8.0) for n in ALIVE])


TOPO = _topology()


def _place(needed: int, quarantined: tuple[str, ...] = (), layout: JobLayout = FSDP, *, down: tuple[str, ...] = (),
           topology: Topology = TOPO, minimum: int | None = None) -> PlacementDecision:
    return choose_nodes(ALIVE, dict.fromkeys(quarantined, "bad"), needed, dict.fromkeys(down, "down"),
                        minimum=minimum, topology=topology, layout=layout)


def _racks(nodes: tuple[str, ...]) -> list[str | None]:
    """The racks in rank order, one entry per stretch."""
    out: list[str | None] = []
    for n in nodes:
        rack = TOPO.rack_of(n)
        if not out or out[-1] != rack:
            out.append(rack)
    return out


def test_a_job_that_fits_a_rack_stays_in_it_and_says_why() -> None:
    d = _place(4)
    assert d.nodes == ("node-0", "node-1", "node-2", "node-3") and d.reason == ""
    assert d.reasons == (
        "ranks 0-7 (EP groups 0-3) on rack r1: node-0, node-1, node-2, node-3",
        "EP groups (2 ranks each) stay inside a node",
        "dense FSDP group (ranks 0-7) stays in rack r1: its slowest link is node link (400 Gbit/s)",
    )


def test_quarantined_nodes_in_the_middle_move_the_job_to_the_fullest_racks() -> None:
    # r1 and r2 lose a node each; r3 is whole: a 4-node job moves there, a 6-node one adds r1
    q = ("node-1", "node-6")
    assert _place(4, q).nodes == ("node-8", "node-9", "node-10", "node-11")
    d = _place(6, q)
    assert d.nodes == ("node-8", "node-9", "node-10", "node-11", "node-0", "node-2")
    assert _racks(d.nodes) == ["r3", "r1"]
    assert d.reasons[-1] == ("dense FSDP group (ranks 0-11) spans racks r3, r1: its slowest link is node "
                             "link (400 Gbit/s)")
    # 8 nodes need all three racks; none of them is a quarantined or down one
    d = _place(8, q, down=("node-9",))
    assert not {"node-1", "node-6", "node-9"} & set(d.nodes) and len(set(d.nodes)) == 8
    assert _racks(d.nodes) == ["r1", "r2", "r3"]  # 3 healthy each: by name; each rack one stretch
    assert d.nodes[-2:] == ("node-8", "node-10")


def test_the_uplink_is_named_when_it_is_the_slowest_link() -> None:
    topo = _topology(node=1000)
    d = _place(6, ("node-0", "node-1", "node-2", "node-3", "node-8", "node-9"), topology=topo)
    assert _racks(d.nodes) == ["r2", "r3"]
    assert d.reasons[-1] == ("dense FSDP group (ranks 0-11) spans racks r2, r3: its slowest link is rack r2 "
                             "uplink (800 Gbit/s)")


def test_an_ep_group_spanning_nodes_gets_nodes_of_one_rack() -> None:
    ep4 = JobLayout(ranks_per_node=2, ep_size=4, data_parallel="fsdp")  # an EP group = 2 nodes
    # 3 healthy nodes in each of r1, r2, r3: 6 nodes as 3 pairs, none split across racks
    q = ("node-1", "node-6", "node-11")
    d = _place(6, q, ep4)
    pairs = [d.nodes[i:i + 2] for i in range(0, 6, 2)]
    assert all(TOPO.rack_of(a) == TOPO.rack_of(b) for a, b in pairs), d.nodes
    assert d.nodes == ("node-0", "node-2", "node-4", "node-5", "node-8", "node-9")
    assert "EP groups (4 ranks each) span up to 2 nodes, each group inside one rack" in d.reasons
    # taking the first six healthy nodes would have split EP group 1 over r1 and r2
    assert choose_nodes(ALIVE, dict.fromkeys(q, "bad"), 6).nodes[2:4] == ("node-3", "node-4")


def test_when_no_rack_has_room_the_split_ep_groups_are_named() -> None:
    ep4 = JobLayout(ranks_per_node=2, ep_size=4, data_parallel="fsdp")
    # healthy: r1 = node-0; r2 = node-4; r3 = node-8, node-9: 4 nodes, one pair must be split
    q = ("node-1", "node-2", "node-3", "node-5", "node-6", "node-7", "node-10", "node-11")
    d = _place(4, q, ep4)
    assert d.nodes == ("node-8", "node-9", "node-0", "node-4")
    assert "1 of 2 EP group(s) cross racks (no rack had room for them whole)" in d.reasons
    assert "EP group 1 (ranks 4-7) spans racks r1, r2: its slowest link is node link (400 Gbit/s)" in d.reasons


def test_hsdp_shards_inside_a_node_and_replicates_across_the_fewest_racks() -> None:
    hsdp = JobLayout(ranks_per_node=4, ep_size=2, data_parallel="hsdp")
    d = _place(5, ("node-4",), hsdp)
    assert _racks(d.nodes) == ["r1", "r3"] and len(d.nodes) == 5
    assert d.reasons[0] == "ranks 0-15 (EP groups 0-7) on rack r1: node-0, node-1, node-2, node-3"
    assert d.reasons[-1] == ("HSDP (sharded inside each node, replicated across them) spans racks r1, r3: "
                             "its slowest link is node link (400 Gbit/s)")


def test_a_program_of_the_users_has_one_known_group_the_world() -> None:
    d = _place(1, (), JobLayout(ranks_per_node=8))
    assert d.reasons == ("ranks 0-7 on rack r1: node-0",
                         "world group (ranks 0-7) stays on node-0: its slowest link is intra-node (2400 Gbit/s)")


def test_not_enough_nodes_waits_with_the_same_reason_as_without_a_topology() -> None:
    q = tuple(ALIVE[:9])
    d = _place(4, q)
    assert d == PlacementDecision((), choose_nodes(ALIVE, dict.fromkeys(q, "bad"), 4).reason)
    assert d.reason.startswith("the job needs 4 healthy node(s) and 3 of the 12 alive are; quarantined: node-0 (bad)")
    # shrinking still works, placed by rack
    d = _place(4, q, minimum=2)
    assert d.nodes == ("node-9", "node-10", "node-11") and d.reason == "shrunk to 3 of 4 node(s)"


def test_stable_while_nothing_changes_and_untouched_by_changes_elsewhere() -> None:
    first = _place(6, ("node-1",))
    assert all(_place(6, ("node-1",)) == first for _ in range(3))
    # a quarantine in a rack the job does not use changes nothing
    assert _place(4, ("node-9",)).nodes == _place(4).nodes


def test_without_a_topology_or_racks_nodes_are_taken_in_order_as_before() -> None:
    q = {"node-1": "bad"}
    assert choose_nodes(ALIVE, q, 3, layout=FSDP) == PlacementDecision(("node-0", "node-2", "node-3"))
    flat = TopologyConfig(node_gbps=100).resolve([NodeInfo(n, n, "x", 1.0) for n in ALIVE])
    d = choose_nodes(ALIVE, q, 3, topology=flat, layout=FSDP)
    assert d.nodes == ("node-0", "node-2", "node-3")
    assert d.reasons[0] == "ranks 0-5 (EP groups 0-2) on nodes of no known rack: node-0, node-2, node-3"
    assert d.reasons[-1] == ("dense FSDP group (ranks 0-5) spans 3 nodes of no known rack: its slowest link is "
                             "node link (100 Gbit/s)")


def test_nodes_of_no_known_rack_come_last() -> None:
    topo = _topology({"r1": ALIVE[0:2], "r2": ALIVE[10:12]})
    d = _place(6, (), topology=topo)
    assert d.nodes[:4] == ("node-0", "node-1", "node-10", "node-11")
    assert d.nodes[4:] == ("node-2", "node-3")
    assert d.reasons[-1].endswith("(link bandwidths not given)")  # a rack is not known: no path


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sets(st.sampled_from(ALIVE)), st.sets(st.sampled_from(ALIVE)), st.integers(1, 12),
       st.sampled_from([1, 2, 4, 8]))
def test_fuzz_placement_invariants(quarantined: set[str], down: set[str], needed: int, ep: int) -> None:
    layout = JobLayout(ranks_per_node=2, ep_size=ep, data_parallel="fsdp")
    block = layout.nodes_per_block
    needed = max(block, needed - needed % block)
    d = choose_nodes(ALIVE, dict.fromkeys(sorted(quarantined), "q"), needed, dict.fromkeys(sorted(down), "d"),
                     topology=TOPO, layout=layout)
    healthy = [n for n in ALIVE if n not in quarantined | down]
    if len(healthy) < needed:
        assert d.nodes == () and d.reason
        return
    assert len(d.nodes) == len(set(d.nodes)) == needed and set(d.nodes) <= set(healthy)
    assert len(_racks(d.nodes)) == len({TOPO.rack_of(n) for n in d.nodes})  # each rack one stretch
    if block == 1:  # fewest racks: the fullest racks suffice
        sizes = sorted((sum(TOPO.rack_of(n) == r for n in healthy) for r in ("r1", "r2", "r3")), reverse=True)
        fewest = next(k for k in range(1, 4) if sum(sizes[:k]) >= needed)
        assert len(set(_racks(d.nodes))) == fewest
    assert d == choose_nodes(ALIVE, dict.fromkeys(sorted(quarantined), "q"), needed,
                             dict.fromkeys(sorted(down), "d"), topology=TOPO, layout=layout)


# -- the controller places by it and stores why ------------------------------------------------


def test_the_controller_places_by_rack_and_reports_why(tmp_path: Path, store: Store,  # noqa: F811
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.controlplane.cli.main import main
    from fleet.controlplane.controller import Controller

    cfg = cluster_config(tmp_path)
    # three local nodes; node-1 and node-2 share rack r2, so a 2-node job goes there, not to node-0
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw["ray"]["nodes"] = 3
    raw["topology"] = {"node_gbps": 100, "racks": {"r1": {"nodes": ["node-0"]}, "r2": {"nodes": ["node-1", "node-2"]}}}
    cfg = type(cfg).model_validate(raw)
    script = Script([Outcome(STEPS)])
    result = Controller(cfg, store, runtime=in_memory_runtime(script)).run()
    assert result.state is JobState.SUCCEEDED
    assert [s.node_name for s in script.attempts[0]] == ["node-1", "node-2"]
    [action] = [a for a in store.actions(result.job_id) if a.kind == "placement"]
    assert action.attempt == 1
    assert action.cause == ("ranks 0-1 on rack r2: node-1, node-2; dense FSDP group (ranks 0-1) stays in rack r2: "
                            "its slowest link is node link (100 Gbit/s)")
    report = load_report(store, result.job_id, 0.0)
    assert report["placements"] == [{"attempt": 1, "reasons": action.cause}]
    capsys.readouterr()
    assert main(["report", result.job_id, "--store", f"sqlite:///{tmp_path}/.fleet/fleet.db"]) == 0
    shown = capsys.readouterr().out
    assert "placement of attempt 1:\n  ranks 0-1 on rack r2: node-1, node-2\n  dense FSDP group" in shown


def test_an_attached_clusters_unknown_rack_node_fails_the_job_in_one_line(tmp_path: Path,
                                                                           store: Store) -> None:  # noqa: F811
    from fleet.controlplane.controller import Controller

    raw = cluster_config(tmp_path).model_dump(mode="json", exclude_unset=True)
    raw["ray"]["address"] = "10.0.0.1:6379"  # the in-memory cluster has node-0 and node-1
    raw["topology"] = {"racks": {"r1": {"nodes": ["node-0", "gpu-7"]}}}
    text = yaml.safe_dump(raw)
    cfg = parse_cluster_yaml(text, "c.yaml")  # an attached cluster's names are not known yet
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "gpu-7" in row)
    with pytest.raises(ConfigError) as info:
        Controller(cfg, store, runtime=in_memory_runtime(Script([Outcome(STEPS)]))).run()
    message = (f"c.yaml:{line}: topology.racks.r1.nodes.1: unknown node 'gpu-7'; "
               "the cluster's nodes: node-0, node-1")
    assert str(info.value) == message
    [job] = store.list_jobs()
    assert job.state is JobState.FAILED and job.reason == message
