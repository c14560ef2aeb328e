"""workers/reporter.py against a real NodeAgent gRPC server on 127.0.0.1, and the
reporter's key promise: it keeps shipping while the main thread is stuck in a collective."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from datetime import timedelta

import grpc
import pytest
import torch
import torch.distributed as dist

from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.kinds import FaultKind
from tests.unit.test_workers_support import AgentServer, Ranks, free_port, wait_for_gate
from fleet.workers.native_fr import NativeFlightTail
from fleet.workers.recorder import FlightRecorder
from fleet.workers.reporter import Reporter
from fleet.workers.spec import WorkerSpec
from fleet.workers.rendezvous import loopback_store

pytestmark = pytest.mark.timeout(60)


def _spec(address: str, rank: int = 0, interval_s: float = 0.02) -> WorkerSpec:
    return WorkerSpec(job_id="job", attempt=1, rank=rank, world_size=2, node_name="n0",
                      master_addr="127.0.0.1", master_port=0, agent_address=address,
                      checkpoint_dir="/nonexistent", report_interval_s=interval_s)


def _step(n: int) -> events_pb2.Event:
    return events_pb2.Event(step=events_pb2.StepEvent(job_id="job", step=n))


@pytest.fixture
def agent():
    server = AgentServer()
    yield server
    server.stop()


def _until(predicate, timeout_s: float) -> bool:
    """Poll ``predicate`` every 20 ms for at most ``timeout_s``; for state with no notifier."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_delivers_events_in_order_with_identity(agent):
    with Reporter(_spec(agent.address, rank=1)) as rep:
        assert rep._thread.name == "fleet-reporter-r1" and rep._thread.daemon
        for n in range(50):
            rep.emit(_step(n))
        agent.wait_for(lambda a: len(a.events) == 50)
    assert [e.step.step for _, e in agent.events] == list(range(50))
    assert {r for r, _ in agent.events} == {1}
    assert rep.sent == 50 and rep.pending == 0 and rep.dropped == 0


def test_close_flushes_what_is_buffered(agent):
    rep = Reporter(_spec(agent.address, interval_s=30.0))  # no periodic tick during the test
    for n in range(10):
        rep.emit(_step(n))
    rep.close()
    assert len(agent.events) == 10
    rep.emit(_step(99))  # after close: dropped, not an error
    assert rep.dropped == 1


def test_status_events_do_not_wait_for_the_next_report(agent):
    with Reporter(_spec(agent.address, interval_s=30.0)) as rep:
        rep.emit(_step(1))  # not urgent: waits for the report interval
        rep.emit(events_pb2.Event(status=events_pb2.WorkerStatus(job_id="job", state=events_pb2.WorkerStatus.TRAINING)))
        agent.wait_for(lambda a: len(a.events) == 2, timeout_s=5)
        assert agent.reports == 1 and _until(lambda: rep.pending == 0, timeout_s=5)


def test_polls_without_events_and_passes_commands(agent):
    got: list[events_pb2.Command] = []
    done = threading.Event()

    def on_command(cmd):
        got.append(cmd)
        done.set()

    agent.send(0, events_pb2.Command(command_id="c1", rank=0, fault=events_pb2.FaultSpec(kind=FaultKind("crash").wire, at_step=9)))
    agent.send(0, events_pb2.Command(command_id="c2", rank=5, stop=True))  # not ours: ignored
    with Reporter(_spec(agent.address), on_command):
        assert done.wait(10)
        agent.wait_for(lambda a: a.reports >= 2)
    assert [c.command_id for c in got] == ["c1"] and got[0].fault.at_step == 9


def test_command_handler_errors_do_not_kill_the_thread(agent):
    calls = []

    def bad(cmd):
        calls.append(cmd.command_id)
        raise RuntimeError("boom")

    agent.send(0, events_pb2.Command(command_id="c1", rank=0, stop=True))
    with Reporter(_spec(agent.address), bad) as rep:
        agent.wait_for(lambda a: a.reports >= 2)
        rep.emit(_step(1))
        agent.wait_for(lambda a: len(a.events) == 1)
        assert rep._thread.is_alive()
    assert calls == ["c1"]


