"""Training throughput of the worker stack on CPU: tokens/s with 1 and 4 ranks, and the
FP8 / high-precision step-time ratio, measured side by side in one run.

    python bench/train_step.py [--preset tiny] [--steps 60] [--repeats 3]

Every configuration runs the real worker (`python -m fleet.workers.train` under
`torchrun --standalone`, gloo on 127.0.0.1, FSDP2, the Llama-4-style MoE model) and
reports the training-loop time of its slowest rank; configurations are interleaved
per repeat so machine noise hits them alike; figures are medians. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.torchrun_workers import run_workers  # noqa: E402


def run(preset: str, ranks: int, fp8: str, steps: int, batch: int, seq: int, timeout_s: float) -> float:
    """Seconds the slowest rank spent in the training loop for ``steps`` steps."""
    args = ["--steps", str(steps), "--checkpoint-interval", "0", "--preset", preset, "--fp8", fp8,
            "--batch-size", str(batch), "--seq-len", str(seq), "--warmup-steps", "0"]
    _, results = run_workers(ranks, args, timeout_s, f"{preset} x{ranks} fp8={fp8}")
    return max(r["train_s"] for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600)
    a = parser.parse_args()
    configs = [("1 rank, fp32", 1, "off"), ("4 ranks, fp32", 4, "off"),
               ("1 rank, fp8 tensorwise", 1, "tensorwise"), ("1 rank, fp8 rowwise", 1, "rowwise")]
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    print(f"preset {a.preset}: {a.steps} steps, batch {a.batch_size} x seq {a.seq_len} per rank; "
          f"{a.repeats} repeats", flush=True)
    for i in range(a.repeats):
        for name, ranks, fp8 in configs:
            times[name].append(run(a.preset, ranks, fp8, a.steps, a.batch_size, a.seq_len, a.timeout_s))
        print(f"  repeat {i + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    tokens_per_step_rank = a.batch_size * a.seq_len

    def tps(name: str, ranks: int) -> float:
        return a.steps * tokens_per_step_rank * ranks / med[name]

    print("\nmedians (training loop of the slowest rank)")
    for name, ranks, _ in configs:
        print(f"  {name:<24} {med[name]:7.2f} s  {1000 * med[name] / a.steps:7.1f} ms/step  "
              f"{tps(name, ranks):9.0f} tokens/s")
    result = {
        "preset": a.preset,
        "steps": a.steps,
        "repeats": a.repeats,
        "tokens_per_s_1rank": round(tps("1 rank, fp32", 1), 1),
        "tokens_per_s_4ranks": round(tps("4 ranks, fp32", 4), 1),
        "scaling_4ranks_vs_1": round(tps("4 ranks, fp32", 4) / tps("1 rank, fp32", 1), 3),
        "step_s_fp32": round(med["1 rank, fp32"] / a.steps, 5),
        "step_s_fp8_tensorwise": round(med["1 rank, fp8 tensorwise"] / a.steps, 5),
        "step_s_fp8_rowwise": round(med["1 rank, fp8 rowwise"] / a.steps, 5),
        "fp8_step_ratio": round(med["1 rank, fp8 tensorwise"] / med["1 rank, fp32"], 3),
        "fp8_rowwise_step_ratio": round(med["1 rank, fp8 rowwise"] / med["1 rank, fp32"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
