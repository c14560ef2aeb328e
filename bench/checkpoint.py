"""How long a checkpoint blocks the training loop: asynchronous vs blocking save, and restore.

    python bench/checkpoint.py [--presets tiny,small] [--repeats 3] [--dir DIR]

For each preset, 2 gloo ranks on 127.0.0.1 build the model (workers/model.py's
``Transformer`` with expert parallelism over both ranks when it has experts), wrap it
with FSDP2 (workers/parallel.py), take one AdamW step, then alternate, ``--repeats``
times each (order flipped every repeat, so drift hits both alike):
  * blocking: ``checkpoint.save`` -> time until it returns (write + commit);
  * asynchronous: ``AsyncCheckpointer.start`` -> the time the loop is blocked (staging
    copy); training steps then run until every rank's write is done (flag folded into
    the step's all-reduce) and ``commit``; reported too: the time to commit and the step
    time during the save against a step without one (2 CPU cores are shared with the
    writer thread, so overlap is not free here);
  * restore: ``checkpoint.load`` of the last committed checkpoint into a fresh model.
Figures are medians over the repeats, per rank maximum. The last line of output is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _build(preset: str, meshes, seed: int):
    """``(model, kind)``: the preset's Llama-4-style model, experts split over the EP group."""
    from fleet.workers.model import Transformer
    from fleet.workers.spec import PRESETS

    ep_group = meshes.ep_group if meshes.ep_size > 1 else None
    return Transformer(PRESETS[preset], seed=seed, ep_group=ep_group), "fleet.workers.model.Transformer"


def _worker(rank: int, world: int, port: int, preset: str, repeats: int, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fleet.workers import checkpoint, data, parallel
    from fleet.workers.rendezvous import loopback_store
    from fleet.workers.recorder import FlightRecorder
    from fleet.workers.spec import PRESETS, TrainArgs

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=loopback_store(rank, world, port), rank=rank,
                            world_size=world, timeout=timedelta(minutes=10))
    args = PRESETS[preset]
    ep = world if args.n_experts and args.n_experts % world == 0 else 1
    meshes = parallel.build_meshes(world, ep, args.n_experts)
    epk = {"ep_rank": meshes.ep_rank, "ep_size": ep}
    model, kind = _build(preset, meshes, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    model = parallel.parallelize(model, meshes, "fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train = TrainArgs(batch_size=1, seq_len=16)

    def step(i: int, flag: float = 0.0) -> float:
        t0 = time.perf_counter()
        b = data.batch(train, args.vocab_size, i, rank)
        out = model(b.inputs)
        logits = out[0] if isinstance(out, tuple) else out
        loss = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten())
        opt.zero_grad()
        loss.backward()
        parallel.clip_grad_norm_(model, 1.0, meshes)
        opt.step()
        stats = torch.tensor([loss.item(), flag], dtype=torch.float64)
        dist.all_reduce(stats)
        return time.perf_counter() - t0, stats[1].item()

    rec = FlightRecorder("bench", 0, rank, lambda e: None)
    sync_dir, async_dir = Path(root) / "sync", Path(root) / "async"
    ckpt = checkpoint.AsyncCheckpointer(async_dir, keep=1, **epk)
    i = 1
    plain = [step(i)[0]]
    res = {"blocking_s": [], "async_blocked_s": [], "async_commit_s": [], "overlap_steps": [],
           "step_s_during_save": [], "step_s": [], "restore_s": []}
    for r in range(repeats):
        for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            i += 1
            if mode == "sync":
                res["blocking_s"].append(checkpoint.save(sync_dir, i, model, opt, rec, keep=1, **epk)[2])
                continue
            t0 = time.perf_counter()
            res["async_blocked_s"].append(ckpt.start(i, model, opt, data_position=i))
            during = []
            while True:
                i += 1
                dt, done = step(i, float(ckpt.poll_local_done()))
                if done == world:
                    break
                during.append(dt)
            ckpt.commit(ckpt.step)
            res["async_commit_s"].append(time.perf_counter() - t0)
            res["overlap_steps"].append(len(during))
            res["step_s_during_save"].append(statistics.median(during) if during else float("nan"))
            i += 1
            res["step_s"].append(step(i)[0])
    found = checkpoint.latest_valid(async_dir)
    for _ in range(repeats):
        fresh, _ = _build(preset, meshes, seed=1)
        fresh = parallel.parallelize(fresh, meshes, "fsdp")
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.load(found[1], fresh, fresh_opt, **epk)
        dist.barrier()
        res["restore_s"].append(time.perf_counter() - t0)
        del fresh, fresh_opt
    ckpt.close()
    res["step_s"] += plain
    size = sum(f.stat().st_size for f in Path(found[1]).iterdir())
    Path(out).write_text(json.dumps({"rank": rank, "kind": kind, "params": n_params,
                                     "ckpt_bytes": size, **res}))
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_preset(preset: str, repeats: int, root: Path, world: int = 2) -> dict:
    port = _free_port()
    outs = [root / f"{preset}-rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port), preset,
                               str(repeats), str(root / preset), str(outs[r])], cwd=REPO)
             for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout=1800)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(p.returncode for p in procs):
        raise SystemExit(f"{preset}: a rank failed ({[p.returncode for p in procs]})")
    ranks = [json.loads(o.read_text()) for o in outs]
    med = lambda key: max(statistics.median(r[key]) for r in ranks)  # noqa: E731 - slowest rank
    row = {"preset": preset, "model": ranks[0]["kind"],
           "params_rank0": ranks[0]["params"], "ckpt_bytes": ranks[0]["ckpt_bytes"],
           "blocking_s": med("blocking_s"), "async_blocked_s": med("async_blocked_s"),
           "async_commit_s": med("async_commit_s"), "overlap_steps": med("overlap_steps"),
           "step_s": med("step_s"), "step_s_during_save": med("step_s_during_save"),
           "restore_s": med("restore_s")}
    row["blocked_ratio"] = row["async_blocked_s"] / row["blocking_s"]
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        _worker(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), a[5], a[6])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    opts = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fleet-bench-ckpt-", dir=opts.dir) as tmp:
        for preset in opts.presets.split(","):
            rows.append(run_preset(preset, opts.repeats, Path(tmp)))
    cols = ["preset", "model", "ckpt_bytes", "blocking_s", "async_blocked_s", "blocked_ratio",
            "async_commit_s", "overlap_steps", "step_s", "step_s_during_save", "restore_s"]
    print("  ".join(f"{c:>18}" for c in cols))
    for row in rows:
        print("  ".join(f"{row[c]:>18.4f}" if isinstance(row[c], float) else f"{row[c]!s:>18}" for c in cols))
    print(json.dumps({"bench": "checkpoint", "world": 2, "repeats": opts.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