def test_keeps_events_while_agent_is_down_and_delivers_when_it_comes_up():
    port = free_port()
    rep = Reporter(_spec(f"127.0.0.1:{port}"), call_timeout_s=0.5)
    try:
        for n in range(20):
            rep.emit(_step(n))
        assert _until(lambda: rep.send_failures >= 1, timeout_s=10)  # the retry path runs
        assert rep.send_failures >= 1 and rep.pending == 20 and rep._thread.is_alive()
        agent = AgentServer(port)
        try:
            agent.wait_for(lambda a: len(a.events) == 20)
            assert [e.step.step for _, e in agent.events] == list(range(20))
        finally:
            rep.close()
            agent.stop()
    finally:
        rep.close()


def test_buffer_is_bounded_and_drops_oldest():
    rep = Reporter(_spec(f"127.0.0.1:{free_port()}", interval_s=30.0), max_buffered=5)
    try:
        for n in range(8):
            rep.emit(_step(n))
        assert rep.pending == 5 and rep.dropped == 3
        assert [e.step.step for e in rep._buffer] == [3, 4, 5, 6, 7]
    finally:
        rep.close(timeout_s=0.5)


def test_discard_mode_runs_no_thread():
    for address in ("", None):
        with Reporter(_spec(address)) as rep:
            assert not rep.enabled
            rep.emit(_step(1))
            assert rep.dropped == 1


# ---- the reporter while the main thread is blocked in a collective ---------------------

def _hang_then_join(rank: int, world_size: int, port: int, agent_address: str) -> int:
    spec = _spec(agent_address, rank=rank)
    dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    try:
        with Reporter(spec) as rep:
            rec = FlightRecorder("job", 1, rank, rep.emit)
            if rank == 1:
                # Rank 1 is "late": it joins only once the test has seen rank 0 inside the op.
                wait_for_gate(30)
            rec.all_reduce(torch.ones(2))
        return rec.last_seq()
    finally:
        dist.destroy_process_group()


def test_started_event_arrives_while_rank_is_blocked_in_collective(agent):
    ranks = Ranks(_hang_then_join, 2, (agent.address,))
    try:
        agent.wait_for(lambda a: any(c.state == "started" for c in a.of_kind("collective", rank=0)),
                       timeout_s=40)
        # Rank 0 is inside all_reduce and rank 1 has not entered: exactly what the agent sees.
        states = [(r, e.collective.state) for r, e in agent.events if e.WhichOneof("kind") == "collective"]
        assert states == [(0, "started")]
    finally:
        ranks.open_gate()
        result = ranks.wait(60)
    assert result == {0: 1, 1: 1}
    assert len(agent.of_kind("collective")) == 4  # both ranks flushed on close


def _hang_native(rank: int, world_size: int, port: int, agent_address: str) -> int:
    """Like ``_hang_then_join``, but the op is a raw ``dist.all_reduce`` that only the
    native flight recorder sees, shipped by the tail from the reporter thread."""
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
    with Reporter(_spec(agent_address, rank=rank)) as rep:
        tail = NativeFlightTail("job", 1, rank, rep.emit, ring_entries=64, poll_interval_s=0.1)
        rep.follow(tail)
        dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=30))
        try:
            if rank == 1:
                wait_for_gate(30)
            dist.all_reduce(torch.ones(2))
            tail.poll(force=True)
        finally:
            dist.destroy_process_group()
    return tail.collectives


