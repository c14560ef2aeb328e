"""A large job's collectives through a real NodeAgent (collective_fronts=True) and a real
controller over a SQLite file: fronts go up instead of collectives, and a TracePull brings
the raw entries into the ``collectives`` table."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from fleet.proto import agent_pb2, agent_pb2_grpc, columns, events_pb2
from fleet.proto.fronts import FrontRow

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-fronts-token-0123456789"
GROUPS = ("0", "dp")


class _Seen:
    """What the controller's observer saw: every front row and how many collectives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.fronts: list[FrontRow] = []
        self.collectives = 0

    def __call__(self, node: str, rows) -> None:  # noqa: ANN001 (a PreparedBatch)
        with self._lock:
            self.fronts.extend(rows.front_rows())
            self.collectives += len(rows.collectives)

    def newest(self) -> dict[tuple[int, str], FrontRow]:
        with self._lock:
            out: dict[tuple[int, str], FrontRow] = {}
            for r in self.fronts:
                out[(r.rank, r.group)] = r
            return out


class _Controller:
    def __init__(self, db: Path) -> None:
        self.store = Store(f"sqlite:///{db}")
        self.registry = AgentRegistry()
        self.seen = _Seen()
        self.server = ControllerServer(
            AgentServicer(self.store, self.registry, TOKEN, controller_id="ctl-fronts", observer=self.seen),
            ControlServicer(None, TOKEN), port=0).start()

    def close(self) -> None:
        self.server.close()
        self.store.close()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[_Controller]:
    c = _Controller(tmp_path / "fleet.db")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def agent(controller: _Controller) -> Iterator[NodeAgent]:
    a = NodeAgent(node_name="node-0", controller_address=controller.server.address, token=TOKEN,
                  settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2,
                                         collective_fronts=True, ring_entries=50))
    a.start(connect_timeout_s=10)
    try:
        yield a
    finally:
        a.close()


def _block(job_id: str, attempt: int, rank: int, seqs: range, *, open_last: bool = False
           ) -> events_pb2.CollectiveColumns:
    evs = []
    for group in GROUPS:
        for seq in seqs:
            for state in ("started", "completed"):
                if open_last and state == "completed" and seq == seqs[-1]:
                    continue
                c = events_pb2.CollectiveEvent(
                    job_id=job_id, attempt=attempt, rank=rank, group=group, group_size=2, seq=seq,
                    op="all_reduce", enter_ns=seq * 1000, exit_ns=seq * 1000 + 500 if state == "completed" else 0,
                    state=state, step=seq)
                c.input_sizes.add().dims.extend([256])
                c.input_dtypes.append("bfloat16")
                evs.append(c)
    return columns.pack(evs)


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_fronts_go_up_instead_of_collectives_and_a_pull_brings_the_raw_entries(
        controller: _Controller, agent: NodeAgent) -> None:
    store = controller.store
    job_id = store.create_job("fronts-test", total_steps=100, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    attempt = store.create_attempt(job_id)
    with grpc.insecure_channel(agent.local_address) as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        for rank in (0, 1):
            for first in (1, 41):
                stub.Report(agent_pb2.WorkerReport(job_id=job_id, attempt=attempt, rank=rank, events=[
                    events_pb2.Event(collectives=_block(job_id, attempt, rank, range(first, first + 40),
                                                        open_last=rank == 1 and first == 41)),
                    events_pb2.Event(step=events_pb2.StepEvent(job_id=job_id, attempt=attempt, rank=rank,
                                                               step=first, loss=1.0, end_ns=time.time_ns()))]),
                    timeout=5)
    assert agent.flush(10)
    # the other events went up; no collective did, fronts did
    assert len(store.steps(job_id)) == 4
    assert store.collectives(job_id) == [] and controller.seen.collectives == 0
    fronts = controller.seen.newest()
    assert set(fronts) == {(r, g) for r in (0, 1) for g in GROUPS}
    assert [(f.entered_seq, f.completed_seq) for f in (fronts[(0, "0")], fronts[(1, "dp")])] == [(80, 80), (80, 79)]
    assert fronts[(1, "dp")].open and not fronts[(0, "0")].open
    assert {f.signature for f in fronts.values()} == {fronts[(0, "0")].signature}
    assert sum(f.entered for f in controller.seen.fronts if (f.rank, f.group) == (0, "dp")) == 80
    # the controller's writer persists the newest front per (rank, group) every few seconds
    _wait(lambda: store.count_fronts(job_id, attempt) == 4, "the fronts in collective_fronts")
    stored = {(f.rank, f.group): (f.entered_seq, f.completed_seq) for f in store.fronts(job_id, attempt)}
    assert stored == {key: (f.entered_seq, f.completed_seq) for key, f in fronts.items()}

    # a pull for rank 1 (rank 5 is not on this node) brings its newest 10 entries of group dp
    controller.registry.send("node-0", events_pb2.Command(
        command_id="pull-1", job_id=job_id, attempt=attempt, rank=-1,
        pull=events_pb2.TracePull(job_id=job_id, attempt=attempt, ranks=[1, 5], groups=["dp"], last=10)))
    _wait(lambda: len(store.collectives(job_id)) >= 10, "the pulled collectives in the store")
    assert agent.flush(10)
    got = store.collectives(job_id)
    assert [(c.rank, c.group, c.seq) for c in got] == [(1, "dp", s) for s in range(71, 81)]
    assert [c.state for c in got] == ["completed"] * 9 + ["started"]

    # every group of rank 0, the default depth, bounded by the ring (50 kept per group)
    controller.registry.send("node-0", events_pb2.Command(
        command_id="pull-2", job_id=job_id, attempt=attempt, rank=-1,
        pull=events_pb2.TracePull(job_id=job_id, attempt=attempt, ranks=[0], last=0)))
    _wait(lambda: len(store.collectives(job_id, rank=0)) >= 100, "rank 0's pulled collectives")
    rank0 = store.collectives(job_id, rank=0)
    assert [(c.group, c.seq) for c in rank0] == [(g, s) for g in GROUPS for s in range(31, 81)]


def test_without_collective_fronts_collectives_go_up_and_a_pull_is_ignored(controller: _Controller) -> None:
    store = controller.store
    job_id = store.create_job("plain-test", total_steps=100, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    attempt = store.create_attempt(job_id)
    with NodeAgent(node_name="node-1", controller_address=controller.server.address, token=TOKEN,
                   settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2)) as agent, \
            grpc.insecure_channel(agent.local_address) as channel:
        controller.registry.send("node-1", events_pb2.Command(
            command_id="pull-0", job_id=job_id, attempt=attempt, rank=-1,
            pull=events_pb2.TracePull(job_id=job_id, attempt=attempt)))
        agent_pb2_grpc.NodeAgentStub(channel).Report(agent_pb2.WorkerReport(
            job_id=job_id, attempt=attempt, rank=0,
            events=[events_pb2.Event(collectives=_block(job_id, attempt, 0, range(1, 6)))]), timeout=5)
        assert agent.flush(10)
        assert len(store.collectives(job_id)) == 10
        assert controller.seen.fronts == []
