"""Long commands show a spinner on stderr while they work, only on a terminal, and never
on stdout: `--json` output stays one JSON document."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from fleet.controlplane.cli import render
from fleet.controlplane.cli.main import main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """stderr as a terminal (a real Rich console writing to a buffer)."""
    screen = io.StringIO()
    monkeypatch.setattr(render, "err_console", Console(file=screen, force_terminal=True, width=120))
    return screen


def test_db_upgrade_spins_on_stderr_and_prints_only_json(terminal: io.StringIO, capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    assert main(["db", "upgrade", "--url", url, "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["changed"] is True and "upgrading" not in out
    assert f"upgrading store {url}" in terminal.getvalue()


def test_replay_of_dumps_spins_on_stderr(terminal: io.StringIO, capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    from tests.unit.test_diagnosis_dumps import write_world

    folder = write_world(tmp_path / "d")
    main(["replay", "--dumps", str(folder), "--json"])
    out = capsys.readouterr().out
    assert json.loads(out)["verdict"] and "reading dumps" not in out
    # the spinner's message follows the reading: files read of files found
    assert "read 4/4 dumps" in terminal.getvalue()


def test_without_a_terminal_progress_prints_nothing(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(render, "err_console", Console(file=screen, force_terminal=False))
    with render.progress("working") as say:
        say("still working")
    assert screen.getvalue() == "" and capsys.readouterr() == ("", "")
