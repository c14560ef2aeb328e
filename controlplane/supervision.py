"""Agent supervision: when a node's agent counts as lost, and when it is started again.

``decide_agents(now, snapshot, config)`` is the decision, a pure function of per-node
facts (``AgentFacts``) at ``now`` (monotonic seconds): it returns ``AgentAction``s, each
with the reason that is stored and shown. An agent is lost when it is connected but
silent past the heartbeat timeout (a partition: its process is alive, it is waited for,
never restarted), or disconnected past the reconnect grace with its process dead (it is
started again at once, or once an agent-down or node-down fault's duration is over).
A lost agent heard from again is back. Its ranks keep training meanwhile.

This module is the decision only: no store, no threads, no I/O. ``agent_supervisor``
(``AgentSupervisor``) keeps the bookkeeping between decisions, gathers the snapshot and
carries the actions out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
