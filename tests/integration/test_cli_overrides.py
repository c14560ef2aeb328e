"""`fleet up --set` and the FLEET_* variables end to end: a real local Ray cluster runs the
overridden job, its stored config is the overridden one, and the reading commands find
its store, logs and report through the variables alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.controlplane.config import DEFAULT_CLUSTER_FILE
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FLEET = [sys.executable, "-m", "fleet.controlplane.cli.main"]
USER_SCRIPT = DEFAULT_CLUSTER_FILE.parent / "user_script.yaml"  # examples/ddp_train.py under fleet
REPO = DEFAULT_CLUSTER_FILE.parent.parent


def _fleet(tmp: Path, env: dict[str, str], *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    # output to files: a pipe nobody reads until the end can fill up and block `fleet up`
    out, err = tmp / f"{argv[0]}.out", tmp / f"{argv[0]}.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.run([*FLEET, *argv], cwd=tmp, env=env, stdout=o, stderr=e, text=True, timeout=timeout_s)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


def test_fleet_up_with_overrides_and_the_reading_commands_by_variable(tmp_path: Path) -> None:
    store_db = tmp_path / "elsewhere" / "fleet.db"
    state_dir = tmp_path / "elsewhere" / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(FLEET_STORE=f"sqlite:///{store_db}", FLEET_STATE_DIR=str(state_dir), FLEET_CLUSTER=str(USER_SCRIPT))
    store_db.parent.mkdir()

    args = f'[--steps, "4", --checkpoint-dir, "{tmp_path / "ckpt"}", --log-every, "1"]'
    up = _fleet(tmp_path, env, "up", "--json", "--set", f"job.entrypoint.workdir={REPO}",
                "--set", f"job.entrypoint.args={args}", "--set", "ray.cpus_per_node=3", timeout_s=360)
    assert up.returncode == 0, up.stderr
    summary = json.loads(up.stdout)
    assert summary["state"] == "SUCCEEDED" and summary["log"] == str(state_dir / "logs" / "controller.log")
    # nothing went to the defaults: the variables and --set decided every path
    assert not (tmp_path / ".fleet").exists() and (tmp_path / "ckpt").is_dir()

    with Store(f"sqlite:///{store_db}") as st:
        (job,) = st.list_jobs()
        stored = json.loads(job.config_json)
    assert job.id == summary["job_id"] and job.state is JobState.SUCCEEDED
    assert stored["job"]["entrypoint"]["args"] == ["--steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                                   "--log-every", "1"]
    assert (stored["ray"]["cpus_per_node"], stored["job"]["entrypoint"]["workdir"]) == (3, str(REPO))
    assert (stored["store"]["url"], stored["state_dir"]) == (f"sqlite:///{store_db}", str(state_dir))

    # the reading commands, given nothing but the variables
    jobs = _fleet(tmp_path, env, "jobs", "--json")
    assert jobs.returncode == 0, jobs.stderr
    assert [j["id"] for j in json.loads(jobs.stdout)] == [job.id]
    report = _fleet(tmp_path, env, "report", job.id, "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["state"] == "SUCCEEDED"
    logs = _fleet(tmp_path, env, "logs", job.id, "--rank", "0")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.strip() and (state_dir / "logs" / job.id).is_dir()
    # a flag still beats its variable
    missing = _fleet(tmp_path, env, "jobs", "--store", f"sqlite:///{tmp_path}/none.db")
    assert missing.returncode == 3 and missing.stderr.startswith("error: --store: no store at")