def test_native_entries_arrive_while_rank_is_blocked_in_collective(agent):
    ranks = Ranks(_hang_native, 2, (agent.address,))
    try:
        agent.wait_for(lambda a: any(c.state == "started" for c in a.of_kind("collective", rank=0)),
                       timeout_s=40)
        started = agent.of_kind("collective", rank=0)
        assert [(c.group, c.seq, c.op, c.state) for c in started] == [("0", 1, "all_reduce", "started")]
        assert agent.of_kind("collective", rank=1) == []
        assert [list(g.ranks) for g in agent.of_kind("group", rank=0)] == [[0, 1]]
    finally:
        ranks.open_gate()
        result = ranks.wait(60)
    assert result == {0: 1, 1: 1}
    for rank in (0, 1):
        assert [c.state for c in agent.of_kind("collective", rank=rank)][-1] == "completed"


class _ForgetfulAgent(agent_pb2_grpc.NodeAgentServicer):
    """Takes the first report with events, then fails the call, as an agent killed before
    it answered; records every report with events."""

    def __init__(self) -> None:
        self.reports: list[agent_pb2.WorkerReport] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-agent"))
        agent_pb2_grpc.add_NodeAgentServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def Report(self, request, context):  # noqa: N802 - gRPC method name
        if not request.events:
            return agent_pb2.WorkerReply()
        with self._cond:
            self.reports.append(request)
            self._cond.notify_all()
            first = len(self.reports) == 1
        if first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "test: the agent died before answering")
        return agent_pb2.WorkerReply()

    def stop(self) -> None:
        self._server.stop(0).wait(5)


def test_a_report_that_got_no_answer_is_sent_again_unchanged():
    agent = _ForgetfulAgent()
    rep = Reporter(_spec(agent.address, interval_s=0.05))
    try:
        for n in range(5):
            rep.emit(_step(n))
        assert _until(lambda: len(agent.reports) >= 2, timeout_s=10)
        for n in range(5, 8):
            rep.emit(_step(n))
        assert _until(lambda: sum(len(r.events) for r in agent.reports) >= 13, timeout_s=10)
    finally:
        rep.close()
        agent.stop()
    first, retry, *later = agent.reports
    # the same number and the same events: an agent that logged it knows it by its number
    assert retry == first and first.report_id >= 1 and first.reporter == rep.reporter_id
    assert [e.step.step for e in first.events] == list(range(5))
    assert [e.step.step for r in later for e in r.events] == [5, 6, 7]
    assert all(r.report_id > first.report_id for r in later)
    assert rep.send_failures == 1 and rep.pending == 0


class _SlowAgent(AgentServer):
    """An agent whose every Report answer waits on ``gate`` (a slow or restarting agent)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.dropped_seen: list[int] = []

    def Report(self, request, context):  # noqa: N802 - gRPC method name
        self.dropped_seen.append(request.dropped_events)
        self.gate.wait(5.0)
        return super().Report(request, context)


def test_sources_are_polled_while_a_report_waits_on_a_slow_agent():
    # a 256-entry ring holds about a second of a busy rank's collectives: a Report call
    # that waits on its agent for up to call_timeout_s must not hold its reads back
    agent = _SlowAgent()
    polls: list[float] = []
    lost = [0]
    try:
        rep = Reporter(_spec(agent.address, interval_s=0.05))
        rep.add_source(lambda force=False: polls.append(time.monotonic()), 0.05, lost=lambda: lost[0])
        assert rep._sources_thread.name == "fleet-sources-r0" and rep._sources_thread.daemon
        assert _until(lambda: agent.dropped_seen, 5.0), "no report reached the agent"
        blocked_at = time.monotonic()   # the reporter thread is inside its first Report call now
        assert _until(lambda: sum(t > blocked_at for t in polls) >= 8, 3.0), \
            f"{sum(t > blocked_at for t in polls)} polls while the report waited"
        lost[0] = 7          # the source lost 7 entries (a ring overwritten unread)
        rep.emit(_step(1))
        agent.gate.set()
        assert _until(lambda: 7 in agent.dropped_seen, 5.0), agent.dropped_seen
        assert rep.lost == 7 and rep.dropped == 0
        rep.close(timeout_s=2.0)
        assert not rep._sources_thread.is_alive()
        assert [s.step for s in agent.of_kind("step")] == [1]
    finally:
        agent.gate.set()
        agent.stop()
