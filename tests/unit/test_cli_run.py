"""`fleet run` and `fleet logs`: argument parsing (the program's arguments pass untouched),
the ClusterConfig built in memory, pre-flight errors before anything starts, the one path
shared with `fleet up` (job id first, exit codes), and the logs of a folder and a store.

No test here starts Ray: the shared path runs with a stand-in Controller that records a
job in a real SQLite store, as the real one does first."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import typer

from fleet.controlplane.cli import run as run_cli
from fleet.controlplane.cli import up as up_cli
from fleet.controlplane.cli.logs import follow_logs
from fleet.controlplane.cli.main import app, main
from fleet.controlplane.cli.run import DEFAULT_MAX_RESTARTS, program_start, run_config
from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, ClusterConfig, load_cluster_config
from fleet.controlplane.errors import ConfigError, JobFailedError, NotFoundError
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.store import Store

pytestmark = pytest.mark.timeout(60)


def _one_line(text: str) -> str:
    """The error's line: an error prints it and one ``hint:`` line, nothing else."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[1].startswith("hint: "), f"expected an error and a hint, got: {text!r}"
    return lines[0]


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A folder holding train.py, as the current directory."""
    (tmp_path / "train.py").write_text("raise SystemExit('user code must not run in these tests')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def captured(monkeypatch) -> list[dict[str, Any]]:
    """`fleet run`'s calls of the shared path, instead of running them."""
    calls: list[dict[str, Any]] = []

    def fake_run_job(config: ClusterConfig, **kwargs: Any) -> None:
        calls.append({"config": config, **kwargs})

    monkeypatch.setattr(up_cli, "run_job", fake_run_job)
    return calls


# -- parsing and the config built in memory -------------------------------------------

def test_everything_after_the_script_goes_to_the_program(project: Path, captured, capsys) -> None:
    argv = ["run", "--nodes", "2", "train.py", "--lr", "0.1", "-v", "--json", "--nodes", "5", "--traceback",
            "--", "x"]
    assert main(argv) == 0, capsys.readouterr()
    (call,) = captured
    program = call["config"].job.user_program
    assert program.script == "train.py"
    assert program.args == ["--lr", "0.1", "-v", "--json", "--nodes", "5", "--traceback", "--", "x"]
    assert call["config"].job.nodes == 2
    assert call["json_out"] is False and call["verbose"] is False and call["announce"] is True


def test_a_module_and_its_arguments(project: Path, captured, capsys) -> None:
    (project / "mypkg").mkdir()
    (project / "mypkg" / "__init__.py").write_text("raise SystemExit('never imported')\n")
    (project / "mypkg" / "train.py").write_text("")
    assert main(["run", "--json", "-m", "mypkg.train", "--json", "-m", "x"]) == 0, capsys.readouterr()
    (call,) = captured
    program = call["config"].job.user_program
    assert (program.module, program.script, program.args) == ("mypkg.train", None, ["--json", "-m", "x"])
    assert call["json_out"] is True and call["announce"] is False  # --json: the JSON alone on stdout


def test_the_config_built_in_memory(tmp_path: Path) -> None:
    config = run_config("examples/train.py", ["--steps", "3"], nodes=3, nproc_per_node=4, max_restarts=7,
                        tee=False, state_dir=tmp_path / "state", workdir=tmp_path)
    default = load_cluster_config(DEFAULT_CLUSTER_FILE)
    assert config.name == "train"
    assert (config.ray.address, config.ray.nodes, config.ray.cpus_per_node) == (None, 3, default.ray.cpus_per_node)
    assert (config.job.nodes, config.job.ranks_per_node, config.job.max_restarts) == (3, 4, 7)
    assert config.job.entrypoint.model_dump() == {
        "module": None, "script": "examples/train.py", "args": ["--steps", "3"], "env": {},
        "workdir": str(tmp_path), "inherit_env": True, "tee": False}
    assert config.state_dir == str(tmp_path / "state")
    assert config.store.url == f"sqlite:///{tmp_path}/state/fleet.db"
    assert config.job.checkpoint_dir == str(tmp_path / "state" / "checkpoints")
    # the default file's other settings are kept; its built-in recipe is not set
    assert config.controller == default.controller and config.agent == default.agent
    assert config.policy == default.policy and config.job.pg_timeout_s == default.job.pg_timeout_s
    assert "steps" not in config.job.model_fields_set


