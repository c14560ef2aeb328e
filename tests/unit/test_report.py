"""`fleet report`'s arithmetic on literal records (no store)."""

from __future__ import annotations

import pytest

from fleet.controlplane.cli.render import exit_text
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.report import job_report, stopped_spans
from fleet.controlplane.store import (
    ActionRecord,
    AttemptRecord,
    CheckpointRecord,
    IncidentRecord,
    JobRecord,
    NodeRecord,
    StepRecord,
    TransitionRecord,
)
from fleet.proto.kinds import IncidentKind


def _step(attempt: int, step: int, end_s: float, rank: int = 0, dur: float = 1.0) -> StepRecord:
    return StepRecord(job_id="j", attempt=attempt, rank=rank, step=step, loss=1.0, step_time_s=dur,
                      tokens_per_s=1.0, end_ns=int(end_s * 1e9))


def test_a_crash_at_step_15_restored_from_10() -> None:
    job = JobRecord(id="j", name="demo", state=JobState.SUCCEEDED, total_steps=30, steps_completed=30,
                    attempts=2, created_at=1000.0, ended_at=1100.0, reason="", config_json="{}")
    attempts = [AttemptRecord("j", 1, AttemptState.FAILED, 1000.5, 1018.0, 0, 15, "crash"),
                AttemptRecord("j", 2, AttemptState.SUCCEEDED, 1018.5, 1041.0, 10, 30, "")]
    steps = [_step(1, k, 1002 + k) for k in range(1, 16)]          # steps 1..15, 1 s each
    steps += [_step(1, 3, 1005.5, rank=1, dur=1.5)]                 # rank 1 was slower on step 3
    steps += [_step(2, k, 1010 + k) for k in range(11, 31)]         # steps 11..30 again from 10
    incidents = [IncidentRecord(1, "j", 1, "crash", 0, "node-0", "crash", "rank 0 died", 1018.0)]
    actions = [ActionRecord(1, "j", 1, "restart", "crash of rank 0", 1018.0),
               ActionRecord(2, "j", 1, "quarantine", "2 incidents on node-0", 1018.1)]
    ckpts = [CheckpointRecord("j", 1, 10, "/c/10", "x", 0.5, True, 1013.0),
             CheckpointRecord("j", 2, 20, "/c/20", "y", 0.5, True, 1031.0)]
    nodes = [NodeRecord("node-0", "r0", "h", "{}", "quarantined", "2 incidents", 1018.1, 1100.0),
             NodeRecord("node-1", "r1", "h", "{}", "quarantined", "old", 900.0, 1100.0)]
    out = job_report(job, attempts, steps, incidents, actions, ckpts, nodes, now=2000.0)
    # kept: attempt 1's steps 1..10 (step 3 took 1.5 s on rank 1) and attempt 2's 11..30
    assert out["productive_s"] == 30.5 and out["wall_s"] == 100.0 and out["ettr"] == 0.305
    assert out["lost_s"] == {"startup_s": 2.0, "detection_s": 1.0, "restart_s": 2.0,
                             "recomputed_s": 5.0, "checkpointing_s": 1.0, "other_s": 58.5}
    (inc,) = out["incidents"]
    assert (inc["kind"], inc["rank"], inc["node"], inc["detected_after_s"], inc["recovery_s"]) == \
        ("crash", 0, "node-0", 1.0, 3.0)
    assert (out["state"], out["final_step"], out["attempts"], out["restarts"]) == ("SUCCEEDED", 30, 2, 1)
    assert out["quarantined_nodes"] == ["node-0"]  # node-1 was quarantined before this job
    assert out["quarantines"] == ["2 incidents on node-0"]


def _moves(*moves: tuple[str | None, str, float]) -> list[TransitionRecord]:
    return [TransitionRecord("j", None, "job", old, new, "", at) for old, new, at in moves]


