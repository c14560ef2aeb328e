"""How a due fault order is carried out (ChaosFirer over recording Protocols) and which
step-timed orders a new attempt is handed again."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.controlplane.chaos import FaultOrder
from fleet.controlplane.chaos_fire import ChaosFirer, target
from fleet.controlplane.detectors import Incident
from fleet.controlplane.errors import NotFoundError
from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind, IncidentKind

PLACEMENT = ["node-0", "node-0", "node-1", "node-1"]


class Job:
    def __init__(self, job_id: str = "j-1") -> None:
        self.job_id = job_id
        self.attempt = 3

    def position(self) -> tuple[int, list[str]]:
        return self.attempt, list(PLACEMENT)


class Recorder:
    """Stands for the agent registry, the node breaker, the supervisor's down times and
    the store's checkpoint validity."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, events_pb2.Command]] = []
        self.killed: list[tuple[str, list[int]]] = []
        self.agent_down: dict[str, float] = {}
        self.node_down: dict[str, float] = {}
        self.corrupted: list[str] = []
        self.invalidated: list[tuple[str, int, str, int | None]] = []

    def send(self, node_name: str, command: events_pb2.Command) -> None:
        self.sent.append((node_name, command))

    def kill_node(self, node: str, ranks: list[int]) -> None:
        self.killed.append((node, ranks))

    def agent_down_until(self, node: str, until: float) -> None:
        self.agent_down[node] = until

    def node_down_until(self, node: str, until: float) -> None:
        self.node_down[node] = until

    def invalidate_checkpoint(self, job_id: str, step: int, reason: str = "",
                              attempt: int | None = None) -> None:
        self.invalidated.append((job_id, step, reason, attempt))

    def corrupt(self, checkpoint_dir: str) -> Path:
        self.corrupted.append(checkpoint_dir)
        return Path(checkpoint_dir) / "step_00000005" / "model.pt"


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


def firer(rec: Recorder) -> ChaosFirer:
    return ChaosFirer(Job(), rec, rec, rec, rec, "/ckpt/j-1", corrupt=rec.corrupt, clock=lambda: 100.0)


def test_target_names_the_node_and_ranks_an_order_hits() -> None:
    assert target(FaultOrder("crash", rank=2), PLACEMENT) == ("node-1", [2])
    assert target(FaultOrder("partition", rank=2), PLACEMENT) == ("node-1", [2, 3])
    assert target(FaultOrder("hang", node="node-0"), PLACEMENT) == ("node-0", [0, 1])
    assert target(FaultOrder("ckpt-corrupt"), PLACEMENT) == ("", [])
    with pytest.raises(NotFoundError, match="rank 4 does not exist"):
        target(FaultOrder("crash", rank=4), PLACEMENT)
    with pytest.raises(NotFoundError, match="node-7"):
        target(FaultOrder("crash", node="node-7"), PLACEMENT)


def test_a_rank_fault_is_a_command_to_that_ranks_agent(rec: Recorder) -> None:
    firer(rec).fire(FaultOrder("slow", rank=1, delay_s=0.5, duration_s=20))
    [(node, cmd)] = rec.sent
    assert (node, cmd.job_id, cmd.attempt, cmd.rank) == ("node-0", "j-1", 3, 1)
    assert (FaultKind.from_wire(cmd.fault.kind), cmd.fault.delay_s, cmd.fault.duration_s) == \
        (FaultKind.SLOW, 0.5, 20.0)


def test_agent_down_with_a_duration_keeps_the_agent_down_until_then(rec: Recorder) -> None:
    firer(rec).fire(FaultOrder("agent-down", node="node-1", duration_s=30))
    [(node, cmd)] = rec.sent
    assert (node, cmd.rank) == ("node-1", -1)
    assert rec.agent_down == {"node-1": 130.0}


def test_node_down_takes_the_node_and_its_ranks_away(rec: Recorder) -> None:
    firer(rec).fire(FaultOrder("node-down", rank=3, duration_s=5))
    assert rec.killed == [("node-1", [2, 3])]
    assert rec.node_down == {"node-1": 105.0}
    assert rec.sent == []


