"""Bring your own script: one unmodified DDP program under torchrun and under `fleet run`.

    .venv/bin/python bench/byo.py [--runs 3] [--ranks 2] [--steps 160] [--width 512]

The program is ``tests/programs/ddp.py`` (no fleet import): a small MLP on gloo that
checkpoints every 10 steps, resumes from its newest checkpoint, and writes one JSON
line per completed step per rank (its own wall clock), which is what is measured here.
Side by side, alternating, in one run:

  * step time: the median step of every rank, before the fault (tracing on under fleet);
  * SIGKILL of rank 1 at step ``steps // 2`` on the first run: recovery = the first step
    completed after the restart minus the killed rank's last step (torchrun
    ``--max-restarts 3``; in torch 2.13 torchrun restarts only with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, set here);
  * rank 1 hangs before step ``steps // 2``: fleet's hang incident (its ``detected_at``)
    minus the hung rank's last step, and whether it names rank 1 and its node; torchrun
    has no hang detector: it waits for the process-group timeout (``--torchrun-pg-timeout-s``,
    run once: its outcome is that timeout, not a distribution).

Medians of ``--runs`` runs; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "tests" / "programs" / "ddp.py"
FLEET = [sys.executable, "-m", "fleet.controlplane.cli.main"]
FAULT_RANK = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(out: Path) -> dict[int, list[dict]]:
    """Each rank's step lines, in order."""
    rows = {int(f.stem.split("-")[1]): [json.loads(line) for line in f.read_text().splitlines() if line]
            for f in sorted(out.glob("rank-*.jsonl"))}
    return {rank: [r for r in lines if "step" in r] for rank, lines in rows.items()}


def _phases(out: Path) -> dict[str, float]:
    """The restarted run's start-up, from the killed rank's last step: program start,
    process group joined, checkpoint restored, first step (slowest rank of each)."""
    lines = [json.loads(line) for f in out.glob("rank-*.jsonl") for line in f.read_text().splitlines() if line]
    killed_last = max(r["t"] for r in lines if "step" in r and r["restart"] == 0)
    starts = [r for r in lines if r.get("phase") == "start" and r["restart"] > 0]
    first = min(r["t"] for r in lines if "step" in r and r["restart"] > 0)
    if not starts:
        return {}
    return {"program_start": round(max(r["t"] for r in starts) - killed_last, 3),
            "pg_ready": round(max(r["pg"] for r in starts) - killed_last, 3),
            "restored": round(max(r["restored"] for r in starts) - killed_last, 3),
            "first_step": round(first - killed_last, 3)}


def _median_step_s(steps: dict[int, list[dict]]) -> float:
    """Median gap between consecutive steps of the first run, every rank, warm-up skipped."""
    gaps = []
    for rows in steps.values():
        first = [r for r in rows if r["restart"] == 0]
        gaps += [b["t"] - a["t"] for a, b in zip(first[5:], first[6:], strict=False) if b["step"] == a["step"] + 1]
    return statistics.median(gaps)


def _recovery_s(steps: dict[int, list[dict]]) -> float:
    """First step completed after the restart (any rank) minus the killed rank's last step."""
    killed_last = max(r["t"] for r in steps[FAULT_RANK] if r["restart"] == 0)
    after = [r["t"] for rows in steps.values() for r in rows if r["restart"] > 0]
    if not after:
        raise SystemExit("no step completed after the restart")
    return min(after) - killed_last


def _program_args(a: argparse.Namespace, work: Path, fault: str) -> list[str]:
    at = a.steps // 2
    extra = {"kill": ["--kill-at", str(at)], "hang": ["--hang-at", str(at)], "none": []}[fault]
    return [str(PROGRAM), "--steps", str(a.steps), "--width", str(a.width), "--ckpt", str(work / "ckpt"),
            "--out", str(work / "out"), "--fault-rank", str(FAULT_RANK), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}


def run_torchrun(a: argparse.Namespace, fault: str, pg_timeout_s: float = 1800.0) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory(prefix="fleet-byo-torchrun-") as tmp:
        work = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(a.ranks),
               "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
               *_program_args(a, work, fault), "--pg-timeout-s", str(pg_timeout_s)]
        env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=a.timeout_s, env=env)
        wall = time.time() - t0
        steps = _steps(work / "out")
    if proc.returncode != 0:
        raise SystemExit(f"torchrun ({fault}) failed with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, steps


def run_fleet(a: argparse.Namespace, fault: str) -> tuple[float, dict, dict]:
    """``fleet run`` on one simulated node with ``--ranks`` ranks; returns the wall time, the
    program's step lines and `fleet report --json`."""
    with tempfile.TemporaryDirectory(prefix="fleet-byo-fleet-") as tmp:
        work = Path(tmp)
        state = work / ".fleet"
        cmd = [*FLEET, "run", "--nodes", "1", "--nproc-per-node", str(a.ranks), "--max-restarts", "3",
               "--no-tee", "--json", "--state-dir", str(state), *_program_args(a, work, fault)]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=a.timeout_s, env=_env())
        wall = time.time() - t0
        if proc.returncode != 0:
            raise SystemExit(f"fleet run ({fault}) failed with {proc.returncode}:\n{proc.stderr[-3000:]}")
        job = json.loads(proc.stdout)["job_id"]
        report = subprocess.run([*FLEET, "report", job, "--json", "--store", f"sqlite:///{state}/fleet.db"],
                                capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp)
        if report.returncode != 0:
            raise SystemExit(f"fleet report failed:\n{report.stderr[-2000:]}")
        return wall, _steps(work / "out"), json.loads(report.stdout)


