"""`--json` on `fleet quarantine`, `fleet release` and `fleet db upgrade`, and FLEET_STORE
in their place of --store, on both store backends (a real SQLite file, a real
PostgreSQL server). Nothing but the JSON document reaches stdout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fleet.controlplane.cli.common import CLUSTER_ENV, STATE_DIR_ENV, STORE_ENV
from fleet.controlplane.cli.main import main
from fleet.controlplane.errors import NotFoundError
from fleet.controlplane.store import Store, migrate
from fleet.controlplane.store.engine import redact

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _no_fleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (STORE_ENV, STATE_DIR_ENV, CLUSTER_ENV):
        monkeypatch.delenv(name, raising=False)


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # the whole of stdout is one JSON document


def test_quarantine_and_release_json(store_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with Store(store_url) as st:
        st.upsert_node("node-1", "ray-node-1", "127.0.0.1", "{}")
    before = time.time()
    got = _json(capsys, "quarantine", "node-1", "--reason", "ECC errors", "--store", store_url, "--json")
    assert got.keys() == {"node", "state", "reason", "quarantined_since"}
    assert (got["node"], got["state"], got["reason"]) == ("node-1", "quarantined", "ECC errors")
    assert before - 1 <= got["quarantined_since"] <= time.time() + 1
    # again: the first reason and time are kept, and shown
    again = _json(capsys, "quarantine", "node-1", "--reason", "other", "--store", store_url, "--json")
    assert again == got
    # no controller runs here (an empty --state-dir): released untested, so no GEMM verdict
    empty = tmp_path / "no-controller"
    empty.mkdir()
    capsys.readouterr()
    assert main(["release", "node-1", "--store", store_url, "--state-dir", str(empty), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"node": "node-1", "released": True, "gemm_check": None}
    assert "without a known-answer GEMM test" in err  # the warning is on stderr, never in the JSON
    # healthy already: nothing moved
    assert _json(capsys, "release", "node-1", "--store", store_url, "--json") == {
        "node": "node-1", "released": False, "gemm_check": None}
    with Store(store_url) as st:
        assert [(t.to_state, t.actor) for t in st.node_history("node-1")] == [
            ("healthy", "controller"), ("quarantined", "operator"), ("healthy", "operator")]


def test_the_store_variable_stands_in_for_the_flag(store_url: str, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with Store(store_url) as st:
        st.upsert_node("node-2", "ray-node-2", "127.0.0.1", "{}")
    monkeypatch.setenv(STORE_ENV, store_url)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))  # holds no controller.json
    monkeypatch.chdir(tmp_path)  # no .fleet here: only the variable names a store
    assert _json(capsys, "quarantine", "node-2", "--reason", "flaky NIC", "--json")["state"] == "quarantined"
    assert [n["state"] for n in _json(capsys, "nodes", "--json")] == ["quarantined"]
    assert _json(capsys, "release", "node-2", "--json")["released"] is True
    capsys.readouterr()
    assert main(["quarantine", "node-9", "--reason", "x", "--json"]) == NotFoundError.exit_code
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 2 and "node-9" in err


def test_db_upgrade_json(store_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                         tmp_path: Path) -> None:
    if store_url.startswith("sqlite"):
        Path(store_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    head = migrate.head()
    got = _json(capsys, "db", "upgrade", "--url", store_url, "--json")
    assert got == {"url": redact(store_url), "before": None, "after": head, "changed": True}
    assert migrate.inspect_url(store_url).state == migrate.AT_HEAD
    # at head: nothing to do, said so; FLEET_STORE names the store as --url does
    monkeypatch.setenv(STORE_ENV, store_url)
    monkeypatch.chdir(tmp_path)
    assert _json(capsys, "db", "upgrade", "--json") == {"url": redact(store_url), "before": head, "after": head,
                                                        "changed": False}
    assert _json(capsys, "db", "current", "--json")["state"] == "head"