def test_defaults_of_fleet_run(project: Path, captured, capsys) -> None:
    assert main(["run", "train.py"]) == 0, capsys.readouterr()
    config = captured[0]["config"]
    assert (config.ray.nodes, config.job.nodes, config.job.ranks_per_node) == (1, 1, 1)
    assert config.job.max_restarts == DEFAULT_MAX_RESTARTS == 3
    assert config.job.user_program.tee is True
    assert config.job.user_program.workdir == str(project)
    assert config.state_dir == ".fleet" and config.store.url == "sqlite:///.fleet/fleet.db"
    assert main(["run", "--no-tee", "--state-dir", "st", "train.py"]) == 0
    assert captured[1]["config"].job.user_program.tee is False
    assert captured[1]["config"].state_dir == "st"


def test_a_bad_module_name_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^fleet run: job\.entrypoint\.module: 'x-y' is not a dotted"):
        run_config("x-y", [], module=True, workdir=tmp_path)


@pytest.mark.parametrize("argv", [["run"], ["run", "--nodes", "0", "train.py"], ["run", "--bogus", "train.py"],
                                  ["run", "--nodes", "17", "train.py"], ["run", "-m"]])
def test_usage_errors_exit_2(project: Path, captured, capsys, argv: list[str]) -> None:
    assert main(argv) == 2
    assert not captured
    assert "Traceback" not in capsys.readouterr().err


def test_program_start_knows_the_commands_options() -> None:
    command = typer.main.get_command(app).commands["run"]
    assert program_start(["--nodes", "2", "--json", "-m", "mod", "--nodes", "3"], command) == 4
    assert program_start(["--nodes=2", "--no-tee", "--traceback", "t.py"], command) == 3
    assert program_start(["--", "t.py", "--json"], command) == 1
    assert program_start(["--nodes", "2"], command) == 2


def test_traceback_before_the_script_is_fleets(project: Path, monkeypatch, capsys) -> None:
    def failing(config: ClusterConfig, **kwargs: Any) -> None:
        raise JobFailedError("job j failed: rank 1 exited with code 1")

    monkeypatch.setattr(up_cli, "run_job", failing)
    assert main(["run", "train.py", "--traceback"]) == JobFailedError.exit_code == 7
    assert "Traceback" not in capsys.readouterr().err  # the program's flag, not fleet's
    assert main(["run", "--traceback", "train.py"]) == 7
    assert "Traceback (most recent call last)" in capsys.readouterr().err


# -- pre-flight: before anything starts ---------------------------------------------

def test_a_missing_script_exits_2_before_anything_starts(project: Path, capsys) -> None:
    code = main(["run", "--nodes", "2", "nope.py", "--lr", "1"])
    out, err = capsys.readouterr()
    assert code == ConfigError.exit_code == 2
    assert _one_line(out + err) == f"error: fleet run: job.entrypoint.script: no such file: {project}/nope.py"
    assert "Traceback" not in out + err
    assert not (project / ".fleet").exists()  # no log, no store: Ray was never started


def test_a_missing_module_exits_2_naming_it(project: Path, capsys) -> None:
    code = main(["run", "-m", "mypkg.trian"])
    out, err = capsys.readouterr()
    assert code == 2
    assert _one_line(out + err) == (f"error: fleet run: job.entrypoint.module: no module named 'mypkg.trian' "
                                    f"(looked in {project} and the Python path)")
    assert not (project / ".fleet").exists()


@pytest.mark.parametrize(("entrypoint", "problem"), [
    ("{script: nope.py}", "job.entrypoint.script: no such file: {root}/nope.py"),
    ("{module: nopkg_xyz}", "job.entrypoint.module: no module named 'nopkg_xyz'"),
    ("{script: train.py, workdir: sub}", "job.entrypoint.workdir: no such directory: {root}/sub"),
])
def test_fleet_up_checks_the_entrypoint_before_anything_starts(project: Path, capsys, entrypoint: str,
                                                               problem: str) -> None:
    cluster = project / "cluster.yaml"
    cluster.write_text(f"ray: {{nodes: 1}}\njob:\n  nodes: 1\n  entrypoint: {entrypoint}\n")
    code = main(["up", "--cluster", str(cluster)])
    out, err = capsys.readouterr()
    assert code == 2
    line = _one_line(out + err)
    assert line.startswith(f"error: {cluster}: {problem.format(root=project)}"), line
    assert not (project / ".fleet").exists()


