"""workers/optim.py: ``LocalAdamW`` on real gloo ranks (FSDP2, an unevenly sharded layer
included) steps to the same bits as torch's AdamW on the DTensors, keeps the same
state_dict, and never enters DTensor's sharding propagation; on plain tensors it is
torch's AdamW."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.unit.test_workers_support import run_ranks
from fleet.workers.optim import LocalAdamW
from fleet.workers.rendezvous import loopback_store
from fleet.workers.snapshot import ensure_adam_state

pytestmark = pytest.mark.timeout(120)

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 5 output rows over 2 ranks: an uneven shard (3 + 2), FSDP pads it
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, seen: list | None = None) -> int:
    """``STEPS`` steps; returns how many entries ``seen`` gained inside ``opt.step()``."""
    gen = torch.Generator().manual_seed(rank)
    inside = 0
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        model(x).square().mean().backward()
        before = len(seen) if seen is not None else 0
        opt.step()
        inside += len(seen) - before if seen is not None else 0
        opt.zero_grad(set_to_none=True)
    return inside


def _both(rank: int, world_size: int, port: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    propagator = DTensor._op_dispatcher.sharding_propagator
    worked_out = []
    real = propagator.propagate_op_sharding_non_cached

    def counted(*args, **kwargs):
        worked_out.append(args[0].op)
        return real(*args, **kwargs)

    propagator.propagate_op_sharding_non_cached = counted
    try:
        local_model = fully_shard(_model())
        local_opt = LocalAdamW(local_model.parameters(), lr=1e-2, weight_decay=0.1)
        before = len(worked_out)
        ensure_adam_state(local_opt)  # as a restore does: no DTensor operation either
        local_props = len(worked_out) - before
        local_props += _train(local_model, local_opt, rank, worked_out)

        ref_model = fully_shard(_model())
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_props = _train(ref_model, ref_opt, rank, worked_out)

        def local_state(opt):
            return [[(k, v.to_local().clone() if isinstance(v, DTensor) else v.clone(), type(v).__name__)
                     for k, v in sorted(s.items())] for s in opt.state.values()]

        return {
            "params_equal": all(torch.equal(a.to_local(), b.to_local())
                                for a, b in zip(local_model.parameters(), ref_model.parameters(), strict=True)),
            "moved": not torch.equal(next(local_model.parameters()).to_local(),
                                     next(fully_shard(_model()).parameters()).to_local()),
            "state": local_state(local_opt), "ref_state": local_state(ref_opt),
            "local_props": local_props, "ref_props": ref_props,
            "foreach": [g["foreach"] for g in local_opt.param_groups],
        }
    finally:
        propagator.propagate_op_sharding_non_cached = real
        dist.destroy_process_group()


def test_local_adamw_steps_fsdp_shards_to_torchs_bits_without_sharding_propagation():
    out = run_ranks(_both, 2, timeout_s=90)
    for rank, got in out.items():
        assert got["moved"], "the optimizer did not move the parameters: the comparison is empty"
        assert got["params_equal"], f"rank {rank}: parameters differ from torch's AdamW on DTensors"
        assert len(got["state"]) == len(got["ref_state"]) == 4  # 2 weights, 2 biases
        for mine, ref in zip(got["state"], got["ref_state"], strict=True):
            assert [(k, kind) for k, _, kind in mine] == [(k, kind) for k, _, kind in ref]
            assert all(torch.equal(a, b) for (_, a, _), (_, b, _) in zip(mine, ref, strict=True))
        # torch's AdamW works shardings out (so the probe sees them); the local one never does
        assert got["ref_props"] > 0
        assert got["local_props"] == 0
        assert got["foreach"] == [False]  # torch's choice for DTensors, kept for the shards


def test_on_plain_tensors_it_is_torchs_adamw():
    torch.manual_seed(0)
    a, b = _model(), _model()
    opt_a = LocalAdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    _train(a, opt_a, 0)
    _train(b, opt_b, 0)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert opt_a.state_dict()["state"].keys() == opt_b.state_dict()["state"].keys()
    assert opt_a.param_groups[0]["foreach"] is None  # torch's own choice for plain tensors
