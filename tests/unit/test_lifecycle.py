"""Job, attempt and node state machines: the full cross-product of moves against the tables."""

from __future__ import annotations

import itertools

import pytest

from fleet.controlplane.errors import FleetError, StateError
from fleet.controlplane.lifecycle import (
    ATTEMPT_TRANSITIONS,
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    AttemptState,
    JobState,
    NodeActor,
    NodeState,
    check_transition,
)

pytestmark = pytest.mark.timeout(30)

J, A = JobState, AttemptState

#: The design, written out independently of the tables in lifecycle.py.
EXPECTED_JOB = {
    (J.PENDING, J.PLACING), (J.PENDING, J.FAILED), (J.PENDING, J.STOPPED),
    (J.PLACING, J.RUNNING), (J.PLACING, J.RESTARTING), (J.PLACING, J.FAILED), (J.PLACING, J.STOPPED),
    (J.RUNNING, J.SUCCEEDED), (J.RUNNING, J.RESTARTING), (J.RUNNING, J.FAILED), (J.RUNNING, J.STOPPED),
    (J.RESTARTING, J.PLACING), (J.RESTARTING, J.FAILED), (J.RESTARTING, J.STOPPED),
    (J.STOPPED, J.RESTARTING),  # a resume (`fleet up --resume`) of a stopped job
}
EXPECTED_ATTEMPT = {
    (A.PLACING, A.RUNNING), (A.PLACING, A.FAILED), (A.PLACING, A.STOPPED),
    (A.RUNNING, A.SUCCEEDED), (A.RUNNING, A.FAILED), (A.RUNNING, A.STOPPED),
}


def _allowed(table) -> set:
    return {(old, new) for old, news in table.items() for new in news}


def test_tables_cover_every_state() -> None:
    assert set(JOB_TRANSITIONS) == set(JobState)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptState)


def test_tables_match_the_design() -> None:
    assert _allowed(JOB_TRANSITIONS) == EXPECTED_JOB
    assert _allowed(ATTEMPT_TRANSITIONS) == EXPECTED_ATTEMPT


@pytest.mark.parametrize("old, new", sorted(EXPECTED_JOB | EXPECTED_ATTEMPT, key=str))
def test_allowed_transition_passes(old, new) -> None:
    assert check_transition(old, new) is None


_JOB_PAIRS = list(itertools.product(JobState, JobState))
_ATTEMPT_PAIRS = list(itertools.product(AttemptState, AttemptState))


@pytest.mark.parametrize(
    "old, new",
    [p for p in _JOB_PAIRS if p not in EXPECTED_JOB] + [p for p in _ATTEMPT_PAIRS if p not in EXPECTED_ATTEMPT],
)
def test_disallowed_transition_raises(old, new) -> None:
    with pytest.raises(StateError) as info:
        check_transition(old, new)
    assert f"{old.value} -> {new.value}" in str(info.value)


def test_self_transitions_are_illegal() -> None:
    for s in [*JobState, *AttemptState]:
        with pytest.raises(StateError):
            check_transition(s, s)


@pytest.mark.parametrize("state", [*JobState, *AttemptState])
def test_terminal_states_have_no_exits_but_a_stopped_jobs_resume(state) -> None:
    table = JOB_TRANSITIONS if isinstance(state, JobState) else ATTEMPT_TRANSITIONS
    if state is J.STOPPED:  # ended (no controller runs it), yet a resume may take it up again
        assert state.terminal and state.resumable and table[state] == {J.RESTARTING}
    else:
        assert state.terminal == (not table[state])
        assert not getattr(state, "resumable", False)


@pytest.mark.parametrize("state", [J.SUCCEEDED, J.FAILED])
def test_a_succeeded_or_failed_job_is_not_resumable(state) -> None:
    assert state.terminal and not state.resumable
    with pytest.raises(StateError, match=f"{state.value} -> RESTARTING"):
        check_transition(state, J.RESTARTING)
    with pytest.raises(StateError, match="STOPPED -> RUNNING"):  # a resume goes through RESTARTING
        check_transition(J.STOPPED, J.RUNNING)
    if state.terminal:
        for new in type(state):
            with pytest.raises(StateError):
                check_transition(state, new)


def test_terminal_sets() -> None:
    assert {s for s in JobState if s.terminal} == {J.SUCCEEDED, J.FAILED, J.STOPPED}
    assert {s for s in AttemptState if s.terminal} == {A.SUCCEEDED, A.FAILED, A.STOPPED}


@pytest.mark.parametrize("old, new", [*itertools.product(JobState, AttemptState), *itertools.product(AttemptState, JobState)])
def test_mixing_job_and_attempt_states_raises(old, new) -> None:
    # same-named members (RUNNING, FAILED, ...) are equal as strings but not as states
    with pytest.raises(StateError):
        check_transition(old, new)


def test_state_error_is_a_fleet_error_with_its_exit_code() -> None:
    with pytest.raises(FleetError) as info:
        check_transition(J.SUCCEEDED, J.RUNNING)
    assert isinstance(info.value, StateError)
    assert info.value.exit_code == 4


# -- nodes ------------------------------------------------------------------------------------

N = NodeState
EXPECTED_NODE = {(N.HEALTHY, N.QUARANTINED), (N.QUARANTINED, N.HEALTHY)}


def test_node_table_matches_the_design() -> None:
    assert set(NODE_TRANSITIONS) == set(NodeState) == {N.HEALTHY, N.QUARANTINED}
    assert _allowed(NODE_TRANSITIONS) == EXPECTED_NODE
    # what the store and `fleet nodes --json` show
    assert [s.value for s in NodeState] == ["healthy", "quarantined"]
    assert [a.value for a in NodeActor] == ["operator", "policy", "controller"]


@pytest.mark.parametrize("old, new", sorted(EXPECTED_NODE, key=str))
def test_allowed_node_transition_passes(old, new) -> None:
    assert check_transition(old, new) is None


@pytest.mark.parametrize("state", list(NodeState))
def test_node_self_transition_raises(state) -> None:
    with pytest.raises(StateError, match=f"{state.value} -> {state.value}"):
        check_transition(state, state)


@pytest.mark.parametrize("old, new", [*itertools.product(NodeState, [*JobState, *AttemptState]),
                                      *itertools.product([*JobState, *AttemptState], NodeState)])
def test_mixing_node_and_job_or_attempt_states_raises(old, new) -> None:
    with pytest.raises(StateError):
        check_transition(old, new)
