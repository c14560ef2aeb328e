"""Detector actions (observe, restart, quarantine) and the phase-aware hang threshold:
pure functions, literal inputs and timestamps."""

from __future__ import annotations

import pytest

from fleet.controlplane.detectors import DETECTOR_KINDS, DetectorAction, Incident, decide_hang, decide_response, \
    phase_hang_threshold
from fleet.controlplane.policy import QuarantineDecision
from fleet.proto.kinds import IncidentKind

pytestmark = pytest.mark.timeout(30)

HANG = Incident(IncidentKind.HANG, "hang", 1, "node-1", "no rank finished a step for 12.0 s")
STRAGGLER = Incident(IncidentKind.STRAGGLER, "straggler", 2, "node-2", "rank 2 entered collectives last")
SPIKE = Incident(IncidentKind.LOSS_SPIKE, "loss", -1, "", "loss 9 at step 40 is 9x the median")
NOT_YET = QuarantineDecision(False, "1 of 2 incidents on node-1 in 3600 s")
WOULD = QuarantineDecision(True, "2 incidents on node-1 within 3600 s (policy: 2)")


# -- observe ----------------------------------------------------------------------------

def test_observe_decides_no_restart_and_no_quarantine_and_says_what_restart_would_do() -> None:
    r = decide_response(HANG, DetectorAction.OBSERVE, 0, 3, NOT_YET)
    assert (r.observed, r.ends_attempt, r.quarantine_now) == (True, False, False)
    assert r.reason == "would restart the attempt (restart 1 of 3)"


def test_observe_says_it_would_quarantine_the_node_the_policy_would() -> None:
    r = decide_response(HANG, DetectorAction.OBSERVE, 1, 3, WOULD)
    assert (r.observed, r.ends_attempt, r.quarantine_now) == (True, False, False)
    assert r.reason == ("would quarantine node-1 (2 incidents on node-1 within 3600 s (policy: 2)) and "
                        "restart the attempt (restart 2 of 3)")


def test_observe_with_the_restart_budget_spent_says_it_would_end_the_job() -> None:
    assert decide_response(HANG, DetectorAction.OBSERVE, 3, 3, NOT_YET).reason == \
        "would end the job (all 3 restarts used)"


def test_observed_side_incident_would_only_be_recorded() -> None:
    r = decide_response(STRAGGLER, DetectorAction.OBSERVE, 0, 3, NOT_YET)
    assert (r.observed, r.ends_attempt) == (True, False)
    assert r.reason == "would record it and go on (1 of 2 incidents on node-1 in 3600 s)"
    assert decide_response(SPIKE, DetectorAction.OBSERVE, 0, 3, QuarantineDecision(False, "no node named")
                           ).reason == "would record it and go on"


# -- restart (the default) and quarantine ---------------------------------------------------

def test_restart_is_the_kinds_usual_course() -> None:
    hang = decide_response(HANG, DetectorAction.RESTART, 0, 3, QuarantineDecision(False, ""))
    assert (hang.observed, hang.ends_attempt, hang.quarantine_now) == (False, True, False)
    side = decide_response(STRAGGLER, DetectorAction.RESTART, 0, 3, QuarantineDecision(False, ""))
    assert (side.observed, side.ends_attempt, side.quarantine_now) == (False, False, False)


def test_quarantine_takes_the_node_out_at_once_and_ends_the_attempt() -> None:
    for incident in (HANG, STRAGGLER):
        r = decide_response(incident, DetectorAction.QUARANTINE, 0, 3, QuarantineDecision(False, ""))
        assert (r.observed, r.ends_attempt, r.quarantine_now) == (False, True, True)
        assert f"detect.{incident.kind}.action is quarantine" in r.reason


def test_quarantine_without_a_node_is_restart() -> None:
    nameless = Incident(IncidentKind.HANG, "hang", -1, "", "unconfirmed: no rank stands out")
    r = decide_response(nameless, DetectorAction.QUARANTINE, 0, 3, QuarantineDecision(False, ""))
    assert (r.quarantine_now, r.ends_attempt) == (False, True)


def test_detector_kinds_are_the_ones_raised_while_an_attempt_runs() -> None:
    assert set(DETECTOR_KINDS) == set(IncidentKind) - {
        IncidentKind.CRASH, IncidentKind.ERROR, IncidentKind.NODE_LOSS, IncidentKind.CONTROLLER_CRASH}


# -- phases -----------------------------------------------------------------------------

TIMEOUTS = {"checkpointing": 600.0, "eval": 300.0}


def test_outside_a_named_phase_the_step_threshold_applies() -> None:
    assert phase_hang_threshold(6.0, {}, TIMEOUTS) == (6.0, "")
    assert phase_hang_threshold(6.0, {0: "", 1: ""}, TIMEOUTS) == (6.0, "")
    assert phase_hang_threshold(6.0, {0: "data"}, TIMEOUTS) == (6.0, "")  # a phase without a timeout


def test_one_rank_checkpointing_holds_the_threshold_for_all() -> None:
    threshold, note = phase_hang_threshold(6.0, {0: "checkpointing", 1: ""}, TIMEOUTS)
    assert threshold == 600.0
    assert note == "rank 0 is in phase 'checkpointing' (detect.phase_timeouts_s.checkpointing: 600 s)"


def test_the_longest_phase_timeout_wins_and_never_shortens_the_threshold() -> None:
    assert phase_hang_threshold(6.0, {0: "eval", 1: "checkpointing"}, TIMEOUTS)[0] == 600.0
    assert phase_hang_threshold(900.0, {0: "checkpointing"}, TIMEOUTS) == (900.0, "")


def test_a_long_checkpoint_is_no_hang_until_its_phase_timeout_passes() -> None:
    """Rank 0 sits in a synchronous checkpoint; rank 1 waits for it in the next all-reduce."""
    last_step_end, step_threshold = 1_000.0, 6.0
    threshold, note = phase_hang_threshold(step_threshold, {0: "checkpointing"}, TIMEOUTS)
    progress = {0: (40, 30.0), 1: (40, 30.0)}
    nodes = ["node-0", "node-1"]
    at = last_step_end + 30.0  # far past the step threshold, inside the checkpoint's
    assert decide_hang(at - last_step_end, threshold, 10.0, "hang", [0], "rank 1 waits for rank 0",
                       progress, nodes) is None
    at = last_step_end + 601.0
    hang = decide_hang(at - last_step_end, threshold, 10.0, "hang", [0], "rank 1 waits for rank 0",
                       progress, nodes, f"no rank finished a step for 601.0 s (hang threshold 600.0 s: {note})")
    assert hang is not None and (hang.kind, hang.rank, hang.node) == (IncidentKind.HANG, 0, "node-0")
    assert "phase 'checkpointing'" in hang.evidence