def test_a_stop_and_resume_is_not_lost_time() -> None:
    """Attempt 1 trains steps 1..20 and is stopped at 1023; the job sits STOPPED until an
    operator resumes it at 5023; attempt 2 restores step 20 and trains 21..30."""
    job = JobRecord(id="j", name="demo", state=JobState.SUCCEEDED, total_steps=30, steps_completed=30,
                    attempts=2, created_at=1000.0, ended_at=5046.0, reason="", config_json="{}")
    attempts = [AttemptRecord("j", 1, AttemptState.STOPPED, 1000.5, 1022.5, 0, 20, "stopped by operator"),
                AttemptRecord("j", 2, AttemptState.SUCCEEDED, 5030.0, 5045.5, 20, 30, "")]
    steps = [_step(1, k, 1002 + k) for k in range(1, 21)] + [_step(2, k, 5015 + k) for k in range(21, 31)]
    transitions = _moves((None, "PENDING", 1000.0), ("PENDING", "PLACING", 1000.1), ("PLACING", "RUNNING", 1001.0),
                         ("RUNNING", "STOPPED", 1023.0), ("STOPPED", "RESTARTING", 5023.0),
                         ("RESTARTING", "PLACING", 5029.0), ("PLACING", "RUNNING", 5031.0),
                         ("RUNNING", "SUCCEEDED", 5046.0))
    actions = [ActionRecord(1, "j", 1, "stop", "stopped by operator bob@vm", 1020.0),
               ActionRecord(2, "j", 1, "resume", "resumed by operator bob@vm after a stop", 5023.0)]
    ckpts = [CheckpointRecord("j", 1, 20, "/c/20", "x", 0.5, True, 1022.0)]
    out = job_report(job, attempts, steps, [], actions, ckpts, [], now=6000.0, transitions=transitions)
    # wall: 5046 - 1000 less the 4000 s stopped; the resume's start-up (5023 -> step 21's start at
    # 5035) is lost time like the job's first (1000 -> 1002)
    assert (out["wall_s"], out["stopped_s"], out["productive_s"], out["ettr"]) == (46.0, 4000.0, 30.0, 0.6522)
    assert out["lost_s"] == {"startup_s": 14.0, "detection_s": 0.0, "restart_s": 0.0, "recomputed_s": 0.0,
                             "checkpointing_s": 0.5, "other_s": 1.5}
    assert (out["restarts"], out["incidents"], out["steps_lost"]) == (0, [], 0)
    # without the transitions (an older caller) the pause is wall time, as before
    plain = job_report(job, attempts, steps, [], actions, ckpts, [], now=6000.0)
    assert (plain["wall_s"], plain["stopped_s"], plain["lost_s"]["startup_s"]) == (4046.0, 0.0, 2.0)


def test_stopped_spans_pair_each_stop_with_its_resume() -> None:
    moves = _moves((None, "PENDING", 0.0), ("RUNNING", "STOPPED", 10.0), ("STOPPED", "RESTARTING", 50.0),
                   ("RESTARTING", "STOPPED", 51.0), ("STOPPED", "RESTARTING", 60.0), ("RUNNING", "STOPPED", 70.0))
    moves.insert(2, TransitionRecord("j", 1, "attempt", "RUNNING", "STOPPED", "", 9.5))  # attempts do not count
    assert stopped_spans(moves) == [(10.0, 50.0), (51.0, 60.0)]  # the last stop was never resumed
    assert stopped_spans(list(reversed(moves))) == [(10.0, 50.0), (51.0, 60.0)]  # ordered by time


def test_a_running_job_with_no_steps_yet() -> None:
    job = JobRecord(id="j", name="demo", state=JobState.PLACING, total_steps=30, steps_completed=0,
                    attempts=0, created_at=1000.0, ended_at=None, reason="", config_json="{}")
    out = job_report(job, [], [], [], [], [], [], now=1010.0)
    assert out["ettr"] == 0.0 and out["wall_s"] == 10.0 and out["incidents"] == []
    assert out["lost_s"]["other_s"] == 10.0


