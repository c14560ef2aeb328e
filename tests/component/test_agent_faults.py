"""The agent's side of the chaos faults aimed at it (partition, agent-down) and agent
restarts on the same local port.

Real gRPC servers on 127.0.0.1: the controller over a real store (both backends), real
NodeAgents, for agent-down a real agent process killed by SIGKILL, and for the workers
either a plain NodeAgent stub or the real ``workers.reporter.Reporter``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane.agent_server import AgentRegistry
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.kinds import FaultKind
from tests.component.conftest import TOKEN, start_server
from tests.component.test_uplink_delivery import _job, _steps
from fleet.workers.reporter import Reporter
from fleet.workers.spec import WorkerSpec

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


# -- helpers ------------------------------------------------------------------------------


def _wait(cond: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _agent(address: str, tmp_path: Path, **kw: object) -> NodeAgent:
    args: dict = dict(node_name="node-0", controller_address=address, token=TOKEN)
    settings: dict = dict(batch_interval_s=0.05, heartbeat_interval_s=0.2, spill_dir=tmp_path / "spill")
    for key, value in kw.items():
        (settings if key in AgentSettings.model_fields else args)[key] = value
    settings["spill_dir"] = str(settings["spill_dir"])
    return NodeAgent(settings=AgentSettings(**settings), **args)


def _fault(job_id: str, attempt: int, kind: str, rank: int = -1, duration_s: float = 0.0,
           command_id: str = "f-1") -> events_pb2.Command:
    return events_pb2.Command(command_id=command_id, job_id=job_id, attempt=attempt, rank=rank,
                              fault=events_pb2.FaultSpec(kind=FaultKind(kind).wire, duration_s=duration_s))


class _Worker:
    """One rank reporting over one long-lived channel, as a worker does."""

    def __init__(self, address: str, job_id: str, attempt: int, rank: int = 0) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = agent_pb2_grpc.NodeAgentStub(self.channel)
        self.job_id, self.attempt, self.rank = job_id, attempt, rank
        self.sent = 0   # steps 1..sent were accepted by the agent

    def report(self, n: int = 0) -> list[events_pb2.Command]:
        """Report the next ``n`` steps; the commands the agent hands back."""
        reply = self.stub.Report(agent_pb2.WorkerReport(
            job_id=self.job_id, attempt=self.attempt, rank=self.rank,
            events=_steps(self.job_id, self.attempt, self.sent + 1, n, self.rank)), timeout=5)
        self.sent += n
        return list(reply.commands)

    def close(self) -> None:
        self.channel.close()


def _stored_steps(store, job_id: str) -> list[int]:  # noqa: ANN001
    return sorted(s.step for s in store.steps(job_id))


# -- partition ----------------------------------------------------------------------------


def test_partition_silences_the_agent_and_loses_nothing(controller, tmp_path: Path) -> None:  # noqa: ANN001
    store, registry = controller.store, controller.registry
    job_id, attempt = _job(store)
    agent = _agent(controller.address, tmp_path)
    agent.start(connect_timeout_s=10)
    worker = _Worker(agent.local_address, job_id, attempt)
    try:
        worker.report(100)
        assert agent.flush(10)
        assert len(store.steps(job_id)) == 100

        registry.send("node-0", _fault(job_id, attempt, "partition", duration_s=2.0))
        _wait(agent.partitioned, what="the partition to start")
        registry.send("node-0", events_pb2.Command(
            command_id="c-during", job_id=job_id, attempt=attempt, rank=0,
            fault=events_pb2.FaultSpec(kind=FaultKind("crash").wire, at_step=10_000)))
        # the worker keeps reporting; the controller hears nothing, commits nothing,
        # and its command does not reach the agent
        commands: list[events_pb2.Command] = []
        silent = 0.0
        deadline = time.monotonic() + 10
        while silent <= 1.5:
            assert time.monotonic() < deadline, "the controller kept hearing from the agent"
            commands += worker.report(20)
            silent = registry.silent_for(time.monotonic()).get("node-0", 0.0)
            time.sleep(0.02)
        assert agent.partitioned()
        assert "node-0" in registry.connected_nodes()   # silent, not disconnected
        assert len(store.steps(job_id)) == 100
        assert commands == []
        during = worker.sent - 100
        assert agent.stats()["backlog"] == during

        _wait(lambda: not agent.partitioned(), what="the partition to end")
        # the command sent during the partition is delivered after it, once
        deadline = time.monotonic() + 10
        while not commands:
            assert time.monotonic() < deadline, "the command sent during the partition was lost"
            commands += worker.report(5)
            time.sleep(0.02)
        assert [c.command_id for c in commands] == ["c-during"]
        assert worker.report() == []
        assert agent.flush(10), agent.stats()
        _wait(lambda: registry.silent_for(time.monotonic()).get("node-0", 99) < 1.0,
              what="heartbeats to resume")
    finally:
        worker.close()
        agent.close()
    assert _stored_steps(store, job_id) == list(range(1, worker.sent + 1)), "events lost or duplicated"
    stats = agent.stats()
    assert stats["partitions"] == 1 and stats["dropped_events"] == 0


def test_a_stream_broken_during_a_partition_reconnects_only_after_it(store, tmp_path: Path) -> None:  # noqa: ANN001
    registry = AgentRegistry()
    server, _ = start_server(store, registry)
    port = _port(server.address)
    job_id, attempt = _job(store)
    agent = _agent(server.address, tmp_path, batch_max_events=50)
    agent.start(connect_timeout_s=10)
    worker = _Worker(agent.local_address, job_id, attempt)
    try:
        worker.report(100)
        assert agent.flush(10)
        agent.partition(3.0)
        worker.report(200)
        server.close(grace_s=0)              # the controller goes away during the partition
        registry = AgentRegistry()
        server, _ = start_server(store, registry, port=port)   # and is back before it ends
        while agent.partitioned():
            assert "node-0" not in registry.connected_nodes(), "connected during the partition"
            worker.report(10)
            time.sleep(0.05)
        assert registry.wait_for({"node-0"}, timeout_s=10) == set()
        assert agent.flush(20), agent.stats()
        assert agent.stats()["reconnects"] >= 1
    finally:
        worker.close()
        agent.close()
        server.close()
    assert _stored_steps(store, job_id) == list(range(1, worker.sent + 1)), "events lost or duplicated"


def test_close_during_a_partition_ends_it_and_flushes(controller, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(controller.store)
    agent = _agent(controller.address, tmp_path)
    agent.start(connect_timeout_s=10)
    worker = _Worker(agent.local_address, job_id, attempt)
    try:
        agent.partition(60.0)
        worker.report(100)
    finally:
        worker.close()
        started = time.monotonic()
        agent.close()
    assert time.monotonic() - started < 10
    assert _stored_steps(controller.store, job_id) == list(range(1, 101))


def test_end_partition_lifts_it_early(controller, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(controller.store)
    agent = _agent(controller.address, tmp_path)
    agent.start(connect_timeout_s=10)
    worker = _Worker(agent.local_address, job_id, attempt)
    try:
        agent.partition(60.0)
        worker.report(100)
        assert not agent.flush(0.5)
        agent.end_partition()
        assert not agent.partitioned()
        assert agent.flush(10), agent.stats()
    finally:
        worker.close()
        agent.close()
    assert _stored_steps(controller.store, job_id) == list(range(1, 101))


# -- agent-down ---------------------------------------------------------------------------


def test_agent_down_calls_die_and_reaches_no_worker(controller, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(controller.store)
    died = threading.Event()
    agent = _agent(controller.address, tmp_path, die=died.set)
    agent.start(connect_timeout_s=10)
    worker = _Worker(agent.local_address, job_id, attempt)
    try:
        worker.report()
        controller.registry.send("node-0", _fault(job_id, attempt, "agent-down"))
        assert died.wait(10)
        assert worker.report() == []
    finally:
        worker.close()
        agent.close()


_AGENT_PROCESS = """
import logging, sys
from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
controller, token, port, spill = sys.argv[1:5]
agent = NodeAgent(node_name="node-0", controller_address=controller, token=token, local_port=int(port),
                  settings=AgentSettings(spill_dir=spill, batch_interval_s=0.05, heartbeat_interval_s=0.2))
