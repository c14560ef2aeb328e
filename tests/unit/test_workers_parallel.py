"""workers/parallel.py: mesh validation, FSDP2/DDP with expert parallelism on real gloo
ranks matching a single-process reference, and the global gradient norm.

``StandInMoE`` is a small model of the structure workers/model.py is growing into
(blocks in ``model.layers``, MoE blocks with routed experts stacked in ``moe.experts``
and sharded over the EP group). The checkpoint tests and bench/checkpoint.py reuse it.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.unit.test_workers_support import run_ranks
from fleet.workers import parallel
from fleet.workers.rendezvous import loopback_store

pytestmark = pytest.mark.timeout(120)


# ---- the stand-in model ------------------------------------------------------------------

class _GatherTokens(torch.autograd.Function):
    """Forward: concatenate every EP rank's tokens. Backward: sum the gradients over the
    group and keep this rank's slice (a reduce-scatter built from gloo's all_reduce)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n = dist.get_world_size(ctx.group)
        return grad.chunk(n)[dist.get_rank(ctx.group)].contiguous(), None


class _ScatterSum(torch.autograd.Function):
    """Forward: sum every rank's contributions for all tokens and keep this rank's slice.
    Backward: gather the slices' gradients back (the transpose of the forward)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _GatherTokens.forward(ctx, grad, ctx.group), None


class StandInExperts(nn.Module):
    """``n_local`` SwiGLU-free experts (``w1`` then ``w2``) stacked: [n_local, ...]."""

    def __init__(self, n_experts: int, n_local: int, first: int, dim: int, hidden: int,
                 gen: torch.Generator) -> None:
        super().__init__()
        w1 = torch.randn(n_experts, dim, hidden, generator=gen) * dim ** -0.5
        w2 = torch.randn(n_experts, hidden, dim, generator=gen) * hidden ** -0.5
        self.first = first
        self.w1 = nn.Parameter(w1[first:first + n_local].clone())
        self.w2 = nn.Parameter(w2[first:first + n_local].clone())

    def forward(self, x: torch.Tensor, choice: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            idx = (choice == self.first + e).nonzero().squeeze(1)
            h = F.silu(x[idx] @ self.w1[e]) @ self.w2[e]
            out = out.index_add(0, idx, h * gate[idx, None])
        return out


class StandInMoELayer(nn.Module):
    def __init__(self, n_experts: int, dim: int, hidden: int, gen: torch.Generator,
                 ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        n_local = n_experts // ep
        self.ep_group = ep_group
        self.router = nn.Linear(dim, n_experts, bias=False)
        nn.init.normal_(self.router.weight, std=dim ** -0.5, generator=gen)
        self.experts = StandInExperts(n_experts, n_local, ep_rank * n_local, dim, hidden, gen)
        self.shared = nn.Linear(dim, dim, bias=False)
        nn.init.normal_(self.shared.weight, std=dim ** -0.5, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens = _GatherTokens.apply(flat, self.ep_group) if self.ep_group is not None else flat
        gate, choice = torch.softmax(self.router(tokens), dim=-1).max(dim=-1)
        routed = self.experts(tokens, choice, gate)
        if self.ep_group is not None:
            routed = _ScatterSum.apply(routed, self.ep_group)
        return (routed + self.shared(flat)).view_as(x)


class StandInBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, gen: torch.Generator,
                 ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim, bias=False)
        nn.init.normal_(self.mix.weight, std=dim ** -0.5, generator=gen)
        if n_experts:
            self.moe = StandInMoELayer(n_experts, dim, hidden, gen, ep_group)
        else:
            self.ffn = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.SiLU(), nn.Linear(hidden, dim, bias=False))
            for lin in (self.ffn[0], self.ffn[2]):
                nn.init.normal_(lin.weight, std=lin.in_features ** -0.5, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm(x))
        return x + (self.moe(x) if hasattr(self, "moe") else self.ffn(x))


class StandInMoE(nn.Module):
    """Embedding, ``n_layers`` blocks (every ``moe_every``-th one MoE), output head."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 2, hidden: int = 48,
                 n_experts: int = 4, moe_every: int = 2, seed: int = 0,
                 ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, generator=gen)
        self.layers = nn.ModuleList(
            StandInBlock(dim, hidden, n_experts if (i + 1) % moe_every == 0 else 0, gen, ep_group)
            for i in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.output.weight, std=dim ** -0.5, generator=gen)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def init_pg(rank: int, world_size: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))