def test_an_attempt_that_fails_before_its_first_step() -> None:
    job = JobRecord(id="j", name="demo", state=JobState.SUCCEEDED, total_steps=5, steps_completed=5,
                    attempts=3, created_at=0.0, ended_at=40.0, reason="", config_json="{}")
    attempts = [AttemptRecord("j", 1, AttemptState.FAILED, 0.5, 10.0, 0, 3, ""),
                AttemptRecord("j", 2, AttemptState.FAILED, 12.0, 14.0, 0, 0, ""),
                AttemptRecord("j", 3, AttemptState.SUCCEEDED, 16.0, 40.0, 0, 5, "")]
    steps = [_step(1, k, 1 + k) for k in (1, 2, 3)] + [_step(3, k, 19 + k) for k in range(1, 6)]
    incidents = [IncidentRecord(1, "j", 1, "crash", 0, "n0", "crash", "", 10.0),
                 IncidentRecord(2, "j", 2, "crash", 0, "n0", "crash", "", 15.0)]
    out = job_report(job, attempts, steps, incidents, [], [], [], now=40.0)
    first, second = out["incidents"]
    assert (first["detected_after_s"], first["recovery_s"]) == (6.0, 10.0)   # step 1 of attempt 3 ends at 20
    assert (second["detected_after_s"], second["recovery_s"]) == (3.0, 5.0)  # attempt 2 started at 12
    # restart: 10 -> 15 (the next incident takes over), then 15 -> 19; never counted twice
    assert out["lost_s"]["restart_s"] == 9.0 and out["lost_s"]["recomputed_s"] == 3.0


def test_recovery_phases_attach_to_the_incident_that_ended_the_attempt() -> None:
    from fleet.controlplane.store import RecoveryRecord

    job = JobRecord(id="j", name="demo", state=JobState.SUCCEEDED, total_steps=20, steps_completed=20,
                    attempts=2, created_at=1000.0, ended_at=1030.0, reason="", config_json="{}")
    attempts = [AttemptRecord("j", 1, AttemptState.FAILED, 1000.0, 1011.0, 0, 10, "crash"),
                AttemptRecord("j", 2, AttemptState.SUCCEEDED, 1011.0, 1030.0, 9, 20, "")]
    steps = [_step(1, k, 1000 + k) for k in range(1, 11)] + [_step(2, k, 1003 + k) for k in range(10, 21)]
    incidents = [IncidentRecord(1, "j", 1, "agent_loss", -1, "node-1", "heartbeat", "agent gone", 1005.0),
                 IncidentRecord(2, "j", 1, "crash", 1, "node-0", "crash", "rank 1 died", 1010.5)]
    rec = RecoveryRecord("j", 2, 1, 2, 1010.0, 0.5, 0.1, 0.05, 0.2, 0.3, 0.35, 1.5, 9, 1, "memory", 3)
    out = job_report(job, attempts, steps, incidents, [], [], [], now=1030.0, recoveries=[rec])
    side, ended = out["incidents"]
    assert (side["kind"], side["ended_attempt"], side["recovery_s"]) == ("agent_loss", False, None)
    assert ended["ended_attempt"] and ended["detected_after_s"] == 0.5
    assert ended["phases"] == {"detect": 0.5, "teardown": 0.1, "place": 0.05, "pg_init": 0.2,
                               "restore": 0.3, "first_step": 0.35}
    assert (ended["restored_step"], ended["restored_from"], ended["steps_lost"], ended["reused_workers"]) == \
        (9, "memory", 1, 3)
    assert out["steps_lost"] == 1 and out["lost_s"]["detection_s"] == 0.5


@pytest.mark.parametrize("later", list(IncidentKind))
def test_only_a_kind_that_ends_attempts_takes_over_as_the_cause(later: IncidentKind) -> None:
    job = JobRecord(id="j", name="demo", state=JobState.FAILED, total_steps=20, steps_completed=5,
                    attempts=1, created_at=1000.0, ended_at=1020.0, reason="", config_json="{}")
    attempts = [AttemptRecord("j", 1, AttemptState.FAILED, 1000.0, 1020.0, 0, 5, "crash")]
    steps = [_step(1, k, 1000 + k) for k in range(1, 6)]
    incidents = [IncidentRecord(1, "j", 1, IncidentKind.CRASH, 0, "node-0", "crash", "rank 0 died", 1010.0),
                 IncidentRecord(2, "j", 1, later, 1, "node-1", "d", "later", 1012.0)]
    out = job_report(job, attempts, steps, incidents, [], [], [], now=1020.0)
    ended = [i["kind"] for i in out["incidents"] if i["ended_attempt"]]
    assert ended == [later if later.ends_attempt else IncidentKind.CRASH]


