"""The uplink's delivery guarantees: batch bounds, spill to disk, backpressure, recorded
drops when the spill disk fails, batches the controller rejects, and the write-ahead log
an agent killed mid-run leaves to its successor.

Real gRPC servers on 127.0.0.1 (the controller over a real SQLite file, or a small
recording AgentService where the test needs to script the controller's answers), a real
Uplink/NodeAgent, and, for disk failure, a real child process whose file-size limit
makes its spill writes fail with EFBIG.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.agent.spool import Spool
from fleet.agent import uplink
from fleet.agent.uplink import Uplink
from fleet.controlplane.agent_server import AgentRegistry
from fleet.controlplane.lifecycle import JobState
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.contract import EVENT_BATCH_EVENTS_TAG, EVENT_BATCH_MARKS_TAG
from tests.component.conftest import TOKEN, start_server

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


# -- helpers ------------------------------------------------------------------------------


def _job(store) -> tuple[str, int]:  # noqa: ANN001
    job_id = store.create_job("uplink-test", total_steps=100_000, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    return job_id, store.create_attempt(job_id)


def _steps(job_id: str, attempt: int, first: int, n: int, rank: int = 0) -> list[events_pb2.Event]:
    return [
        events_pb2.Event(step=events_pb2.StepEvent(
            job_id=job_id, attempt=attempt, rank=rank, step=s, loss=1.0 / s, step_time_s=0.01,
            tokens_per_s=100.0, end_ns=1_700_000_000_000_000_000 + s,
        ))
        for s in range(first, first + n)
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uplink(address: str, spill_dir: Path | None, node: str = "node-0", **kw: object) -> Uplink:
    hello = agent_pb2.Hello(agent_id=f"agent-{node}", node_name=node, token=TOKEN, epoch=time.time_ns())
    uplink_kw: dict = dict(reconnect_max_s=0.2)
    uplink_kw.update({k: kw.pop(k) for k in ("reconnect_max_s", "on_ack") if k in kw})
    fields = {**AgentSettings().model_dump(), "batch_interval_s": 0.02, "heartbeat_interval_s": 0.2,
              "spill_dir": "" if spill_dir is None else str(spill_dir), **kw}
    # unvalidated on purpose: some tests go below cluster.yaml's floors (a 16 KiB memory
    # budget, a 128 KiB message limit) to reach the spill and drop paths with few events
    settings = AgentSettings.model_construct(**fields)
    return Uplink(
        controller_address=address, token=TOKEN, hello=hello, on_command=lambda c: None,
        heartbeat=lambda: agent_pb2.Heartbeat(agent_id=hello.agent_id, time_ns=time.time_ns()),
        settings=settings, **uplink_kw,
    )


def _spill_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.batch"))


def _wait(cond: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class RecordingAgentService(agent_pb2_grpc.AgentServiceServicer):
    """A scripted controller: records what arrives, acks every batch (or rejects the seqs
    in ``reject``), and on its first stream breaks the stream when ``break_on_seq`` arrives."""

    def __init__(self, reject: dict[int, str] | None = None, break_on_seq: int = 0) -> None:
        self.reject = reject or {}
        self.break_on_seq = break_on_seq
        self.cond = threading.Condition()
        self.received: list[agent_pb2.EventBatch] = []   # every batch, resends included
        self.committed: dict[int, agent_pb2.EventBatch] = {}
        self.drops: list[agent_pb2.DropReport] = []
        self.streams = 0

    def Connect(self, request_iterator, context):  # noqa: ANN001, N802
        with self.cond:
            self.streams += 1
            stream = self.streams
        for msg in request_iterator:
            kind = msg.WhichOneof("msg")
            if kind == "hello":
                yield agent_pb2.ControllerMessage(welcome=agent_pb2.Welcome(controller_id="recording"))
            elif kind == "batch":
                batch = msg.batch
                with self.cond:
                    self.received.append(batch)
                    self.cond.notify_all()
                if stream == 1 and batch.seq == self.break_on_seq:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "test: the stream breaks")
                if batch.seq in self.reject:
                    ack = agent_pb2.Ack(epoch=batch.epoch, seq=batch.seq, rejected=self.reject[batch.seq])
                else:
                    with self.cond:
                        self.committed[batch.seq] = batch
                    ack = agent_pb2.Ack(epoch=batch.epoch, seq=batch.seq)
                yield agent_pb2.ControllerMessage(ack=ack)
            elif kind == "drop":
                with self.cond:
                    self.drops.append(msg.drop)
                    self.cond.notify_all()


@contextlib.contextmanager
def _serve(servicer: agent_pb2_grpc.AgentServiceServicer) -> Iterator[str]:
    executor = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fleet-test-agent-svc")
    server = grpc.server(executor)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0).wait(5)
        executor.shutdown(wait=False, cancel_futures=True)


# -- batching ---------------------------------------------------------------------------


def test_batches_are_bounded_by_events_and_bytes_and_keep_order(tmp_path: Path) -> None:
    big = events_pb2.Event(checkpoint=events_pb2.CheckpointEvent(job_id="j", path="x" * 5000))
    events = _steps("j", 1, 1, 120) + [big] + _steps("j", 1, 121, 30)
    service = RecordingAgentService()
    with _serve(service) as address:
        up = _uplink(address, tmp_path / "spill", batch_max_events=50, batch_max_bytes=2000).start()
        try:
            up.submit(events[:60])
            up.submit(events[60:])
            assert up.flush(10), up.stats()
        finally:
            up.close()
    batches = service.received
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    got = [e for b in batches for e in b.events]
    assert got == events  # every event, once, in order: the hand-built encoding parses back
    for b in batches:
        assert len(b.events) <= 50
        if len(b.events) > 1:
            assert sum(e.ByteSize() for e in b.events) <= 2000
    assert [len(b.events) for b in batches if big in b.events] == [1]  # the large event went alone
    assert up.stats()["acked_events"] == len(events)


def test_on_ack_reports_each_committed_batch(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    service = RecordingAgentService()
    with _serve(service) as address:
        up = _uplink(address, tmp_path / "spill", batch_max_events=10, on_ack=lambda s, n: seen.append((s, n)))
        up.start()
        try:
            up.submit(_steps("j", 1, 1, 35))
            assert up.flush(10)
        finally:
            up.close()
    assert sorted(seen) == [(1, 10), (2, 10), (3, 10), (4, 5)]


# -- spill, backpressure -----------------------------------------------------------------


def test_batches_beyond_memory_spill_to_disk_and_are_delivered_exactly_once(store, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(store)
    port = _free_port()
    spill = tmp_path / "spill"
    up = _uplink(f"127.0.0.1:{port}", spill, batch_max_events=100, batch_max_bytes=8 * 1024,
                 memory_max_bytes=64 * 1024).start()
    server = None
    try:
        n = 4000   # ~ 240 KiB of events: well beyond the 64 KiB kept in memory
        for first in range(1, n + 1, 500):
            up.submit(_steps(job_id, attempt, first, 500), timeout_s=5)
        stats = up.stats()
        files = _spill_files(spill)
        assert stats["spilled_batches"] > 0
        assert len(files) == stats["spilled_batches"]
        assert stats["spilled_bytes"] == sum(f.stat().st_size for f in files)
        assert stats["memory_bytes"] < 64 * 1024 + 8 * 1024   # batches, plus the one being filled
        assert stats["backlog"] == n and stats["dropped_events"] == 0
        assert all(oct(p.stat().st_mode & 0o777) == "0o700" for p in (spill, files[0].parent))

        server, _ = start_server(store, AgentRegistry(), port=port)   # the controller comes up
        assert up.flush(30), f"not delivered: {up.stats()}"
        stats = up.stats()
        assert stats["acked_events"] == n
        assert stats["spilled_batches"] == 0 and stats["spilled_bytes"] == 0
        assert _spill_files(spill) == []
    finally:
        up.close()
        if server is not None:
            server.close()
    steps = [s.step for s in store.steps(job_id)]
    assert len(steps) == n, "events lost or duplicated"
    assert sorted(steps) == list(range(1, n + 1))
    assert [p for p in spill.rglob("*") if not p.is_dir()] == []  # close() cleaned up


def test_full_memory_and_spill_block_submit_instead_of_dropping(store, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(store)
    port = _free_port()
    up = _uplink(f"127.0.0.1:{port}", tmp_path / "spill", batch_max_events=100, batch_max_bytes=4096,
                 memory_max_bytes=64 * 1024, spill_max_bytes=16 * 1024).start()
    server = None
    blocked: list[BaseException | None] = []
    try:
        accepted = 0
        with pytest.raises(TimeoutError):
            for _ in range(200):
                up.submit(_steps(job_id, attempt, accepted + 1, 100), timeout_s=0.3)
                accepted += 100
        refused_first = accepted + 1   # the worker keeps these; they are never stored
        stats = up.stats()
        assert stats["dropped_events"] == 0
        assert stats["backlog"] == accepted
        assert stats["spilled_bytes"] <= 16 * 1024
        assert stats["memory_bytes"] < 64 * 1024 + 4096   # batches, plus the one being filled

        # a submit now blocks until the controller acks something
        later = _steps(job_id, attempt, 100_000, 100)

        def submit_later() -> None:
            try:
                up.submit(later, timeout_s=30)
                blocked.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                blocked.append(exc)

        t = threading.Thread(target=submit_later, name="fleet-test-submit", daemon=True)
        t.start()
        t.join(0.5)
        assert t.is_alive(), "submit did not block with memory and spill full"
        server, _ = start_server(store, AgentRegistry(), port=port)
        t.join(30)
        assert not t.is_alive() and blocked == [None]
        assert up.flush(30), up.stats()
        assert up.stats()["dropped_events"] == 0
    finally:
        up.close()
        if server is not None:
            server.close()
    steps = sorted(s.step for s in store.steps(job_id))
    assert steps == list(range(1, accepted + 1)) + list(range(100_000, 100_100))
    assert refused_first not in steps


def test_worker_reports_get_resource_exhausted_when_the_agent_is_full(store, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(store)
    registry = AgentRegistry()
    server, _ = start_server(store, registry)
    port = int(server.address.rsplit(":", 1)[1])
    agent = NodeAgent(node_name="node-0", controller_address=server.address, token=TOKEN,
                      settings=AgentSettings(batch_interval_s=0.02, batch_max_events=100, batch_max_bytes=4096,
                                             memory_max_bytes=64 * 1024, spill_max_bytes=0,
                                             spill_dir=str(tmp_path / "spill")))
    agent.start(connect_timeout_s=10)
    channel = grpc.insecure_channel(agent.local_address)
    try:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        server.close(grace_s=0)   # the controller goes away
        sent, refused = 0, None
        for _ in range(40):
            events = _steps(job_id, attempt, sent + 1, 200)
            try:
                stub.Report(agent_pb2.WorkerReport(job_id=job_id, attempt=attempt, rank=0, events=events),
                            timeout=15)
            except grpc.RpcError as exc:
                refused = (exc.code(), events)
                break
            sent += 200
        assert refused is not None and refused[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert agent.stats()["dropped_events"] == 0
        server, _ = start_server(store, AgentRegistry(), port=port)
        # the worker kept the refused events and reports them again
        stub.Report(agent_pb2.WorkerReport(job_id=job_id, attempt=attempt, rank=0, events=refused[1]),
                    timeout=15)
        assert agent.flush(30), agent.stats()
    finally:
        channel.close()
        agent.close()
        server.close()
    steps = sorted(s.step for s in store.steps(job_id))
    assert steps == list(range(1, sent + 201))


def test_an_event_over_the_message_limit_is_dropped_and_reported(tmp_path: Path) -> None:
    huge = events_pb2.Event(checkpoint=events_pb2.CheckpointEvent(job_id="j", path="x" * 100_000))
    service = RecordingAgentService()
    with _serve(service) as address:
        # 64 KiB of headroom leaves room for events up to 64 KiB in a 128 KiB message
        up = _uplink(address, tmp_path / "spill", max_message_bytes=128 * 1024).start()
        try:
            up.submit(_steps("j", 1, 1, 5) + [huge] + _steps("j", 1, 6, 5))
            assert up.flush(10), up.stats()
            _wait(lambda: service.drops, what="the drop report to reach the server")
            stats = up.stats()
        finally:
            up.close()
    assert [e.step.step for b in service.received for e in b.events] == list(range(1, 11))
    assert [(d.first_seq, d.last_seq, d.events) for d in service.drops] == [(0, 0, 1)]
    assert "message limit" in service.drops[0].reason
    assert (stats["dropped_events"], stats["dropped_batches"], stats["acked_events"]) == (1, 0, 10)


# An agent in a child process, killed mid-run by its parent (the worker): it prints its
# local address, then one line per report it answered; it holds its partial batch (a 60 s
# batch interval), so what it leaves is in flight, in cut batches and in its log.
_AGENT_CHILD = r"""
import logging, sys, time
from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from tests.component.conftest import TOKEN

