"""Every error is one line plus a hint of what to do: each FleetError class has a hint, a
raise site may give a better one, the CLI prints exactly the two lines (``fleet
<command>`` in a hint made the command that ran), and --traceback still shows the rest."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest

from fleet.controlplane import errors
from fleet.controlplane.cli.main import main
from fleet.controlplane.errors import ConfigError, FleetError, JobStoppedError, NotFoundError
from fleet.controlplane.store import Store

pytestmark = pytest.mark.timeout(60)

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, FleetError)]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_has_a_one_line_hint_of_its_own(cls: type[FleetError]) -> None:
    assert isinstance(cls.hint, str) and cls.hint.strip() and "\n" not in cls.hint
    if cls is not FleetError:
        assert "hint" in vars(cls), f"{cls.__name__} inherits FleetError's hint"


def test_a_raise_site_may_give_its_own_hint_and_it_survives_pickling() -> None:
    plain = NotFoundError("job 'x' not found")
    assert plain.hint == NotFoundError.hint and str(plain) == "job 'x' not found"
    own = NotFoundError("node 'n' not found", hint="`fleet nodes` lists them")
    assert own.hint == "`fleet nodes` lists them" and NotFoundError.hint != own.hint
    back = pickle.loads(pickle.dumps(own))  # how Ray carries an error between processes
    assert (type(back), str(back), back.hint) == (NotFoundError, "node 'n' not found", "`fleet nodes` lists them")
    assert pickle.loads(pickle.dumps(plain)).hint == NotFoundError.hint


def test_the_exit_codes_are_the_documented_ones() -> None:
    codes = {c.__name__: c.exit_code for c in CLASSES}
    assert codes == {"FleetError": 1, "ConfigError": 2, "DumpError": 2, "NotFoundError": 3, "StateError": 4,
                     "AuthError": 5, "UnavailableError": 6, "JobFailedError": 7, "JobStoppedError": 8,
                     "Interrupted": 130}
    assert "8" in JobStoppedError.hint


@pytest.mark.parametrize(("argv", "code", "error", "hint"), [
    (["up", "--cluster", "/nonexistent.yaml"], 2, "error: /nonexistent.yaml: no such file",
     "hint: --cluster (or FLEET_CLUSTER) names the file"),
    (["inject-fault", "--job", "j", "--kind", "meteor", "--rank", "0"], 2, "error: --kind: unknown fault kind",
     "hint: `fleet inject-fault --help` lists its flags"),
    (["db", "upgrade", "--url", "postgresql://127.0.0.1:1/nope?connect_timeout=1"], None, "error: ",
     "hint: "),
    (["config", "schema", "--output", "/nonexistent/dir/x.json"], 2, "error: --output: cannot write",
     "hint: name a file in a folder that exists"),
])
def test_the_cli_prints_exactly_the_error_and_its_hint(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                       code: int | None, error: str, hint: str) -> None:
    monkeypatch.chdir(tmp_path)
    got, out, err = _run(capsys, *argv)
    assert got != 0 and (code is None or got == code)
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith(error) and lines[1].startswith(hint), lines


def test_a_hint_naming_the_command_names_a_subcommand_too(capsys: pytest.CaptureFixture[str]) -> None:
    class Bad(ConfigError):
        hint = "`fleet <command> --help` says more"

    from fleet.controlplane.cli import main as main_module

    assert main_module._hint(Bad("x"), ["db", "--url", "u", "upgrade"]) == "`fleet db upgrade --help` says more"
    assert main_module._hint(Bad("x"), ["nodes"]) == "`fleet nodes --help` says more"
    assert main_module._hint(NotFoundError("x"), ["nodes"]) == NotFoundError.hint


def test_an_unknown_job_names_where_to_look(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    Store(f"sqlite:///{tmp_path}/x.db").close()
    code, out, err = _run(capsys, "report", "nope", "--store", f"sqlite:///{tmp_path}/x.db")
    assert code == NotFoundError.exit_code and out == ""
    error, hint = err.splitlines()
    assert "nope" in error and "`fleet jobs`" in hint and "--store" in hint


def test_brackets_in_a_message_are_text_not_markup(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _run(capsys, "up", "--set", "job.name=[bold]x")
    assert code == 2
    assert "--set job.name=[bold]x" in err.splitlines()[0]


def test_traceback_shows_the_traceback_then_the_two_lines(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "up", "--cluster", "/nonexistent.yaml", "--traceback")
    assert code == 2
    assert "Traceback" in err and "ConfigError" in err
    assert err.splitlines()[-2:] == [
        "error: /nonexistent.yaml: no such file",
        "hint: --cluster (or FLEET_CLUSTER) names the file; without either fleet runs examples/local.yaml"]