def test_incidents_carry_detection_from_the_last_progress_exit_code_and_traceback() -> None:
    job = JobRecord(id="j", name="demo", state=JobState.RUNNING, total_steps=20, steps_completed=8,
                    attempts=2, created_at=1000.0, ended_at=None, reason="", config_json="{}")
    attempts = [AttemptRecord("j", 1, AttemptState.FAILED, 1000.0, 1010.0, 0, 5, "rank 1 exited"),
                AttemptRecord("j", 2, AttemptState.RUNNING, 1012.0, None, 4, None, "")]
    steps = [_step(1, k, 1000 + k) for k in range(1, 6)] + [_step(2, k, 1010 + k) for k in range(5, 9)]
    incidents = [IncidentRecord(1, "j", 1, IncidentKind.STRAGGLER, 0, "n0", "straggler", "slow", 1003.5),
                 IncidentRecord(2, "j", 1, IncidentKind.CRASH, 1, "n1", "crash", "rank 1 exited", 1009.0,
                                traceback="ValueError: bad batch\n", exit_code=1)]
    out = job_report(job, attempts, steps, incidents, [], [], [], now=1020.0, progress={1: 1003.0, 2: 1005.0})
    side, crash = out["incidents"]
    assert (side["detected_at"], side["detected_after_s"], side["exit_code"], side["traceback"]) == (
        1003.5, 0.5, None, "")
    assert (crash["detected_at"], crash["detected_after_s"], crash["exit_code"], crash["traceback"]) == (
        1009.0, 4.0, 1, "ValueError: bad batch\n")
    assert (crash["recovery_s"], crash["next_attempt_after_s"]) == (6.0, 3.0)  # step 5 of attempt 2 ends at 1015
    assert out["ettr"] == round(out["productive_s"] / 20.0, 4)
    assert out["attempts_detail"] == [
        {"number": 1, "state": "FAILED", "started_at": 1000.0, "ended_at": 1010.0, "wall_s": 10.0,
         "reason": "rank 1 exited"},
        {"number": 2, "state": "RUNNING", "started_at": 1012.0, "ended_at": None, "wall_s": 8.0, "reason": ""}]
    # an attempt with no progress before the incident: null, not the attempt's start
    none_seen = job_report(job, attempts, steps, incidents, [], [], [], now=1020.0, progress={1: None})
    assert [i["detected_after_s"] for i in none_seen["incidents"]] == [None, None]


def test_a_job_without_the_step_api_has_no_ettr_and_wall_time_by_attempt() -> None:
    job = JobRecord(id="j", name="script", state=JobState.SUCCEEDED, total_steps=0, steps_completed=0,
                    attempts=2, created_at=1000.0, ended_at=1030.0, reason="", config_json="{}")
    attempts = [AttemptRecord("j", 1, AttemptState.FAILED, 1001.0, 1010.0, 0, None, "rank 0 was killed"),
                AttemptRecord("j", 2, AttemptState.SUCCEEDED, 1011.5, 1030.0, 0, None, "")]
    incidents = [IncidentRecord(1, "j", 1, IncidentKind.CRASH, 0, "n0", "crash", "rank 0 was killed", 1009.5,
                                exit_code=-9)]
    out = job_report(job, attempts, [], incidents, [], [], [], now=1040.0, progress={1: 1008.0})
    assert out["ettr"] is None and out["productive_s"] == 0.0 and out["wall_s"] == 30.0
    assert [(a["number"], a["wall_s"]) for a in out["attempts_detail"]] == [(1, 9.0), (2, 18.5)]
    (crash,) = out["incidents"]
    assert (crash["exit_code"], crash["detected_after_s"], crash["recovery_s"], crash["next_attempt_after_s"]) == (
        -9, 1.5, None, 2.0)


@pytest.mark.parametrize("code, text", [
    (None, ""), (0, "exit code 0"), (1, "exit code 1"), (-9, "killed by signal 9 (SIGKILL)"),
    (-15, "killed by signal 15 (SIGTERM)"), (-200, "killed by signal 200"),
])
def test_exit_status_text(code: int | None, text: str) -> None:
    assert exit_text(code) == text
