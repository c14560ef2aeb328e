"""Agent supervision: when a node's agent counts as lost, and when it is started again.

``decide_agents(now, snapshot, config)`` is the decision, a pure function of per-node
facts (``AgentFacts``) at ``now`` (monotonic seconds): it returns ``AgentAction``s, each
with the reason that is stored and shown. An agent is lost when it is connected but
silent past the heartbeat timeout (a partition: its process is alive, it is waited for,
never restarted), or disconnected past the reconnect grace with its process dead (it is
started again at once, or once an agent-down or node-down fault's duration is over).
A lost agent heard from again is back. Its ranks keep training meanwhile.

``AgentSupervisor`` carries the bookkeeping between decisions (lost agents, restarts
due, the back-at times of agent-down and node-down faults), gathers the snapshot from
the agent registry and the agents, and carries the actions out against the store.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from fleet.controlplane.errors import FleetError
from fleet.controlplane.runtime import Agents
from fleet.controlplane.store import Store
from fleet.proto.kinds import IncidentKind

log = logging.getLogger(__name__)

#: A disconnected agent whose process is gone is declared lost after this long (a live
#: agent reconnects by itself well within it).
AGENT_RECONNECT_GRACE_S = 1.0


@dataclass(frozen=True)
class SupervisionConfig:
    """``heartbeat_timeout_s``: a connected agent silent this long is lost
    (``controller.heartbeat_timeout_s``); ``reconnect_grace_s``: how long a disconnected
    one gets to reconnect before its process is asked after."""

    heartbeat_timeout_s: float
    reconnect_grace_s: float = AGENT_RECONNECT_GRACE_S


@dataclass(frozen=True)
class AgentFacts:
    """What is known of one node's agent at the time of a decision.

    ``silent_s``: seconds since it was last heard (0 when it never connected);
    ``alive``: whether its process answers, None when nobody asked (it must be asked
    when ``needs_probe``; unknown counts as dead);
    ``restart_due_at``: when a lost dead agent is to be started again (None: not due);
    ``node_back_at`` / ``agent_back_at``: when a node-down / agent-down fault with a
    duration is over (0: none)."""

    node: str
    connected: bool
    silent_s: float
    alive: bool | None = None
    lost: bool = False
    restart_due_at: float | None = None
    node_back_at: float = 0.0
    agent_back_at: float = 0.0


@dataclass(frozen=True)
class AgentSnapshot:
    agents: tuple[AgentFacts, ...]


class AgentActionKind(enum.StrEnum):
    LOST = "lost"        # record an agent_loss incident; restart at ``restart_at`` if set
    RESTART = "restart"  # start the agent again now
    BACK = "back"        # a lost agent is heard again


@dataclass(frozen=True)
class AgentAction:
    kind: AgentActionKind
    node: str
    reason: str
    restart_at: float | None = None  # LOST of a dead agent: when to start it again


def _fresh(f: AgentFacts, config: SupervisionConfig) -> bool:
    return f.connected and f.silent_s < config.heartbeat_timeout_s


def needs_probe(f: AgentFacts, config: SupervisionConfig) -> bool:
    """Whether the decision about ``f`` depends on its process being alive (asking costs
    a round trip to the agent's process, so the supervisor asks only then)."""
    if f.lost or _fresh(f, config):
        return False
    return f.connected or f.silent_s >= config.reconnect_grace_s


def decide_agents(now: float, snapshot: AgentSnapshot, config: SupervisionConfig) -> list[AgentAction]:
    """The actions due at ``now`` (monotonic seconds), in node order of the snapshot."""
    actions: list[AgentAction] = []
    timeout = config.heartbeat_timeout_s
    for f in snapshot.agents:
        if f.lost:
            if _fresh(f, config):
                actions.append(AgentAction(AgentActionKind.BACK, f.node, f"agent on {f.node} is back"))
            elif f.restart_due_at is not None and now >= f.restart_due_at:
                actions.append(AgentAction(AgentActionKind.RESTART, f.node,
                                           f"agent on {f.node} restarted"))
            continue
        if _fresh(f, config) or (not f.connected and f.silent_s < config.reconnect_grace_s):
            continue
        if f.connected or f.alive:
            if f.silent_s < timeout:
                continue
            reason = (f"agent on {f.node} silent for {f.silent_s:.1f} s (heartbeat timeout {timeout:g} s); "
                      "its process is alive: partitioned from the controller")
        else:
            reason = f"agent on {f.node} is gone (stream closed {f.silent_s:.1f} s ago, process dead)"
        if f.alive:  # partitioned: it comes back by itself
            actions.append(AgentAction(AgentActionKind.LOST, f.node, reason))
            continue
        due = max(now, f.node_back_at, f.agent_back_at)
        actions.append(AgentAction(AgentActionKind.LOST, f.node, reason, restart_at=due))
        if now >= due:
            actions.append(AgentAction(AgentActionKind.RESTART, f.node, f"agent on {f.node} restarted"))
    return actions


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