address, spill = sys.argv[1], sys.argv[2]
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
agent = NodeAgent(node_name="node-wal", controller_address=address, token=TOKEN, settings=AgentSettings(
    batch_interval_s=60, batch_max_events=50, spill_dir=spill, gemm_interval_s=0))
agent.start(connect_timeout_s=20)
print(agent.local_address, flush=True)
time.sleep(600)   # killed long before
"""

REPORT_EVENTS = 20


def _report(job_id: str, attempt: int, report_id: int) -> agent_pb2.WorkerReport:
    first = (report_id - 1) * REPORT_EVENTS + 1
    return agent_pb2.WorkerReport(job_id=job_id, attempt=attempt, rank=0,
                                  events=_steps(job_id, attempt, first, REPORT_EVENTS),
                                  reporter="worker-1", report_id=report_id)


def test_an_agent_killed_mid_run_loses_nothing_and_stores_nothing_twice(store, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(store)
    server, _ = start_server(store, AgentRegistry())
    spill = tmp_path / "spill"
    log_path = tmp_path / "agent.log"
    successor = None
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", _AGENT_CHILD, server.address, str(spill)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=log_file, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, log_path.read_text()
        local = proc.stdout.readline().strip()
        assert local, log_path.read_text()
        with grpc.insecure_channel(local) as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            for report_id in range(1, 32):   # 620 events: 12 full batches cut, 20 events in the log
                stub.Report(_report(job_id, attempt, report_id), timeout=15)
        _wait(lambda: store.steps(job_id), what="some batches to be committed")
        os.killpg(proc.pid, signal.SIGKILL)   # killed with its last batches unacknowledged
        proc.wait(10)
        assert store.last_step(job_id) < 31 * REPORT_EVENTS   # the log's 20 events were never sent

        successor = NodeAgent(node_name="node-wal", controller_address=server.address, token=TOKEN,
                              settings=AgentSettings(batch_interval_s=0.02, spill_dir=str(spill),
                                                     gemm_interval_s=0))
        successor.start(connect_timeout_s=20)
        with grpc.insecure_channel(successor.local_address) as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            # the worker never heard back about report 31 (say): it sends it again, unchanged
            stub.Report(_report(job_id, attempt, 31), timeout=15)
            stub.Report(_report(job_id, attempt, 32), timeout=15)
        assert successor.flush(30), successor.stats()
        stats = successor.stats()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if successor is not None:
            successor.close()
        server.close()
    steps = [s.step for s in store.steps(job_id)]
    assert sorted(steps) == list(range(1, 32 * REPORT_EVENTS + 1)), "events lost or stored twice"
    # what the killed agent held went up again through its successor, and nothing is left
    assert stats["resent_events"] >= REPORT_EVENTS and stats["dropped_events"] == 0, stats
    assert store.ingest_drops() == []
    assert not any((spill / "agent-node-wal").glob("*/*.batch"))


def test_a_predecessors_log_is_adopted_from_whatever_point_it_died_at(tmp_path: Path) -> None:
    """The crash windows of a cut, laid out by hand: a log whose cut batch was written but
    not rotated, a log superseded by a newer one, a torn tail. Every answered report goes
    up exactly once; the torn one does not (its worker sends it again)."""
    spill = tmp_path / "spill"
    events = _steps("j", 1, 1, 40)
    fields = [uplink._length_delimited(EVENT_BATCH_EVENTS_TAG, e.SerializeToString()) for e in events]

    def mark(report_id: int) -> bytes:
        return uplink._length_delimited(EVENT_BATCH_MARKS_TAG, agent_pb2.ReportMark(
            reporter="w", report_id=report_id).SerializeToString())

    def header(epoch: int, seq: int) -> bytes:
        return agent_pb2.EventBatch(agent_id="agent-node-0", epoch=epoch, seq=seq).SerializeToString()

    # epoch 100: batch 1 (events 1-10) was written, then the process died before rotating
    # log 1 (events 1-15, two reports); 10 of those are in the batch, 5 are live
    a = spill / "agent-node-0" / "100"
    a.mkdir(parents=True)
    (a / f"{1:020d}.10.batch").write_bytes(header(100, 1) + b"".join(fields[0:10]))
    (a / f"pending.{1:020d}.log").write_bytes(b"".join(fields[0:10]) + mark(1) + b"".join(fields[10:15]) + mark(2))
    # epoch 200: log 3 was rotated into log 4 (events 21-25) but not yet deleted; log 4
    # ends in a torn report (events 26-27 and half of 28, no mark)
    b = spill / "agent-node-0" / "200"
    b.mkdir(parents=True)
    (b / f"{2:020d}.5.batch").write_bytes(header(200, 2) + b"".join(fields[15:20]))
    (b / f"pending.{3:020d}.log").write_bytes(b"".join(fields[20:25]) + mark(7))
    (b / f"pending.{4:020d}.log").write_bytes(b"".join(fields[20:25]) + mark(7) + b"".join(fields[25:27])
                                               + fields[27][:7])
    service = RecordingAgentService()
    with _serve(service) as address:
        up = _uplink(address, spill).start()
        try:
            assert up.durable("w", 7) and not up.durable("w", 8) and not up.durable("", 0)
            assert up.flush(10), up.stats()
            stats = up.stats()
        finally:
            up.close()
    got = [(b.epoch, b.seq, [e.step.step for e in b.events]) for b in service.received]
    assert got == [(100, 1, list(range(1, 11))), (100, 2, list(range(11, 16))),
                   (200, 2, list(range(16, 21))), (200, 4, list(range(21, 26)))], got
    assert stats["resent_events"] == 25 and stats["dropped_events"] == 0, stats
    assert not a.exists() and not b.exists()


def test_a_live_agents_folder_is_left_alone(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    live = Spool(spill, "agent-node-0", 5678)        # another live process of this agent
    live.append(1, b"".join(uplink._length_delimited(EVENT_BATCH_EVENTS_TAG, e.SerializeToString())
                            for e in _steps("j", 1, 1, 3)))
    service = RecordingAgentService()
    try:
        with _serve(service) as address:
            up = _uplink(address, spill).start()
            try:
                assert up.flush(10)
            finally:
                up.close()
        assert service.received == [] and live.dir.is_dir()
    finally:
        live.close()
    assert not live.dir.exists()


# -- rejected batches --------------------------------------------------------------------


def test_a_rejected_batch_is_counted_and_never_resent(tmp_path: Path) -> None:
    service = RecordingAgentService(reject={2: "step is negative"}, break_on_seq=4)
    events = _steps("j", 1, 1, 50)
    with _serve(service) as address:
        up = _uplink(address, tmp_path / "spill", batch_max_events=10).start()
        try:
            up.submit(events)           # five full batches, seq 1..5
            assert up.flush(20), up.stats()
            stats = up.stats()
        finally:
            up.close()
    assert service.streams >= 2 and stats["reconnects"] >= 1   # the stream broke once
    assert [b.seq for b in service.received].count(2) == 1     # the rejected one was not resent
    assert sorted(service.committed) == [1, 3, 4, 5]
    assert [e for s in (1, 3, 4, 5) for e in service.committed[s].events] == events[:10] + events[20:]
    assert stats["rejected_events"] == 10
    assert stats["acked_events"] == 40
    assert stats["dropped_events"] == 0 and stats["backlog"] == 0


# -- a failing spill disk -----------------------------------------------------------------

# Runs in a child process: its file-size limit makes every spill write fail with EFBIG.
_CHILD = r"""
import json, logging, resource, signal, sys, time
from tests.component.test_uplink_delivery import _steps, _uplink
from pathlib import Path

