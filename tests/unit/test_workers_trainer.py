"""The training recipe on real gloo ranks: a rank killed mid-run and restored from the
async checkpoint replays the uninterrupted loss curve bit for bit; activation
checkpointing changes nothing numerically; the schedule, gradient accumulation,
loss-free router balancing and step metrics do what the recipe says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
from tests.unit.test_workers_support import AgentServer, run_ranks
from fleet.workers import checkpoint, train
from fleet.workers.faults import FAULT_EXIT_CODE
from fleet.workers.schedule import lr_at
from fleet.workers.spec import ModelArgs, TrainArgs, WorkerSpec

pytestmark = pytest.mark.timeout(180)


def _spec(rank: int, world: int, port: int, agent: str, ckpt: str, attempt: int,
          train_args: TrainArgs, model: ModelArgs = ModelArgs()) -> WorkerSpec:
    return WorkerSpec(
        job_id="job-r", attempt=attempt, rank=rank, world_size=world, node_name="n0",
        master_addr="127.0.0.1", master_port=port, agent_address=agent, checkpoint_dir=ckpt,
        model=model, train=train_args, pg_timeout_s=20.0, report_interval_s=0.02,
        env={"GLOO_SOCKET_IFNAME": "lo"})


def _run(rank, world, port, agent, ckpt, attempt, train_args, model=ModelArgs()):
    return train.run(_spec(rank, world, port, agent, ckpt, attempt, train_args, model))


def _run_or_fail(rank, world, port, agent, ckpt, attempt, train_args):
    try:
        return train.run(_spec(rank, world, port, agent, ckpt, attempt, train_args))
    except Exception as exc:  # the surviving rank loses its peer; it must fail, not hang
        return type(exc).__name__


@pytest.fixture
def agent():
    server = AgentServer()
    yield server
    server.stop()


def _steps(agent: AgentServer, attempt: int, rank: int = 0) -> dict[int, events_pb2.StepEvent]:
    return {s.step: s for s in agent.of_kind("step", rank) if s.attempt == attempt}


def test_killed_rank_restored_from_async_checkpoint_replays_losses_bit_for_bit(agent, tmp_path):
    recipe = TrainArgs(steps=16, checkpoint_interval=5, ep_size=2, async_checkpoint=True)
    run_ranks(_run, 2, (agent.address, str(tmp_path / "ref"), 0, recipe), timeout_s=120)
    reference = _steps(agent, 0)

    # attempt 1: rank 1 is killed at step 13; the newest committed checkpoint is <= 12
    agent.send(1, events_pb2.Command(command_id="k", rank=1,
                                     fault=events_pb2.FaultSpec(kind=FaultKind("crash").wire, at_step=13)))
    out = run_ranks(_run_or_fail, 2, (agent.address, str(tmp_path / "run"), 1, recipe),
                    timeout_s=120, expect_exit={1: FAULT_EXIT_CODE})
    assert out[0] != "ok" and isinstance(out[0], str)
    # attempt 2: restores and finishes
    resumed = run_ranks(_run, 2, (agent.address, str(tmp_path / "run"), 2, recipe), timeout_s=120)
    restored = resumed[0]["restored_step"]
    assert 5 <= restored <= 12 and resumed[0]["final_step"] == 16
    after = _steps(agent, 2)
    assert sorted(after) == list(range(restored + 1, 17))
    for step, ev in after.items():
        ref = reference[step]
        assert (ev.loss, ev.grad_norm, ev.aux_loss) == (ref.loss, ref.grad_norm, ref.aux_loss), step
    # the metrics are real: the schedule's lr, a gradient norm, a router loss, expert load
    for step, ev in reference.items():
        assert ev.lr == pytest.approx(lr_at(recipe, step))
        assert ev.grad_norm > 0 and ev.aux_loss > 0 and ev.mfu > 0
        assert [x.layer for x in ev.expert_load] == [1, 3]    # tiny's MoE layers
        assert all(sum(x.tokens_per_expert) == 2 * 4 * 64 for x in ev.expert_load)


def test_activation_checkpointing_and_accumulation(agent, tmp_path):
    plain = TrainArgs(steps=4, checkpoint_interval=0, warmup_steps=0)
    run_ranks(_run, 1, (agent.address, str(tmp_path / "a"), 0, plain), timeout_s=120)
    run_ranks(_run, 1, (agent.address, str(tmp_path / "b"), 1,
                        dataclasses.replace(plain, activation_checkpointing=True)), timeout_s=120)
    base, ac = _steps(agent, 0), _steps(agent, 1)
    assert [base[s].loss for s in range(1, 5)] == [ac[s].loss for s in range(1, 5)]   # recompute is exact

    run_ranks(_run, 1, (agent.address, str(tmp_path / "c"), 2,
                        dataclasses.replace(plain, grad_accum_steps=3)), timeout_s=120)
    acc = _steps(agent, 2)
    assert len(acc) == 4
    # three micro-batches per step: three times the tokens routed per MoE layer
    assert all(sum(x.tokens_per_expert) == 3 * 4 * 64 for x in acc[1].expert_load)
    assert acc[1].loss != base[1].loss


def test_loss_free_balancing_keeps_router_biases_identical_across_ranks(agent, tmp_path):
    model = dataclasses.replace(ModelArgs(), load_balance="bias")
    recipe = TrainArgs(steps=6, checkpoint_interval=3, warmup_steps=0)
    run_ranks(_run, 2, (agent.address, str(tmp_path), 0, recipe, model), timeout_s=120)
    for step, ev in _steps(agent, 0).items():
        assert ev.aux_loss == 0.0                                  # no auxiliary loss in bias mode
        assert ev.loss == _steps(agent, 0, rank=1)[step].loss
    # the checkpoint carries the biases, and they moved away from zero
    found = checkpoint.latest_valid(tmp_path)
    assert found is not None and found[0] == 6
    state = {"extra": b""}
    dcp.load(state, checkpoint_id=found[1], no_dist=True)
    biases = checkpoint._unpack(state["extra"])["router_bias"]
    assert len(biases) == 2 and all(torch.count_nonzero(b) > 0 for b in biases)