def test_ckpt_corrupt_at_a_step_goes_to_rank_0_else_is_done_here(rec: Recorder) -> None:
    f = firer(rec)
    f.fire(FaultOrder("ckpt-corrupt", at_step=7))
    [(node, cmd)] = rec.sent
    assert (node, cmd.rank, cmd.fault.at_step) == ("node-0", 0, 7)
    assert rec.invalidated == []  # rank 0 reports its own corruption
    f.fire(FaultOrder("ckpt-corrupt"))
    assert rec.corrupted == ["/ckpt/j-1"]
    assert rec.invalidated == [("j-1", 5, "ckpt-corrupt fault: the controller flipped bytes in model.pt", 3)]


def test_step_timed_orders_not_reached_are_rearmed_and_the_cause_never(rec: Recorder) -> None:
    f = firer(rec)
    crash, hang, late = FaultOrder("crash", rank=1, at_step=5), FaultOrder("hang", rank=2, at_step=9), \
        FaultOrder("nan", rank=0, at_step=30)
    for order in (crash, hang, late):
        f.fire(order)
    f.fire(FaultOrder("crash", rank=3))  # at once: nothing to re-arm
    assert f.armed() == [crash, hang, late]
    left = f.forget_caused(Incident(IncidentKind.CRASH, "crash", 1, "node-0", "rank 1 died"))
    assert left and f.armed() == [hang, late]
    rec.sent.clear()
    f.rearm(completed=8)  # the failed attempt fired up to step 9: the hang went off
    assert [(n, c.rank, c.fault.at_step) for n, c in rec.sent] == [("node-0", 0, 30)]
    assert f.armed() == [late]


# -- ckpt-corrupt on a real checkpoint, the validity in a real SQLite store ---------------------


def test_the_controllers_corruption_marks_the_checkpoint_invalid_in_the_store_at_once(tmp_path: Path,
                                                                                      rec: Recorder) -> None:
    from tests.unit.test_chaos import _save_two_checkpoints
    from tests.unit.test_workers_parallel import in_pg
    from tests.unit.test_workers_support import run_ranks
    from fleet.controlplane.store import Store
    from fleet.workers import checkpoint

    ckpt = tmp_path / "ckpt"
    run_ranks(in_pg, 1, (_save_two_checkpoints, str(ckpt)), timeout_s=50)
    with Store(f"sqlite:///{tmp_path}/fleet.db") as store:
        job_id = store.create_job("t", 20, "{}")
        attempt = store.create_attempt(job_id)
        saved = [events_pb2.Event(checkpoint=events_pb2.CheckpointEvent(
            job_id=job_id, attempt=attempt, rank=0, step=step, path=str(checkpoint.step_path(ckpt, step)),
            time_ns=step)) for step in (5, 10)]
        assert store.record_batch("agent-node-0", 1, 1, saved)
        job = Job(job_id)
        job.attempt = attempt
        # the real corruption (chaos.corrupt_checkpoint), no restore anywhere
        ChaosFirer(job, rec, rec, rec, store, str(ckpt)).fire(FaultOrder("ckpt-corrupt"))
        assert checkpoint.latest_valid(ckpt)[0] == 5
        assert [(c.step, c.valid) for c in store.checkpoints(job_id)] == [(5, True), (10, False)]
        assert store.latest_valid_checkpoint(job_id).step == 5
        [action] = [a for a in store.actions(job_id) if a.kind == "ckpt_invalid"]
        assert action.attempt == attempt
        assert action.cause.startswith("checkpoint of step 10 invalid: ckpt-corrupt fault: the controller "
                                       "flipped bytes in ")


def test_a_corruption_the_store_has_not_heard_of_is_logged_not_raised(tmp_path: Path, rec: Recorder,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from fleet.controlplane.store import Store

    with Store(f"sqlite:///{tmp_path}/fleet.db") as store:
        job_id = store.create_job("t", 20, "{}")
        ChaosFirer(Job(job_id), rec, rec, rec, store, "/ckpt", corrupt=rec.corrupt).fire(FaultOrder("ckpt-corrupt"))
        assert rec.corrupted == ["/ckpt"] and store.checkpoints(job_id) == []
    assert "checkpoint of step 5 is not in the store yet" in caplog.text
