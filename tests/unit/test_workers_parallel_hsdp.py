"""workers/parallel.py, ``data_parallel: hsdp``: 4 real gloo ranks as 2 "nodes" x 2 ranks
train the tiny Transformer (workers/model.py, ModelArgs()) under fsdp, ddp and hsdp (with
and without expert parallelism). Checked: every replica set from ``replica_sets`` holds
bit-identical local state after each optimizer step, hsdp's losses track fsdp's, its
gradient norm equals ddp's, and a DCP checkpoint saved under hsdp loads back exactly
(under hsdp, and resharded into fsdp). Layout rules are checked in one process.

One spawn runs every scenario, one after another (group creation is collective and
every rank runs the same sequence), to keep the file cheap.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.unit.test_workers_parallel import in_pg
from tests.unit.test_workers_support import run_ranks
from fleet.workers import checkpoint, parallel
from fleet.workers.model import Transformer
from fleet.workers.recorder import FlightRecorder
from fleet.workers.spec import ModelArgs

pytestmark = pytest.mark.timeout(120)

WORLD, PER_NODE = 4, 2
STEPS = 3
MAX_NORM = 0.5  # below the init grad norm: clipping scales every update
SCENARIOS = [("fsdp", 1), ("fsdp", 4), ("ddp", 1), ("ddp", 2), ("hsdp", 1), ("hsdp", 2)]


def _batch(step: int, rank: int, args: ModelArgs, per_rank: int = 2, seq: int = 16):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(args.vocab_size, (per_rank, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _digests(model, opt) -> dict[str, str]:
    """sha256 of this rank's local parameters, buffers and AdamW state, per class."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    experts = parallel.expert_param_ids(inner)
    hashes = {"dense": hashlib.sha256(), "experts": hashlib.sha256()}
    for name, p in inner.named_parameters():
        h = hashes["experts" if id(p) in experts else "dense"]
        h.update(name.encode())
        h.update(_local(p).contiguous().view(torch.uint8).numpy().tobytes())
        for key, value in sorted(opt.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(_local(value).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for name, b in inner.named_buffers():
        hashes["dense"].update(name.encode())
        hashes["dense"].update(_local(b).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {k: h.hexdigest() for k, h in hashes.items()}


def _full(model) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for n, p in inner.named_parameters()}


def _build(mode: str, ep: int, args: ModelArgs):
    meshes = parallel.build_meshes(WORLD, ep, args.n_experts,
                                   ranks_per_node=PER_NODE if mode == "hsdp" else None)
    model = Transformer(args, seed=0, ep_group=meshes.ep_group if ep > 1 else None)
    model = parallel.parallelize(model, meshes, mode)
    return meshes, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(rank: int, mode: str, ep: int, args: ModelArgs, ckpt_dir: str) -> dict:
    meshes, model, opt = _build(mode, ep, args)
    losses, norms, digests = [], [], []
    for step in range(1, STEPS + 1):
        inputs, targets = _batch(step, rank, args)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        parallel.sync_expert_grads(model, meshes)
        norms.append(parallel.clip_grad_norm_(model, MAX_NORM, meshes))
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().double().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
        digests.append(_digests(model, opt))
    out = {"losses": losses, "norms": norms, "digests": digests,
           "sets": parallel.replica_sets(meshes, mode)}
    if mode == "hsdp":
        out.update(_checkpoint_round_trip(rank, ep, args, meshes, model, opt, ckpt_dir))
    return out


def _checkpoint_round_trip(rank, ep, args, meshes, model, opt, ckpt_dir) -> dict:
    """Save under hsdp; load into a fresh hsdp model and into a fresh fsdp model."""
    rec = FlightRecorder("job", 0, rank, lambda _e: None)
    path = f"{ckpt_dir}/ep{ep}"
    checkpoint.save(path, STEPS, model, opt, rec, ep_rank=meshes.ep_rank, ep_size=ep)
    saved, saved_full = _digests(model, opt), _full(model)
    found = checkpoint.latest_valid(path)
    _, again, again_opt = _build("hsdp", ep, args)
    step, _ = checkpoint.load(found[1], again, again_opt, ep_rank=meshes.ep_rank, ep_size=ep)
    _, flat, flat_opt = _build("fsdp", ep, args)
    checkpoint.load(found[1], flat, flat_opt, ep_rank=meshes.ep_rank, ep_size=ep)
    flat_full = _full(flat)
    return {"loaded_step": step, "reloaded_same": _digests(again, again_opt) == saved,
            "fsdp_same": flat_full.keys() == saved_full.keys()
            and all(torch.equal(flat_full[k], v) for k, v in saved_full.items())}


def _all_scenarios(rank: int, world_size: int, ckpt_dir: str) -> dict:
    torch.manual_seed(0)
    args = ModelArgs()
    return {f"{mode}/ep{ep}": _train(rank, mode, ep, args, ckpt_dir) for mode, ep in SCENARIOS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    torch.set_num_threads(1)
    ckpt = tmp_path_factory.mktemp("hsdp-ckpt")
    return run_ranks(in_pg, WORLD, (_all_scenarios, str(ckpt)), timeout_s=100)


@pytest.mark.parametrize("scenario", [f"{m}/ep{e}" for m, e in SCENARIOS])
def test_replica_sets_are_bit_identical_after_every_step(runs, scenario):
    sets = runs[0][scenario]["sets"]
    assert all(runs[r][scenario]["sets"] == sets for r in range(WORLD))
    for cls, groups in sets.items():
        assert sorted(r for g in groups for r in g) == list(range(WORLD)), (cls, groups)
        for step in range(STEPS):
            for group in groups:
                got = {r: runs[r][scenario]["digests"][step][cls] for r in group}
                assert len(set(got.values())) == 1, f"{scenario} {cls} step {step + 1}: {got}"


def test_hsdp_replicates_across_nodes_and_shards_inside_one():
    runs_sets = parallel.replica_sets_of(WORLD, 1, "hsdp", PER_NODE)
    assert runs_sets == {"dense": [[0, 2], [1, 3]], "experts": [[0, 2], [1, 3]]}
    assert parallel.replica_sets_of(WORLD, 2, "hsdp", PER_NODE)["experts"] == [[0, 2], [1, 3]]
    assert parallel.replica_sets_of(WORLD, 2, "ddp") == {"dense": [[0, 1, 2, 3]], "experts": [[0, 2], [1, 3]]}
    assert parallel.replica_sets_of(WORLD, 1, "fsdp")["dense"] == [[0], [1], [2], [3]]


def test_hsdp_shards_differ_inside_a_node(runs):
    # the comparison above can fail: the two ranks of a node hold different shards
    for scenario in ("hsdp/ep1", "hsdp/ep2"):
        last = [runs[r][scenario]["digests"][-1]["dense"] for r in range(WORLD)]
        assert last[0] != last[1] and last[2] != last[3]
    experts = [runs[r]["ddp/ep2"]["digests"][-1]["experts"] for r in range(WORLD)]
    assert experts[0] != experts[1]  # different EP ranks hold different experts


@pytest.mark.parametrize("scenario", ["hsdp/ep1", "hsdp/ep2", "fsdp/ep4"])
def test_hsdp_losses_track_fsdp_and_norm_equals_ddp(runs, scenario):
    # fsdp/ep4: expert shard groups of one rank, where FSDP's own custom divide factor
    # would divide twice (the same path as hsdp/ep2)
    ref = runs[0]["fsdp/ep1"]
    ddp = runs[0]["ddp/ep1" if scenario.endswith("ep1") else "ddp/ep2"]
    assert ref["norms"][0] > MAX_NORM  # clipping is exercised
    for r in range(WORLD):
        got = runs[r][scenario]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4), r
        assert got["norms"] == pytest.approx(ddp["norms"], rel=1e-5), r
        assert got["norms"][0] == pytest.approx(ref["norms"][0], rel=1e-5), r


@pytest.mark.parametrize("scenario", ["hsdp/ep1", "hsdp/ep2"])
def test_hsdp_checkpoint_loads_back_exactly(runs, scenario):
    for r in range(WORLD):
        got = runs[r][scenario]
        assert got["loaded_step"] == STEPS
        assert got["reloaded_same"], f"rank {r}: hsdp -> hsdp changed the local state"
        assert got["fsdp_same"], f"rank {r}: hsdp -> fsdp changed the parameters"


@pytest.mark.parametrize(("world", "ep", "per_node", "field"), [
    (4, 1, 3, "ranks_per_node"), (4, 1, 0, "ranks_per_node"), (8, 4, 2, "ep_size"), (4, 2, 1, "ep_size"),
])
def test_bad_hsdp_layouts_name_the_field(world, ep, per_node, field):
    with pytest.raises(ValueError, match=field):
        parallel.check_sizes(world, ep, 4, ranks_per_node=per_node)
    with pytest.raises(ValueError, match=field):
        parallel.replica_sets_of(world, ep, "hsdp", per_node)


def test_hsdp_needs_its_meshes():
    with pytest.raises(ValueError, match="ranks_per_node"):
        parallel.replica_sets_of(4, 1, "hsdp")
    with pytest.raises(ValueError, match="data_parallel"):
        parallel.replica_sets_of(4, 1, "zero3")