def test_the_example_user_script_config_passes_its_checks(monkeypatch) -> None:
    from fleet.controlplane.entrypoint import check_entrypoint

    repo = DEFAULT_CLUSTER_FILE.parent.parent
    monkeypatch.chdir(repo)
    config = load_cluster_config(repo / "examples" / "user_script.yaml")
    assert config.job.user_program.script == "examples/ddp_train.py"
    assert (config.ray.nodes, config.job.nodes, config.job.ranks_per_node) == (2, 2, 2)
    check_entrypoint(config, "examples/user_script.yaml")


# -- the path shared with `fleet up` --------------------------------------------------

class _StandInController:
    """Does what the real Controller does before Ray starts: creates the job and reports
    progress; then ends the job in ``end``, as the real one would."""

    end = JobState.SUCCEEDED

    def __init__(self, config: ClusterConfig, store: Store, *, config_json: str, on_progress: Any,
                 resume_job: str, on_output: Any) -> None:
        self.config, self.store, self.config_json, self.on_progress = config, store, config_json, on_progress
        self.job_id = ""

    def run(self) -> Any:
        from fleet.controlplane.controller import Progress, RunResult

        self.job_id = self.store.create_job(self.config.name, self.config.job.steps, self.config_json)
        self.on_progress(Progress(self.job_id, "PENDING", 0, 0, self.config.job.steps, 0, "starting Ray"))
        os.write(1, b"ray chatter that belongs in the log\n")  # Ray's driver prints to fd 1
        self.on_progress(Progress(self.job_id, "RUNNING", 1, 0, self.config.job.steps, 0, "training"))
        self.store.set_job_state(self.job_id, JobState.PLACING)
        self.store.set_job_state(self.job_id, JobState.RUNNING)
        self.store.set_job_state(self.job_id, self.end, "the end")
        return RunResult(self.job_id, self.end, 1, 0, "the end")


@pytest.fixture
def stand_in(monkeypatch) -> type[_StandInController]:
    import fleet.controlplane.controller as controller

    monkeypatch.setattr(controller, "Controller", _StandInController)
    return _StandInController


def test_fleet_run_prints_the_job_id_first_and_exits_0_on_success(project: Path, stand_in, capfd) -> None:
    assert main(["run", "train.py"]) == 0
    out, _ = capfd.readouterr()
    lines = out.splitlines()
    with Store("sqlite:///.fleet/fleet.db") as st:
        (job,) = st.list_jobs()
    assert lines[0] == job.id
    assert job.name == "train" and job.state is JobState.SUCCEEDED
    assert json.loads(job.config_json)["job"]["entrypoint"]["script"] == "train.py"
    assert any(f"job {job.id} SUCCEEDED" in line for line in lines[1:])
    assert "ray chatter" not in out
    assert "ray chatter" in (project / ".fleet" / "logs" / "controller.log").read_text()


def test_fleet_run_json_prints_only_the_summary(project: Path, stand_in, capfd) -> None:
    assert main(["run", "--json", "train.py"]) == 0
    summary = json.loads(capfd.readouterr().out)
    assert summary["state"] == "SUCCEEDED" and summary["job_id"].startswith("j-")


def test_fleet_run_exits_7_when_the_job_failed(project: Path, stand_in, monkeypatch, capfd) -> None:
    monkeypatch.setattr(stand_in, "end", JobState.FAILED)
    assert main(["run", "train.py"]) == JobFailedError.exit_code
    out, err = capfd.readouterr()
    assert out.splitlines()[0].startswith("j-")
    assert "failed: the end" in err


