"""workers/checkpoint.py: blocking and asynchronous DCP saves on real gloo ranks (FSDP2 with
expert parallelism), the manifest commit, validity checks and retention."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from tests.unit.test_workers_parallel import StandInMoE, in_pg
from tests.unit.test_workers_support import run_ranks
from fleet.workers import checkpoint, data, parallel
from fleet.workers.recorder import FlightRecorder
from fleet.workers.spec import TrainArgs

pytestmark = pytest.mark.timeout(90)

TRAIN = TrainArgs(batch_size=2, seq_len=8, mean_doc_len=4)
VOCAB = 64


def _train_steps(model, opt, steps, rank=0, meshes=None):
    for step in steps:
        b = data.batch(TRAIN, VOCAB, step, rank)
        loss = F.cross_entropy(model(b.inputs).flatten(0, 1), b.targets.flatten())
        opt.zero_grad()
        loss.backward()
        if meshes is not None:
            parallel.clip_grad_norm_(model, 1.0, meshes)
        opt.step()
    return loss.item()


def _local(t):
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _fingerprint(model, opt) -> dict:
    """This rank's shards of everything that must round-trip (DTensors as local shards)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {
        "model": {k: _local(v) for k, v in model_sd.items()},
        "optim": {k: {n: _local(t) if torch.is_tensor(t) else t for n, t in s.items()}
                  for k, s in optim_sd["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optim_sd["param_groups"]],
    }


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


# ---- asynchronous save, FSDP2 + EP on 2 ranks ------------------------------------------------

def _fsdp_model(meshes, seed):
    model = StandInMoE(vocab=VOCAB, seed=seed, ep_group=meshes.ep_group)
    model = parallel.parallelize(model, meshes, "fsdp")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _slow_writes(seconds: float) -> None:
    """Make this rank's shard writes take ``seconds`` longer (runs in DCP's writer thread)."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystemWriter.write_data

    def slow(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    filesystem.FileSystemWriter.write_data = slow


def _async_round_trip(rank: int, world_size: int, ckpt_dir: str) -> dict:
    meshes = parallel.build_meshes(world_size, 2, n_experts=4)
    ep = {"ep_rank": meshes.ep_rank, "ep_size": 2}
    ckpt = checkpoint.AsyncCheckpointer(ckpt_dir, keep=2, **ep)
    model, opt = _fsdp_model(meshes, seed=0)
    _train_steps(model, opt, [1, 2], rank, meshes)
    if rank == 1:
        _slow_writes(1.5)
    saved = _fingerprint(model, opt)
    torch.manual_seed(100 + rank)
    rng_at_save = torch.get_rng_state()
    blocked_s = ckpt.start(2, model, opt, extra={"router_bias": torch.arange(4.0)}, data_position=40 + rank)
    with pytest.raises(checkpoint.CheckpointError):
        ckpt.start(3, model, opt)  # one save in flight at a time
    early_commit_refused = False
    steps_overlapped, manifest_before_done = 0, False
    step = 2
    while True:
        step += 1
        loss = _train_steps(model, opt, [step], rank, meshes)  # training goes on meanwhile
        # The "my save is done" flag rides on the loss all-reduce the loop makes anyway.
        stats = torch.tensor([loss, float(ckpt.poll_local_done())], dtype=torch.float64)
        dist.all_reduce(stats)
        if stats[1] == world_size:
            break
        steps_overlapped += 1
        if rank == 0:
            manifest_before_done |= (Path(ckpt_dir) / "step_00000002" / checkpoint.MANIFEST).exists()
            manifest_before_done |= checkpoint.latest_valid(ckpt_dir) is not None
        if not early_commit_refused and not ckpt.poll_local_done():
            with pytest.raises(checkpoint.CheckpointError, match="cannot commit"):
                ckpt.commit(2)
            early_commit_refused = True
    path, sha = ckpt.commit(2)
    ckpt.close()
    torch.manual_seed(999)  # disturb: load must restore it

    results = []
    for seed in (5, 6):  # restore twice, into differently initialised models
        fresh, fresh_opt = _fsdp_model(meshes, seed=seed)
        restored_step, extra = checkpoint.load(path, fresh, fresh_opt, **ep)
        results.append((restored_step, extra, torch.equal(torch.get_rng_state(), rng_at_save),
                        _equal(_fingerprint(fresh, fresh_opt), saved)))
        _train_steps(fresh, fresh_opt, range(3, step + 1), rank, meshes)
        results[-1] += (_equal(_fingerprint(fresh, fresh_opt), _fingerprint(model, opt)),)
        torch.manual_seed(999)
    return {"path": path, "sha": sha, "blocked_s": blocked_s, "overlapped": steps_overlapped,
            "manifest_before_done": manifest_before_done, "early_commit_refused": early_commit_refused,
            "results": results, "history": [(a.value, b.value) for a, b in ckpt.history]}


def test_async_round_trip_with_fsdp_and_ep_is_exact(tmp_path):
    out = run_ranks(in_pg, 2, (_async_round_trip, str(tmp_path)), timeout_s=80)
    for rank in (0, 1):
        r = out[rank]
        assert r["path"] == str(tmp_path / "step_00000002")
        assert r["overlapped"] >= 1 and not r["manifest_before_done"] and r["early_commit_refused"]
        for step, extra, rng_ok, same_state, same_after_training in r["results"]:
            assert step == 2 and rng_ok and same_state and same_after_training
            assert torch.equal(extra["router_bias"], torch.arange(4.0))
            assert extra["data_position"] == 40 + rank
        assert r["history"] == [("idle", "writing"), ("writing", "written"), ("written", "idle")]
    assert len(out[0]["sha"]) == 64 and out[1]["sha"] == ""
    assert checkpoint.latest_valid(tmp_path) == (2, str(tmp_path / "step_00000002"))
    manifest = json.loads((tmp_path / "step_00000002" / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 2 and ".metadata" in manifest["files"]
    assert any(name.startswith("__1_") for name in manifest["files"])  # rank 1's shards


def _killed_mid_save(rank: int, world_size: int, ckpt_dir: str) -> str:
    meshes = parallel.build_meshes(world_size, 1)
    from datetime import timedelta
    ckpt = checkpoint.AsyncCheckpointer(ckpt_dir, timeout=timedelta(seconds=5))
    model, opt = _fsdp_model(meshes, seed=0)
    ckpt.start(1, model, opt)
    ckpt.wait_local(30)
    ckpt.commit(1)
    if rank == 1:
        _slow_writes(30)
    ckpt.start(2, model, opt)
    if rank == 1:
        time.sleep(0.5)
        os._exit(17)  # killed while its shards are being written: nobody commits step 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            assert not ckpt.poll_local_done(), "step 2 cannot be done without rank 1"
        except checkpoint.CheckpointError:
            return "failed"
        time.sleep(0.1)
    return "still waiting"


def test_rank_killed_before_commit_leaves_no_valid_checkpoint(tmp_path):
    out = run_ranks(in_pg, 2, (_killed_mid_save, str(tmp_path)), timeout_s=80, expect_exit={1: 17})
    assert out[0] == "failed"
    assert not (tmp_path / "step_00000002" / checkpoint.MANIFEST).exists()
    assert checkpoint.latest_valid(tmp_path) == (1, str(tmp_path / "step_00000001"))
    # The next run, resuming from step 1, clears the half-written step 2 first.
    checkpoint.AsyncCheckpointer(tmp_path, resume_step=1).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


# ---- blocking save on 2 ranks ------------------------------------------------------------------

def _save_then_load(rank: int, world_size: int, ckpt_dir: str) -> dict:
    events = []
    rec = FlightRecorder("job", 0, rank, events.append)
    model = StandInMoE(vocab=VOCAB, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train_steps(model, opt, range(1, 4))  # same data on both ranks: plain tensors are replicas
    path, manifest_sha, seconds = checkpoint.save(ckpt_dir, 3, model, opt, rec, keep=2, data_position=7)
    saved = _fingerprint(model, opt)
    rng_at_save = torch.get_rng_state()
    torch.manual_seed(1234 + rank)
    fresh = StandInMoE(vocab=VOCAB, seed=99)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    step, extra = checkpoint.load(path, fresh, fresh_opt)
    barriers = [e.collective for e in events if e.collective.state == "completed"]
    return {"path": path, "sha": manifest_sha, "step": step, "extra": extra,
            "rng_ok": torch.equal(torch.get_rng_state(), rng_at_save),
            "same": _equal(_fingerprint(fresh, fresh_opt), saved),
            "ops": [(c.op, c.seq) for c in barriers]}


def test_blocking_two_rank_round_trip_is_exact(tmp_path):
    out = run_ranks(in_pg, 2, (_save_then_load, str(tmp_path)))
    for rank in (0, 1):
        r = out[rank]
        assert r["step"] == 3 and r["path"] == str(tmp_path / "step_00000003")
        assert r["same"] and r["rng_ok"] and r["extra"] == {"data_position": 7}
        assert r["ops"] == [("barrier", 1), ("barrier", 2)]
    assert len(out[0]["sha"]) == 64 and out[1]["sha"] == ""
    assert checkpoint.latest_valid(tmp_path) == (3, str(tmp_path / "step_00000003"))


# ---- validity and retention, single process --------------------------------------------------

def _save_single(ckpt_dir: Path, step: int, keep: int = 0):
    model = StandInMoE(vocab=VOCAB, n_layers=1, seed=step)
    opt = torch.optim.AdamW(model.parameters())
    _train_steps(model, opt, [1])
    return checkpoint.save(ckpt_dir, step, model, opt, keep=keep)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_latest_valid_skips_missing_and_corrupted_manifests(tmp_path):
    assert checkpoint.latest_valid(tmp_path / "absent") is None
    for step in (5, 10, 15, 20):
        _save_single(tmp_path, step)
    (tmp_path / "step_00000020" / checkpoint.MANIFEST).unlink()               # crashed before commit
    data_file = next(p for p in (tmp_path / "step_00000015").glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF                                                 # bit rot, same size
    data_file.write_bytes(bytes(raw))
    (tmp_path / "step_00000010" / checkpoint.MANIFEST).write_text("{not json")  # torn manifest
    (tmp_path / "step_00000030").mkdir()                                       # empty leftover
    (tmp_path / "notes").mkdir()
    assert checkpoint.latest_valid(tmp_path) == (5, str(tmp_path / "step_00000005"))
    skipped: list[checkpoint.InvalidCheckpoint] = []
    assert checkpoint.latest_valid(tmp_path, skipped=skipped)[0] == 5
    assert [(s.step, s.path) for s in skipped] == [(n, str(tmp_path / f"step_{n:08d}")) for n in (30, 20, 15, 10)]
    reasons = [s.reason for s in skipped]
    assert reasons[0] == reasons[1] == "MANIFEST.json is missing"
    assert reasons[2] == f"{data_file.name} does not match its sha256 in MANIFEST.json"
    assert reasons[3].startswith("unreadable MANIFEST.json")
    assert not checkpoint.verify(tmp_path / "step_00000015")
    assert checkpoint.verify(tmp_path / "step_00000015", checksums=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_manifest_for_another_step_or_format_is_invalid(tmp_path):
    _save_single(tmp_path, 5)
    os.rename(tmp_path / "step_00000005", tmp_path / "step_00000006")
    assert checkpoint.latest_valid(tmp_path) is None
    _save_single(tmp_path, 7)
    manifest = tmp_path / "step_00000007" / checkpoint.MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": 1}))
    assert checkpoint.latest_valid(tmp_path) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_keeps_the_newest_committed_and_replaces_stale_dirs(tmp_path):
    stale = tmp_path / "step_00000004"
    stale.mkdir()
    (stale / "__7_0.distcp").write_bytes(b"from an older attempt")
    for step in (1, 2, 3, 4):
        path, sha, seconds = _save_single(tmp_path, step, keep=2)
        assert seconds > 0 and len(sha) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert not (stale / "__7_0.distcp").exists()
    assert checkpoint.latest_valid(tmp_path)[0] == 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_single_process_lifecycle_and_bad_calls(tmp_path):
    model = StandInMoE(vocab=VOCAB, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    _train_steps(model, opt, [1])
    with checkpoint.AsyncCheckpointer(tmp_path, keep=1) as ckpt:
        assert not ckpt.poll_local_done()                   # idle
        with pytest.raises(ValueError, match="data_position"):
            ckpt.start(1, model, opt, extra={"data_position": 3})
        assert ckpt.state is checkpoint.SaveState.IDLE
        for step in (1, 2):
            ckpt.start(step, model, opt)
            ckpt.wait_local(30)
            ckpt.commit(step)
        with pytest.raises(checkpoint.CheckpointError, match="not after"):
            ckpt.start(2, model, opt)
        with pytest.raises(checkpoint.CheckpointError, match="cannot commit"):
            ckpt.commit(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]
    assert checkpoint.latest_valid(tmp_path) == (2, str(tmp_path / "step_00000002"))
