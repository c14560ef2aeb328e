"""`fleet up --resume` of a STOPPED job (``recovery.take_over``) against a real SQLite store:
the rows it writes (a resume action, the STOPPED -> RESTARTING transition, no incident, no
restart, no failed attempt), its refusals (ended jobs, a controller still running, a config
that cannot continue the job) and which of the config's faults fire again
(``faults_after``); `fleet status`'s ETTR agrees with `fleet report`'s across the pause."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.controlplane import auth
from fleet.controlplane.auth import operator
from fleet.controlplane.chaos import FaultOrder
from fleet.controlplane.errors import ConfigError, StateError
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.recovery import faults_after, take_over
from fleet.controlplane.report import load_report
from fleet.controlplane.status import ettr_so_far
from fleet.controlplane.store import Store
from fleet.proto import events_pb2 as pb

pytestmark = pytest.mark.timeout(60)

S = 1_000_000_000
STOP_STEP = 12


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path}/fleet.db") as s:
        yield s


def _stopped_job(store: Store, ckpt_dir: Path, total_steps: int = 50) -> str:
    """A job whose attempt 1 trained steps 1..12 on two ranks and was stopped by an operator
    with a checkpoint of step 12 (as `fleet stop` leaves it)."""
    job = store.create_job("resume-demo", total_steps=total_steps, config_json="{}")
    store.set_job_state(job, JobState.PLACING, "placing")
    store.create_attempt(job)
    store.set_attempt_state(job, 1, AttemptState.RUNNING)
    store.set_job_state(job, JobState.RUNNING, "attempt 1 running")
    t0 = time.time() - 20
    events = [pb.Event(step=pb.StepEvent(job_id=job, attempt=1, rank=r, step=k, loss=1.0, step_time_s=0.5,
                                         end_ns=int((t0 + k) * S))) for k in range(1, STOP_STEP + 1) for r in (0, 1)]
    events.append(pb.Event(checkpoint=pb.CheckpointEvent(
        job_id=job, attempt=1, rank=0, step=STOP_STEP, path=str(ckpt_dir / job / f"step-{STOP_STEP}"),
        manifest_sha256="ab", save_s=0.1, time_ns=int((t0 + STOP_STEP) * S))))
    assert store.record_batch("agent-node-0", 1, 1, events)
    store.record_action(job, 1, "stop", "stopped by operator bob@vm: maintenance")
    reason = f"stopped by operator bob@vm: maintenance; checkpoint at step {STOP_STEP}"
    store.set_attempt_final_step(job, 1, STOP_STEP)
    store.set_attempt_state(job, 1, AttemptState.STOPPED, reason)
    store.set_job_state(job, JobState.STOPPED, reason)
    return job


def test_resuming_a_stopped_job_writes_a_resume_not_a_recovery(store: Store, tmp_path: Path) -> None:
    job = _stopped_job(store, tmp_path / "ckpt")
    took = take_over(store, tmp_path / "state", job, checkpoint_dir=tmp_path / "ckpt" / job, steps=50,
                     by="alice@host")
    # not a failure recovery: no restart counted, no recovery timed; it restores the stop's step
    assert (took.recovery, took.restarts, took.resumed_at) == (None, 0, STOP_STEP)
    record = store.get_job(job)
    assert (record.state, record.reason, record.ended_at, record.total_steps) == (
        JobState.RESTARTING, "resumed by operator alice@host after a stop", None, 50)
    last = store.transitions(job)[-1]
    assert (last.entity, last.from_state, last.to_state, last.reason) == (
        "job", "STOPPED", "RESTARTING", "resumed by operator alice@host after a stop")
    assert [(a.kind, a.attempt, a.cause) for a in store.actions(job) if a.kind != "stop"] == [
        ("resume", 1, f"resumed by operator alice@host after a stop; restores the checkpoint of step {STOP_STEP}")]
    assert store.incidents(job) == [] and store.recoveries(job) == []
    [attempt] = store.get_attempts(job)  # the stopped attempt stays as it was
    assert (attempt.state, attempt.final_step) == (AttemptState.STOPPED, STOP_STEP)
    # the next attempt continues the numbering; the job moves on as after a restart
    store.set_job_state(job, JobState.PLACING, "placing worker group")
    assert store.create_attempt(job) == 2


def test_a_resume_with_other_steps_stores_them(store: Store, tmp_path: Path) -> None:
    job = _stopped_job(store, tmp_path / "ckpt")
    take_over(store, tmp_path / "state", job, checkpoint_dir=tmp_path / "ckpt" / job, steps=20, by="alice@host")
    assert store.get_job(job).total_steps == 20
    [resume] = [a for a in store.actions(job) if a.kind == "resume"]
    assert resume.cause.endswith(f"restores the checkpoint of step {STOP_STEP}; job.steps 50 -> 20")


def test_the_operator_is_user_at_host_by_default(store: Store, tmp_path: Path) -> None:
    job = _stopped_job(store, tmp_path / "ckpt")
    take_over(store, tmp_path / "state", job, checkpoint_dir=tmp_path / "ckpt" / job, steps=50)
    assert store.get_job(job).reason == f"resumed by operator {operator()} after a stop"
    assert operator().endswith(__import__("socket").gethostname())


@pytest.mark.parametrize("end", [JobState.SUCCEEDED, JobState.FAILED])
def test_an_ended_job_is_refused(store: Store, tmp_path: Path, end: JobState) -> None:
    job = store.create_job("done", total_steps=5, config_json="{}")
    store.set_job_state(job, JobState.PLACING, "placing")
    if end is JobState.SUCCEEDED:
        store.set_job_state(job, JobState.RUNNING, "running")
    store.set_job_state(job, end, "over")
    with pytest.raises(StateError) as info:
        take_over(store, tmp_path / "state", job)
    assert str(info.value) == f"job {job} is {end.value}; there is nothing to resume"
    assert "only a STOPPED job or one whose controller died can be resumed" in info.value.hint
    assert store.get_job(job).state is end and store.actions(job) == []


def test_a_job_whose_controller_still_runs_is_refused(store: Store, tmp_path: Path) -> None:
    job = _stopped_job(store, tmp_path / "ckpt")
    state_dir = tmp_path / "state"
    # a live process standing for the controller that still tears the stopped job down
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        auth.write_controller_info(state_dir, auth.ControllerInfo("127.0.0.1:1", "t", job, proc.pid))
        with pytest.raises(StateError, match=f"still run by controller pid {proc.pid}; stop it first"):
            take_over(store, state_dir, job, checkpoint_dir=tmp_path / "ckpt" / job, steps=50)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert store.get_job(job).state is JobState.STOPPED


def test_a_config_that_cannot_continue_the_job_is_refused_untouched(store: Store, tmp_path: Path) -> None:
    job = _stopped_job(store, tmp_path / "ckpt")
    with pytest.raises(ConfigError) as info:  # another folder: the stop's checkpoint would not be found
        take_over(store, tmp_path / "state", job, checkpoint_dir=tmp_path / "elsewhere" / job, steps=50)
    assert str(info.value).startswith(f"job.checkpoint_dir: job {job}'s checkpoint of step {STOP_STEP} is ")
    with pytest.raises(ConfigError, match=f"job.steps is {STOP_STEP}, but job {job} stopped with a checkpoint "
                                          f"at step {STOP_STEP}: there is nothing left to train"):
        take_over(store, tmp_path / "state", job, checkpoint_dir=tmp_path / "ckpt" / job, steps=STOP_STEP)
    record = store.get_job(job)
    assert (record.state, record.total_steps) == (JobState.STOPPED, 50)
    assert [a.kind for a in store.actions(job)] == ["stop"]


def test_only_faults_timed_after_the_stop_fire_again() -> None:
    orders = [FaultOrder("crash", rank=1, at_step=5), FaultOrder("crash", rank=2, at_step=STOP_STEP),
              FaultOrder("hang", rank=0, at_step=STOP_STEP + 1), FaultOrder("node-down", node="node-1", after_s=3.0),
              FaultOrder("ckpt-corrupt"), FaultOrder("controller-crash", at_step=40)]
    assert faults_after(orders, STOP_STEP) == [orders[2], orders[5]]
    assert faults_after(orders, 0) == [orders[0], orders[1], orders[2], orders[5]]


def test_status_ettr_agrees_with_the_report_across_the_pause(store: Store, tmp_path: Path) -> None:
    job = _stopped_job(store, tmp_path / "ckpt")
    take_over(store, tmp_path / "state", job, checkpoint_dir=tmp_path / "ckpt" / job, steps=20, by="a@b")
    store.set_job_state(job, JobState.PLACING, "placing worker group")
    store.create_attempt(job)
    store.set_attempt_restored(job, 2, STOP_STEP)
    t1 = time.time()
    store.record_batch("agent-node-0", 1, 2, [pb.Event(step=pb.StepEvent(
        job_id=job, attempt=2, rank=r, step=k, loss=1.0, step_time_s=0.5, end_ns=int((t1 + k - STOP_STEP) * S)))
        for k in range(STOP_STEP + 1, 21) for r in (0, 1)])
    now = t1 + 10
    report = load_report(store, job, now)
    moves = {(t.from_state, t.to_state): t.at for t in store.transitions(job) if t.entity == "job"}
    stopped = moves[("STOPPED", "RESTARTING")] - moves[("RUNNING", "STOPPED")]
    assert report["stopped_s"] == round(stopped, 3) and "stopped_s" not in report["lost_s"]
    assert report["wall_s"] == round(now - store.get_job(job).created_at - stopped, 3)
    assert report["productive_s"] == 20 * 0.5 and report["restarts"] == 0
    assert ettr_so_far(store, store.get_job(job), store.get_attempts(job), now) == report["ettr"]
