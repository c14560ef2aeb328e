"""Job, attempt and node state machines.

A job has attempts; an attempt is one worker group with one process group. A node is
healthy (placement may use it) or quarantined (taken out, by an operator or by the
quarantine policy, until released).
Allowed transitions are tables; ``check_transition`` raises ``StateError`` on any other
move, a self-move included. A terminal state (``JobState.terminal``) means no controller
runs the job any more; the one way out of one is a resume of a STOPPED job
(``STOPPED -> RESTARTING``, `fleet up --resume JOB`, ``recovery.take_over``): an operator's
stop is a pause, a SUCCEEDED or FAILED job stays ended. The store calls it on every state change and records the
transition as a row (``transitions`` for jobs and attempts, ``node_transitions`` for
nodes, with who moved the node: a ``NodeActor``).
"""

from __future__ import annotations

import enum

from fleet.controlplane.errors import StateError


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        """No controller runs the job: it ended (a STOPPED one may be resumed, ``resumable``)."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)

    @property
    def resumable(self) -> bool:
        """An ended job that `fleet up --resume` may take up again (STOPPED -> RESTARTING)."""
        return self is JobState.STOPPED


class AttemptState(str, enum.Enum):
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"        # FAILED_ATTEMPT in the design: the job may restart
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.STOPPED)


class NodeState(enum.StrEnum):
    """Whether placement may use a node. A node-down fault or a failed health check is
    not a state: the first is the controller's memory of a timed fault, the second a
    verdict stored next to the state (``nodes.health``)."""

    HEALTHY = "healthy"
    QUARANTINED = "quarantined"


class NodeActor(enum.StrEnum):
    """Who moved a node (``node_transitions.actor``)."""

    OPERATOR = "operator"      # `fleet quarantine` / `fleet release`
    POLICY = "policy"          # the controller's automatic quarantine (``policy.decide_quarantine``)
    CONTROLLER = "controller"  # the controller registered the node (its first row)


_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _J.PENDING: frozenset({_J.PLACING, _J.FAILED, _J.STOPPED}),
    _J.PLACING: frozenset({_J.RUNNING, _J.RESTARTING, _J.FAILED, _J.STOPPED}),
    _J.RUNNING: frozenset({_J.SUCCEEDED, _J.RESTARTING, _J.FAILED, _J.STOPPED}),
    _J.RESTARTING: frozenset({_J.PLACING, _J.FAILED, _J.STOPPED}),
    _J.SUCCEEDED: frozenset(),
    _J.FAILED: frozenset(),
    _J.STOPPED: frozenset({_J.RESTARTING}),  # only a resume (`fleet up --resume`) takes it
}

_A = AttemptState
ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    _A.PLACING: frozenset({_A.RUNNING, _A.FAILED, _A.STOPPED}),
    _A.RUNNING: frozenset({_A.SUCCEEDED, _A.FAILED, _A.STOPPED}),
    _A.SUCCEEDED: frozenset(),
    _A.FAILED: frozenset(),
    _A.STOPPED: frozenset(),
}


_N = NodeState
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _N.HEALTHY: frozenset({_N.QUARANTINED}),
    _N.QUARANTINED: frozenset({_N.HEALTHY}),
}

State = JobState | AttemptState | NodeState
_TABLES: dict[type, dict] = {JobState: JOB_TRANSITIONS, AttemptState: ATTEMPT_TRANSITIONS,
                             NodeState: NODE_TRANSITIONS}


def check_transition(old: State, new: State) -> None:
    """Raise ``StateError`` unless ``old -> new`` is an allowed move of the same machine."""
    table = _TABLES[type(old)]
    if type(new) is not type(old) or new not in table[old]:
        raise StateError(f"illegal transition {old.value} -> {new.value}")
