"""`fleet status` and `fleet stop` against a real `fleet up` (a local Ray cluster of two
raylets, real agents, gloo workers, SQLite): the live view, then a graceful stop whose
checkpoint is stored valid and on disk, and `fleet up`'s STOPPED exit code (8); then
`fleet up --resume` of the stopped job, to completion from exactly the stop's checkpoint."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from fleet.controlplane.errors import JobStoppedError
from fleet.controlplane.lifecycle import AttemptState, JobState
from tests.integration.test_fleet_up import FLEET, FleetUp, controller_job, store_of, write_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _fleet(tmp: Path, *argv: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEET, *argv], cwd=tmp, capture_output=True, text=True, timeout=timeout_s)


def test_status_shows_the_running_job_and_stop_checkpoints_it(tmp_path: Path) -> None:
    # no checkpoint falls due in this test: the only one is the stop's
    run = FleetUp(tmp_path, write_cluster(tmp_path, steps=100_000, checkpoint_interval=10_000))
    run.wait_until(lambda: controller_job(tmp_path), 120, "the controller to start")
    job_id = controller_job(tmp_path)

    def training() -> bool:
        with store_of(tmp_path) as store:
            return store.last_step(job_id) >= 3

    run.wait_until(training, 240, "training to start")
    out = _fleet(tmp_path, "status", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    job = status["job"]
    assert (status["source"], job["job_id"], job["state"], job["attempt"]) == ("controller", job_id, "RUNNING", 1)
    assert job["step"] > 0 and job["total_steps"] == 100_000 and job["world_size"] == 4
    assert job["loss"] is not None and job["tokens_per_s"] > 0 and job["stopping"] == ""
    nodes = {n["name"]: n for n in status["nodes"]}
    assert {name: (n["ranks"], n["agent_connected"]) for name, n in nodes.items()} == {
        "node-0": ([0, 1], True), "node-1": ([2, 3], True)}

    t0 = time.monotonic()
    out = _fleet(tmp_path, "stop", job_id, "--reason", "integration test", "--json")
    stop_s = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    stopped = json.loads(out.stdout)
    step = stopped["final_step"]
    assert stopped["state"] == "STOPPED" and step > job["step"] - 1
    assert (stopped["checkpoint_step"], stopped["checkpoint_at_stop"], stopped["controller_exited"]) == (
        step, True, True)
    assert stopped["reason"].startswith("stopped by operator ")
    assert stopped["reason"].endswith(f": integration test; checkpoint at step {step}"), stopped["reason"]

    up_out, up_err = run.wait(60)
    assert run.proc.returncode == JobStoppedError.exit_code == 8, up_err[-3000:]
    summary = json.loads(up_out)
    assert (summary["state"], summary["final_step"], summary["reason"]) == ("STOPPED", step, stopped["reason"])
    run.assert_tree_gone()
    with store_of(tmp_path) as store:
        record = store.get_job(job_id)
        assert (record.state, record.reason) == (JobState.STOPPED, stopped["reason"])
        [attempt] = store.get_attempts(job_id)
        assert (attempt.state, attempt.final_step) == (AttemptState.STOPPED, step)
        # the stop's checkpoint: stored valid, on disk with its manifest
        [ckpt] = store.checkpoints(job_id)
        assert (ckpt.step, ckpt.valid) == (step, True)
        assert (Path(ckpt.path) / "MANIFEST.json").is_file()
        assert [a.cause for a in store.actions(job_id) if a.kind == "stop"] == [
            stopped["reason"].rsplit("; checkpoint", 1)[0]]
    # with the controller gone, the store answers
    out = _fleet(tmp_path, "status", job_id, "--json")
    assert out.returncode == 0, out.stderr
    after = json.loads(out.stdout)
    assert (after["source"], after["job"]["state"], after["job"]["checkpoint_step"]) == ("store", "STOPPED", step)
    log = (tmp_path / ".fleet" / "logs" / "controller.log").read_text()
    ranks_s = next(ln for ln in log.splitlines() if "attempt 1 stopped in" in ln).split("stopped in ")[1].split(":")[0]
    print(f"fleet stop: {stop_s:.1f} s from the request to the controller gone, the ranks' part {ranks_s} "
          f"(stopped at step {step})")
    _resume(tmp_path, job_id, step, run.tmp / "cluster.yaml")


def _resume(tmp_path: Path, job_id: str, step: int, cluster: Path) -> None:
    """`fleet up --resume` of the stopped job (the same file, 8 steps more): it restores
    exactly the stop's checkpoint, recomputes nothing, and its report leaves the pause out."""
    extra = 8
    t0 = time.monotonic()
    resumed = FleetUp(tmp_path, cluster, ("--resume", job_id, "--set", f"job.steps={step + extra}"))
    summary = resumed.finish(timeout_s=240)
    resume_s = time.monotonic() - t0
    resumed.assert_tree_gone()
    assert (summary["job_id"], summary["state"], summary["final_step"], summary["attempts"]) == (
        job_id, "SUCCEEDED", step + extra, 2)
    with store_of(tmp_path) as store:
        record = store.get_job(job_id)
        assert (record.state, record.total_steps) == (JobState.SUCCEEDED, step + extra)
        first, second = store.get_attempts(job_id)
        assert (first.state, second.state, second.restored_step) == (
            AttemptState.STOPPED, AttemptState.SUCCEEDED, step)
        restored = [w for w in store.worker_status(job_id, 2) if w.state == "RESTORED"]
        assert sorted((w.rank, w.restored_step) for w in restored) == [(r, step) for r in range(4)], restored
        for rank in range(4):  # no step trained twice: attempt 2 starts right after the stop's step
            assert sorted(s.step for s in store.steps(job_id, attempt=2, rank=rank)) == list(
                range(step + 1, step + extra + 1))
        assert store.recoveries(job_id) == [] and store.incidents(job_id) == []
        kinds = [(a.kind, a.attempt) for a in store.actions(job_id)]
        assert kinds == [("stop", 1), ("resume", 1)], kinds
        [resume] = [a for a in store.actions(job_id) if a.kind == "resume"]
        assert resume.cause.startswith("resumed by operator ") and resume.cause.endswith(
            f"after a stop; restores the checkpoint of step {step}; job.steps 100000 -> {step + extra}")
        moves = [(t.from_state, t.to_state) for t in store.transitions(job_id) if t.entity == "job"]
        assert moves[-5:] == [("RUNNING", "STOPPED"), ("STOPPED", "RESTARTING"), ("RESTARTING", "PLACING"),
                              ("PLACING", "RUNNING"), ("RUNNING", "SUCCEEDED")], moves
        at = {(t.from_state, t.to_state): t.at for t in store.transitions(job_id) if t.entity == "job"}
        paused = at[("STOPPED", "RESTARTING")] - at[("RUNNING", "STOPPED")]
        wall = record.ended_at - record.created_at - paused
    out = _fleet(tmp_path, "report", job_id, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["stopped_s"] == round(paused, 3) and report["stopped_s"] > 0
    assert report["wall_s"] == round(wall, 3) and report["restarts"] == 0
    # the report's ETTR is its unrounded productive time over the wall, rounded to 4 places;
    # from the rounded productive_s it can differ in the last place (0.27995: 0.2799 or 0.28)
    assert abs(report["ettr"] - report["productive_s"] / wall) < 1e-4 and 0 < report["ettr"] <= 1
    assert report["lost_s"]["recomputed_s"] == 0.0
    out = _fleet(tmp_path, "report", job_id)
    assert out.returncode == 0 and f"(and {report['stopped_s']:.1f} s stopped, not counted)" in out.stdout, out
    out = _fleet(tmp_path, "status", job_id, "--json")
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)["job"]
    assert (view["state"], view["attempt"], view["step"], view["restarts"], view["ettr"]) == (
        "SUCCEEDED", 2, step + extra, 0, report["ettr"])
    print(f"fleet up --resume: {resume_s:.1f} s to finish {extra} steps after the stop at step {step} "
          f"(the job sat stopped {paused:.1f} s; ETTR {report['ettr']})")
