"""The CLI entry point: one clear line and the right exit code for each kind of error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.controlplane.cli.main import main
from fleet.controlplane.errors import ConfigError, NotFoundError, UnavailableError
from fleet.controlplane.store import Store

pytestmark = pytest.mark.timeout(60)

USAGE = 2  # click's exit code for a usage error


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(text: str) -> str:
    """The error's line: an error prints it and one ``hint:`` line, nothing else."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[1].startswith("hint: "), f"expected an error and a hint, got: {text!r}"
    return lines[0]


def test_up_with_missing_cluster_file(capsys) -> None:
    code, out, err = _run(capsys, "up", "--cluster", "/nonexistent.yaml")
    assert code == ConfigError.exit_code == 2
    line = _one_line(out + err)
    assert "/nonexistent.yaml" in line
    assert "no such file" in line
    assert "Traceback" not in out + err


def test_up_with_unknown_key_names_key_and_line(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\njob:\n  steps: 10\n  stepz: 20\n")
    code, out, err = _run(capsys, "up", "--cluster", str(bad))
    assert code == 2
    line = _one_line(out + err)
    assert f"{bad}:4: job.stepz: unknown key" in line
    assert "Traceback" not in out + err
    assert not (tmp_path / ".fleet").exists()


def test_jobs_json_on_an_empty_store(capsys, tmp_path: Path) -> None:
    Store(f"sqlite:///{tmp_path}/x.db").close()
    code, out, err = _run(capsys, "jobs", "--store", f"sqlite:///{tmp_path}/x.db", "--json")
    assert code == 0, err
    assert json.loads(out) == []


@pytest.mark.parametrize("command", ["jobs", "nodes", "replay"])
def test_reading_a_store_that_does_not_exist_creates_nothing(capsys, tmp_path: Path, command: str) -> None:
    args = [command, *(["j-x"] if command == "replay" else []), "--store", f"sqlite:///{tmp_path}/typo/x.db"]
    code, out, err = _run(capsys, *args)
    assert code == NotFoundError.exit_code
    assert f"--store: no store at {tmp_path}/typo/x.db" in _one_line(out + err)
    assert not (tmp_path / "typo").exists()


def test_replay_of_unknown_job_is_not_found(capsys, tmp_path: Path) -> None:
    Store(f"sqlite:///{tmp_path}/x.db").close()
    code, out, err = _run(capsys, "replay", "nope", "--store", f"sqlite:///{tmp_path}/x.db")
    assert code == NotFoundError.exit_code == 3
    line = _one_line(out + err)
    assert "nope" in line
    assert "Traceback" not in out + err


def test_inject_fault_without_a_running_controller(capsys, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    code, out, err = _run(capsys, "inject-fault", "--job", "j", "--kind", "crash", "--rank", "0",
                          "--state-dir", str(state))
    assert code != 0
    assert code == UnavailableError.exit_code
    line = _one_line(out + err)
    assert "controller.json" in line


def test_inject_fault_without_a_target(capsys, tmp_path: Path) -> None:
    # no --rank and no --node: refused as a flag error before any controller is looked up
    code, out, err = _run(capsys, "inject-fault", "--job", "j", "--kind", "crash", "--state-dir", str(tmp_path))
    assert code == 2
    line = _one_line(out + err)
    assert "--rank" in line and "--node" in line
    assert "Traceback" not in out + err


def test_inject_fault_with_rank_and_node(capsys, tmp_path: Path) -> None:
    code, out, err = _run(capsys, "inject-fault", "--job", "j", "--kind", "crash", "--rank", "0",
                          "--node", "node-0", "--state-dir", str(tmp_path))
    assert code == 2
    line = _one_line(out + err)
    assert "--rank" in line and "--node" in line


def test_inject_fault_negative_rank(capsys, tmp_path: Path) -> None:
    code, out, err = _run(capsys, "inject-fault", "--job", "j", "--kind", "crash", "--rank", "-1",
                          "--state-dir", str(tmp_path))
    assert code == 2
    assert "--rank" in _one_line(out + err)


def test_unknown_option_is_a_usage_error(capsys) -> None:
    code, out, err = _run(capsys, "jobs", "--no-such-option")
    assert code == USAGE
    assert "--no-such-option" in out + err
    assert "Traceback" not in out + err


def test_unknown_command_is_a_usage_error(capsys) -> None:
    code, out, err = _run(capsys, "frobnicate")
    assert code == USAGE
    assert "frobnicate" in out + err


def test_missing_required_option_is_a_usage_error(capsys) -> None:
    code, out, err = _run(capsys, "inject-fault", "--job", "j")
    assert code == USAGE
    assert "kind" in out + err
    assert "Traceback" not in out + err


def test_bad_option_value_is_a_usage_error(capsys) -> None:
    code, out, err = _run(capsys, "inject-fault", "--job", "j", "--kind", "crash", "--rank", "abc")
    assert code == USAGE
    assert "abc" in out + err or "--rank" in out + err
    assert "Traceback" not in out + err


def test_no_arguments_prints_usage(capsys) -> None:
    code, out, err = _run(capsys)
    assert code in (0, USAGE)
    assert "Usage" in out + err


def test_help_exits_zero(capsys) -> None:
    code, out, err = _run(capsys, "--help")
    assert code == 0
    assert "inject-fault" in out + err


def test_traceback_flag_shows_the_traceback(capsys) -> None:
    code, out, err = _run(capsys, "up", "--cluster", "/nonexistent.yaml", "--traceback")
    assert code == 2
    assert "Traceback" in out + err
    assert "ConfigError" in out + err
    assert "/nonexistent.yaml" in out + err
