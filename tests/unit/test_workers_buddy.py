"""Peer copies of sharded state (workers/buddy.py): who holds whose copy, the restore
plan, and on real gloo ranks (2 simulated nodes x 2 ranks, FSDP2 + expert parallelism)
a rank whose process is lost restored from its buddy's copy, bit for bit; a rank lost
with its buddy falls back to disk, saying why."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_workers_support import AgentServer, free_port, run_ranks
from fleet.workers import buddy, snapshot, train
from fleet.workers.spec import TrainArgs, WorkerSpec

pytestmark = pytest.mark.timeout(300)

FAIL_AT = 7
PER_NODE = 2


def test_a_buddy_is_the_same_local_rank_on_the_next_node():
    pairs = {r: buddy.Buddies(r, 2, r // 2, 3) for r in range(6)}
    assert [pairs[r].buddy for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [pairs[r].ward for r in range(6)] == [4, 5, 0, 1, 2, 3]
    for r, b in pairs.items():
        assert b.buddy // 2 != r // 2 and pairs[b.buddy].ward == r
        assert b.buddy_of(r) == b.buddy
    alone = buddy.Buddies(1, 4, 0, 1)
    assert not alone.active and alone.buddy == alone.ward == -1


def test_the_plan_takes_the_newest_step_every_rank_can_get():
    buddy_of = [2, 3, 0, 1]
    # every rank has its own snapshot of 6 and 5
    p = buddy.plan([[6, 5]] * 4, [[6, 5]] * 4, buddy_of, disk=5)
    assert (p.step, p.sources) == (6, (-1, -1, -1, -1))
    # rank 1's process was replaced: its shard comes from its buddy, rank 3
    p = buddy.plan([[6, 5], [], [6, 5], [6, 5]], [[6, 5]] * 4, buddy_of, disk=5)
    assert (p.step, p.sources) == (6, (-1, 3, -1, -1))
    # its buddy held step 5 only (the copy of 6 never arrived): everyone goes back to 5
    p = buddy.plan([[6, 5], [], [6, 5], [6, 5]], [[6, 5], [5, 4], [6, 5], [6, 5]], buddy_of, disk=0)
    assert (p.step, p.sources) == (5, (-1, 3, -1, -1))
    # ranks one step apart (a failure cut the last all-reduce half way)
    p = buddy.plan([[7, 6], [6, 5], [7, 6], [7, 6]], [[7, 6], [6, 5], [7, 6], [7, 6]], buddy_of, disk=0)
    assert (p.step, p.sources) == (6, (-1, -1, -1, -1))


def test_the_plan_says_why_memory_cannot_serve():
    buddy_of = [2, 3, 0, 1]
    # rank 1 and its buddy rank 3 were both replaced: rank 1's copy is gone
    p = buddy.plan([[6, 5], [], [6, 5], []], [[6, 5], [], [6, 5], [6, 5]], buddy_of, disk=5)
    assert p.step == 0 and p.reason == ("no copy of the state of rank 1 is left in memory: rank 1 and its "
                                        "buddy rank 3 were both lost")
    p = buddy.plan([[3, 2]] * 4, [[3, 2]] * 4, buddy_of, disk=5)
    assert p.step == 0 and "on disk is newer" in p.reason
    assert buddy.plan([[]] * 4, [[]] * 4, buddy_of, disk=0).step == 0


def test_snapshot_memory_counts_own_and_peer_copies():
    one = buddy.state_bytes(1000, 4, sharded=True)
    assert one == 3000
    # two kept and the one being taken, of its own and of its ward's
    assert buddy.snapshot_memory(1000, 4, 2, sharded=True, peer=True) == 6 * one
    assert buddy.snapshot_memory(1000, 4, 1, sharded=True, peer=True) == 3 * one   # no other node
    assert buddy.snapshot_memory(1000, 4, 2, sharded=False, peer=True) == 3 * 12000


def test_peer_holder_keeps_the_newest_copies_and_reuses_buffers():
    h = buddy.PeerHolder()
    key = ("job", 1)
    first = None
    for step in range(1, 5):
        c = h.buffer(key, [3, 1], rng_numel=4)
        first = first or c
        c.step = step
        h.commit(key, c)
    assert h.steps(key) == [4, 3]
    assert h.get(key, 2) is None and h.get(key, 4) is not None
    assert h.nbytes() == 3 * (4 * 8 + 4)  # two kept and one spare
    h.drop_newer(key, 3)
    assert h.steps(key) == [3]
    h.forget_other_jobs("other")
    assert h.steps(key) == [] and h.nbytes() == 0


def _spec(rank, world, port, agent, ckpt, attempt, recipe) -> WorkerSpec:
    return WorkerSpec(
        job_id="job-buddy", attempt=attempt, rank=rank, world_size=world, node_name=f"n{rank // PER_NODE}",
        master_addr="127.0.0.1", master_port=port, agent_address=agent, checkpoint_dir=ckpt,
        train=recipe, pg_timeout_s=20.0, report_interval_s=0.02, env={"GLOO_SOCKET_IFNAME": "lo"},
        local_rank=rank % PER_NODE, local_world_size=PER_NODE, group_rank=rank // PER_NODE,
        group_world_size=world // PER_NODE)


def _reference(rank, world, port, agent, ckpt, recipe):
    losses = {}
    train.run(_spec(rank, world, port, agent, ckpt, 0, recipe), on_step=lambda r: losses.update({r.step: r.loss}))
    return losses


def _lose_then_restart(rank, world, port, agent, ckpt, recipe, port2, lost):
    def fail(step: int) -> None:
        if rank == lost[0] and step == FAIL_AT:
            raise RuntimeError("injected failure")

    try:
        train.run(_spec(rank, world, port, agent, ckpt, 1, recipe), before_step=fail)
    except Exception:  # noqa: BLE001 - one rank raises, the others lose their peer
        pass
    held = buddy.holder().nbytes()
    if rank in lost:  # this rank's process "died": a replacement holds nothing
        snapshot.holder().clear()
        buddy.holder().clear()
    losses = {}
    result = train.run(_spec(rank, world, port2, agent, ckpt, 2, recipe),
                       on_step=lambda r: losses.update({r.step: r.loss}))
    return {"restored_step": result["restored_step"], "restored_from": result["restored_from"],
            "losses": losses, "held": held}


@pytest.fixture
def agent():
    server = AgentServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free losses of every rank (one run for the module's tests)."""
    recipe = TrainArgs(steps=10, checkpoint_interval=4, data_parallel="fsdp", ep_size=2)
    server = AgentServer()
    try:
        ref = run_ranks(_reference, 4, (server.address, str(tmp_path_factory.mktemp("ref")), recipe), timeout_s=150)
    finally:
        server.stop()
    return recipe, ref


