"""Ingest processes (``controller.ingest_processes``): agent streams served by several
processes on one port, what they forward reaching the controller's registry, observer and
metrics, commands reaching the streams, and a process lost without losing an event.

Real parts: real ingest processes (``python -m fleet.controlplane.ingest_shards``) on a
real PostgreSQL server, real ``grpc.aio`` agent streams speaking the wire contract, a real
``NodeAgent`` with its write-ahead log, and a real controller process SIGKILLed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import grpc
import psutil
import pytest

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane.agent_server import AgentRegistry
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.ingest_shards import IngestShards
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.metrics import ControllerMetrics
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import PreparedBatch
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.contract import CONNECT_METHOD_PATH, TOKEN_METADATA_KEY
from tests.component.conftest import TOKEN
from tests.component.test_agent_stream import _wait

pytestmark = pytest.mark.timeout(120)

STREAMS = 12
STEPS_PER_STREAM = 5


@pytest.fixture
def pg_url(postgres_server) -> Iterator[str]:  # noqa: ANN001
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    with Store(pg_url) as s:
        yield s


class Seen:
    """The controller-side observer: every forwarded batch's steps, by node."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: list[tuple[str, int, int]] = []  # (node, rank, step)

    def __call__(self, node: str, batch: PreparedBatch) -> None:
        with self.lock:
            self.steps += [(node, s.rank, s.step) for s in batch.step_rows()]


def _shards(store_url: str, registry: AgentRegistry, seen: Seen, metrics: ControllerMetrics,
            processes: int = 2) -> IngestShards:
    return IngestShards(processes, store_url=store_url, host="127.0.0.1", port=0, token=TOKEN,
                        controller_id="ctl-shards", registry=registry, observer=seen, metrics=metrics,
                        max_message_bytes=1 << 20)


def _job(store: Store) -> tuple[str, int]:
    job_id = store.create_job("shards-test", total_steps=10_000, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    return job_id, store.create_attempt(job_id)


def _batch(i: int, seq: int, job_id: str, attempt: int) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(batch=agent_pb2.EventBatch(
        agent_id=f"agent-{i}", epoch=1, seq=seq, events=[events_pb2.Event(step=events_pb2.StepEvent(
            job_id=job_id, attempt=attempt, rank=i, step=s, loss=1.0, step_time_s=0.01, tokens_per_s=1.0,
            end_ns=time.time_ns())) for s in range(1 + (seq - 1) * STEPS_PER_STREAM, 1 + seq * STEPS_PER_STREAM)]))


def test_streams_over_two_processes_are_stored_once_and_reach_the_controller(store: Store, pg_url: str) -> None:
    job_id, attempt = _job(store)
    registry, seen, metrics = AgentRegistry(), Seen(), ControllerMetrics()
    with _shards(pg_url, registry, seen, metrics) as shards:
        assert len(shards.pids()) == 2

        async def agents() -> dict[int, list[agent_pb2.ControllerMessage]]:
            # one connection per agent, as in life (a distinct argument keeps gRPC from
            # sharing one): the kernel spreads the connections over the two processes
            channels = [grpc.aio.insecure_channel(shards.address, options=[("fleet.test.agent", i)])
                        for i in range(STREAMS)]
            calls = [ch.stream_stream(CONNECT_METHOD_PATH, request_serializer=agent_pb2.AgentMessage.SerializeToString,
                                      response_deserializer=agent_pb2.ControllerMessage.FromString)(
                metadata=((TOKEN_METADATA_KEY, TOKEN),)) for ch in channels]
            got: dict[int, list[agent_pb2.ControllerMessage]] = {i: [] for i in range(STREAMS)}
            try:
                for i, call in enumerate(calls):
                    await call.write(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
                        agent_id=f"agent-{i}", node_name=f"node-{i}", epoch=1, token=TOKEN)))
                    got[i].append(await call.read())
                    await call.write(_batch(i, 1, job_id, attempt))
                    await call.write(_batch(i, 2, job_id, attempt))
                for i, call in enumerate(calls):
                    while not (got[i][-1].HasField("ack") and got[i][-1].ack.seq == 2):
                        got[i].append(await asyncio.wait_for(call.read(), 20))
                # the controller's registry knows every stream, whichever process serves it
                await asyncio.to_thread(_wait, lambda: len(registry.connected_nodes()) == STREAMS, 10,
                                        "every stream in the controller's registry")
                # counted while the streams are open: each one's end is forwarded too
                served.extend(len(s.sessions) for s in shards.shards)
                # a command for node-3 reaches node-3's stream, through its process
                registry.send("node-3", events_pb2.Command(command_id="c-3", job_id=job_id, attempt=attempt))
                msg = await asyncio.wait_for(calls[3].read(), 10)
                got[3].append(msg)
            finally:
                for ch in channels:
                    await ch.close()
            return got

        served: list[int] = []
        got = asyncio.run(agents())
        assert all(m[0].HasField("welcome") for m in got.values())
        assert got[3][-1].command.command_id == "c-3"
        assert sum(served) == STREAMS, served
        # every batch stored exactly once, and forwarded to the controller's observer
        rows = store.steps(job_id)
        assert sorted((r.rank, r.step) for r in rows) == sorted(
            (i, s) for i in range(STREAMS) for s in range(1, 2 * STEPS_PER_STREAM + 1))
        _wait(lambda: len(seen.steps) == STREAMS * 2 * STEPS_PER_STREAM, 10, "every batch at the observer")
        assert sorted(seen.steps) == sorted((f"node-{i}", i, s) for i in range(STREAMS)
                                            for s in range(1, 2 * STEPS_PER_STREAM + 1))
        # the processes' counters reach the controller's metrics
        _wait(lambda: metrics.value("fleet_ingest_batches_total") == 2 * STREAMS, 10, "the forwarded counters")
        assert metrics.value("fleet_ingest_events_total") == 2 * STREAMS * STEPS_PER_STREAM
        # the streams ended with their channels: none is connected any more
        _wait(lambda: not registry.connected_nodes(), 10, "the ended streams to leave the registry")
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in shards.pids())


