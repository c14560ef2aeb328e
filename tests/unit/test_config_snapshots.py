"""cluster.yaml's in-memory snapshot settings: peer copies need a buddy on another node,
and the copies must fit job.snapshot_memory_max_mb; both refused at load, naming the key."""

from __future__ import annotations

import pytest

from fleet.controlplane.config import parse_cluster_yaml
from fleet.controlplane.errors import ConfigError


def test_memory_snapshots_take_a_mode_or_a_bool():
    assert parse_cluster_yaml("job: {}").job.memory_snapshots == "peer"
    assert parse_cluster_yaml("job: {memory_snapshots: local}").job.memory_snapshots == "local"
    assert parse_cluster_yaml("job: {memory_snapshots: true}").job.memory_snapshots == "peer"
    assert parse_cluster_yaml("job: {memory_snapshots: false}").job.memory_snapshots == "off"
    assert parse_cluster_yaml("job: {memory_snapshots: false}").job.train_args().memory_snapshots == "off"
    with pytest.raises(ConfigError, match="job.memory_snapshots"):
        parse_cluster_yaml("job: {memory_snapshots: buddies}")


def test_peer_copies_on_one_node_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"job\.memory_snapshots to local.*2\+ nodes"):
        parse_cluster_yaml("job: {nodes: 1, memory_snapshots: peer}")
    # the default on one node is simply the rank's own copy; replicated DDP state needs no buddy
    assert parse_cluster_yaml("job: {nodes: 1}").job.nodes == 1
    parse_cluster_yaml("job: {nodes: 1, memory_snapshots: peer, data_parallel: ddp, ep_size: 1}")


def test_snapshots_over_the_memory_budget_are_refused_with_the_estimate():
    with pytest.raises(ConfigError, match=r"needs about 6\.\d MiB per rank \(own and peer copies of 1\.\d MiB "
                                          r"of state\), above job\.snapshot_memory_max_mb \(0\.5\)"):
        parse_cluster_yaml("job: {snapshot_memory_max_mb: 0.5}")
    # local copies only: half as much, under a 4 MiB budget
    parse_cluster_yaml("job: {snapshot_memory_max_mb: 4, memory_snapshots: local}")
    parse_cluster_yaml("job: {snapshot_memory_max_mb: 0.5, memory_snapshots: off}")
