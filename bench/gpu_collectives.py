"""NCCL all_gather bandwidth on one GPU host: fleet's figure from the flight recorder's
traces vs an nccl-tests-style timed loop, in the same run (``bench/gpu_smoke.sh`` runs it).

    torchrun --standalone --nproc-per-node <GPUs> bench/gpu_collectives.py OUT_DIR
    torchrun --standalone --nproc-per-node 2 bench/gpu_collectives.py OUT_DIR --cpu   # a dry run on gloo

Each rank, for S = 1 KiB .. 64 MiB (x4; S as nccl-tests defines it for all_gather: the
whole gathered output, so each rank sends S / n): warm-up, then ``iters`` back-to-back
``all_gather_into_tensor`` between two CUDA events (the loop's time per op: elapsed / iters,
the slowest rank's). With ``TORCH_NCCL_ENABLE_TIMING=1`` NCCL's flight recorder keeps each
op's device duration (``duration_ms``); every rank dumps its ring into OUT_DIR and rank 0
reads the dumps with fleet's dump reader and ``diagnosis.bandwidth.analyse`` -- exactly
what ``fleet replay --dumps OUT_DIR`` shows -- and compares.

With one GPU the group has one member: all_gather's bus factor (n-1)/n is 0, so busbw is
0 on both sides and the comparison is of algbw (S / t), which still checks the timing
path end to end. The last line is one JSON object. Written without a GPU at hand: the
first run on one is its test; ``--cpu`` runs the same steps on gloo (whose dumps carry no
durations: fleet's figures are "-") to check the script itself anywhere.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
#: torch 2.13's name for all_gather_into_tensor (the old name warns on every call)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
WARMUP = 5


def _iters(size: int) -> int:
    return max(10, min(200, (256 << 20) // size))


def main(out: Path, cpu: bool = False) -> None:
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = _Cpu() if cpu else torch.cuda
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("gloo" if cpu else "nccl")
    device = "cpu" if cpu else "cuda"
    loop: dict[int, float] = {}
    iters_of: dict[int, int] = {}
    for size in SIZES:
        per_rank = size // 4 // world  # float32 elements this rank sends
        send = torch.ones(per_rank, device=device)
        recv = torch.empty(per_rank * world, device=device)
        for _ in range(WARMUP):
            _all_gather(recv, send)
        iters = iters_of[size] = _iters(size)
        start, end = dev.Event(enable_timing=True), dev.Event(enable_timing=True)
        dist.barrier()
        dev.synchronize()
        start.record()
        for _ in range(iters):
            _all_gather(recv, send)
        end.record()
        dev.synchronize()
        t = torch.tensor([start.elapsed_time(end) / 1e3 / iters], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's, as nccl-tests reports
        loop[size] = float(t.item())
    dev.synchronize()
    dumper = torch._C._distributed_c10d._dump_fr_trace if cpu else torch._C._distributed_c10d._dump_nccl_trace
    dump = dumper(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    (out / f"rank_{rank}").write_bytes(dump)
    dist.barrier()
    if rank == 0:
        _compare(out, world, loop, iters_of, "cpu (gloo dry run)" if cpu else torch.cuda.get_device_name(0))
    dist.destroy_process_group()


class _Cpu:
    """The few ``torch.cuda`` calls the loop makes, on the host clock (``--cpu``)."""

    class Event:
        def __init__(self, enable_timing: bool = True) -> None:
            self.t = 0.0

        def record(self) -> None:
            self.t = time.perf_counter()

        def elapsed_time(self, end: "_Cpu.Event") -> float:
            return (end.t - self.t) * 1e3  # ms, as CUDA events report

    @staticmethod
    def synchronize() -> None:
        pass


def _compare(out: Path, world: int, loop: dict[int, float], iters_of: dict[int, int], device: str) -> None:
    from fleet.controlplane.diagnosis import load_traces
    from fleet.controlplane.diagnosis.bandwidth import analyse, bus_factor

    entries = pickle.loads((out / "rank_0").read_bytes()).get("entries", [])
    timed = sum(1 for e in entries if e.get("duration_ms"))
    report = analyse(load_traces(out, "rank_"))
    rows = {r.bytes: r for r in report.rows if r.op == "all_gather" and r.group_size == world}
    factor = bus_factor("all_gather", world) or 0.0
    use_alg = factor == 0.0  # one GPU: busbw is 0 on both sides, compare algbw
    res: dict = {"gpus": world, "device": device, "entries": len(entries),
                 "entries_with_duration": timed, "compared": "algbw" if use_alg else "busbw",
                 "sizes_bytes": SIZES, "loop_bps": [], "fleet_bps": [], "rel_error": []}
    print(f"{'size':>10} {'iters':>6} {'loop GB/s':>10} {'fleet GB/s':>11} {'rel err':>8}")
    for size in SIZES:
        loop_bps = size / loop[size] * (1.0 if use_alg else factor)
        row = rows.get(size)
        fleet_bps = None if row is None else (row.algbw_bps if use_alg else row.busbw_bps)
        err = None if fleet_bps is None else abs(fleet_bps - loop_bps) / loop_bps
        res["loop_bps"].append(loop_bps)
        res["fleet_bps"].append(fleet_bps)
        res["rel_error"].append(err)
        print(f"{size:>10} {iters_of[size]:>6} {loop_bps / 1e9:>10.2f} "
              f"{'-' if fleet_bps is None else f'{fleet_bps / 1e9:.2f}':>11} "
              f"{'-' if err is None else f'{err:.1%}':>8}")
    errors = [e for e in res["rel_error"] if e is not None]
    res["max_busbw_rel_error"] = max(errors) if len(errors) == len(SIZES) else None
    res["median_rel_error"] = statistics.median(errors) if errors else None
    res["timing_note"] = report.timing_note
    print(json.dumps(res))


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    main(folder, cpu="--cpu" in sys.argv[2:])