def _hang(report: dict, steps: dict[int, list[dict]]) -> tuple[float, bool]:
    """Seconds from the hung rank's last step to fleet's hang incident; whether it names the
    hung rank (and its node, the only one)."""
    hangs = [i for i in report["incidents"] if i["kind"] == "hang"]
    if not hangs:
        raise SystemExit(f"fleet named no hang: {report['incidents']}")
    last = max(r["t"] for r in steps[FAULT_RANK] if r["restart"] == 0)
    return hangs[0]["detected_at"] - last, hangs[0]["rank"] == FAULT_RANK and hangs[0]["node"] == "node-0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--width", type=int, default=512, help="MLP width: sets the step time")
    p.add_argument("--torchrun-pg-timeout-s", type=float, default=30.0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    a = p.parse_args()

    step_f, step_t, rec_f, rec_t, hang_f, right = [], [], [], [], [], []
    for i in range(a.runs):
        wall_t, steps_t = run_torchrun(a, "kill")
        wall_f, steps_f, _ = run_fleet(a, "kill")
        step_t.append(_median_step_s(steps_t))
        step_f.append(_median_step_s(steps_f))
        rec_t.append(_recovery_s(steps_t))
        rec_f.append(_recovery_s(steps_f))
        _, steps_h, report = run_fleet(a, "hang")
        detect, ok = _hang(report, steps_h)
        hang_f.append(detect)
        right.append(ok)
        print(f"run {i + 1}: step fleet {step_f[-1] * 1e3:.1f} ms / torchrun {step_t[-1] * 1e3:.1f} ms; "
              f"SIGKILL recovery fleet {rec_f[-1]:.2f} s / torchrun {rec_t[-1]:.2f} s; "
              f"hang named by fleet after {detect:.2f} s ({'right rank' if ok else 'WRONG rank'}); "
              f"wall fleet {wall_f:.1f} s / torchrun {wall_t:.1f} s", flush=True)
    wall_hang_t, steps_ht = run_torchrun(a, "hang", pg_timeout_s=a.torchrun_pg_timeout_s)
    last = max(r["t"] for r in steps_ht[FAULT_RANK] if r["restart"] == 0)
    first_after = min((r["t"] for rows in steps_ht.values() for r in rows if r["restart"] > 0), default=None)
    torchrun_hang_s = (first_after - last) if first_after is not None else float("nan")

    median_step = statistics.median(step_f)
    out = {
        "ranks": a.ranks, "steps": a.steps, "runs": a.runs,
        "median_step_s": round(median_step, 5),
        "torchrun_median_step_s": round(statistics.median(step_t), 5),
        "step_time_ratio": round(median_step / statistics.median(step_t), 3),
        "fleet_recovery_s": round(statistics.median(rec_f), 3),
        "torchrun_recovery_s": round(statistics.median(rec_t), 3),
        "recovery_ratio": round(statistics.median(rec_f) / statistics.median(rec_t), 3),
        "fleet_hang_detect_s": round(statistics.median(hang_f), 3),
        "hang_target_s": round(3 * median_step + 2, 3),
        "hang_culprit_right": all(right),
        "torchrun_hang_to_restart_s": round(torchrun_hang_s, 3),
        "torchrun_pg_timeout_s": a.torchrun_pg_timeout_s,
        "torchrun_restart_env": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
    }
    print(f"\nmedians of {a.runs}: step time fleet/torchrun {out['step_time_ratio']:.3f} (target <= 1.03); "
          f"recovery fleet {out['fleet_recovery_s']:.2f} s vs torchrun {out['torchrun_recovery_s']:.2f} s = "
          f"{out['recovery_ratio']:.2f}x (target <= 0.5); hang named after {out['fleet_hang_detect_s']:.2f} s "
          f"(target <= 3 steps + 2 s = {out['hang_target_s']:.2f} s); torchrun: the hang ended at its "
          f"process-group timeout, {torchrun_hang_s:.1f} s after it began ({a.torchrun_pg_timeout_s:g} s timeout). "
          "torchrun restarts in torch 2.13 only with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set).")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
