"""How the model is spread over ranks: device meshes, FSDP2/DDP wrapping, expert parallelism,
and the global gradient norm.

Layout (world = dp * ep ranks, torchtitan-style "dp_shard includes ep"):
  * every rank is a data-parallel rank: it reads its own micro-batch;
  * dense (non-expert) parameters are replicated in value across all ranks and
    sharded (FSDP) or reduced (DDP) over the 1-D ``dense`` mesh of all ranks;
  * routed experts are split over the expert-parallel (EP) group of ``ep`` consecutive
    ranks ([0..ep-1], [ep..2ep-1], ...): EP rank j holds experts
    [j*n/ep, (j+1)*n/ep); the ranks with the same EP index form the
    expert-data-parallel (EDP) group, over which those experts are sharded/reduced.

Expert parameters are every parameter of a submodule named ``experts`` (see
``expert_modules``); everything else is dense.

Gradient scale: each rank's loss is the mean over its own micro-batch, and the
optimizer must see the gradient of the mean over the global batch. Dense gradients
are therefore averaged over all ``world`` ranks. An expert copy's gradient already
sums the contributions of its whole EP group (the token exchange is differentiable),
so expert gradients are summed over the EDP group and divided by ``world`` too, not
by the EDP size.

Invariant: every rank builds every process group, in the same order
(``build_meshes`` is collective), so group creation never deadlocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

DATA_PARALLEL_MODES = ("fsdp", "ddp")
EXPERTS = "experts"  # name of the submodule that holds an MoE layer's routed experts


@dataclass(frozen=True)
class Meshes:
    """The process groups of one rank. ``dense`` spans all ranks; ``ep``/``edp`` are
    this rank's expert-parallel and expert-data-parallel groups."""

    world_size: int
    ep_size: int
    dense: DeviceMesh            # 1-D, all ranks: FSDP/DDP of dense params
    ep_mesh: DeviceMesh          # 1-D, this rank's EP group (consecutive ranks)
    edp_mesh: DeviceMesh         # 1-D, ranks with this rank's EP index

    @property
    def edp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.ep_mesh.get_group()

    @property
    def edp_group(self) -> dist.ProcessGroup:
        return self.edp_mesh.get_group()

    @property
    def ep_rank(self) -> int:
        """This rank's index in its EP group: it holds that slice of the experts."""
        return self.ep_mesh.get_local_rank()


def check_sizes(world_size: int, ep_size: int, n_experts: int = 0) -> None:
    """Raise ValueError, naming the fields, unless the EP layout fits the world."""
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1")
    if ep_size < 1:
        raise ValueError(f"ep_size ({ep_size}) must be >= 1")
    if world_size % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide world_size ({world_size})")
    if n_experts and n_experts % ep_size:
        raise ValueError(f"n_experts ({n_experts}) must be divisible by ep_size ({ep_size})")
    if ep_size > 1 and not n_experts:
        raise ValueError(f"ep_size ({ep_size}) > 1 needs a MoE model (n_experts > 0)")


def build_meshes(world_size: int, ep_size: int, n_experts: int = 0, device_type: str = "cpu") -> Meshes:
    """Create the dense mesh and the EP/EDP meshes on every rank (collective).

    Needs an initialized default process group of ``world_size`` ranks. The 2-D mesh
    ``(edp, ep)`` is laid out row-major, so EP groups are consecutive ranks.
    """
    check_sizes(world_size, ep_size, n_experts)
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise ValueError(f"build_meshes needs an initialized process group of world_size ({world_size}) ranks")
    dense = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    grid = init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    return Meshes(world_size, ep_size, dense, grid["ep"], grid["edp"])


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every submodule named ``experts``, outermost only."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == EXPERTS and not any(name.startswith(n + ".") for n, _ in found):
            found.append((name, module))
    return found


def expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for _, m in expert_modules(model) for p in m.parameters()}


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("parallelize needs the model's blocks in `model.layers`")
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def parallelize(model: nn.Module, meshes: Meshes, data_parallel: str = "fsdp") -> nn.Module:
    """Wrap ``model`` for data parallelism; returns the module to train.

    "fsdp": FSDP2 ``fully_shard`` on each block's experts over the EDP mesh (gradient
    divide factor = world), then on each block and on the root over the dense mesh.
    Parameters become DTensors; the model is changed in place and returned.
    "ddp": ``DistributedDataParallel`` over all ranks for dense parameters, with the
    expert parameters excluded from it; call ``sync_expert_grads`` after backward.
    """
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, not {data_parallel!r}")
    if data_parallel == "fsdp":
        for block in _blocks(model):
            for _, experts in expert_modules(block):
                fully_shard(experts, mesh=meshes.edp_mesh)
                # FSDP divides by its mesh size (edp) by default: see the module docstring.
                # A custom factor would use PREMUL_SUM, which gloo lacks; sum-only
                # comms make FSDP sum and then divide locally.
                experts.set_gradient_divide_factor(float(meshes.world_size))
                experts.set_force_sum_reduction_for_comms(True)
            fully_shard(block, mesh=meshes.dense)
        fully_shard(model, mesh=meshes.dense)
        return model
    # Experts differ across EP ranks: DDP must neither broadcast nor average them.
    ignored = [f"{name}.{n}" for name, m in expert_modules(model)
               for n, _ in (*m.named_parameters(), *m.named_buffers())]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(model, process_group=meshes.dense.get_group())


def sync_expert_grads(model: nn.Module, meshes: Meshes) -> None:
    """DDP mode: sum expert gradients over the EDP group and divide by world (in place).

    One flat all-reduce. A no-op for FSDP-wrapped models (FSDP reduces them itself).
    """
    if isinstance(model, FSDPModule):
        return
    grads = [p.grad for _, m in expert_modules(model) for p in m.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if meshes.edp_size > 1:
        dist.all_reduce(flat, group=meshes.edp_group)
    flat.div_(meshes.world_size)
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, meshes: Meshes) -> float:
    """Scale all gradients so their global L2 norm is at most ``max_norm``; return the
    norm before clipping.

    Every gradient element is counted once over the whole job: FSDP shards (dense or
    expert, whatever their mesh) are disjoint, so their local squares are summed over
    all ranks; plain (DDP) dense gradients are replicated on every rank and plain
    expert gradients on every EDP rank, so their squares are divided by that count.
    One all-reduce of three float64 sums over all ranks. ``max_norm <= 0`` only measures.
    """
    experts = expert_param_ids(model)
    sums = torch.zeros(3, dtype=torch.float64)  # [sharded, replicated dense, replicated experts]
    grads = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        if isinstance(g, DTensor):
            local = g.to_local()
            slot = 0
            if any(not pl.is_shard() for pl in g.placements):
                raise ValueError("clip_grad_norm_ expects FSDP (Shard) gradients, not "
                                 f"{g.placements} on {tuple(g.device_mesh.mesh.shape)}")
        else:
            local = g
            slot = 2 if id(p) in experts else 1
        sums[slot] += local.double().pow(2).sum()
    if dist.is_initialized() and meshes.world_size > 1:
        dist.all_reduce(sums, group=meshes.dense.get_group())
    total = float((sums[0] + sums[1] / meshes.world_size + sums[2] / meshes.edp_size).sqrt())
    coef = max_norm / (total + 1e-6)  # the epsilon torch.nn.utils.clip_grad_norm_ uses
    if max_norm > 0 and coef < 1.0:
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return total
