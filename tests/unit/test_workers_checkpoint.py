"""workers/checkpoint.py: 2-rank DCP save/load round trip, the manifest commit, validity
checks and retention."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.unit.test_workers_support import run_ranks
from workers import checkpoint, data
from workers.model import Transformer
from workers.recorder import FlightRecorder
from workers.spec import ModelArgs, TrainArgs

pytestmark = pytest.mark.timeout(60)


def _train_steps(model, opt, steps, rank=0):
    for step in steps:
        inputs, targets = data.batch(TrainArgs(), 256, step, rank)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _fingerprint(model, opt) -> dict:
    """Everything that must round-trip, as plain lists (picklable back to the parent)."""
    state = opt.state_dict()
    return {
        "model": {k: v.tolist() for k, v in model.state_dict().items()},
        "optim": {i: {k: v.tolist() for k, v in s.items()} for i, s in state["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
    }


def _save_then_load(rank: int, world_size: int, port: int, ckpt_dir: str) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    try:
        events = []
        rec = FlightRecorder("job", 0, rank, events.append)
        model = Transformer(ModelArgs(), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        _train_steps(model, opt, range(1, 4))
        path, manifest_sha, seconds = checkpoint.save(ckpt_dir, 3, model, opt, rec, keep=2)
        saved = _fingerprint(model, opt)
        rng_at_save = torch.get_rng_state()
        torch.manual_seed(1234 + rank)  # disturb: load must restore it

        fresh = Transformer(ModelArgs(), seed=99)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
        step = checkpoint.load(path, fresh, fresh_opt)
        assert torch.equal(torch.get_rng_state(), rng_at_save)
        # Training on from the restored state matches training on from the original.
        _train_steps(model, opt, [4])
        _train_steps(fresh, fresh_opt, [4])
        same_next = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        barriers = [e.collective for e in events if e.collective.state == "completed"]
        return {"path": path, "sha": manifest_sha, "seconds": seconds, "step": step, "saved": saved,
                "loaded": _fingerprint(*_reload(path)), "same_next": same_next,
                "ops": [(c.op, c.seq) for c in barriers]}
    finally:
        dist.destroy_process_group()


def _reload(path):
    model = Transformer(ModelArgs(), seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    checkpoint.load(path, model, opt)
    return model, opt


def test_two_rank_round_trip_is_exact(tmp_path):
    out = run_ranks(_save_then_load, 2, (str(tmp_path),))
    for rank in (0, 1):
        r = out[rank]
        assert r["step"] == 3 and r["path"] == str(tmp_path / "step_00000003")
        assert r["loaded"] == r["saved"]
        assert r["same_next"]
        assert r["ops"] == [("barrier", 1), ("barrier", 2)]
    assert len(out[0]["sha"]) == 64 and out[1]["sha"] == ""
    assert checkpoint.latest_valid(tmp_path) == (3, str(tmp_path / "step_00000003"))
    manifest = json.loads((tmp_path / "step_00000003" / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 3 and ".metadata" in manifest["files"]


# ---- validity and retention, single process --------------------------------------------

def _save_single(ckpt_dir: Path, step: int, keep: int = 0):
    model = Transformer(ModelArgs(n_layers=1), seed=step)
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
    assert not checkpoint.verify(tmp_path / "step_00000015")
    assert checkpoint.verify(tmp_path / "step_00000015", checksums=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_manifest_for_another_step_is_invalid(tmp_path):
    _save_single(tmp_path, 5)
    os.rename(tmp_path / "step_00000005", tmp_path / "step_00000006")
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
