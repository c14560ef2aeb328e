"""In-process restart from in-memory snapshots on real gloo ranks: the same processes run
a failed attempt and then the next one, which restores the last finished step from
memory (no disk checkpoint is that new) and replays the fault-free losses bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_workers_support import AgentServer, free_port, run_ranks
from fleet.workers import snapshot, train
from fleet.workers.spec import TrainArgs, WorkerSpec

pytestmark = pytest.mark.timeout(240)

FAIL_AT = 7


def _spec(rank, world, port, agent, ckpt, attempt, recipe) -> WorkerSpec:
    return WorkerSpec(
        job_id="job-snap", attempt=attempt, rank=rank, world_size=world, node_name="n0",
        master_addr="127.0.0.1", master_port=port, agent_address=agent, checkpoint_dir=ckpt,
        train=recipe, pg_timeout_s=20.0, report_interval_s=0.02, env={"GLOO_SOCKET_IFNAME": "lo"})


def _reference(rank, world, port, agent, ckpt, recipe):
    losses = {}
    train.run(_spec(rank, world, port, agent, ckpt, 0, recipe), on_step=lambda r: losses.update({r.step: r.loss}))
    return losses


def _fail_then_restart(rank, world, port, agent, ckpt, recipe, port2):
    def fail(step: int) -> None:
        if rank == 1 and step == FAIL_AT:
            raise RuntimeError("injected failure")

    try:
        train.run(_spec(rank, world, port, agent, ckpt, 1, recipe), before_step=fail)
    except Exception as exc:  # noqa: BLE001 - rank 1 raises; rank 0 loses its peer
        first = type(exc).__name__
    else:
        first = "finished"
    losses = {}
    result = train.run(_spec(rank, world, port2, agent, ckpt, 2, recipe),
                       on_step=lambda r: losses.update({r.step: r.loss}))
    return {"first": first, "restored_step": result["restored_step"],
            "restored_from": result["restored_from"], "losses": losses}


@pytest.fixture
def agent():
    server = AgentServer()
    yield server
    server.stop()


def test_in_process_restart_restores_last_step_from_memory_bit_for_bit(agent, tmp_path):
    # replicated state: any rank's snapshot serves. Sharded state, where every rank restores
    # its own shard (or its buddy's copy of it), is tests/unit/test_workers_buddy.py's
    recipe = TrainArgs(steps=12, checkpoint_interval=5, data_parallel="ddp", ep_size=1)
    ref = run_ranks(_reference, 2, (agent.address, str(tmp_path / "ref"), recipe), timeout_s=120)
    out = run_ranks(_fail_then_restart, 2,
                    (agent.address, str(tmp_path / "run"), recipe, free_port()), timeout_s=180)
    for rank in (0, 1):
        assert out[rank]["first"] != "finished"
        # the disk has step 5 at best; memory has the last finished step
        assert out[rank]["restored_step"] == FAIL_AT - 1
        assert out[rank]["restored_from"].startswith("memory")
        assert sorted(out[rank]["losses"]) == list(range(FAIL_AT, 13))
        for step, loss in out[rank]["losses"].items():
            assert loss == ref[rank][step], f"rank {rank} step {step}: {loss} != {ref[rank][step]}"


def test_snapshot_holder_keeps_two_newest_and_reuses_buffers():
    h = snapshot.SnapshotHolder()
    live = [torch.zeros(3), torch.zeros(2, dtype=torch.float64)]
    for step in range(1, 5):
        for t in live:
            t.fill_(step)
        h.take(("job", 1), step, live, data_position=step * 10)
    assert h.newest(("job", 1)).step == 4
    assert h.get(("job", 1), 3).tensors[0].tolist() == [3.0, 3.0, 3.0]
    assert h.get(("job", 1), 2) is None
    target = [torch.empty(3), torch.empty(2, dtype=torch.float64)]
    snapshot.restore_into(target, h.get(("job", 1), 3))
    assert target[1].tolist() == [3.0, 3.0]
    with pytest.raises(RuntimeError, match="layout"):
        snapshot.restore_into([torch.empty(4)], h.newest(("job", 1)))
    h.forget_other_jobs("other")
    assert h.newest(("job", 1)) is None
