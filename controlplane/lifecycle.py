"""Job and attempt state machines.

A job has attempts; an attempt is one worker group with one process group.
Allowed transitions are tables; ``check_transition`` raises ``StateError`` on any other
move. The store calls it on every state change and records the transition as a row.
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
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


class AttemptState(str, enum.Enum):
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"        # FAILED_ATTEMPT in the design: the job may restart
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (AttemptState.SUCCEEDED, AttemptState.FAILED, AttemptState.STOPPED)


_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _J.PENDING: frozenset({_J.PLACING, _J.FAILED, _J.STOPPED}),
    _J.PLACING: frozenset({_J.RUNNING, _J.RESTARTING, _J.FAILED, _J.STOPPED}),
    _J.RUNNING: frozenset({_J.SUCCEEDED, _J.RESTARTING, _J.FAILED, _J.STOPPED}),
    _J.RESTARTING: frozenset({_J.PLACING, _J.FAILED, _J.STOPPED}),
    _J.SUCCEEDED: frozenset(),
    _J.FAILED: frozenset(),
    _J.STOPPED: frozenset(),
}

_A = AttemptState
ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    _A.PLACING: frozenset({_A.RUNNING, _A.FAILED, _A.STOPPED}),
    _A.RUNNING: frozenset({_A.SUCCEEDED, _A.FAILED, _A.STOPPED}),
    _A.SUCCEEDED: frozenset(),
    _A.FAILED: frozenset(),
    _A.STOPPED: frozenset(),
}


def check_transition(old: JobState | AttemptState, new: JobState | AttemptState) -> None:
    """Raise ``StateError`` unless ``old -> new`` is an allowed move of the same machine."""
    table = JOB_TRANSITIONS if isinstance(old, JobState) else ATTEMPT_TRANSITIONS
    if type(new) is not type(old) or new not in table[old]:
        raise StateError(f"illegal transition {old.value} -> {new.value}")