def in_pg(rank: int, world_size: int, port: int, body, *args):
    """Rank entry for ``run_ranks``: ``body(rank, world_size, *args)`` inside a gloo group.

    The group is destroyed, and garbage collected, only after ``body``'s frame is gone:
    FSDP modules sit in reference cycles, and a process group they keep alive until
    interpreter shutdown aborts the process there ("terminate called without an
    active exception") now and then.
    """
    init_pg(rank, world_size, port)
    try:
        return body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
        gc.collect()


def global_batch(world_size: int, per_rank: int = 2, seq: int = 8, vocab: int = 64, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (world_size * per_rank, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def full_params(model: nn.Module, meshes: parallel.Meshes) -> dict[str, torch.Tensor]:
    """Every parameter at full size (experts gathered over the EP group), by name."""
    from torch.distributed.tensor import DTensor

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    experts = parallel.expert_param_ids(inner)
    out = {}
    for name, p in inner.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if id(p) in experts and meshes.ep_size > 1:
            parts = [torch.empty_like(t) for _ in range(meshes.ep_size)]
            dist.all_gather(parts, t.contiguous(), group=meshes.ep_group)
            t = torch.cat(parts)
        out[name] = t.detach().clone()
    return out


# ---- one step on ranks vs a single process ------------------------------------------------

MAX_NORM = 0.5  # below the init grad norm, so clipping scales the update


def _step_on_ranks(rank: int, world_size: int, ep_size: int, mode: str) -> dict:
    meshes = parallel.build_meshes(world_size, ep_size, n_experts=4)
    model = StandInMoE(seed=0, ep_group=meshes.ep_group if ep_size > 1 else None)
    model = parallel.parallelize(model, meshes, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = global_batch(world_size)
    per = inputs.shape[0] // world_size
    mine = slice(rank * per, (rank + 1) * per)
    loss = F.cross_entropy(model(inputs[mine]).flatten(0, 1), targets[mine].flatten())
    loss.backward()
    parallel.sync_expert_grads(model, meshes)
    norm = parallel.clip_grad_norm_(model, MAX_NORM, meshes)
    opt.step()
    return {"norm": norm, "params": full_params(model, meshes)}


def _reference(world_size: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = StandInMoE(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = global_batch(world_size)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    opt.step()
    return norm, {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize(("world_size", "ep_size", "mode"), [
    (4, 2, "fsdp"), (4, 2, "ddp"), (2, 1, "fsdp"), (2, 2, "ddp"),
])
def test_one_step_matches_single_process_reference(world_size, ep_size, mode):
    torch.set_num_threads(1)
    ref_norm, ref = _reference(world_size)
    assert ref_norm > MAX_NORM  # clipping is exercised
    out = run_ranks(in_pg, world_size, (_step_on_ranks, ep_size, mode), timeout_s=90)
    for rank, r in out.items():
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-5), rank
        assert r["params"].keys() == ref.keys()
        for name, want in ref.items():
            torch.testing.assert_close(r["params"][name], want, rtol=0, atol=1e-5, msg=f"{rank} {name}")


# ---- layout and validation, single process -----------------------------------------------

@pytest.mark.parametrize(("world", "ep", "experts", "field"), [
    (4, 3, 6, "ep_size"), (4, 2, 3, "n_experts"), (4, 0, 4, "ep_size"), (2, 2, 0, "n_experts"),
])
def test_bad_sizes_name_the_field(world, ep, experts, field):
    with pytest.raises(ValueError, match=field):
        parallel.check_sizes(world, ep, experts)


def test_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="data_parallel"):
        parallel.parallelize(StandInMoE(), None, "zero3")


def test_expert_modules_are_found_by_name():
    model = StandInMoE(n_layers=4, moe_every=2)
    assert [n for n, _ in parallel.expert_modules(model)] == ["layers.1.moe.experts", "layers.3.moe.experts"]
    assert len(parallel.expert_param_ids(model)) == 4


def _groups_on_ranks(rank: int, world_size: int) -> dict:
    meshes = parallel.build_meshes(world_size, 2, n_experts=4)
    return {"ep": dist.get_process_group_ranks(meshes.ep_group),
            "edp": dist.get_process_group_ranks(meshes.edp_group),
            "ep_rank": meshes.ep_rank, "edp_size": meshes.edp_size}


def test_ep_groups_are_consecutive_ranks():
    out = run_ranks(in_pg, 4, (_groups_on_ranks,), timeout_s=60)
    assert [out[r]["ep"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [out[r]["edp"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [out[r]["ep_rank"] for r in range(4)] == [0, 1, 0, 1]
    assert {out[r]["edp_size"] for r in range(4)} == {2}
