"""When an agent counts as lost, is restarted, or is back (pure decision, literal timestamps)."""

from __future__ import annotations

import pytest

from fleet.controlplane.supervision import (
    AgentAction,
    AgentActionKind,
    AgentFacts,
    AgentSnapshot,
    SupervisionConfig,
    decide_agents,
    needs_probe,
)

CFG = SupervisionConfig(heartbeat_timeout_s=10.0, reconnect_grace_s=1.0)
LOST, RESTART, BACK = AgentActionKind.LOST, AgentActionKind.RESTART, AgentActionKind.BACK


def decide(now: float, *facts: AgentFacts) -> list[AgentAction]:
    return decide_agents(now, AgentSnapshot(tuple(facts)), CFG)


def kinds(actions: list[AgentAction]) -> list[tuple[AgentActionKind, str]]:
    return [(a.kind, a.node) for a in actions]


def test_a_heard_agent_needs_nothing() -> None:
    f = AgentFacts("node-0", connected=True, silent_s=0.4)
    assert not needs_probe(f, CFG)
    assert decide(100.0, f) == []


def test_partition_silent_but_alive_is_an_incident_and_no_restart() -> None:
    f = AgentFacts("node-1", connected=True, silent_s=12.5, alive=True)
    assert needs_probe(AgentFacts("node-1", connected=True, silent_s=12.5), CFG)
    [action] = decide(100.0, f)
    assert action.kind is LOST and action.node == "node-1" and action.restart_at is None
    assert action.reason == ("agent on node-1 silent for 12.5 s (heartbeat timeout 10 s); "
                             "its process is alive: partitioned from the controller")


def test_disconnected_alive_agent_is_waited_for_until_the_heartbeat_timeout() -> None:
    assert decide(100.0, AgentFacts("node-1", connected=False, silent_s=5.0, alive=True)) == []
    [action] = decide(100.0, AgentFacts("node-1", connected=False, silent_s=10.0, alive=True))
    assert action.kind is LOST and action.restart_at is None


def test_dead_agent_is_an_incident_and_restarted_at_once() -> None:
    f = AgentFacts("node-0", connected=False, silent_s=1.5, alive=False)
    assert needs_probe(AgentFacts("node-0", connected=False, silent_s=1.5), CFG)
    lost, restart = decide(200.0, f)
    assert lost.kind is LOST and lost.restart_at == 200.0
    assert lost.reason == "agent on node-0 is gone (stream closed 1.5 s ago, process dead)"
    assert (restart.kind, restart.node, restart.reason) == (RESTART, "node-0", "agent on node-0 restarted")


def test_connected_but_silent_dead_agent_is_restarted_too() -> None:
    f = AgentFacts("node-0", connected=True, silent_s=11.0, alive=False)
    assert kinds(decide(50.0, f)) == [(LOST, "node-0"), (RESTART, "node-0")]


@pytest.mark.parametrize("field", ["agent_back_at", "node_back_at"])
def test_restart_waits_for_the_fault_duration(field: str) -> None:
    f = AgentFacts("node-1", connected=False, silent_s=2.0, alive=False, **{field: 130.0})
    [lost] = decide(100.0, f)
    assert lost.kind is LOST and lost.restart_at == 130.0
    # the supervisor now holds it as lost and due at 130
    held = AgentFacts("node-1", connected=False, silent_s=20.0, lost=True, restart_due_at=130.0)
    assert not needs_probe(held, CFG)
    assert decide(129.9, held) == []
    assert kinds(decide(130.0, held)) == [(RESTART, "node-1")]


def test_the_later_of_agent_down_and_node_down_counts() -> None:
    f = AgentFacts("node-1", connected=False, silent_s=2.0, alive=False, agent_back_at=120.0, node_back_at=140.0)
    [lost] = decide(100.0, f)
    assert lost.restart_at == 140.0


def test_a_lost_agent_heard_again_is_back() -> None:
    f = AgentFacts("node-1", connected=True, silent_s=0.3, lost=True)
    [back] = decide(300.0, f)
    assert (back.kind, back.node, back.reason) == (BACK, "node-1", "agent on node-1 is back")


def test_a_lost_partitioned_agent_still_silent_needs_nothing_more() -> None:
    f = AgentFacts("node-1", connected=True, silent_s=30.0, lost=True)
    assert decide(300.0, f) == []


def test_disconnected_within_the_reconnect_grace_is_nothing() -> None:
    f = AgentFacts("node-0", connected=False, silent_s=0.6)
    assert not needs_probe(f, CFG)
    assert decide(100.0, f) == []
    assert decide(100.0, AgentFacts("node-0", connected=False, silent_s=0.6, alive=False)) == []


