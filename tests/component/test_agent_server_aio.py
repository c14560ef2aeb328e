"""The asyncio AgentService: agent streams hold no thread, and a stream parked on a full
writer queue stops reading without stalling the others.

Real parts: the real ``ControllerServer`` and ``AgentServicer`` over a real SQLite file,
real ``grpc.aio`` clients speaking the wire contract (Hello, EventBatch, Ack), a real
``IngestWriter`` and a real SQLite write lock to stall it.
"""

from __future__ import annotations

import collections
import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from fleet.controlplane.store.writer import IngestWriter
from fleet.proto import agent_pb2, control_pb2, control_pb2_grpc, events_pb2
from fleet.proto.contract import CONNECT_METHOD_PATH, TOKEN_METADATA_KEY
from tests.component.conftest import TOKEN, StoreJobControl

pytestmark = pytest.mark.timeout(90)

#: More streams than the old server's 1,024-thread pool could hold open at once.
STREAMS = 1100
#: Threads the whole test process may have while every stream is open (the old design:
#: two per stream, over 2,200).
MAX_THREADS = 64


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path}/fleet.db") as s:
        yield s


def _job(store: Store) -> tuple[str, int]:
    job_id = store.create_job("aio-test", total_steps=10_000, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    return job_id, store.create_attempt(job_id)


def _hello(i: int) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(hello=agent_pb2.Hello(
        agent_id=f"agent-{i}", node_name=f"node-{i}", epoch=1, token=TOKEN))


def _batch(i: int, seq: int, job_id: str, attempt: int, rank: int, step: int) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(batch=agent_pb2.EventBatch(
        agent_id=f"agent-{i}", epoch=1, seq=seq, events=[events_pb2.Event(step=events_pb2.StepEvent(
            job_id=job_id, attempt=attempt, rank=rank, step=step, loss=1.0, step_time_s=0.01,
            tokens_per_s=1.0, end_ns=time.time_ns()))]))


def _open(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    connect = channel.stream_stream(
        CONNECT_METHOD_PATH, request_serializer=agent_pb2.AgentMessage.SerializeToString,
        response_deserializer=agent_pb2.ControllerMessage.FromString)
    return connect(metadata=((TOKEN_METADATA_KEY, TOKEN),))


def _threads() -> int:
    """Every thread of this process, the native ones (gRPC's) included."""
    return psutil.Process().num_threads()


def test_more_streams_than_the_old_thread_pool_are_served_without_a_thread_each(store: Store) -> None:
    job_id, attempt = _job(store)
    registry = AgentRegistry()
    server = ControllerServer(AgentServicer(store, registry, TOKEN, controller_id="ctl-aio"),
                              ControlServicer(StoreJobControl(store), TOKEN)).start()
    peak: list[int] = []
    try:
        async def agents() -> list[tuple[int, int]]:
            # 22 connections of 50 streams: agents each have their own connection in life;
            # here fewer keep the test's own file descriptors modest
            channels = [grpc.aio.insecure_channel(server.address) for _ in range(STREAMS // 50)]
            all_open = asyncio.Event()
            opened = 0

            async def agent(i: int) -> tuple[int, int]:
                nonlocal opened
                call = _open(channels[i % len(channels)])
                await call.write(_hello(i))
                welcome = await asyncio.wait_for(call.read(), 30)
                assert welcome.WhichOneof("msg") == "welcome", welcome
                await call.write(_batch(i, 1, job_id, attempt, rank=i, step=1))
                ack = await asyncio.wait_for(call.read(), 30)
                opened += 1
                if opened == STREAMS:   # the last ack: every stream is open now
                    peak.append(_threads())
                    peak.append(len(registry.connected_nodes()))
                    all_open.set()
                await asyncio.wait_for(all_open.wait(), 30)   # every stream open at once
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
                return ack.ack.epoch, ack.ack.seq

            try:
                acks = await asyncio.gather(*(agent(i) for i in range(STREAMS)))
            finally:
                await asyncio.gather(*(c.close() for c in channels))
            return acks

        started = time.monotonic()
        acks = asyncio.run(agents())
        took = time.monotonic() - started
    finally:
        server.close()
    assert acks == [(1, 1)] * STREAMS
    threads, connected = peak
    assert connected == STREAMS, "every stream was welcomed and open at the same time"
    assert threads < MAX_THREADS, f"{threads} threads with {STREAMS} streams open"
    steps = store.steps(job_id)
    assert sorted(s.rank for s in steps) == list(range(STREAMS)), "each batch stored exactly once"
    assert registry.connected_nodes() == set()
    print(f"{STREAMS} streams in {took:.1f} s, {threads} threads at the peak")


def test_a_parked_stream_stops_reading_but_the_loop_serves_on(store: Store, tmp_path: Path) -> None:
    """A full writer queue parks the stream (it reads no further batches, nothing is
    dropped) while commands still reach it and the other services answer; once the store
    frees up every batch is acked in order and stored once."""
    job_id, attempt = _job(store)
    registry = AgentRegistry()
    servicer = AgentServicer(store, registry, TOKEN, controller_id="ctl-aio")
    servicer.writer.close()   # the same writer class, with a queue of 3 batches
    servicer.writer = IngestWriter(store, servicer.metrics, max_queued_events=3, max_group_events=1)
    server = ControllerServer(servicer, ControlServicer(StoreJobControl(store), TOKEN)).start()
    lock = sqlite3.connect(tmp_path / "fleet.db", isolation_level=None, timeout=10)
    released = threading.Event()

    def queued() -> float:
        return servicer.metrics.registry.get_sample_value("fleet_ingest_queued_events") or 0.0

    async def agent() -> tuple[list[int], list[str], float]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = _open(channel)
            await call.write(_hello(0))
            assert (await asyncio.wait_for(call.read(), 10)).WhichOneof("msg") == "welcome"
            lock.execute("BEGIN IMMEDIATE")   # the writer's commits now wait on SQLite's lock
            for seq in range(1, 11):
                await call.write(_batch(0, seq, job_id, attempt, rank=0, step=seq))
            deadline = time.monotonic() + 10
            while queued() < 3:   # one batch in the stalled commit, three queued: parked
                assert time.monotonic() < deadline, "the writer queue never filled"
                await asyncio.sleep(0.02)
            # the parked stream still gets commands; another service still answers
            registry.send("node-0", events_pb2.Command(command_id="c-1", job_id=job_id, attempt=attempt))
            msg = await asyncio.wait_for(call.read(), 5)
            commands = [msg.command.command_id]
            health = health_pb2_grpc.HealthStub(channel)
            t = time.monotonic()
            status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            jobs = await control_pb2_grpc.ControlServiceStub(channel).ListJobs(
                control_pb2.ListJobsRequest(), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5)
            answer_s = time.monotonic() - t
            assert [j.job_id for j in jobs.jobs] == [job_id]
            # the queue may have been full before the writer took the first batch into its
            # (stalled) commit: the parked stream then puts one more in at its next try
            deadline = time.monotonic() + 10
            while queued() != 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert queued() == 3, "the queue stays full: the parked stream read no further batch"
            lock.execute("ROLLBACK")
            released.set()
            acked = []   # an ack covers every batch up to its seq: a run of them may come as one
            while not acked or acked[-1] < 10:
                msg = await asyncio.wait_for(call.read(), 10)
                assert msg.WhichOneof("msg") == "ack", msg
                assert not msg.ack.rejected
                acked.append(msg.ack.seq)
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            return acked, commands, answer_s

    try:
        acked, commands, answer_s = asyncio.run(agent())
    finally:
        if not released.is_set() and lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
        server.close()
    assert commands == ["c-1"]
    assert acked == sorted(set(acked)) and acked[-1] == 10, f"acks in the order the batches were sent: {acked}"
    assert answer_s < 2.0, f"health and ListJobs took {answer_s:.2f} s with a stream parked"
    assert sorted(s.step for s in store.steps(job_id)) == list(range(1, 11))


def test_a_run_of_acks_is_written_as_its_highest_and_rejections_are_kept() -> None:
    from fleet.controlplane.agent_server import _next_message

    def ack(seq: int, rejected: str = "", epoch: int = 1) -> agent_pb2.ControllerMessage:
        return agent_pb2.ControllerMessage(ack=agent_pb2.Ack(epoch=epoch, seq=seq, rejected=rejected))

    command = agent_pb2.ControllerMessage(command=events_pb2.Command())
    outbox = collections.deque([ack(5), ack(6), ack(7, "bad"), ack(8), ack(9), command, ack(10),
                                ack(11, epoch=2)])
    written = []
    while outbox:
        written.append(_next_message(outbox))
    assert [(m.WhichOneof("msg"), m.ack.seq, m.ack.rejected, m.ack.epoch) for m in written] == [
        ("ack", 6, "", 1), ("ack", 7, "bad", 1), ("ack", 9, "", 1), ("command", 0, "", 0),
        ("ack", 10, "", 1), ("ack", 11, "", 2)]


def test_parked_streams_take_turns_instead_of_all_waking_on_every_ack(store: Store, tmp_path: Path) -> None:
    """Many streams parked behind a stalled writer: once it frees up, every batch is
    stored once and acked, and the parked streams were woken about once per batch that
    waited (the old design woke every parked stream on every ack: streams x acks)."""
    job_id, attempt = _job(store)
    registry = AgentRegistry()
    servicer = AgentServicer(store, registry, TOKEN, controller_id="ctl-aio")
    servicer.writer.close()
    servicer.writer = IngestWriter(store, servicer.metrics, max_queued_events=2, max_group_events=1)
    server = ControllerServer(servicer, None).start()
    lock = sqlite3.connect(tmp_path / "fleet.db", isolation_level=None, timeout=10)
    streams, per_stream = 40, 3
    parked_at_peak: list[int] = []

    def queued() -> float:
        return servicer.metrics.registry.get_sample_value("fleet_ingest_queued_events") or 0.0

    async def agents() -> list[list[int]]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            calls = [_open(channel) for _ in range(streams)]
            for i, call in enumerate(calls):
                await call.write(_hello(i))
                assert (await asyncio.wait_for(call.read(), 10)).WhichOneof("msg") == "welcome"
            lock.execute("BEGIN IMMEDIATE")   # the writer's commits now wait on SQLite's lock
            for i, call in enumerate(calls):
                for seq in range(1, per_stream + 1):
                    await call.write(_batch(i, seq, job_id, attempt, rank=i, step=seq))
            deadline = time.monotonic() + 10
            while len(servicer._parked) < streams - 3:   # all but the queued and the committing
                assert time.monotonic() < deadline, f"only {len(servicer._parked)} streams parked"
                await asyncio.sleep(0.02)
            parked_at_peak.append(len(servicer._parked))
            while queued() != 2 and time.monotonic() < deadline:   # full (see the test above)
                await asyncio.sleep(0.02)
            assert queued() == 2
            lock.execute("ROLLBACK")

            async def drain(call: grpc.aio.StreamStreamCall) -> list[int]:
                acked: list[int] = []
                while not acked or acked[-1] < per_stream:
                    msg = await asyncio.wait_for(call.read(), 30)
                    assert msg.WhichOneof("msg") == "ack" and not msg.ack.rejected, msg
                    acked.append(msg.ack.seq)
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
                return acked

            return await asyncio.gather(*(drain(c) for c in calls))

    try:
        acks = asyncio.run(agents())
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
        server.close()
    assert all(a == sorted(set(a)) and a[-1] == per_stream for a in acks), acks
    steps = store.steps(job_id)
    assert sorted((s.rank, s.step) for s in steps) == [(r, q) for r in range(streams) for q in range(1, per_stream + 1)]
    # a turn per ack, one per batch let in (room for the next?) and one per refusal after
    # that: a few per batch; waking every parked stream on every ack would be ~streams x batches
    batches = streams * per_stream
    assert servicer._parked.woken <= 3 * batches, (
        f"{servicer._parked.woken} wake-ups for {batches} batches ({parked_at_peak[0]} streams parked at the peak)")
    assert len(servicer._parked) == 0
