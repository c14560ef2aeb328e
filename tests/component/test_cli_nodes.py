"""`fleet quarantine` / `fleet release` / `fleet nodes` on both store backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.controlplane.cli.main import main
from fleet.controlplane.errors import ConfigError, NotFoundError
from fleet.controlplane.store import Store

pytestmark = pytest.mark.timeout(60)


def _nodes(capsys: pytest.CaptureFixture, url: str) -> dict[str, dict]:
    capsys.readouterr()
    assert main(["nodes", "--store", url, "--json"]) == 0
    return {n["name"]: n for n in json.loads(capsys.readouterr().out)}


def test_quarantine_is_stored_shown_and_reversible(store_url: str, capsys: pytest.CaptureFixture,
                                                   tmp_path: Path) -> None:
    with Store(store_url) as st:
        for name in ("node-0", "node-1"):
            st.upsert_node(name, f"ray-{name}", "127.0.0.1", "{}")
    assert main(["quarantine", "node-1", "--reason", "crashed twice in 10 min", "--store", store_url]) == 0
    assert "node-1 quarantined since" in capsys.readouterr().out
    nodes = _nodes(capsys, store_url)
    assert (nodes["node-1"]["state"], nodes["node-1"]["quarantine_reason"]) == ("quarantined", "crashed twice in 10 min")
    assert nodes["node-1"]["quarantined_since"] and nodes["node-0"]["state"] == "healthy"
    # never tested: no GEMM verdict yet
    assert (nodes["node-0"]["health"], nodes["node-0"]["gemm_check"]) == ("unknown", None)
    # persisted: a fresh Store (a restarted controller) sees it, and re-registering keeps it
    with Store(store_url) as st:
        st.upsert_node("node-1", "ray-node-1-new", "127.0.0.1", "{}")
        (n1,) = [n for n in st.list_nodes() if n.name == "node-1"]
        assert n1.state == "quarantined"
    # no controller runs here (an empty --state-dir): released without the GEMM test, warned
    assert main(["release", "node-1", "--store", store_url, "--state-dir", str(tmp_path)]) == 0
    assert "without a known-answer GEMM test" in capsys.readouterr().err
    nodes = _nodes(capsys, store_url)
    assert (nodes["node-1"]["state"], nodes["node-1"]["quarantine_reason"]) == ("healthy", "")


def test_bad_quarantine_requests_are_one_line_errors(store_url: str, capsys: pytest.CaptureFixture) -> None:
    Store(store_url).close()
    assert main(["quarantine", "node-7", "--reason", "x", "--store", store_url]) == NotFoundError.exit_code
    assert "node-7" in capsys.readouterr().err
    assert main(["quarantine", "node-7", "--reason", "  ", "--store", store_url]) == ConfigError.exit_code
    assert "--reason" in capsys.readouterr().err
    assert main(["release", "node-7", "--store", store_url]) == NotFoundError.exit_code


def test_operator_moves_are_in_the_node_history(store_url: str, capsys: pytest.CaptureFixture,
                                                tmp_path: Path) -> None:
    with Store(store_url) as st:
        st.upsert_node("node-1", "ray-node-1", "127.0.0.1", "{}")
    assert main(["quarantine", "node-1", "--reason", "bad GEMM", "--store", store_url]) == 0
    # again: the first reason is kept, the output shows it, nothing new is stored
    assert main(["quarantine", "node-1", "--reason", "still bad", "--store", store_url]) == 0
    assert "quarantined since" in capsys.readouterr().out.splitlines()[-1]
    last = _nodes(capsys, store_url)["node-1"]["last_transition"]
    assert {k: last[k] for k in ("from_state", "to_state", "reason", "actor", "job_id")} == {
        "from_state": "healthy", "to_state": "quarantined", "reason": "bad GEMM", "actor": "operator",
        "job_id": None}
    assert main(["release", "node-1", "--reason", "GEMM passes again", "--store", store_url,
                 "--state-dir", str(tmp_path)]) == 0
    assert "node-1 released" in capsys.readouterr().out
    assert main(["release", "node-1", "--store", store_url]) == 0  # healthy already: a no-op
    assert "node-1 was not quarantined" in capsys.readouterr().out
    with Store(store_url) as st:
        assert [(t.to_state, t.reason, t.actor) for t in st.node_history("node-1")] == [
            ("healthy", "registered", "controller"), ("quarantined", "bad GEMM", "operator"),
            ("healthy", "GEMM passes again", "operator")]
    nodes = _nodes(capsys, store_url)
    assert (nodes["node-1"]["state"], nodes["node-1"]["last_transition"]["actor"]) == ("healthy", "operator")
