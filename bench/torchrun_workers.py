"""Run fleet's worker (`python -m fleet.workers.train`) under plain `torchrun --standalone` and
collect each rank's result line: the control-plane-free peer the benchmarks compare with."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_RESULT = re.compile(r"FLEET_WORKER_RESULT (\{[^}]*\})")


def run_workers(ranks: int, train_args: list[str], timeout_s: float, what: str) -> tuple[float, list[dict]]:
    """Train ``ranks`` local ranks with ``train_args`` (checkpoints in a temporary folder);
    returns the wall seconds and every rank's result dict. Exits naming ``what`` on failure."""
    with tempfile.TemporaryDirectory(prefix="fleet-bench-torchrun-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), "-m", "fleet.workers.train",
               "--checkpoint-dir", str(Path(tmp) / "ckpt"), *train_args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout_s, env=env)
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{what} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    results = [json.loads(m) for m in _RESULT.findall(out.stdout)]
    if len(results) != ranks:
        raise SystemExit(f"{what}: expected {ranks} rank results, got {len(results)}")
    return wall, results
