"""Node checks end to end: a real NodeAgent runs the known-answer GEMM test, its result
travels the real agent stream to a real controller gRPC server over a real store (both
backends), ``NodeChecks`` judges it, and `fleet nodes` / `fleet release` show and act on it.

Covered: a health_check command -> result in the store and `fleet nodes`; the sdc-gemm
fault -> the test fails -> the node is quarantined (actor policy, element and bound in
the reason); `fleet release` refused while the node is defective, allowed with --force,
gated by a passing test on a sound node, and untested (warned) with no controller; the
idle test; no agent / no result as their own verdicts.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleet.agent.node_agent import GemmChecker, NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane import auth
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.cli.main import main
from fleet.controlplane.client import ControlClient
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.errors import ConfigError, StateError, UnavailableError
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.lifecycle import NodeActor, NodeState
from fleet.controlplane.node_checks import NO_AGENT, TIMED_OUT, NodeChecks
from fleet.controlplane.store import Store
from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
from tests.component.conftest import TOKEN, StoreJobControl

pytestmark = pytest.mark.timeout(90)


def _wait(cond: Callable[[], object], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class Site:
    store: Store
    registry: AgentRegistry
    checks: NodeChecks
    server: ControllerServer
    state_dir: Path
    tmp_path: Path
    url: str

    def agent(self, node: str, **settings: object) -> NodeAgent:
        a = NodeAgent(node_name=node, controller_address=self.server.address, token=TOKEN,
                      settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2,
                                             spill_dir=str(self.tmp_path / "spill"), gemm_size=64, **settings))
        return a   # started by ``with``


@pytest.fixture
def site(store: Store, store_url: str, tmp_path: Path) -> Iterator[Site]:
    registry = AgentRegistry()
    checks = NodeChecks(store, registry)
    server = ControllerServer(
        AgentServicer(store, registry, TOKEN, controller_id="ctl-test", on_node_check=checks.observe),
        ControlServicer(StoreJobControl(store), TOKEN, node_checks=checks), port=0).start()
    state_dir = tmp_path / "state-dir"
    state_dir.mkdir()
    auth.write_controller_info(state_dir, auth.ControllerInfo(server.address, TOKEN, "", os.getpid()))
    try:
        yield Site(store, registry, checks, server, state_dir, tmp_path, store_url)
    finally:
        server.close()


def _cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _node(store: Store, name: str):  # noqa: ANN202
    return next(n for n in store.list_nodes() if n.name == name)


def test_a_health_check_lands_in_the_store_and_fleet_nodes(site: Site, capsys: pytest.CaptureFixture) -> None:
    url = site.url
    with site.agent("node-0"):
        assert _node(site.store, "node-0").health == "unknown"
        result = site.checks.check(["node-0"], timeout_s=30, job_id="", attempt=0)["node-0"]
        assert result.ok and not result.quarantined, result
        assert (result.dtype, result.size, result.device) == ("float32", 64, "cpu")
        assert 0 <= result.error <= result.bound and "ok: worst element" in result.reason
        n = _node(site.store, "node-0")
        assert (n.health, n.state) == ("ok", NodeState.HEALTHY) and "float32 64x64 GEMM on cpu" in n.health_reason
        # the result is a row of sdc_checks outside any job (no job id, no rank)
        _wait(lambda: "node-0" in site.store.last_gemm_checks(), what="the gemm row")
        row = site.store.last_gemm_checks()["node-0"]
        assert (row.job_id, row.rank, row.kind, row.ok, row.step) == ("", None, "gemm", True, 0)
        assert json.loads(row.detail)["trigger"] == "command"
        assert [r.id for r in site.store.gemm_checks("node-0")] == [row.id]
    code, out, _ = _cli(capsys, "nodes", "--store", url, "--json")
    assert code == 0
    (shown,) = json.loads(out)
    assert shown["health"] == "ok" and shown["gemm_check"]["ok"] is True
    assert "float32 64x64 GEMM on cpu ok" in shown["gemm_check"]["summary"]
    code, out, _ = _cli(capsys, "nodes", "--store", url)
    assert code == 0 and "gemm test" in out and re.search(r"ok \d+s ago", out)


def test_sdc_gemm_makes_the_test_fail_and_quarantines_the_node(site: Site, capsys: pytest.CaptureFixture) -> None:
    with site.agent("node-0") as a0, site.agent("node-1"):
        site.registry.send("node-0", events_pb2.Command(
            command_id="f-1", job_id="", rank=-1, fault=events_pb2.FaultSpec(kind=FaultKind.SDC_GEMM.wire)))
        _wait(lambda: a0.defective, what="the sdc-gemm fault to reach the agent")
        got = site.checks.preflight(["node-0", "node-1"], timeout_s=30)
        assert list(got) == ["node-0", "node-1"]
        bad, good = got["node-0"], got["node-1"]
        assert good.ok and not good.quarantined
        assert not bad.ok and bad.verdict == "failed" and bad.quarantined
        assert (bad.row, bad.col) == (5, 3) and bad.error > bad.bound > 0
        n0 = _node(site.store, "node-0")
        assert n0.state is NodeState.QUARANTINED and n0.health == "failed"
        assert "element (5, 3)" in n0.quarantine_reason and "bound" in n0.quarantine_reason
        last = site.store.node_history("node-0")[-1]
        assert (last.to_state, last.actor) == (NodeState.QUARANTINED, NodeActor.POLICY.value)
        assert _node(site.store, "node-1").state is NodeState.HEALTHY

        # release is refused while the node is defective, and it stays quarantined
        code, _, err = _cli(capsys, "release", "node-0", "--state-dir", str(site.state_dir),
                            "--store", site.url)
        assert code == StateError.exit_code
        assert "cannot release node-0" in err and "element (5, 3)" in err and "--force" in err
        assert _node(site.store, "node-0").state is NodeState.QUARANTINED
        # a sound node quarantined by hand is released once its test passes
        site.store.quarantine_node("node-1", "suspected", actor=NodeActor.OPERATOR)
        code, out, _ = _cli(capsys, "release", "node-1", "--state-dir", str(site.state_dir),
                            "--store", site.url)
        assert code == 0 and "node-1 released" in out
        assert "GEMM test passed" in site.store.node_history("node-1")[-1].reason
        # --force skips the test
        code, out, _ = _cli(capsys, "release", "node-0", "--force", "--state-dir", str(site.state_dir),
                            "--store", site.url)
        assert code == 0 and "node-0 released" in out
        assert _node(site.store, "node-0").state is NodeState.HEALTHY


def test_release_without_a_controller_and_without_an_agent(site: Site, capsys: pytest.CaptureFixture) -> None:
    site.store.upsert_node("node-9", "ray-9", "127.0.0.1", "{}")
    site.store.quarantine_node("node-9", "bad", actor=NodeActor.OPERATOR)
    # a controller is running, but node-9 has no agent: refused, with the way out
    code, _, err = _cli(capsys, "release", "node-9", "--state-dir", str(site.state_dir), "--store", site.url)
    assert code == UnavailableError.exit_code and "no connected agent" in err and "--force" in err
    assert _node(site.store, "node-9").state is NodeState.QUARANTINED
    code, _, err = _cli(capsys, "release", "node-9", "--timeout", "0", "--state-dir", str(site.state_dir),
                        "--store", site.url)
    assert code == ConfigError.exit_code and "--timeout" in err
    # no controller running here: released untested, with a warning
    empty = site.tmp_path / "no-controller"
    empty.mkdir()
    code, out, err = _cli(capsys, "release", "node-9", "--state-dir", str(empty), "--store", site.url)
    assert code == 0 and "node-9 released" in out and "without a known-answer GEMM test" in err
    assert _node(site.store, "node-9").state is NodeState.HEALTHY


def test_release_json_carries_the_gemm_verdict_and_finds_the_controller_by_variable(
        site: Site, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # no --state-dir and no --store: FLEET_STATE_DIR and FLEET_STORE name the running site
    monkeypatch.setenv("FLEET_STATE_DIR", str(site.state_dir))
    monkeypatch.setenv("FLEET_STORE", site.url)
    with site.agent("node-1"):
        site.store.upsert_node("node-1", "ray-1", "127.0.0.1", "{}")
        site.store.quarantine_node("node-1", "suspected", actor=NodeActor.OPERATOR)
        code, out, err = _cli(capsys, "release", "node-1", "--json")
        assert code == 0, err
        got = json.loads(out)  # stdout is the JSON document alone: the test's line is in it
        assert (got["node"], got["released"], got["gemm_check"]["verdict"]) == ("node-1", True, "ok")
        assert "float32 64x64 GEMM on cpu" in got["gemm_check"]["reason"]
        assert _node(site.store, "node-1").state is NodeState.HEALTHY
        assert "GEMM test passed" in site.store.node_history("node-1")[-1].reason


def test_check_node_rpc_and_its_bad_input(site: Site) -> None:
    with site.agent("node-0"), ControlClient(site.server.address, TOKEN) as client:
        reply = client.check_node("node-0", timeout_s=30)
        assert reply.verdict == "ok" and (reply.dtype, reply.size) == ("float32", 64) and reply.at > 0
        assert client.check_node("node-7", timeout_s=5).verdict == NO_AGENT
        with pytest.raises(ConfigError, match="timeout_s"):
            client.check_node("node-0", timeout_s=0)
        with pytest.raises(ConfigError, match="node"):
            client.check_node("", timeout_s=5)


def test_a_result_that_never_comes_times_out(site: Site) -> None:
    class Silent:  # an agent that takes the command and never answers
        def send(self, node_name: str, command: events_pb2.Command) -> None:
            assert command.WhichOneof("kind") == "health_check"

    t = time.monotonic()
    got = NodeChecks(site.store, Silent()).check(["node-0"], timeout_s=0.3)["node-0"]
    assert got.verdict == TIMED_OUT and "within 0.3 s" in got.reason
    assert time.monotonic() - t < 5


def test_an_idle_node_tests_itself(site: Site) -> None:
    with site.agent("node-0", gemm_interval_s=0.2):
        _wait(lambda: "node-0" in site.store.last_gemm_checks(), what="an idle GEMM test")
        row = site.store.last_gemm_checks()["node-0"]
        assert row.ok and json.loads(row.detail)["trigger"] == "idle"
        _wait(lambda: _node(site.store, "node-0").health == "ok", what="the idle verdict")


def test_the_idle_test_waits_while_ranks_report() -> None:
    events: list[events_pb2.Event] = []
    idle = [False]
    checker = GemmChecker("node-x", 16, 0.05, submit=lambda e, urgent: events.append((e, urgent)),
                          idle=lambda: idle[0])
    checker.start()
    try:
        ran = checker.run_now(timeout_s=30)   # on demand runs whatever ranks do
        assert ran.ok and len(events) == 1
        assert events[0][1] is True           # a command's answer: sent at once
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:   # ten intervals with a rank attached: no test
            assert len(events) == 1
            time.sleep(0.05)
        idle[0] = True
        _wait(lambda: len(events) > 1, what="the idle test once no rank reports")
        assert json.loads(events[-1][0].sdc.detail)["trigger"] == "idle"
        assert events[-1][1] is False         # an idle run waits for the next batch
    finally:
        checker.close()


def _gemm_event(ok: bool, time_ns: int, detail: str = "") -> events_pb2.SdcCheckEvent:
    return events_pb2.SdcCheckEvent(rank=-1, node="node-3", kind="gemm", ok=ok, value="3.4", expected="0.001",
                                    detail=detail, time_ns=time_ns)


def test_an_older_result_changes_nothing_and_any_detail_is_judged(site: Site) -> None:
    site.store.upsert_node("node-3", "ray-3", "127.0.0.1", "{}")
    site.checks.observe("node-3", _gemm_event(False, 2_000, "not json"))
    n = _node(site.store, "node-3")
    assert (n.health, n.state) == ("failed", NodeState.QUARANTINED)
    assert n.quarantine_reason == "known-answer GEMM test failed: not json"
    # a resend of an older, passing result (after a reconnect) does not undo the verdict
    site.checks.observe("node-3", _gemm_event(True, 1_000, '{"summary": "fine"}'))
    assert _node(site.store, "node-3").health == "failed"
    site.checks.observe("node-3", _gemm_event(True, 3_000, "[1, 2]"))   # JSON, not an object
    n = _node(site.store, "node-3")
    assert (n.health, n.health_reason) == ("ok", "[1, 2]")
    # a test that could not run says nothing about the arithmetic: no quarantine
    site.store.upsert_node("node-4", "ray-4", "127.0.0.1", "{}")
    site.checks.observe("node-4", _gemm_event(False, 3_500, '{"error": true, "summary": "torch failed"}'))
    n = _node(site.store, "node-4")
    assert (n.health, n.health_reason, n.state) == ("error", "torch failed", NodeState.HEALTHY)
    # a node the store does not know: the verdict is logged, nothing breaks
    site.checks.observe("node-404", _gemm_event(False, 4_000))
    site.checks.observe("node-3", events_pb2.SdcCheckEvent(kind="fingerprint", time_ns=5_000))  # not ours
    assert _node(site.store, "node-3").health == "ok"


def test_a_test_that_cannot_run_is_reported_as_an_error() -> None:
    events: list[events_pb2.Event] = []
    # size 0: cannot run
    checker = GemmChecker("node-x", 0, 0, submit=lambda e, urgent: events.append(e), idle=lambda: True)
    checker.start()
    try:
        ev = checker.run_now(timeout_s=30)
    finally:
        checker.close()
    detail = json.loads(ev.detail)
    assert not ev.ok and detail["error"] is True and "could not run" in detail["summary"]
    assert [e.sdc for e in events] == [ev]
