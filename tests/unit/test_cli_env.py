"""Where a command finds its store, state folder and cluster file: the flag, else its
FLEET_* variable, else the cluster file's value, else the built-in default; `fleet up
--set` (and the variables `fleet up` takes as overrides) refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet.controlplane.cli.common import CLUSTER_ENV, STATE_DIR_ENV, STORE_ENV
from fleet.controlplane.cli.main import main
from fleet.controlplane.config import DEFAULT_CLUSTER_FILE
from fleet.controlplane.errors import ConfigError, NotFoundError, UnavailableError
from fleet.controlplane.store import Store

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_fleet_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (STORE_ENV, STATE_DIR_ENV, CLUSTER_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # the defaults (.fleet/...) are relative to the working directory


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _store_with_job(path: Path, name: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{path}"
    with Store(url) as st:
        st.create_job(name, 1, "{}")
    return url


def _cluster(path: Path, store: Path, state_dir: Path) -> Path:
    path.write_text(f"name: c\nstate_dir: {state_dir}\nstore:\n  url: sqlite:///{store}\n")
    return path


def _job_names(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    code, out, err = _run(capsys, "jobs", "--json", *argv)
    assert code == 0, err
    return [j["name"] for j in json.loads(out)]


# -- the store ------------------------------------------------------------------

def test_store_flag_beats_variable_beats_cluster_file_beats_default(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flag = _store_with_job(tmp_path / "flag.db", "from-flag")
    env = _store_with_job(tmp_path / "env.db", "from-env")
    _store_with_job(tmp_path / "file.db", "from-file")
    _store_with_job(tmp_path / ".fleet" / "fleet.db", "from-default")  # examples/local.yaml's store.url
    cluster = _cluster(tmp_path / "c.yaml", tmp_path / "file.db", tmp_path / "state")

    assert _job_names(capsys) == ["from-default"]
    assert _job_names(capsys, "--cluster", str(cluster)) == ["from-file"]
    monkeypatch.setenv(CLUSTER_ENV, str(cluster))
    assert _job_names(capsys) == ["from-file"]
    monkeypatch.setenv(STORE_ENV, env)
    assert _job_names(capsys) == ["from-env"]
    assert _job_names(capsys, "--cluster", str(cluster)) == ["from-env"]  # the store's variable beats a file
    assert _job_names(capsys, "--store", flag) == ["from-flag"]


@pytest.mark.parametrize("where", ["flag", "env", "cluster", "default"])
def test_a_missing_store_is_named_by_where_it_came_from(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str) -> None:
    missing = tmp_path / "typo" / "x.db"
    args: list[str] = []
    if where == "flag":
        args, source = ["--store", f"sqlite:///{missing}"], "--store"
    elif where == "env":
        monkeypatch.setenv(STORE_ENV, f"sqlite:///{missing}")
        source = STORE_ENV
    elif where == "cluster":
        cluster = _cluster(tmp_path / "c.yaml", missing, tmp_path / "state")
        monkeypatch.setenv(CLUSTER_ENV, str(cluster))
        source = f"{cluster}: store.url"
    else:
        missing, source = Path(".fleet/fleet.db"), f"{DEFAULT_CLUSTER_FILE}: store.url"
    code, out, err = _run(capsys, "nodes", *args)
    assert code == NotFoundError.exit_code
    error, hint = err.strip().splitlines()
    assert error == f"error: {source}: no store at {missing} (nothing has run with it yet?)"
    assert hint.startswith("hint: ") and STORE_ENV in hint and out == ""
    assert not (tmp_path / "typo").exists() and not (tmp_path / ".fleet").exists()


def test_an_empty_variable_counts_as_unset(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    _store_with_job(tmp_path / ".fleet" / "fleet.db", "from-default")
    monkeypatch.setenv(STORE_ENV, "")
    monkeypatch.setenv(CLUSTER_ENV, "")
    assert _job_names(capsys) == ["from-default"]


# -- the state folder -----------------------------------------------------------

def _controller_json_looked_up(capsys: pytest.CaptureFixture[str], *argv: str) -> Path:
    """The controller.json `fleet inject-fault` looked for (no controller runs anywhere here)."""
    code, _, err = _run(capsys, "inject-fault", "--job", "j", "--kind", "crash", "--rank", "0", *argv)
    assert code == UnavailableError.exit_code, err
    error, hint = err.strip().splitlines()
    assert hint.startswith("hint: ") and STATE_DIR_ENV in hint
    return Path(error.split("(", 1)[1].split(" does not exist")[0])


def test_state_dir_flag_beats_variable_beats_cluster_file_beats_default(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cluster = _cluster(tmp_path / "c.yaml", tmp_path / "file.db", tmp_path / "file-state")
    assert _controller_json_looked_up(capsys) == Path(".fleet/controller.json")
    assert _controller_json_looked_up(capsys, "--cluster", str(cluster)) == tmp_path / "file-state/controller.json"
    monkeypatch.setenv(CLUSTER_ENV, str(cluster))
    assert _controller_json_looked_up(capsys) == tmp_path / "file-state/controller.json"
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "env-state"))
    assert _controller_json_looked_up(capsys) == tmp_path / "env-state/controller.json"
    flag = _controller_json_looked_up(capsys, "--state-dir", str(tmp_path / "flag-state"))
    assert flag == tmp_path / "flag-state/controller.json"


def test_fleet_logs_reads_the_state_folder_of_the_variable(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = tmp_path / "elsewhere" / "logs" / "j-1" / "attempt-1"
    folder.mkdir(parents=True)
    (folder / "rank-0.log").write_text("hello from rank 0\n")
    code, _, err = _run(capsys, "logs", "j-1")
    assert code == NotFoundError.exit_code and "no logs under .fleet/logs" in err and STATE_DIR_ENV in err
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "elsewhere"))
    code, out, err = _run(capsys, "logs", "j-1")
    assert code == 0, err
    assert out == "hello from rank 0\n"


# -- fleet up / fleet config show: the variables and --set as overrides ----------

def _shown(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = _run(capsys, "config", "show", "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def test_fleet_up_takes_the_variables_as_overrides_and_set_beats_them(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cluster = _cluster(tmp_path / "c.yaml", tmp_path / "file.db", tmp_path / "file-state")
    shown = _shown(capsys, "--cluster", str(cluster))
    assert (shown["store"]["url"], shown["state_dir"]) == (f"sqlite:///{tmp_path}/file.db", str(tmp_path / "file-state"))
    monkeypatch.setenv(STORE_ENV, "sqlite:///env.db")
    monkeypatch.setenv(STATE_DIR_ENV, "env-state")
    shown = _shown(capsys, "--cluster", str(cluster))
    assert (shown["store"]["url"], shown["state_dir"]) == ("sqlite:///env.db", "env-state")
    shown = _shown(capsys, "--cluster", str(cluster), "--set", "state_dir=set-state", "--set", "job.steps=12")
    assert (shown["store"]["url"], shown["state_dir"], shown["job"]["steps"]) == ("sqlite:///env.db", "set-state", 12)
    monkeypatch.setenv(CLUSTER_ENV, str(cluster))
    assert _shown(capsys)["name"] == "c"
    assert _shown(capsys, "--cluster", str(DEFAULT_CLUSTER_FILE))["name"] == "local-demo"


def test_a_cluster_variable_naming_no_file_says_so(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CLUSTER_ENV, str(tmp_path / "gone.yaml"))
    code, out, err = _run(capsys, "up")
    assert code == ConfigError.exit_code
    error, hint = err.strip().splitlines()
    assert error == f"error: {CLUSTER_ENV}: {tmp_path / 'gone.yaml'}: no such file"
    assert hint.startswith(f"hint: {CLUSTER_ENV} names a file") and out == ""


def test_fleet_up_with_a_bad_set_exits_2_naming_the_key_before_anything_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fleet.controlplane.cli.main", "up", "--set", "job.steps=abc"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == ConfigError.exit_code == 2, proc.stderr
    error, hint = proc.stderr.strip().splitlines()
    assert error.startswith("error: --set job.steps=abc: job.steps: Input should be a valid integer")
    assert hint.startswith("hint: ") and "fleet config schema" in hint
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    # nothing started: no state folder, no log, no store, no Ray session (its imports alone take longer)
    assert list(tmp_path.iterdir()) == [] and took < 30, took


# -- fleet run --set ---------------------------------------------------------------

def test_fleet_run_set_is_fleets_before_the_script_and_the_programs_after() -> None:
    import typer

    from fleet.controlplane.cli.main import app
    from fleet.controlplane.cli.run import program_start

    command = typer.main.get_command(app).commands["run"]
    assert program_start(["--set", "job.max_restarts=1", "t.py", "--set", "x=1"], command) == 2
    assert program_start(["--set=detect.hang.action=observe", "--nodes", "2", "t.py"], command) == 3


def test_fleet_run_applies_set_last_and_validates_it(tmp_path: Path) -> None:
    from fleet.controlplane.cli.run import run_config
    from fleet.controlplane.config_overrides import parse_overrides

    config = run_config("t.py", ["--lr", "0.1"], nodes=2, workdir=tmp_path, overrides=parse_overrides(
        ["detect.hang.action=observe", "job.max_restarts=0", "job.entrypoint.tee=false"]))
    assert config.detect.hang.action.value == "observe" and config.job.max_restarts == 0
    assert config.job.user_program.tee is False and config.job.user_program.args == ["--lr", "0.1"]
    with pytest.raises(ConfigError) as info:
        run_config("t.py", [], workdir=tmp_path, overrides=parse_overrides(["job.max_restarts=-1"]))
    assert str(info.value).startswith("--set job.max_restarts=-1: job.max_restarts: Input should be greater")


def test_fleet_run_with_a_bad_set_exits_2_before_anything_starts(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    code, out, err = _run(capsys, "run", "--set", "job.steps=5", "train.py", "--set", "mine")
    assert code == ConfigError.exit_code and out == ""
    error, hint = err.strip().splitlines()
    # a built-in trainer setting: a program's steps are its own
    assert error.startswith("error: --set job.steps=5: job: steps is a setting of the built-in trainer"), error
    assert hint.startswith("hint: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]
