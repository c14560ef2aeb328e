"""cluster.yaml's ``topology:`` section: its errors (with the key and line), node -> rack
resolution (racks, Ray labels), and the slowest link of a group's path."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.controlplane.config import ClusterConfig, parse_cluster_yaml
from fleet.controlplane.config_overrides import parse_override
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.runtime import NodeInfo
from fleet.controlplane.topology import BYTES_PER_GBIT, LinkPath, Topology, TopologyConfig

pytestmark = pytest.mark.timeout(60)

SRC = "x.yaml"
ATTACHED = "ray:\n  address: 10.0.0.1:6379\n"


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_cluster_yaml(text, SRC)
    return str(info.value)


def _nodes(*names: str, labels: dict[str, dict[str, str]] | None = None) -> list[NodeInfo]:
    return [NodeInfo(n, f"id-{n}", "10.0.0.1", 8.0, (labels or {}).get(n, {})) for n in names]


# -- the section as written -----------------------------------------------------------------


def test_absent_means_no_topology() -> None:
    assert parse_cluster_yaml("name: x\n", SRC).topology is None


def test_the_documented_shape_parses_bandwidths_in_gbit_per_s() -> None:
    cfg = parse_cluster_yaml(
        "topology:\n  intra_node_gbps: 2400\n  node_gbps: 400\n  rack_uplink_gbps: 1600\n"
        "  rack_label: fleet.rack\n  racks:\n    r1: {nodes: [node-0]}\n    r2: {nodes: [node-1], uplink_gbps: 800}\n",
        SRC)
    assert cfg.topology is not None
    topo = cfg.topology.resolve(_nodes("node-0", "node-1"))
    assert topo.node_bps == 400 * BYTES_PER_GBIT == 50e9  # bytes/s
    assert (topo.intra_node_bps, topo.rack_uplink_bps) == (300e9, 200e9)
    assert (topo.uplink_of("r1"), topo.uplink_of("r2")) == (200e9, 100e9)


@pytest.mark.parametrize(("text", "expected"), [
    ("topology:\n  node_gbps: 0\n", "x.yaml:2: topology.node_gbps: Input should be greater than 0"),
    ("topology:\n  intra_node_gbps: 10\n  rack_uplink_gbps: -400\n",
     "x.yaml:3: topology.rack_uplink_gbps: Input should be greater than 0"),
    ("topology:\n  racks:\n    r1:\n      nodes: [node-0]\n      uplink_gbps: 0\n",
     "x.yaml:5: topology.racks.r1.uplink_gbps: Input should be greater than 0"),
    ("topology:\n  node_gbps: .inf\n", "x.yaml:2: topology.node_gbps: Input should be a finite number"),
    ("topology:\n  racks:\n    r1: {nodes: [node-0, node-1]}\n    r2:\n      nodes:\n        - node-1\n",
     "x.yaml:6: topology.racks.r2.nodes.0: node-1 is already in rack r1"),
    ("topology:\n  racks:\n    r1:\n      nodes: [node-0, node-0]\n",
     "x.yaml:4: topology.racks.r1.nodes.1: node-0 is already in rack r1"),
    ("topology:\n  racks:\n    r1:\n      nodes:\n        - node-0\n        - node-7\n",
     "x.yaml:6: topology.racks.r1.nodes.1: unknown node 'node-7'; the cluster's nodes: node-0, node-1"),
    ("ray:\n  nodes: 3\ntopology:\n  racks:\n    r9: {nodes: [gpu-1]}\n",
     "x.yaml:5: topology.racks.r9.nodes.0: unknown node 'gpu-1'; the cluster's nodes: node-0, node-1, node-2"),
    ("topology:\n  rack_label: ''\n", "x.yaml:2: topology.rack_label: String should have at least 1 character"),
    ("topology:\n  racks:\n    r1: {nodes: [node-0], uplink: 5}\n", "x.yaml:3: topology.racks.r1.uplink: unknown key"),
    ("topology: [node-0]\n", "x.yaml:1: topology: Input should be a valid dictionary or instance of TopologyConfig"),
])
def test_bad_input_is_one_line_naming_the_key_and_line(text: str, expected: str) -> None:
    assert _error(text) == expected


def test_an_override_to_blame_is_named_instead_of_the_file() -> None:
    with pytest.raises(ConfigError) as info:
        parse_cluster_yaml("topology:\n  node_gbps: 400\n", SRC, overrides=[parse_override("topology.node_gbps=0")])
    assert str(info.value) == "--set topology.node_gbps=0: topology.node_gbps: Input should be greater than 0"


def test_racks_named_by_number_are_racks_named_by_that_text() -> None:
    cfg = parse_cluster_yaml("topology:\n  racks:\n    1: {nodes: [node-0]}\n    2: {nodes: [node-1]}\n", SRC)
    assert cfg.topology is not None and list(cfg.topology.racks) == ["1", "2"]


# -- an attached cluster: its node names are checked once Ray is up -----------------------


def test_an_attached_cluster_checks_node_names_when_ray_is_up_with_the_files_line() -> None:
    text = ATTACHED + "topology:\n  node_gbps: 100\n  racks:\n    r1:\n      nodes:\n        - 10.0.0.1-aa\n" \
        "        - gpu-7\n"
    cfg = parse_cluster_yaml(text, SRC)  # names are not known yet: accepted
    assert cfg.topology is not None
    with pytest.raises(ConfigError) as info:
        cfg.topology.resolve(_nodes("10.0.0.1-aa", "10.0.0.2-bb"))
    assert str(info.value) == ("x.yaml:9: topology.racks.r1.nodes.1: unknown node 'gpu-7'; "
                               "the cluster's nodes: 10.0.0.1-aa, 10.0.0.2-bb")
    assert "fleet nodes" in info.value.hint
    cfg.topology.check_nodes(["gpu-7", "10.0.0.1-aa"])  # all there: no error


def test_a_long_node_list_is_cut_short_in_the_error() -> None:
    cfg = TopologyConfig(racks={"r1": {"nodes": ["x"]}})
    with pytest.raises(ConfigError) as info:
        cfg.check_nodes([f"n{i}" for i in range(20)])
    # not located by a parse: the file is named generically
    assert str(info.value) == ("cluster.yaml: topology.racks.r1.nodes.0: unknown node 'x'; the cluster's nodes: "
                               "n0, n1, n2, n3, n4, n5, n6, n7, ... (20 in all)")


def test_the_same_text_parses_to_equal_configs() -> None:
    text = ATTACHED + "topology:\n  racks:\n    r1: {nodes: [a]}\n"
    assert parse_cluster_yaml(text, SRC) == parse_cluster_yaml(text, SRC)


# -- node -> rack ---------------------------------------------------------------------------


def test_a_rack_comes_from_racks_else_from_the_ray_label_else_none() -> None:
    cfg = TopologyConfig(rack_uplink_gbps=800, racks={"r1": {"nodes": ["a"]}, "r2": {"nodes": [], "uplink_gbps": 80}})
    labels = {"a": {"fleet.rack": "r9"}, "b": {"fleet.rack": "r2"}, "c": {"fleet.rack": "r3"}, "d": {"other": "r1"}}
    topo = cfg.resolve(_nodes("a", "b", "c", "d", labels=labels))
    assert [topo.rack_of(n) for n in "abcd"] == ["r1", "r2", "r3", None]  # racks wins over a label
    assert topo.uplink_of("r2") == 80 * BYTES_PER_GBIT  # a labelled rack still gets its own uplink
    assert topo.uplink_of("r3") == 800 * BYTES_PER_GBIT  # ... or the default
    assert topo.rack_of("unknown-node") is None


def test_another_label_key_or_none_at_all() -> None:
    labels = {"a": {"fleet.rack": "r1", "zone": "z1"}}
    assert TopologyConfig(rack_label="zone").resolve(_nodes("a", labels=labels)).rack_of("a") == "z1"
    assert TopologyConfig(rack_label=None).resolve(_nodes("a", labels=labels)).rack_of("a") is None


def test_ray_nodes_entries_become_node_infos_with_their_labels() -> None:
    from fleet.controlplane.orchestrator import alive_nodes

    entries = [  # the shape ray.nodes() returns (Ray 2.x: "Labels" next to "Resources")
        {"NodeID": "ff" * 28, "Alive": True, "NodeManagerAddress": "127.0.0.1",
         "Resources": {"CPU": 4.0, "fleet-node-1": 1.0}, "Labels": {"fleet.rack": "r2", "ray.io/node-id": "ff"}},
        {"NodeID": "ab" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.5", "Resources": {"CPU": 8.0}},
        {"NodeID": "cd" * 28, "Alive": False, "NodeManagerAddress": "10.0.0.6", "Resources": {}, "Labels": {}},
        {"NodeID": "ee" * 28, "Alive": True, "NodeManagerAddress": "127.0.0.1",
         "Resources": {"CPU": 4.0, "fleet-node-0": 1.0}, "Labels": {"fleet.rack": "r1"}},
    ]
    nodes = alive_nodes(entries)
    assert [(n.name, n.cpus, dict(n.labels)) for n in nodes] == [
        ("node-0", 4.0, {"fleet.rack": "r1"}),
        ("node-1", 4.0, {"fleet.rack": "r2", "ray.io/node-id": "ff"}),
        ("10.0.0.5-abababab", 8.0, {}),
    ]
    topo = TopologyConfig().resolve(nodes)
    assert [topo.rack_of(n.name) for n in nodes] == ["r1", "r2", None]
    assert len({n for n in nodes}) == 3  # still hashable with labels


# -- the slowest link -------------------------------------------------------------------------


def _racked(**gbps: float | None) -> Topology:
    cfg = TopologyConfig(
        intra_node_gbps=gbps.get("intra", 2400), node_gbps=gbps.get("node", 400),
        rack_uplink_gbps=gbps.get("uplink", 1600),
        racks={"r1": {"nodes": ["n0", "n1"]}, "r2": {"nodes": ["n2", "n3"], "uplink_gbps": gbps.get("r2", 800)},
               "r3": {"nodes": ["n4"]}})
    return cfg.resolve(_nodes("n0", "n1", "n2", "n3", "n4", "n5"))


def test_one_node_is_the_intra_node_fabric() -> None:
    assert _racked().path(["n2", "n2"]) == LinkPath(300e9, "intra-node (2400 Gbit/s)", "node", ("r2",))
    assert _racked().path(["n5"]) == LinkPath(300e9, "intra-node (2400 Gbit/s)", "node", ())


def test_one_rack_is_the_node_links() -> None:
    assert _racked().path(["n1", "n0"]) == LinkPath(50e9, "node link (400 Gbit/s)", "rack", ("r1",))


def test_several_racks_are_the_slowest_of_node_links_and_their_uplinks() -> None:
    # the node links are slower than every uplink
    assert _racked().path(["n0", "n2"]) == LinkPath(50e9, "node link (400 Gbit/s)", "cross-rack", ("r1", "r2"))
    # r2's uplink is the slowest
    assert _racked(node=1000).path(["n0", "n2", "n4"]) == \
        LinkPath(100e9, "rack r2 uplink (800 Gbit/s)", "cross-rack", ("r1", "r2", "r3"))
    # on a tie the uplink is named: it is the link the racks share
    assert _racked(node=800).path(["n3", "n1"]).link == "rack r2 uplink (800 Gbit/s)"
    assert _racked(node=2000).path(["n4", "n0"]).link == "rack r1 uplink (1600 Gbit/s)"  # r1, r3 tie: by name


def test_no_path_where_a_needed_bandwidth_is_not_given() -> None:
    assert _racked(intra=None).path(["n0"]) is None
    assert _racked(node=None).path(["n0", "n1"]) is None
    assert _racked(uplink=None).path(["n0", "n2"]) is None  # r1 has no uplink then
    assert _racked(uplink=None).path(["n2", "n3"]) is not None  # inside r2 no uplink is crossed
    assert _racked().path(["n0", "n5"]) is None  # n5's rack is not known
    assert _racked().path([]) is None


def test_a_cluster_without_racks_is_one_network_of_node_links() -> None:
    topo = TopologyConfig(node_gbps=100).resolve(_nodes("a", "b", "c"))
    assert topo.path(["a", "c"]) == LinkPath(12.5e9, "node link (100 Gbit/s)", "rack", ())


# -- fuzzing: any YAML under topology: is a valid config or one ConfigError --------------------

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -1, 0.5, 400, 1e7, 1e8, math.inf]),
    st.text(max_size=12), st.sampled_from(["node-0", "node-1", "node-9", "r1", "fleet.rack", ""]),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=3)),
    max_leaves=8)
_RACK = st.one_of(st.fixed_dictionaries({}, optional={
    "nodes": st.one_of(st.lists(st.sampled_from(["node-0", "node-1", "node-2"]), max_size=3), _VALUES),
    "uplink_gbps": _VALUES, "bogus": _VALUES}), _VALUES)
_TOPOLOGY = st.one_of(st.fixed_dictionaries({}, optional={
    "intra_node_gbps": _VALUES, "node_gbps": _VALUES, "rack_uplink_gbps": _VALUES, "rack_label": _VALUES,
    "racks": st.one_of(st.dictionaries(st.one_of(st.sampled_from(["r1", "r2", "", "a.b"]), st.integers()), _RACK,
                                       max_size=3), _VALUES)}), _VALUES)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(_TOPOLOGY, st.booleans())
def test_fuzz_the_topology_section_is_valid_or_one_config_error(topology: object, attached: bool) -> None:
    data = {"topology": topology, **({"ray": {"address": "10.0.0.1:6379"}} if attached else {})}
    text = yaml.safe_dump(data)
    try:
        cfg = parse_cluster_yaml(text, SRC)
    except ConfigError as exc:
        assert str(exc).startswith(SRC) and "\n" not in str(exc)
        return
    assert isinstance(cfg, ClusterConfig)
    if cfg.topology is not None:
        try:
            topo = cfg.topology.resolve(_nodes("node-0", "node-1", labels={"node-1": {"fleet.rack": "r2"}}))
        except ConfigError as exc:  # an attached cluster's unknown node
            assert attached and str(exc).startswith(SRC) and "unknown node" in str(exc)
            return
        path = topo.path(["node-0", "node-1"])
        assert path is None or path.bandwidth_bps > 0


def test_where_the_entries_are_written_does_not_make_configs_unequal() -> None:
    a = parse_cluster_yaml(ATTACHED + "topology:\n  racks:\n    r1: {nodes: [a]}\n", "a.yaml")
    b = parse_cluster_yaml(ATTACHED + "\n\ntopology: {racks: {r1: {nodes: [a]}}}\n", "b.yaml")
    assert a == b
    for cfg, where in ((a, "a.yaml:5"), (b, "b.yaml:5")):
        assert cfg.topology is not None
        with pytest.raises(ConfigError, match=f"^{where}: topology.racks.r1.nodes.0: unknown node 'a'"):
            cfg.topology.check_nodes(["b"])
