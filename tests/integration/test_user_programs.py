"""User programs under `fleet up`: training scripts written against the libraries users
already use (plain DDP, PyTorch Lightning, Hugging Face Accelerate), none importing
fleet, on a real local Ray cluster of two simulated nodes with real gloo.

The programs (tests/programs/) write one JSON line per completed step and rank, with
torchrun's restart count, so each test sees from outside where a run started and
ended; fleet's view comes from the job's SQLite store and `fleet report --json`. Each
test has its own state_dir and store: the quarantine policy counts incidents per node
across the jobs of one store.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.store import Store
from fleet.proto.kinds import IncidentKind
from tests.integration.test_fleet_up import FLEET, FleetUp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
#: What fleet says of a rank it believes died before init_process_group.
BEFORE_PG = "before creating its process group"


def write_cluster(tmp: Path, script: str, args: list[str], *, ranks_per_node: int = 1,
                  max_restarts: int = 2) -> Path:
    """cluster.yaml for ``script`` on 2 simulated nodes, everything under ``tmp``."""
    cfg = {
        "name": Path(script).stem,
        "state_dir": str(tmp / ".fleet"),
        "ray": {"address": None, "nodes": 2, "cpus_per_node": 2},
        "store": {"url": f"sqlite:///{tmp}/.fleet/fleet.db"},
        "job": {
            "nodes": 2, "ranks_per_node": ranks_per_node, "max_restarts": max_restarts,
            "restart_backoff_s": 0.5, "pg_timeout_s": 300,
            "entrypoint": {"script": script, "args": args, "workdir": str(tmp)},
        },
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def program_args(tmp: Path, *, steps: int, ckpt_every: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--steps", str(steps), "--ckpt", str(tmp / "ckpt"), "--ckpt-every", str(ckpt_every),
            "--out", str(tmp / "out"), *extra]


def steps_of(tmp: Path, rank: int) -> list[dict]:
    """The per-step lines rank ``rank`` wrote, over every run, in order (a program may
    also write other lines, such as ddp.py's per-run ``"phase": "start"``)."""
    path = tmp / "out" / f"rank-{rank}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if "step" in line]


def store_of(tmp: Path) -> Store:
    return Store(f"sqlite:///{tmp}/.fleet/fleet.db")


def report(tmp: Path, job_id: str) -> dict:
    out = subprocess.run([*FLEET, "report", job_id, "--json"], cwd=tmp, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def finish_failing(run: FleetUp, timeout_s: float = 240) -> tuple[int, str]:
    """Wait for a `fleet up` expected to fail, sampling its tree: (exit code, stderr)."""
    deadline = time.monotonic() + timeout_s
    while run.proc.poll() is None and time.monotonic() < deadline:
        run.sample()
        time.sleep(0.2)
    try:
        _, err = run.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.wait()
        raise AssertionError(f"fleet up did not end in {timeout_s} s") from None
    return run.proc.returncode, err


def test_plain_ddp_succeeds_and_fleet_logs_shows_one_rank(tmp_path: Path) -> None:
    steps = 20
    cluster = write_cluster(tmp_path, str(PROGRAMS / "ddp.py"),
                            program_args(tmp_path, steps=steps, ckpt_every=10, extra=("--width", "32")),
                            ranks_per_node=2)
    run = FleetUp(tmp_path, cluster)
    summary = run.finish()
    run.assert_tree_gone()
    run.assert_loopback_only()

    assert (summary["state"], summary["attempts"]) == ("SUCCEEDED", 1), summary
    job_id = summary["job_id"]
    with store_of(tmp_path) as store:
        assert store.get_job(job_id).state is JobState.SUCCEEDED
        assert store.incidents(job_id) == []
        placed = sorted((r.rank, r.node) for r in store.ranks(job_id, 1))
    assert placed == [(0, "node-0"), (1, "node-0"), (2, "node-1"), (3, "node-1")]
    for rank in range(4):
        assert [s["step"] for s in steps_of(tmp_path, rank)] == list(range(1, steps + 1))

    out = subprocess.run([*FLEET, "logs", job_id, "--rank", "1", "--state-dir", str(tmp_path / ".fleet")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"rank 1: done at step {steps} (restart 0)" in out.stdout
    assert "rank 0:" not in out.stdout and "[rank" not in out.stdout


KILLED = [
    # program, ranks per node, the rank killed, its node, steps, checkpoint interval, kill step
    pytest.param("ddp.py", 2, 3, "node-1", 30, 10, 15, id="ddp"),
    pytest.param("lightning_train.py", 1, 1, "node-1", 20, 5, 8, id="lightning"),
    pytest.param("accelerate_train.py", 1, 1, "node-1", 20, 5, 8, id="accelerate"),
]


@pytest.mark.parametrize(("program", "per_node", "victim", "node", "steps", "every", "kill_at"), KILLED)
def test_sigkilled_rank_is_restarted_and_the_program_resumes_from_its_checkpoint(
        tmp_path: Path, program: str, per_node: int, victim: int, node: str, steps: int, every: int,
        kill_at: int) -> None:
    extra = ("--fault-rank", str(victim), "--kill-at", str(kill_at))
    if program == "ddp.py":
        extra += ("--width", "32")
    cluster = write_cluster(tmp_path, str(PROGRAMS / program),
                            program_args(tmp_path, steps=steps, ckpt_every=every, extra=extra),
                            ranks_per_node=per_node)
    run = FleetUp(tmp_path, cluster)
    summary = run.finish()
    run.assert_tree_gone()

    assert (summary["state"], summary["attempts"]) == ("SUCCEEDED", 2), summary
    job_id = summary["job_id"]
    with store_of(tmp_path) as store:
        assert [a.state for a in store.get_attempts(job_id)] == [AttemptState.FAILED, AttemptState.SUCCEEDED]
        incidents = store.incidents(job_id)
    assert [(i.kind, i.rank, i.node, i.exit_code, i.attempt) for i in incidents] == [
        (IncidentKind.CRASH, victim, node, -9, 1)], incidents
    assert "killed by signal 9 (SIGKILL)" in incidents[0].evidence
    # the rank trained kill_at - 1 steps with its process group: it did not die before creating it
    assert BEFORE_PG not in incidents[0].evidence, incidents[0].evidence
    reported = report(tmp_path, job_id)["incidents"]
    assert [(i["kind"], i["rank"], i["node"], i["exit_code"]) for i in reported] == [("crash", victim, node, -9)]

    resumed_from = (kill_at - 1) // every * every
    assert resumed_from >= every
    first_run = [s["step"] for s in steps_of(tmp_path, victim) if s["restart"] == 0]
    assert first_run == list(range(1, kill_at)), first_run
    for rank in range(2 * per_node):
        second_run = [s["step"] for s in steps_of(tmp_path, rank) if s["restart"] == 1]
        # resumed after the checkpoint, not from step 0, and trained to the end
        assert second_run == list(range(resumed_from + 1, steps + 1)), (rank, second_run)


def test_hung_ddp_rank_is_named_long_before_the_process_group_timeout(tmp_path: Path) -> None:
    steps, every, hang_at = 30, 10, 15
    cluster = write_cluster(tmp_path, str(PROGRAMS / "ddp.py"), program_args(
        tmp_path, steps=steps, ckpt_every=every,
        extra=("--width", "32", "--hang-at", str(hang_at), "--pg-timeout-s", "300")))
    run = FleetUp(tmp_path, cluster)
    summary = run.finish()
    run.assert_tree_gone()

    assert (summary["state"], summary["attempts"]) == ("SUCCEEDED", 2), summary
    job_id = summary["job_id"]
    with store_of(tmp_path) as store:
        incidents = store.incidents(job_id)
    assert [(i.kind, i.rank, i.node, i.attempt) for i in incidents] == [
        (IncidentKind.HANG, 1, "node-1", 1)], incidents
    assert "culprit rank 1" in incidents[0].evidence
    hung = [s for s in steps_of(tmp_path, 1) if s["restart"] == 0]
    assert hung[-1]["step"] == hang_at - 1
    detected_after_s = incidents[0].detected_at - hung[-1]["t"]
    assert 0 < detected_after_s < 60, detected_after_s
    for rank in (0, 1):
        second_run = [s["step"] for s in steps_of(tmp_path, rank) if s["restart"] == 1]
        assert second_run == list(range(every + 1, steps + 1)), (rank, second_run)


def test_a_start_up_failure_on_every_attempt_ends_the_job_after_two(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path, str(PROGRAMS / "ddp.py"),
                            program_args(tmp_path, steps=10, ckpt_every=5, extra=("--fail-at-start",)),
                            max_restarts=3)
    run = FleetUp(tmp_path, cluster)
    code, err = finish_failing(run)
    run.assert_tree_gone()

    assert code != 0, err[-2000:]
    with store_of(tmp_path) as store:
        (job,) = store.list_jobs()
        incidents = store.incidents(job.id)
    # the same failure twice in a row is enough: not max_restarts + 1 attempts
    assert (job.state, job.attempts) == (JobState.FAILED, 2), (job.state, job.attempts, job.reason)
    assert "RuntimeError: cannot open the dataset on rank" in job.reason
    assert len(incidents) == 2
    for incident in incidents:
        assert incident.kind is IncidentKind.ERROR and incident.exit_code == 1
        last = incident.traceback.strip().splitlines()[-1]
        assert last.startswith("RuntimeError: cannot open the dataset on rank"), incident.traceback


def test_a_rank_that_exits_early_is_explained(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path, str(PROGRAMS / "ddp.py"),
                            program_args(tmp_path, steps=10, ckpt_every=5, extra=("--exit-early",)))
    run = FleetUp(tmp_path, cluster)
    summary = run.finish()
    run.assert_tree_gone()

    # the fault is for the first run only: the second one trains to the end
    assert (summary["state"], summary["attempts"]) == ("SUCCEEDED", 2), summary
    with store_of(tmp_path) as store:
        incidents = store.incidents(summary["job_id"])
    assert [(i.rank, i.node, i.exit_code, i.attempt) for i in incidents] == [(1, "node-1", 0, 1)], incidents
    assert "exited with code 0 before creating its process group" in incidents[0].evidence
    assert [s["step"] for s in steps_of(tmp_path, 1)] == list(range(1, 11))


def test_a_missing_script_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path, "no_such_train.py", ["--steps", "5"])
    proc = subprocess.Popen([*FLEET, "up", "--cluster", str(cluster), "--json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started: set[str] = set()
    while proc.poll() is None:
        try:
            started |= {p.name() for p in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()  # the error, and its hint
    assert len(lines) == 2 and "job.entrypoint.script" in lines[0] and "no_such_train.py" in lines[0], err
    assert lines[1].startswith("hint: "), err
    assert out == ""
    assert not started, started
    # nothing was started: no Ray session, no store, no logs
    assert not (tmp_path / ".fleet").exists()


def test_the_step_api_feeds_fault_injection_nan_detection_report_and_replay(tmp_path: Path) -> None:
    # attempt 1: a crash scheduled at step 25 (aimed by fleet.step); attempt 2 (restored from
    # step 20): rank 1 reports a NaN loss at step 22, with ~4 s of steps left to notice it;
    # attempt 3 (from step 20 again) finishes
    cluster = write_cluster(tmp_path, str(PROGRAMS / "stepapi.py"),
                            ["--steps", "60", "--ckpt", str(tmp_path / "ckpt"), "--nan-at", "22",
                             "--nan-attempt", "2", "--step-sleep", "0.1"], ranks_per_node=1, max_restarts=3)
    cfg = yaml.safe_load(cluster.read_text())
    cfg["chaos"] = {"faults": [{"kind": "crash", "rank": 0, "at_step": 25}]}
    cluster.write_text(yaml.safe_dump(cfg))
    run = FleetUp(tmp_path, cluster)
    summary = run.finish()
    run.assert_tree_gone()

    assert (summary["state"], summary["attempts"]) == ("SUCCEEDED", 3), summary
    job_id = summary["job_id"]
    with store_of(tmp_path) as store:
        incidents = [(i.attempt, i.kind, i.rank, i.node) for i in store.incidents(job_id)]
        assert incidents == [(1, IncidentKind.CRASH, 0, "node-0"), (2, IncidentKind.NAN, 1, "node-1")], incidents
        # rank 0 crashed at the top of step 25 (inside fleet.step(24)); rank 1, which
        # survived it, reported up to step 24 (the killed rank's unsent reports die with it)
        first = store.steps(job_id, attempt=1, rank=1)
        assert first and max(s.step for s in first) == 24
        assert max(s.step for s in store.steps(job_id, attempt=3, rank=1)) == 60
        # from the program's own newest checkpoint: 20, or 30 if it saved that before the
        # NaN incident ended attempt 2 (the program does not stop on a NaN itself)
        assert min(s.step for s in store.steps(job_id, attempt=3, rank=1)) in (21, 31)
        assert all(s.tokens_per_s > 0 for s in store.steps(job_id, attempt=3, rank=1)[1:])
    out = report(tmp_path, job_id)
    assert out["ettr"] is not None and 0 < out["ettr"] <= 1
    nan = out["incidents"][1]
    assert nan["detected_after_s"] is not None and nan["detected_after_s"] < 10

    replay = subprocess.run([*FLEET, "replay", job_id, "--attempt", "3", "--json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr
    view = json.loads(replay.stdout)
    assert view["verdict"] == "ok" and sorted(view["ranks"]) == [0, 1]
    assert any(g for g in view["groups"]), view["groups"]  # the program's collectives were traced
