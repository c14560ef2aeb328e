"""A plain torch.distributed program timing all_reduce and all_gather in a loop (no fleet import).

    torchrun --nproc-per-node 2 bench/collectives_worker.py --out /tmp/coll

``bench/collectives.py`` runs it under ``fleet up`` and compares what it measures with
the bus bandwidth fleet derives from the same run's traces. It is what nccl-tests'
``all_reduce_perf`` / ``all_gather_perf`` do, on gloo and float32: for each op and each
message size ``S`` (nccl-tests' S: all_reduce's buffer, all_gather's whole gathered
output, so each rank's input is S / world size),

  * warm-up iterations; their wall time, the slowest rank's (one 8-byte all_reduce of
    MAX), sets ``N``, the iterations of one repetition: about ``--rep-s`` of work, at
    most ``--max-collectives`` / ``--reps`` (so the run stays inside the flight
    recorder's ring and a few minutes long);
  * ``--reps`` repetitions (fewer for long calls, 7 at least: about ``--max-size-s`` per
    (op, S)), each a barrier and then N (at least ``--min-iters``) back-to-back calls
    timed with ``time.perf_counter()`` around the loop.

Every call goes through ``torch.distributed``'s module functions (``dist.all_reduce``,
``dist.all_gather_into_tensor``), as a user's program would, so a wrapper installed on
them (fleet's timing of gloo calls) sees them all.

Each rank writes ``<out>/rank-<r>.jsonl``: one line per (op, S) with ``n`` (N), ``reps``
(seconds per repetition) and ``windows`` (each repetition's wall-clock start and end,
``time.time_ns()``, to pick the timed collectives out of a trace), then one line
``{"issued": {op: count}}`` with every collective it issued on the world group, by
canonical op name (warm-ups, the MAX all_reduces and the barriers included), so that the
caller can tell whether a recorder kept them all.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

KIB = 1024


def _sizes(lo: int, hi: int) -> list[int]:
    """lo, 4 lo, 16 lo, ... up to hi (bytes)."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


class Loop:
    """One (op, S): its buffers and one call, counted in ``issued``."""

    def __init__(self, op: str, size: int, world: int, issued: Counter) -> None:
        if size % (4 * world):
            raise SystemExit(f"--min-bytes: {size} B is not a multiple of 4 x {world} ranks (float32 shards)")
        self.op, self.issued = op, issued
        if op == "all_reduce":
            self.buf = torch.zeros(size // 4, dtype=torch.float32)
        else:
            self.out = torch.zeros(size // 4, dtype=torch.float32)
            self.inp = torch.zeros(size // 4 // world, dtype=torch.float32)
        # all_gather_into_tensor's newer name; the old one is deprecated and calls it
        self.gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def run(self, n: int) -> None:
        """``n`` back-to-back calls (module attributes looked up per call, as user code does)."""
        if self.op == "all_reduce":
            for _ in range(n):
                dist.all_reduce(self.buf)
        else:
            gather = self.gather_name
            for _ in range(n):
                getattr(dist, gather)(self.out, self.inp)
        self.issued[self.op] += n


def _slowest(seconds: float, issued: Counter) -> float:
    """The largest of every rank's ``seconds`` (one 8-byte all_reduce)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    issued["all_reduce"] += 1
    return float(t.item())


def _barrier(issued: Counter) -> None:
    dist.barrier()
    issued["barrier"] += 1


def measure(loop: Loop, a: argparse.Namespace, issued: Counter) -> dict:
    """Warm up, size N, then time ``a.reps`` repetitions of N calls."""
    _barrier(issued)
    loop.run(1)  # first call: buffers and connections
    t0 = time.perf_counter()
    loop.run(a.warmup)
    per_call = _slowest((time.perf_counter() - t0) / a.warmup, issued)
    # at least --min-iters calls: with one, a repetition is the first rank out of the
    # barrier waiting for the last, not a call
    n = max(a.min_iters, min(round(a.rep_s / max(per_call, 1e-9)), a.max_collectives // a.reps))
    # long calls: fewer repetitions (odd, at least 7), so that one (op, S) takes about --max-size-s
    n_reps = max(7, min(a.reps, int(a.max_size_s / (n * per_call)))) | 1
    reps, windows = [], []
    for _ in range(n_reps):
        _barrier(issued)
        w0 = time.time_ns()
        t0 = time.perf_counter()
        loop.run(n)
        reps.append(time.perf_counter() - t0)
        windows.append((w0, time.time_ns()))
    return {"warmup_s_per_call": per_call, "n": n, "reps": reps, "windows": windows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="folder for rank-<r>.jsonl")
    p.add_argument("--ops", default="all_reduce,all_gather")
    p.add_argument("--min-bytes", type=int, default=KIB)
    p.add_argument("--max-bytes", type=int, default=64 * KIB * KIB)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--warmup", type=int, default=3, help="timed warm-up calls (after one untimed)")
    p.add_argument("--rep-s", type=float, default=0.05, help="aimed wall time of one repetition, s")
    p.add_argument("--max-collectives", type=int, default=600,
                   help="timed calls per (op, S) at most (reps x N)")
    p.add_argument("--min-iters", type=int, default=5, help="calls per repetition at least")
    p.add_argument("--max-size-s", type=float, default=8.0,
                   help="aimed wall time of one (op, S)'s repetitions, s (fewer of them, 7 at least)")
    p.add_argument("--pg-timeout-s", type=float, default=600.0)
    a = p.parse_args()
    ops = a.ops.split(",")
    for op in ops:
        if op not in ("all_reduce", "all_gather"):
            raise SystemExit(f"--ops: unknown op {op!r} (all_reduce, all_gather)")

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    issued: Counter = Counter()
    with open(out_dir / f"rank-{rank}.jsonl", "w", buffering=1) as out:
        for op in ops:
            for size in _sizes(a.min_bytes, a.max_bytes):
                row = measure(Loop(op, size, world, issued), a, issued)
                out.write(json.dumps({"op": op, "bytes": size, "world": world, **row}) + "\n")
                if rank == 0:
                    print(f"{op} {size} B: N={row['n']}, median rep {sorted(row['reps'])[len(row['reps']) // 2]:.4f} s",
                          flush=True)
        _barrier(issued)
        out.write(json.dumps({"issued": dict(issued), "pid": os.getpid()}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
