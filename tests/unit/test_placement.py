"""Placement never uses a quarantined node (pure decision)."""

from __future__ import annotations

from fleet.controlplane.placement import choose_nodes

ALIVE = ["node-0", "node-1", "node-2"]


def test_takes_the_first_healthy_nodes_in_order() -> None:
    assert choose_nodes(ALIVE, {}, 2).nodes == ("node-0", "node-1")
    assert choose_nodes(ALIVE, {"node-0": "crashed twice"}, 2).nodes == ("node-1", "node-2")
    assert choose_nodes(ALIVE, {"node-1": "slow"}, 2).nodes == ("node-0", "node-2")


def test_not_enough_healthy_nodes_says_which_are_quarantined_and_why() -> None:
    d = choose_nodes(ALIVE, {"node-0": "SDC on GPU 3", "node-2": "straggler"}, 2)
    assert d.nodes == ()
    assert d.reason == ("the job needs 2 healthy node(s) and 1 of the 3 alive are; quarantined: "
                        "node-0 (SDC on GPU 3), node-2 (straggler)")


def test_quarantine_of_a_node_that_is_not_alive_changes_nothing() -> None:
    assert choose_nodes(ALIVE, {"node-9": "gone"}, 3).nodes == tuple(ALIVE)
    assert "quarantined: none" in choose_nodes(["node-0"], {}, 2).reason


def test_a_down_node_is_not_used_and_the_wait_says_so() -> None:
    d = choose_nodes(ALIVE, {}, 3, down={"node-1": "node-down fault, back in 4 s"})
    assert d.nodes == () and d.reason.endswith("down: node-1 (node-down fault, back in 4 s)")
    assert choose_nodes(ALIVE, {}, 2, down={"node-1": "x"}).nodes == ("node-0", "node-2")


def test_shrinking_takes_what_is_healthy_once_the_minimum_is_met() -> None:
    d = choose_nodes(ALIVE, {"node-0": "bad", "node-2": "bad"}, 3, minimum=1)
    assert d.nodes == ("node-1",) and d.reason == "shrunk to 1 of 3 node(s)"
    assert choose_nodes(ALIVE, {"node-0": "bad"}, 3, minimum=2).nodes == ("node-1", "node-2")
    assert choose_nodes(ALIVE, {"node-0": "bad", "node-2": "bad"}, 3, minimum=2).nodes == ()
    assert choose_nodes(ALIVE, {}, 2, minimum=1) == choose_nodes(ALIVE, {}, 2)  # enough: no shrink
