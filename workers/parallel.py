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

HSDP (``data_parallel="hsdp"``, FSDP2 with a 2-D mesh, as Meta's FT-HSDP): ranks of a
node are consecutive (global rank = node * ranks_per_node + local rank). Dense
parameters are sharded over the ranks of a node and replicated across nodes, on the
mesh ``("replicate", "shard") = (nodes, ranks_per_node)``. Experts: the EP groups must
stay inside a node (``ep_size`` divides ``ranks_per_node``); an EP rank's experts are
sharded over the ``ranks_per_node // ep_size`` ranks of its node with the same EP index
and replicated across nodes, on ``("replicate", "eshard") = (nodes, ranks_per_node //
ep_size)``. So every shard, dense or expert, has one copy per node: the ranks with the
same in-node position hold bit-identical state (``replica_sets``), which is what SDC
fingerprints compare.

Expert parameters are every parameter of a submodule named ``experts`` (see
``expert_modules``); everything else is dense.

Gradient scale: each rank's loss is the mean over its own micro-batch, and the
optimizer must see the gradient of the mean over the global batch. Dense gradients
are therefore averaged over all ``world`` ranks. An expert copy's gradient already
sums the contributions of its whole EP group (the token exchange is differentiable),
so expert gradients are summed over the EDP group and divided by ``world`` too, not
by the EDP size. HSDP is no different: dense gradients are averaged over both mesh
dimensions (world), expert gradients summed over both and divided by world.

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

DATA_PARALLEL_MODES = ("fsdp", "ddp", "hsdp")
EXPERTS = "experts"  # name of the submodule that holds an MoE layer's routed experts


@dataclass(frozen=True)
class Meshes:
    """The process groups of one rank. ``dense`` spans all ranks; ``ep``/``edp`` are
    this rank's expert-parallel and expert-data-parallel groups. The HSDP meshes exist
    only when ``build_meshes`` was given ``ranks_per_node`` (0 here otherwise)."""

    world_size: int
    ep_size: int
    dense: DeviceMesh            # 1-D, all ranks: FSDP/DDP of dense params
    ep_mesh: DeviceMesh          # 1-D, this rank's EP group (consecutive ranks)
    edp_mesh: DeviceMesh         # 1-D, ranks with this rank's EP index
    ranks_per_node: int = 0
    hsdp_dense: DeviceMesh | None = None    # 2-D ("replicate", "shard") = (nodes, ranks_per_node)
    hsdp_experts: DeviceMesh | None = None  # 2-D ("replicate", "eshard") = (nodes, ranks_per_node // ep)

    @property
    def nodes(self) -> int:
        """Nodes of the HSDP layout (0 without one)."""
        return self.world_size // self.ranks_per_node if self.ranks_per_node else 0

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


def _check_world(world_size: int, ep_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size ({world_size}) must be >= 1")
    if ep_size < 1:
        raise ValueError(f"ep_size ({ep_size}) must be >= 1")
    if world_size % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide world_size ({world_size})")


def check_sizes(world_size: int, ep_size: int, n_experts: int = 0, ranks_per_node: int | None = None) -> None:
    """Raise ValueError, naming the fields, unless the EP layout fits the world (and,
    with ``ranks_per_node``, the HSDP layout: see ``check_hsdp``)."""
    _check_world(world_size, ep_size)
    if n_experts and n_experts % ep_size:
        raise ValueError(f"n_experts ({n_experts}) must be divisible by ep_size ({ep_size})")
    if ep_size > 1 and not n_experts:
        raise ValueError(f"ep_size ({ep_size}) > 1 needs a MoE model (n_experts > 0)")
    if ranks_per_node is not None:
        check_hsdp(world_size, ep_size, ranks_per_node)


def check_hsdp(world_size: int, ep_size: int, ranks_per_node: int) -> None:
    """Raise ValueError, naming the fields, unless ``data_parallel: hsdp`` can lay the
    job out: whole nodes of consecutive ranks, EP groups inside a node."""
    if ranks_per_node < 1:
        raise ValueError(f"hsdp: ranks_per_node ({ranks_per_node}) must be >= 1")
    if world_size % ranks_per_node:
        raise ValueError(f"hsdp: ranks_per_node ({ranks_per_node}) must divide world_size ({world_size})")
    if ranks_per_node % ep_size:
        raise ValueError(f"hsdp: ep_size ({ep_size}) must divide ranks_per_node ({ranks_per_node}), so that "
                         "expert-parallel groups stay inside a node and every expert shard has a copy on "
                         "each other node")


def build_meshes(world_size: int, ep_size: int, n_experts: int = 0, device_type: str = "cpu",
                 ranks_per_node: int | None = None) -> Meshes:
    """Create the dense mesh and the EP/EDP meshes on every rank (collective).

    Needs an initialized default process group of ``world_size`` ranks. The 2-D mesh
    ``(edp, ep)`` is laid out row-major, so EP groups are consecutive ranks.
    ``ranks_per_node`` (give it for ``data_parallel="hsdp"``, and only then: it also
    requires ``ep_size`` to divide it) adds the HSDP meshes; the ranks of a node must be
    consecutive.
    """
    check_sizes(world_size, ep_size, n_experts, ranks_per_node)
    if not dist.is_initialized() or dist.get_world_size() != world_size:
        raise ValueError(f"build_meshes needs an initialized process group of world_size ({world_size}) ranks")
    dense = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    grid = init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    if ranks_per_node is None:
        return Meshes(world_size, ep_size, dense, grid["ep"], grid["edp"])
    nodes = world_size // ranks_per_node
    hsdp_dense = init_device_mesh(device_type, (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    hsdp_experts = hsdp_dense
    if ep_size > 1:
        # row-major (node, shard, ep): the "ep" rows are the EP groups of ``grid``
        cube = init_device_mesh(device_type, (nodes, ranks_per_node // ep_size, ep_size),
                                mesh_dim_names=("replicate", "eshard", "ep"))
        hsdp_experts = cube["replicate", "eshard"]
    return Meshes(world_size, ep_size, dense, grid["ep"], grid["edp"], ranks_per_node, hsdp_dense, hsdp_experts)


def replica_sets_of(world_size: int, ep_size: int, data_parallel: str,
                    ranks_per_node: int | None = None) -> dict[str, list[list[int]]]:
    """For ``"dense"`` and ``"experts"``: the lists of global ranks whose local state of
    that class (parameters, buffers, optimizer state) must be bit-identical after every
    optimizer step. Singleton lists mean nothing to compare (fsdp: every shard is unique).

    ddp: dense = all ranks, experts = the EDP groups (all ranks when ``ep_size`` is 1).
    hsdp (needs ``ranks_per_node``): for both, the ranks with the same in-node position
    on every node. Pure; the controller can call it to tell whether a job has copies.
    """
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, not {data_parallel!r}")
    _check_world(world_size, ep_size)
    if data_parallel == "ddp":
        edp = [list(range(j, world_size, ep_size)) for j in range(ep_size)]
        return {"dense": [list(range(world_size))], "experts": edp}
    if data_parallel == "fsdp":
        alone = [[r] for r in range(world_size)]
        return {"dense": alone, "experts": [list(s) for s in alone]}
    if ranks_per_node is None:
        raise ValueError("data_parallel hsdp needs ranks_per_node")
    check_hsdp(world_size, ep_size, ranks_per_node)
    same_position = [list(range(p, world_size, ranks_per_node)) for p in range(ranks_per_node)]
    return {"dense": same_position, "experts": [list(s) for s in same_position]}


def replica_sets(meshes: Meshes, data_parallel: str) -> dict[str, list[list[int]]]:
    """``replica_sets_of`` for the layout ``meshes`` was built with."""
    return replica_sets_of(meshes.world_size, meshes.ep_size, data_parallel,
                           meshes.ranks_per_node or None)


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
    "hsdp": the same over the 2-D HSDP meshes (``build_meshes(..., ranks_per_node=)``):
    parameters become DTensors placed ``(Replicate(), Shard(0))``.
    "ddp": ``DistributedDataParallel`` over all ranks for dense parameters, with the
    expert parameters excluded from it; call ``sync_expert_grads`` after backward. Its
    start-up broadcast of rank 0's parameters is skipped (``init_sync=False``): every rank
    builds the model from the same seed, and a restore then loads the same state on every
    rank; the broadcast, the first collective of a new process group, cost 0.5-3 s on 4
    gloo ranks, on the critical path of every restart.
    """
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL_MODES}, not {data_parallel!r}")
    if data_parallel in ("fsdp", "hsdp"):
        dense_mesh, expert_mesh = meshes.dense, meshes.edp_mesh
        if data_parallel == "hsdp":
            if meshes.hsdp_dense is None or meshes.hsdp_experts is None:
                raise ValueError("data_parallel hsdp needs meshes built with build_meshes(..., ranks_per_node=N)")
            dense_mesh, expert_mesh = meshes.hsdp_dense, meshes.hsdp_experts
        for block in _blocks(model):
            for _, experts in expert_modules(block):
                fully_shard(experts, mesh=expert_mesh)
                # FSDP divides by its mesh size (edp) by default: see the module docstring.
                # A custom factor would use PREMUL_SUM, which gloo lacks; sum-only
                # comms make FSDP sum and then divide locally.
                experts.set_force_sum_reduction_for_comms(True)
                if expert_mesh.size(expert_mesh.ndim - 1) == 1:
                    # A shard group of one rank (fsdp: ep_size == world; hsdp: ep_size ==
                    # ranks_per_node): torch 2.13's FSDP then divides by a custom factor
                    # twice, so keep its default (edp) and divide the rest (ep) here.
                    experts.set_all_reduce_hook(_divide_by(float(meshes.ep_size)))
                else:
                    experts.set_gradient_divide_factor(float(meshes.world_size))
            fully_shard(block, mesh=dense_mesh)
        fully_shard(model, mesh=dense_mesh)
        return model
    # Experts differ across EP ranks: DDP must neither broadcast nor average them.
    ignored = [f"{name}.{n}" for name, m in expert_modules(model)
               for n, _ in (*m.named_parameters(), *m.named_buffers())]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(model, process_group=meshes.dense.get_group(), init_sync=False)


def _divide_by(factor: float):
    def hook(reduced: torch.Tensor) -> None:
        reduced.div_(factor)
    return hook


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
    all ranks; HSDP shards have one copy per node (the ``Replicate`` mesh dimensions),
    so their squares are divided by that count; plain (DDP) dense gradients are
    replicated on every rank and plain expert gradients on every EDP rank, so their
    squares are divided by that count. One all-reduce of three float64 sums over all
    ranks. ``max_norm <= 0`` only measures.
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
            copies = 1
            for dim, pl in enumerate(g.placements):
                if pl.is_replicate():
                    copies *= g.device_mesh.size(dim)
                elif not pl.is_shard():
                    raise ValueError("clip_grad_norm_ expects FSDP/HSDP (Shard, Replicate) gradients, not "
                                     f"{g.placements} on {tuple(g.device_mesh.mesh.shape)}")
            square = g.to_local().double().pow(2).sum()
            sums[0] += square if copies == 1 else square / copies
        else:
            sums[2 if id(p) in experts else 1] += g.double().pow(2).sum()
    if dist.is_initialized() and meshes.world_size > 1:
        dist.all_reduce(sums, group=meshes.dense.get_group())
    total = float((sums[0] + sums[1] / meshes.world_size + sums[2] / meshes.edp_size).sqrt())
    coef = max_norm / (total + 1e-6)  # the epsilon torch.nn.utils.clip_grad_norm_ uses
    if max_norm > 0 and coef < 1.0:
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return total