print(agent.start(connect_timeout_s=20), flush=True)
sys.stdin.read()   # until the test closes stdin
agent.close()
"""


@contextlib.contextmanager
def _agent_process(controller_address: str, port: int, spill: Path, log_path: Path) -> Iterator[
        tuple[subprocess.Popen, str]]:
    """A NodeAgent in its own process; yields it and the local address it serves."""
    with open(log_path, "a") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", _AGENT_PROCESS, controller_address, TOKEN, str(port), str(spill)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
            start_new_session=True,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        assert line, f"the agent process did not start (rc {proc.poll()}): {log_path.read_text()}"
        yield proc, line.strip()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def test_agent_down_kills_the_process_and_a_restart_on_the_same_port_serves_its_workers(
        controller, tmp_path: Path) -> None:  # noqa: ANN001
    store, registry = controller.store, controller.registry
    job_id, attempt = _job(store)
    port = _free_port()
    log_path = tmp_path / "agents.log"
    received: list[events_pb2.Command] = []
    spec = WorkerSpec(job_id=job_id, attempt=attempt, rank=0, world_size=1, node_name="node-0",
                      master_addr="127.0.0.1", master_port=0, agent_address=f"127.0.0.1:{port}",
                      checkpoint_dir=str(tmp_path / "ckpt"), report_interval_s=0.1)

    with _agent_process(controller.address, port, tmp_path / "spill", log_path) as (first, address):
        assert address == spec.agent_address
        reporter = Reporter(spec, on_command=received.append)
        try:
            for e in _steps(job_id, attempt, 1, 50):
                reporter.emit(e)
            _wait(lambda: len(store.steps(job_id)) == 50, what="the first events to be stored")
            epoch = registry.session("node-0").epoch

            registry.send("node-0", _fault(job_id, attempt, "agent-down"))
            assert first.wait(10) == -signal.SIGKILL
            _wait(lambda: "node-0" not in registry.connected_nodes(), what="the controller to see the stream end")

            # the worker keeps its events while no agent serves its address
            failures = reporter.send_failures
            for e in _steps(job_id, attempt, 51, 50):
                reporter.emit(e)
            _wait(lambda: reporter.send_failures > failures, what="a failed report")
            assert reporter.pending == 50

            with _agent_process(controller.address, port, tmp_path / "spill", log_path) as (second, again):
                assert again == address
                assert registry.wait_for({"node-0"}, timeout_s=10) == set()
                session = registry.session("node-0")
                assert session.epoch != epoch and session.local_address == address
                _wait(lambda: len(store.steps(job_id)) == 100, timeout_s=30,
                      what="the events buffered by the worker to reach the new agent")
                registry.send("node-0", events_pb2.Command(
                    command_id="c-after", job_id=job_id, attempt=attempt, rank=0, stop=True))
                _wait(lambda: received, what="a command through the new agent")
                reporter.close()
                assert second.stdin is not None
                second.stdin.close()
                assert second.wait(30) == 0, log_path.read_text()
        finally:
            reporter.close()
    assert [c.command_id for c in received] == ["c-after"]
    assert reporter.dropped == 0
    assert _stored_steps(store, job_id) == list(range(1, 101)), "events lost or duplicated"
    assert "agent-down fault" in log_path.read_text()


# -- restart on the same port -------------------------------------------------------------


def test_a_restarted_agent_serves_the_same_port_to_the_same_channel(
        controller, tmp_path: Path) -> None:  # noqa: ANN001
    store, registry = controller.store, controller.registry
    job_id, attempt = _job(store)
    first = _agent(controller.address, tmp_path)
    address = first.start(connect_timeout_s=10)
    worker = _Worker(address, job_id, attempt)
    try:
        worker.report(100)
        assert first.flush(10)
        epoch = registry.session("node-0").epoch
        first.close()
        with pytest.raises(grpc.RpcError):
            worker.report(1)

        second = _agent(controller.address, tmp_path, local_port=_port(address))
        assert second.start(connect_timeout_s=10) == address
        try:
            # the worker's channel finds the new agent by itself (after its reconnect backoff)
            deadline = time.monotonic() + 15
            while True:
                try:
                    worker.report(100)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the worker never reached the new agent"
                    time.sleep(0.1)
            assert second.flush(10)
            session = registry.session("node-0")
            assert session.connected and session.epoch != epoch
        finally:
            second.close()
    finally:
        worker.close()
    assert _stored_steps(store, job_id) == list(range(1, 201))


def test_a_port_still_served_by_a_live_agent_is_refused(controller, tmp_path: Path) -> None:  # noqa: ANN001
    live = _agent(controller.address, tmp_path / "live")
    address = live.start(connect_timeout_s=10)
    try:
        spill = tmp_path / "second"
        second = _agent(controller.address, tmp_path, node_name="node-1", spill_dir=spill,
                        local_port=_port(address))
        with pytest.raises(OSError, match="cannot serve workers"):
            second.start(connect_timeout_s=10)
        assert "node-1" not in controller.registry.connected_nodes()
        assert not any(spill.rglob("*.lock")), "the refused agent kept its spill folder"
    finally:
        live.close()
