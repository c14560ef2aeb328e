"""The agent supervisor: applies ``supervision.decide_agents`` to one job's agents.

``AgentSupervisor`` keeps the bookkeeping between decisions (lost agents, restarts due,
the back-at times of agent-down and node-down faults), gathers each decision's snapshot
from the agent registry (who is connected, when last heard) and the agents (whether a
process is alive, asked only when the decision depends on it), and carries the actions
out: a lost agent is an ``agent_loss`` incident in the store, a restart is the agents'
``restart`` and a ``restart_agent`` action. The decision itself stays pure in
``supervision``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from fleet.controlplane.errors import FleetError
from fleet.controlplane.runtime import Agents
from fleet.controlplane.store import Store
from fleet.controlplane.supervision import AgentAction, AgentActionKind, AgentFacts, AgentSnapshot, \
    SupervisionConfig, decide_agents, needs_probe
from fleet.proto.kinds import IncidentKind

log = logging.getLogger(__name__)


class Session(Protocol):
    """An agent's stream as the registry keeps it (``agent_server.AgentSession``)."""

    last_heard: float
    connected: bool


class Sessions(Protocol):
    """The live agent streams (``agent_server.AgentRegistry``)."""

    def session(self, node_name: str) -> Session | None: ...


class AgentSupervisor:
    """Applies ``decide_agents`` to one job's agents; the bookkeeping between ticks.

    ``check`` runs on the controller's thread; the down-time setters are called from the
    chaos scheduler's thread, hence the lock."""

    def __init__(self, store: Store, job_id: str, sessions: Sessions, agents: Agents,
                 config: SupervisionConfig) -> None:
        self._store = store
        self._job_id = job_id
        self._sessions = sessions
        self._agents = agents
        self._config = config
        self._lock = threading.Lock()
        self._lost: set[str] = set()
        self._restart_due: dict[str, float] = {}
        self._node_back_at: dict[str, float] = {}
        self._agent_back_at: dict[str, float] = {}

    def agent_down_until(self, node: str, until: float) -> None:
        """An agent-down fault keeps ``node``'s agent down until ``until`` (monotonic)."""
        with self._lock:
            self._agent_back_at[node] = until

    def node_down_until(self, node: str, until: float) -> None:
        """A node-down fault keeps ``node`` unusable until ``until`` (monotonic)."""
        with self._lock:
            self._node_back_at[node] = until

    def down_nodes(self, now: float) -> dict[str, str]:
        """Nodes a node-down fault still holds down, with why."""
        with self._lock:
            return {n: f"node-down fault, back in {t - now:.0f} s" for n, t in self._node_back_at.items() if t > now}

    def is_lost(self, node: str) -> bool:
        return node in self._lost

    def restored(self, node: str) -> None:
        """``node``'s agent was started again outside ``check`` (before an attempt)."""
        self._lost.discard(node)
        self._restart_due.pop(node, None)

    def snapshot(self, now: float, nodes: Iterable[str]) -> AgentSnapshot:
        """The facts of ``nodes`` at ``now``; a process is asked after only when it matters."""
        facts = []
        with self._lock:
            back = {n: (self._node_back_at.get(n, 0.0), self._agent_back_at.get(n, 0.0)) for n in nodes}
        for node, (node_back, agent_back) in back.items():
            session = self._sessions.session(node)
            f = AgentFacts(node=node, connected=session is not None and session.connected,
                           silent_s=now - session.last_heard if session is not None else 0.0,
                           lost=node in self._lost, restart_due_at=self._restart_due.get(node),
                           node_back_at=node_back, agent_back_at=agent_back)
            if needs_probe(f, self._config):
                f = dataclasses.replace(f, alive=self._agents.alive(node))
            facts.append(f)
        return AgentSnapshot(tuple(facts))

    def check(self, attempt: int) -> list[AgentAction]:
        """Decide about every agent now and carry the actions out; returns them."""
        now = time.monotonic()
        actions = decide_agents(now, self.snapshot(now, list(self._agents.actors)), self._config)
        for a in actions:
            if a.kind is AgentActionKind.BACK:
                self._lost.discard(a.node)
                log.info("%s", a.reason)
            elif a.kind is AgentActionKind.LOST:
                self._lost.add(a.node)
                self._store.record_incident(self._job_id, attempt, IncidentKind.AGENT_LOSS.value, "heartbeat",
                                            a.reason, rank=-1, node=a.node)
                log.warning("%s", a.reason)
                if a.restart_at is not None:
                    self._restart_due[a.node] = a.restart_at
                    with self._lock:  # an agent-down's duration counts once
                        self._agent_back_at.pop(a.node, None)
            else:
                self._restart(a, attempt)
        return actions

    def _restart(self, action: AgentAction, attempt: int) -> None:
        try:
            self._agents.restart(action.node)
        except FleetError as exc:
            log.error("%s", exc)  # still lost and due: tried again at the next check
            return
        self.restored(action.node)
        self._store.record_action(self._job_id, attempt, "restart_agent", action.reason)
        log.warning("%s", action.reason)
