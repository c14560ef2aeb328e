"""`fleet status` and `fleet stop` against a real ControlService (the controller's own
JobService) on 127.0.0.1:0 over a real SQLite store, with a real node agent connected; the
store fallback with no controller; and their errors (one line plus a hint, exit codes)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane import auth
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.cli.main import main
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.job_control import JobService, LiveJob
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.store import Store
from fleet.proto import events_pb2 as pb
from tests.component.conftest import TOKEN

pytestmark = pytest.mark.timeout(120)

S = 1_000_000_000
PLACEMENT = ["node-0", "node-0", "node-1", "node-1"]


def _step(job: str, attempt: int, rank: int, step: int, end_s: float) -> pb.Event:
    return pb.Event(step=pb.StepEvent(job_id=job, attempt=attempt, rank=rank, step=step, loss=3.0 - step / 100,
                                      step_time_s=0.001, tokens_per_s=1000.0, end_ns=int(end_s * S)))


def _checkpoint(job: str, attempt: int, step: int) -> pb.Event:
    return pb.Event(checkpoint=pb.CheckpointEvent(job_id=job, attempt=attempt, rank=0, step=step,
                                                  path=f"/ckpt/{step}", manifest_sha256="ab", save_s=0.1,
                                                  time_ns=time.time_ns()))


def _seed(store: Store) -> str:
    """A job whose attempt 1 crashed and attempt 2 runs 4 ranks on node-0 and node-1 at step 12."""
    for n in ("node-0", "node-1"):
        store.upsert_node(n, f"ray-{n}", "127.0.0.1", "{}")
    job = store.create_job("status-demo", total_steps=50, config_json="{}")
    store.set_job_state(job, JobState.PLACING, "placing")
    store.create_attempt(job)
    store.set_attempt_state(job, 1, AttemptState.RUNNING)
    store.set_job_state(job, JobState.RUNNING, "attempt 1 running")
    store.record_incident(job, 1, "crash", "exit", "rank 1 on node-0 was killed\nby signal 9 (SIGKILL)", rank=1,
                          node="node-0")
    store.set_attempt_state(job, 1, AttemptState.FAILED, "crash")
    store.record_action(job, 1, "restart", "crash of rank 1")
    store.set_job_state(job, JobState.RESTARTING, "crash of rank 1")
    store.set_job_state(job, JobState.PLACING, "placing")
    store.create_attempt(job)
    for rank, node in enumerate(PLACEMENT):
        store.record_rank(job, 2, rank, node, 1000 + rank)
    store.set_attempt_state(job, 2, AttemptState.RUNNING)
    store.set_job_state(job, JobState.RUNNING, "attempt 2 running")
    t0 = time.time()
    store.record_batch("a", 1, 1, [_step(job, 2, r, k, t0 + k / 1000) for k in range(1, 13) for r in range(4)]
                       + [_checkpoint(job, 2, 10)])
    store.record_drop("agent-node-1", "node-1", 1, 5, 5, 7, "spill disk full", "agent")
    return job


@dataclass
class Live:
    store: Store
    url: str
    job: LiveJob
    state_dir: Path
    address: str


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path}/fleet.db") as s:
        yield s


@pytest.fixture
def live(store: Store, tmp_path: Path) -> Iterator[Live]:
    """The controller's own JobService behind a real ControlService, its job on attempt 2, the
    agent of node-0 connected (node-1's is not), and controller.json in the state dir."""
    job = LiveJob(job_id=_seed(store))
    job.move_to(2, PLACEMENT)
    registry = AgentRegistry()
    servicer = AgentServicer(store, registry, TOKEN, controller_id="ctl-test")
    server = ControllerServer(servicer, ControlServicer(JobService(store, job, registry, stop_timeout_s=7.0), TOKEN),
                              port=0).start()
    agent = NodeAgent(node_name="node-0", controller_address=server.address, token=TOKEN,
                      settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2))
    state_dir = tmp_path / "state"
    try:
        agent.start(connect_timeout_s=10)
        auth.write_controller_info(state_dir, auth.ControllerInfo(server.address, TOKEN, job.job_id, os.getpid()))
        yield Live(store, f"sqlite:///{tmp_path}/fleet.db", job, state_dir, server.address)
    finally:
        agent.close()
        server.close()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _error(err: str) -> tuple[str, str]:
    """The error line and the hint line: nothing else, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    return lines[0], lines[1]


def test_status_from_the_running_controller(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "status", "--json", "--state-dir", str(live.state_dir), "--store", live.url)
    assert code == 0
    s = json.loads(out)
    assert (s["source"], s["controller"]) == ("controller", live.address)
    j = s["job"]
    assert (j["job_id"], j["state"], j["attempt"], j["attempt_state"]) == (live.job.job_id, "RUNNING", 2, "RUNNING")
    assert (j["step"], j["total_steps"], j["world_size"], j["restarts"], j["checkpoint_step"]) == (12, 50, 4, 1, 10)
    assert j["loss"] == pytest.approx(2.88) and j["tokens_per_s"] == pytest.approx(4000.0)
    assert j["ettr"] is not None and 0 < j["ettr"] <= 1
    assert j["last_incident"]["kind"] == "crash" and j["last_incident"]["rank"] == 1
    assert j["last_incident"]["evidence"] == "rank 1 on node-0 was killed by signal 9 (SIGKILL)"
    nodes = {n["name"]: n for n in s["nodes"]}
    assert set(nodes) == {"node-0", "node-1"}
    assert (nodes["node-0"]["ranks"], nodes["node-0"]["agent_connected"]) == ([0, 1], True)
    assert 0 <= nodes["node-0"]["silent_s"] < 5
    assert (nodes["node-1"]["ranks"], nodes["node-1"]["agent_connected"], nodes["node-1"]["silent_s"]) == (
        [2, 3], False, None)
    assert nodes["node-1"]["events_lost"] == 7
    # without JOB: the controller's job; the text view says where it comes from
    code, out, _ = _run(capsys, "status", "--state-dir", str(live.state_dir), "--store", live.url)
    assert code == 0
    assert live.job.job_id in out and f"from the running controller at {live.address}" in out
    assert "step 12/50" in out and "ETTR" in out and "last incident: crash" in out


def test_status_from_the_store_when_no_controller_answers(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    live_json = json.loads(_run(capsys, "status", live.job.job_id, "--json", "--state-dir", str(live.state_dir),
                                "--store", live.url)[1])
    (live.state_dir / "controller.json").unlink()
    code, out, _ = _run(capsys, "status", live.job.job_id, "--json", "--state-dir", str(live.state_dir),
                        "--store", live.url)
    assert code == 0
    s = json.loads(out)
    assert (s["source"], s["controller"]) == ("store", None)
    # the same figures as the controller's, but for what only it knows
    for key in ("job_id", "state", "attempt", "step", "loss", "tokens_per_s", "restarts", "checkpoint_step",
                "last_incident", "world_size"):
        assert s["job"][key] == live_json["job"][key], key
    assert [(n["name"], n["ranks"], n["agent_connected"]) for n in s["nodes"]] == [
        ("node-0", [0, 1], False), ("node-1", [2, 3], False)]
    # without JOB: the newest job in the store; the header says where it comes from
    code, out, _ = _run(capsys, "status", "--state-dir", str(live.state_dir), "--store", live.url)
    assert code == 0 and "from the store (no controller running)" in out and live.job.job_id in out


def test_ettr_so_far_is_fleet_reports(store: Store) -> None:
    """The same ETTR as `fleet report`, summed in SQL: attempt 1's steps above the step
    attempt 2 restored do not count, each step counts its slowest rank."""
    from fleet.controlplane.report import load_report
    from fleet.controlplane.status import ettr_so_far

    job = store.create_job("ettr", total_steps=10, config_json="{}")
    store.set_job_state(job, JobState.PLACING, "placing")
    store.create_attempt(job)
    t0 = time.time()
    events = [pb.Event(step=pb.StepEvent(job_id=job, attempt=1, rank=r, step=k, step_time_s=0.01 * (1 + r + k),
                                         end_ns=int((t0 + k) * S))) for k in range(1, 9) for r in range(2)]
    store.set_attempt_state(job, 1, AttemptState.FAILED, "crash")
    store.create_attempt(job)
    store.set_attempt_restored(job, 2, 5)
    events += [pb.Event(step=pb.StepEvent(job_id=job, attempt=2, rank=r, step=k, step_time_s=0.02,
                                          end_ns=int((t0 + 10 + k) * S))) for k in range(6, 11) for r in range(2)]
    store.record_batch("a", 1, 1, events)
    now = t0 + 30
    expected = load_report(store, job, now)["ettr"]
    got = ettr_so_far(store, store.get_job(job), store.get_attempts(job), now)
    assert got == expected and got is not None and got > 0
    # by hand: attempt 1 keeps steps 1..5 (slowest rank 1: 0.01 * (2 + k)), attempt 2 steps 6..10
    productive = sum(0.01 * (2 + k) for k in range(1, 6)) + 5 * 0.02
    assert got == pytest.approx(productive / (now - store.get_job(job).created_at), abs=1e-4)


def test_a_controller_that_does_not_answer_falls_back_to_the_store(store: Store, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    job = _seed(store)
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auth.write_controller_info(tmp_path / "state", auth.ControllerInfo(f"127.0.0.1:{port}", TOKEN, job, 1))
    t0 = time.monotonic()
    code, out, _ = _run(capsys, "status", "--json", "--state-dir", str(tmp_path / "state"),
                        "--store", f"sqlite:///{tmp_path}/fleet.db")
    assert code == 0 and time.monotonic() - t0 < 10
    assert json.loads(out)["source"] == "store" and json.loads(out)["job"]["job_id"] == job


def test_status_of_an_unknown_job_is_3(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    for _ in ("controller", "store"):
        code, _, err = _run(capsys, "status", "j-nope", "--state-dir", str(live.state_dir), "--store", live.url)
        assert code == 3
        error, _hint = _error(err)
        assert "j-nope" in error
        (live.state_dir / "controller.json").unlink(missing_ok=True)


def test_stop_asks_the_controller_and_waits_until_stopped(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    """The service takes the request; a thread plays the attempt runner (the real one is in
    tests/integration/test_fleet_up_status.py): checkpoint, STOPPED, controller.json gone."""
    seen: dict[str, object] = {}

    def runner() -> None:
        if not live.job.stopping.wait(30):
            return
        seen["reason"] = live.job.stop_reason
        live.job.set_stop_phase("checkpointing")
        time.sleep(0.3)  # a step and its checkpoint
        live.store.record_batch("a", 1, 2, [_step(live.job.job_id, 2, r, 13, time.time()) for r in range(4)]
                                + [_checkpoint(live.job.job_id, 2, 13)])
        live.job.set_stop_phase("tearing down")
        reason = f"{live.job.stop_reason}; checkpoint at step 13"
        live.store.set_attempt_state(live.job.job_id, 2, AttemptState.STOPPED, reason)
        live.store.set_job_state(live.job.job_id, JobState.STOPPED, reason)
        time.sleep(0.3)
        auth.remove_controller_info(live.state_dir, os.getpid())

    thread = threading.Thread(target=runner, name="test-runner")
    thread.start()
    try:
        code, out, err = _run(capsys, "stop", live.job.job_id, "--reason", "maintenance", "--json",
                              "--state-dir", str(live.state_dir), "--store", live.url)
    finally:
        live.job.stopping.set()
        thread.join(30)
    assert code == 0, err
    result = json.loads(out)
    assert result["reason"].startswith("stopped by operator ") and "maintenance; checkpoint at step 13" in \
        result["reason"]
    assert "@" in str(seen["reason"])  # user@host
    assert (result["state"], result["checkpoint_step"], result["checkpoint_at_stop"], result["final_step"]) == (
        "STOPPED", 13, True, 13)
    assert result["controller_exited"] is True
    # it has ended now: a second stop says how (4), from the store
    code, _, err = _run(capsys, "stop", live.job.job_id, "--state-dir", str(live.state_dir), "--store", live.url)
    assert code == 4
    error, _ = _error(err)
    assert f"job {live.job.job_id} has already ended: STOPPED (stopped by operator" in error


def test_stop_no_wait_and_timeout(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "stop", live.job.job_id, "--no-wait", "--json", "--state-dir", str(live.state_dir))
    assert code == 0
    assert json.loads(out) == {"job_id": live.job.job_id, "state": "STOPPING", "attempt": 2, "stop_timeout_s": 7.0}
    assert live.job.stopping.is_set() and live.job.stop_reason.startswith("stopped by operator")
    # nobody carries it out here: the wait ends at --timeout, exit 6, saying where it is
    code, _, err = _run(capsys, "stop", live.job.job_id, "--timeout", "0.5", "--state-dir", str(live.state_dir))
    assert code == 6
    error, hint = _error(err)
    assert f"job {live.job.job_id} did not stop within 0.5 s (--timeout); it is RUNNING" in error
    assert "fleet status" in hint


def test_stop_errors(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    state = ["--state-dir", str(live.state_dir), "--store", live.url]
    code, _, err = _run(capsys, "stop", "j-nope", *state)          # the controller runs another job
    assert code == 3 and "j-nope" in _error(err)[0]
    (live.state_dir / "controller.json").unlink()                   # no controller
    code, _, err = _run(capsys, "stop", live.job.job_id, *state)
    assert code == 6
    error, hint = _error(err)
    assert f"cannot stop job {live.job.job_id} (the store says it is RUNNING): no controller is running" in error
    assert "is `fleet up` running?" in hint and "FLEET_STATE_DIR" in hint
    code, _, err = _run(capsys, "stop", "j-nope", *state)           # no controller, no such job
    assert code == 3 and "job j-nope not found" in _error(err)[0]
    code, _, err = _run(capsys, "stop", "j-nope", "--state-dir", str(live.state_dir),
                        "--store", f"sqlite:///{live.state_dir}/absent.db")  # no controller, no store
    assert code == 6 and "no controller is running" in _error(err)[0]
    code, _, err = _run(capsys, "stop", live.job.job_id, "--timeout", "-1", *state)
    assert code == 2 and "--timeout" in _error(err)[0]
    code, _, err = _run(capsys, "status", "--interval", "0", *state)
    assert code == 2 and "--interval" in _error(err)[0]


def _fleet(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "fleet.controlplane.cli.main", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_until(proc: subprocess.Popen[str], text: str, times: int = 1, timeout_s: float = 30.0) -> str:
    """What ``proc`` printed on stdout until ``text`` appeared ``times`` times (AssertionError
    after ``timeout_s``)."""
    assert proc.stdout is not None
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while seen.count(text.encode()) < times:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} within {timeout_s} s; got {seen.decode(errors='replace')!r}"
            if sel.select(left):
                chunk = os.read(fd, 65536)
                assert chunk, f"stdout closed before {text!r}; got {seen.decode(errors='replace')!r}"
                seen += chunk
    return seen.decode()


def test_watch_json_prints_a_line_per_refresh_until_the_job_ends(store: Store, tmp_path: Path) -> None:
    job = _seed(store)
    proc = _fleet("status", job, "--watch", "--json", "--interval", "0.2", "--state-dir", str(tmp_path / "state"),
                  "--store", f"sqlite:///{tmp_path}/fleet.db")
    try:
        first, second = (json.loads(line) for line in _read_until(proc, "\n", times=2).splitlines()[:2])
        assert (first["job"]["state"], second["job"]["state"]) == ("RUNNING", "RUNNING")
        assert second["at"] > first["at"]
        store.set_attempt_state(job, 2, AttemptState.STOPPED, "stopped by operator")
        store.set_job_state(job, JobState.STOPPED, "stopped by operator")
        rest = _read_until(proc, '"STOPPED"')
        assert proc.wait(timeout=30) == 0
        assert json.loads(rest.strip().splitlines()[-1])["job"]["state"] == "STOPPED"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_ends_on_ctrl_c_with_exit_0(store: Store, tmp_path: Path) -> None:
    job = _seed(store)
    proc = _fleet("status", job, "--watch", "--interval", "0.2", "--state-dir", str(tmp_path / "state"),
                  "--store", f"sqlite:///{tmp_path}/fleet.db")
    try:
        # on a pipe each refresh prints a view after the last: wait for the second
        views = _read_until(proc, "from the store (no controller running)", times=2)
        assert views.count(job) >= 2 and "step 12/50" in views
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