address, spill, job_id, attempt, n = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
up = _uplink(address, spill, node="node-disk", batch_max_events=1000, batch_max_bytes=4096,
             memory_max_bytes=16 * 1024).start()
up.submit(_steps(job_id, attempt, 1, n), timeout_s=10)
print(json.dumps({"submitted": up.stats()}), flush=True)
sys.stdin.readline()   # the parent started the controller
ok = up.flush(30)
print(json.dumps({"flushed": ok, "stats": up.stats()}), flush=True)
up.close()
"""


def _read_json_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "the child process said nothing in time"
    line = proc.stdout.readline()
    assert line, f"the child process ended early (rc {proc.poll()})"
    return json.loads(line)


def test_failed_spill_writes_are_dropped_counted_and_reported(store, tmp_path: Path) -> None:  # noqa: ANN001
    job_id, attempt = _job(store)
    port = _free_port()
    n = 600   # ~ 36 KiB: 16 KiB stay in memory, the rest must spill, and cannot
    log_path = tmp_path / "child.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, f"127.0.0.1:{port}", str(tmp_path / "spill"), job_id,
             str(attempt), str(n)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True,
            start_new_session=True,
        )
    server = None
    try:
        first = _read_json_line(proc, 30)["submitted"]
        assert first["dropped_batches"] > 0 and first["dropped_events"] > 0
        assert first["spilled_batches"] == 0
        server, _ = start_server(store, AgentRegistry(), port=port)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        final = _read_json_line(proc, 60)
        proc.communicate(timeout=30)
        _wait(lambda: sum(d.events for d in store.ingest_drops() if d.agent_id == "agent-node-disk")
              >= final["stats"]["dropped_events"], what="the drop reports to be stored")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if server is not None:
            server.close()
    stderr = log_path.read_text()
    assert proc.returncode == 0, stderr
    stats = final["stats"]
    assert final["flushed"], stats
    # the partial batch left after submit may also have been cut (and dropped) since
    assert stats["dropped_events"] >= first["dropped_events"]
    assert stats["acked_events"] + stats["dropped_events"] == n
    # the loss reached the controller, which recorded it
    drops = [d for d in store.ingest_drops() if d.agent_id == "agent-node-disk"]
    assert sum(d.events for d in drops) == stats["dropped_events"]
    assert sum(d.last_seq - d.first_seq + 1 for d in drops) == stats["dropped_batches"]
    assert all("EFBIG" in d.reason for d in drops), [d.reason for d in drops]
    # what was kept is stored exactly once
    assert len(store.steps(job_id)) == stats["acked_events"]
    # one log line per burst, not one per batch: the batches dropped at submit are one
    # burst; the partial batch cut later is a second one if it came more than
    # DROP_BURST_GAP_S after (a slow, loaded machine between "submitted" and "go")
    assert 1 <= stderr.count("dropping ") <= 2 < stats["dropped_batches"], (stats, stderr)