def test_fleet_up_keeps_its_output(project: Path, stand_in, capfd) -> None:
    cluster = project / "cluster.yaml"
    cluster.write_text("ray: {nodes: 1}\njob: {nodes: 1, entrypoint: {script: train.py}}\n")
    assert main(["up", "--cluster", str(cluster)]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[0].startswith("job j-") and "SUCCEEDED" in lines[0]  # no bare job-id line
    assert lines[1].startswith("inspect: fleet replay j-")


# -- fleet logs ---------------------------------------------------------------------

def _logs(root: Path, job: str, attempts: dict[int, dict[int, str]]) -> Path:
    for n, ranks in attempts.items():
        folder = root / "logs" / job / f"attempt-{n}"
        folder.mkdir(parents=True)
        for r, text in ranks.items():
            (folder / f"rank-{r}.log").write_text(text)
        (folder / "rank-0.error.json").write_text("{}")
    return root


def test_logs_of_the_last_attempt_every_rank_prefixed(tmp_path: Path, capsys) -> None:
    state = _logs(tmp_path, "j-1", {1: {0: "old\n"}, 2: {0: "a\nb\n", 1: "c\nno newline", 10: "d\n"}})
    assert main(["logs", "j-1", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] a", "[rank 0] b", "[rank 1] c", "[rank 1] no newline", "[rank 10] d"]
    assert main(["logs", "j-1", "--state-dir", str(state), "--attempt", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["old"]  # one rank shown: no prefix
    assert main(["logs", "j-1", "--state-dir", str(state), "--rank", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["c", "no newline"]


def test_logs_keep_brackets_and_bad_bytes_as_text(tmp_path: Path, capsys) -> None:
    state = _logs(tmp_path, "j-1", {1: {0: ""}})
    (state / "logs" / "j-1" / "attempt-1" / "rank-0.log").write_bytes(b"[bold]x[/] \xff\r\n")
    assert main(["logs", "j-1", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out == "[bold]x[/] \ufffd\n"


@pytest.mark.parametrize(("args", "problem"), [
    (["j-2"], "job j-2: no logs under {state}/logs"),
    (["j-1", "--attempt", "3"], "job j-1 has no logs for attempt 3 (attempts with logs: 1, 2)"),
    (["j-1", "--rank", "5"], "job j-1 attempt 2 has no log for rank 5 (ranks with logs: 0, 1)"),
    (["j-1", "--attempt", "1"], "job j-1 attempt 1 has no rank logs in {state}/logs/j-1/attempt-1"),
    (["../logs"], "job ../logs: no logs under {state}/logs"),
])
def test_logs_that_do_not_exist_are_one_line_exit_3(tmp_path: Path, capsys, args: list[str], problem: str) -> None:
    state = _logs(tmp_path, "j-1", {1: {}, 2: {0: "a\n", 1: "b\n"}})
    code = main(["logs", *args, "--state-dir", str(state)])
    out, err = capsys.readouterr()
    assert code == NotFoundError.exit_code == 3
    assert _one_line(out + err) == "error: " + problem.format(state=state)


def test_follow_prints_lines_as_they_arrive_until_the_attempt_ends(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path}/fleet.db") as st:
        config = run_config("t.py", [], nodes=1, nproc_per_node=2, workdir=tmp_path)
        job = st.create_job("t", 0, config.model_dump_json())
        attempt = st.create_attempt(job)
        folder = tmp_path / "logs" / job / f"attempt-{attempt}"
        folder.mkdir(parents=True)
        got: list[str] = []
        arrived = threading.Event()

        def write(line: str) -> None:
            got.append(line)
            arrived.set()

        def ranks() -> None:
            with open(folder / "rank-0.log", "ab") as f0:
                f0.write(b"first\n")
                f0.flush()
                assert arrived.wait(20), "follow never printed the first line"
                (folder / "rank-1.log").write_bytes(b"from one\n")
                f0.write(b"unfinished")
            st.set_attempt_state(job, attempt, AttemptState.RUNNING)
            st.set_attempt_state(job, attempt, AttemptState.FAILED, "rank 1 died")

        t = threading.Thread(target=ranks, name="ranks")
        t.start()
        t0 = time.monotonic()
        follow_logs(st, job, attempt, folder, None, write, poll_s=0.02)
        t.join(timeout=20)
        assert time.monotonic() - t0 < 20
    assert got[0] == "[rank 0] first"
    assert sorted(got[1:]) == ["[rank 0] unfinished", "[rank 1] from one"]


def test_follow_through_the_cli_on_an_ended_job(tmp_path: Path, capsys) -> None:
    state = _logs(tmp_path, "placeholder", {})
    with Store(f"sqlite:///{state}/fleet.db") as st:
        job = st.create_job("t", 0, "{}")
        st.set_job_state(job, JobState.STOPPED, "stopped")
    _logs(state, job, {1: {3: "x\n"}})
    assert main(["logs", job, "--follow", "--state-dir", str(state), "--rank", "3"]) == 0
    assert capsys.readouterr().out == "x\n"