def test_a_lost_rank_is_restored_from_its_buddys_copy_bit_for_bit(agent, tmp_path, reference):
    recipe, ref = reference
    out = run_ranks(_lose_then_restart, 4,
                    (agent.address, str(tmp_path / "run"), recipe, free_port(), (1,)), timeout_s=200)
    assert out[1]["restored_from"] == "peer copy from rank 3"
    for rank in (0, 2, 3):
        assert out[rank]["restored_from"] == "memory"
    for rank in range(4):
        assert out[rank]["held"] > 0  # every rank held its ward's copy
        # the disk has step 4; memory (own or the buddy's) has the last finished step
        assert out[rank]["restored_step"] == FAIL_AT - 1
        assert sorted(out[rank]["losses"]) == list(range(FAIL_AT, 11))
        for step, loss in out[rank]["losses"].items():
            assert loss == ref[rank][step], f"rank {rank} step {step}: {loss} != {ref[rank][step]}"


def test_a_rank_lost_with_its_buddy_falls_back_to_disk_saying_why(agent, tmp_path, reference):
    recipe, ref = reference
    out = run_ranks(_lose_then_restart, 4,
                    (agent.address, str(tmp_path / "run"), recipe, free_port(), (1, 3)), timeout_s=200)
    for rank in range(4):
        assert out[rank]["restored_step"] == 4
        assert out[rank]["restored_from"] == ("disk: no copy of the state of rank 1, 3 is left in memory: "
                                              "rank 1 and its buddy rank 3 were both lost")
        for step, loss in out[rank]["losses"].items():
            assert loss == ref[rank][step], f"rank {rank} step {step}: {loss} != {ref[rank][step]}"


def test_a_copy_round_trips_a_flat_state():
    live = [torch.arange(5, dtype=torch.float32), torch.arange(3, dtype=torch.float64)]
    h = snapshot.SnapshotHolder()
    snap = h.stage(("j", 0), 3, live, 7)
    words = [w.clone() for _, w in snap.state.words]
    target = [torch.zeros(5), torch.zeros(3, dtype=torch.float64)]
    other = snapshot.SnapshotHolder().stage(("j", 0), 0, target, None)
    for (_, dst), src in zip(other.state.words, words, strict=True):
        dst.copy_(src)
    snapshot.restore_into(target, other)
    assert target[0].tolist() == live[0].tolist() and target[1].tolist() == live[1].tolist()
