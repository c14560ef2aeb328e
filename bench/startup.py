"""Wall time of `fleet up`, split into start-up and training, next to plain torchrun.

    python bench/startup.py [--cluster examples/local.yaml] [--repeats 3]

Each repeat runs, in a fresh temporary folder:
  1. `fleet up --cluster FILE --json` (Ray cluster, controller, agents, worker actors,
     gloo process group, restore, training, teardown), and
  2. the same training (same model, steps, world size, checkpoint interval) under plain
     `torchrun --standalone`, which has no control plane at all: the floor fleet is
     measured against.
Start-up is everything before the first training step (interpreter and imports
included); training runs from the first step to the last rank's end. Figures are
medians over the repeats; the last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.torchrun_workers import run_workers  # noqa: E402
from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, load_cluster_config  # noqa: E402

FLEET_PARTS = ("ray_start_s", "controller_start_s", "agents_start_s", "placement_s")
WORKER_PARTS = ("pg_init_s", "restore_s")


def run_fleet(cluster: Path, timeout_s: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "fleet.controlplane.cli.main", "up", "--cluster", str(cluster), "--json"],
            cwd=tmp, capture_output=True, text=True, timeout=timeout_s,
        )
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"fleet up failed ({out.returncode}):\n{out.stderr[-3000:]}")
    summary = json.loads(out.stdout)
    if summary["state"] != "SUCCEEDED":
        raise SystemExit(f"fleet up ended {summary['state']}: {summary['reason']}")
    timings, phases = summary["timings_s"], summary["phases_s"]
    training = phases["training_wall_s"]
    teardown = timings["teardown_s"]
    fig = {"wall_s": wall, "training_s": training, "teardown_s": teardown,
           "startup_s": wall - training - teardown}
    fig.update({k: timings[k] for k in FLEET_PARTS})
    fig.update({k: phases[k] for k in WORKER_PARTS})
    return fig


def run_torchrun(cluster: Path, timeout_s: float) -> dict[str, float]:
    job = load_cluster_config(cluster).job
    args = [
        "--steps", str(job.steps),
        "--checkpoint-interval", str(job.checkpoint_interval),
        "--preset", job.model.preset, "--fp8", job.model.args().fp8,
        "--batch-size", str(job.batch_size), "--seq-len", str(job.seq_len),
        "--ep-size", str(job.ep_size), "--data-parallel", job.data_parallel,
        "--grad-accum-steps", str(job.grad_accum_steps), "--warmup-steps", str(job.warmup_steps),
        "--lr", str(job.lr),
    ]
    if not job.async_checkpoint:
        args.append("--sync-checkpoint")
    wall, results = run_workers(job.world_size, args, timeout_s, "torchrun")
    training = max(r["train_s"] for r in results)
    return {
        "wall_s": wall,
        "training_s": training,
        "startup_s": wall - training,
        "pg_init_s": max(r["pg_init_s"] for r in results),
        "restore_s": max(r["restore_s"] for r in results),
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER_FILE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args()
    cluster = args.cluster.resolve()
    cfg = load_cluster_config(cluster)
    print(f"cluster {cluster}: {cfg.job.nodes} nodes x {cfg.job.ranks_per_node} ranks, "
          f"{cfg.job.steps} steps, model {cfg.job.model.preset}; {args.repeats} repeats", flush=True)

    fleet_runs, torchrun_runs = [], []
    for i in range(args.repeats):
        # interleaved, so machine noise hits both sides alike
        fleet_runs.append(run_fleet(cluster, args.timeout_s))
        torchrun_runs.append(run_torchrun(cluster, args.timeout_s))
        f, t = fleet_runs[-1], torchrun_runs[-1]
        print(f"  repeat {i + 1}: fleet up {f['wall_s']:.2f} s (start-up {f['startup_s']:.2f}, "
              f"training {f['training_s']:.2f}, teardown {f['teardown_s']:.2f}) | torchrun "
              f"{t['wall_s']:.2f} s (start-up {t['startup_s']:.2f}, training {t['training_s']:.2f})",
              flush=True)

    fleet, torchrun = median_of(fleet_runs), median_of(torchrun_runs)
    steps = cfg.job.steps
    print("\nmedians                   fleet up    torchrun    ratio")
    for key in ("wall_s", "startup_s", "training_s"):
        print(f"  {key:<22} {fleet[key]:>9.2f}   {torchrun[key]:>9.2f}   {fleet[key] / torchrun[key]:>6.2f}x")
    print("fleet start-up parts: " + ", ".join(
        f"{k} {fleet[k]:.2f}" for k in (*FLEET_PARTS, *WORKER_PARTS)))
    result = {
        "cluster": str(cluster),
        "repeats": args.repeats,
        "steps": steps,
        "world_size": cfg.job.world_size,
        "fleet": fleet,
        "torchrun": torchrun,
        "fleet_steps_per_s": round(steps / fleet["training_s"], 2),
        "torchrun_steps_per_s": round(steps / torchrun["training_s"], 2),
        "wall_ratio": round(fleet["wall_s"] / torchrun["wall_s"], 3),
        "startup_ratio": round(fleet["startup_s"] / torchrun["startup_s"], 3),
        "training_ratio": round(fleet["training_s"] / torchrun["training_s"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