def _report(agent: NodeAgent, job_id: str, attempt: int, first: int, n: int) -> None:
    with grpc.insecure_channel(agent.local_address) as ch:
        agent_pb2_grpc.NodeAgentStub(ch).Report(agent_pb2.WorkerReport(
            job_id=job_id, attempt=attempt, rank=0, events=[events_pb2.Event(step=events_pb2.StepEvent(
                job_id=job_id, attempt=attempt, rank=0, step=s, loss=1.0, step_time_s=0.01,
                end_ns=time.time_ns())) for s in range(first, first + n)]), timeout=10)


def test_a_killed_ingest_process_is_started_again_and_its_agent_loses_nothing(
        store: Store, pg_url: str, tmp_path) -> None:  # noqa: ANN001
    job_id, attempt = _job(store)
    registry, seen, metrics = AgentRegistry(), Seen(), ControllerMetrics()
    with _shards(pg_url, registry, seen, metrics) as shards:
        agent = NodeAgent(node_name="node-0", controller_address=shards.address, token=TOKEN,
                          settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2,
                                                 spill_dir=str(tmp_path / "spill")))
        agent.start(connect_timeout_s=10)
        try:
            _report(agent, job_id, attempt, 1, 50)
            assert agent.flush(10)
            _wait(lambda: "node-0" in registry.connected_nodes(), 10, "node-0 connected")
            serving = next(s for s in shards.shards if s.sessions)
            before = set(shards.pids())
            os.kill(serving.proc.pid, signal.SIGKILL)
            _wait(lambda: "node-0" not in registry.connected_nodes() or registry.session("node-0").shard is not serving,
                  10, "node-0's stream on the killed process to end")
            _report(agent, job_id, attempt, 51, 50)
            assert agent.flush(20)
            # a process took the killed one's place on the same port
            _wait(lambda: len(shards.pids()) == 2 and set(shards.pids()) != before, 30, "a replacement process")
            _wait(lambda: "node-0" in registry.connected_nodes(), 10, "node-0 connected again")
        finally:
            agent.close()
    steps = sorted(s.step for s in store.steps(job_id))
    assert steps == list(range(1, 101))  # each exactly once


def test_ingest_processes_exit_when_their_controller_is_killed(pg_url: str) -> None:
    controller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from fleet.controlplane.agent_server import AgentRegistry
        from fleet.controlplane.ingest_shards import IngestShards
        s = IngestShards(2, store_url={pg_url!r}, host="127.0.0.1", port=0, token={TOKEN!r},
                         controller_id="c", registry=AgentRegistry(), max_message_bytes=1 << 20)
        print(s.address, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        address = controller.stdout.readline().strip()
        assert address.startswith("127.0.0.1:"), address
        children = psutil.Process(controller.pid).children()
        assert len(children) == 2
        controller.kill()
        controller.wait(10)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"ingest processes outlived their controller: {[p.pid for p in alive]}"
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(10)


def test_sqlite_is_refused_with_the_key_named(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="controller.ingest_processes: needs a PostgreSQL store"):
        IngestShards(2, store_url=f"sqlite:///{tmp_path}/f.db", host="127.0.0.1", port=0, token=TOKEN,
                     controller_id="c", registry=AgentRegistry(), max_message_bytes=1 << 20)