def test_a_node_never_connected_is_nothing() -> None:
    assert decide(100.0, AgentFacts("node-2", connected=False, silent_s=0.0)) == []


def test_actions_follow_the_snapshot_order() -> None:
    actions = decide(100.0,
                     AgentFacts("node-0", connected=False, silent_s=3.0, alive=False),
                     AgentFacts("node-1", connected=True, silent_s=0.1),
                     AgentFacts("node-2", connected=True, silent_s=0.1, lost=True))
    assert kinds(actions) == [(LOST, "node-0"), (RESTART, "node-0"), (BACK, "node-2")]


class _Agents:
    """Stands for the runtime's agents: which processes answer, and restarts asked for."""

    def __init__(self, nodes: list[str], dead: set[str]) -> None:
        self.actors = dict.fromkeys(nodes, object())
        self.dead = dead
        self.restarted: list[str] = []

    def alive(self, node: str, timeout_s: float = 2.0) -> bool:
        return node not in self.dead

    def restart(self, node: str) -> str:
        self.restarted.append(node)
        self.dead.discard(node)
        return "127.0.0.1:1"


def test_the_supervisor_records_the_loss_and_restarts_when_due(tmp_path) -> None:  # noqa: ANN001
    import time

    from fleet.controlplane.agent_server import AgentRegistry, AgentSession
    from fleet.controlplane.store import Store
    from fleet.controlplane.agent_supervisor import AgentSupervisor

    now = time.monotonic()
    registry = AgentRegistry()
    for node, heard in (("node-0", now), ("node-1", now - 3.0)):
        registry.attach(AgentSession(f"agent-{node}", node, 1, "127.0.0.1:1", last_heard=heard))
    registry.detach(registry.session("node-1"))
    agents = _Agents(["node-0", "node-1"], dead={"node-1"})
    with Store(f"sqlite:///{tmp_path}/fleet.db") as store:
        job = store.create_job("t", 10, "{}")
        sup = AgentSupervisor(store, job, registry, agents, CFG)  # type: ignore[arg-type]
        sup.agent_down_until("node-1", now + 3600.0)
        assert kinds(sup.check(attempt=1)) == [(LOST, "node-1")]
        assert sup.is_lost("node-1") and agents.restarted == []
        [incident] = store.incidents(job)
        assert (incident.kind, incident.node, incident.rank) == ("agent_loss", "node-1", -1)
        assert incident.evidence.startswith("agent on node-1 is gone (stream closed 3.")
        assert sup.check(attempt=1) == []  # due in an hour: nothing yet, and no second incident
        sup.restored("node-1")  # started again before the next attempt
        assert not sup.is_lost("node-1")
        sup.node_down_until("node-0", now + 60.0)
        assert sup.down_nodes(now) == {"node-0": "node-down fault, back in 60 s"}
        assert len(store.incidents(job)) == 1


def test_the_supervisor_restarts_a_dead_agent_at_once(tmp_path) -> None:  # noqa: ANN001
    import time

    from fleet.controlplane.agent_server import AgentRegistry, AgentSession
    from fleet.controlplane.store import Store
    from fleet.controlplane.agent_supervisor import AgentSupervisor

    registry = AgentRegistry()
    registry.attach(AgentSession("agent-node-1", "node-1", 1, "127.0.0.1:1", last_heard=time.monotonic() - 2.0))
    registry.detach(registry.session("node-1"))
    agents = _Agents(["node-1"], dead={"node-1"})
    with Store(f"sqlite:///{tmp_path}/fleet.db") as store:
        job = store.create_job("t", 10, "{}")
        sup = AgentSupervisor(store, job, registry, agents, CFG)  # type: ignore[arg-type]
        assert kinds(sup.check(attempt=2)) == [(LOST, "node-1"), (RESTART, "node-1")]
        assert agents.restarted == ["node-1"] and not sup.is_lost("node-1")
        assert [(a.kind, a.attempt, a.cause) for a in store.actions(job)] == \
            [("restart_agent", 2, "agent on node-1 restarted")]


def test_the_decision_module_imports_no_store_threads_or_io() -> None:
    """supervision.py is the pure decision: whatever gathers facts or acts on them lives
    in agent_supervisor.py."""
    import ast
    import inspect

    from fleet.controlplane import supervision

    tree = ast.parse(inspect.getsource(supervision))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | \
        {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "enum", "dataclasses"}, imported
    assert not hasattr(supervision, "AgentSupervisor")
