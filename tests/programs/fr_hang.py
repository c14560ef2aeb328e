"""A plain torchrun script that records its collectives with ``fleet.record_collectives``
and whose last rank hangs in Python before a step's all_reduce (the other ranks block in
it). Nobody reaches ``close()``: the dumps must come from the ranks' stall watchers.

    torchrun --nproc-per-node 3 tests/programs/fr_hang.py OUT_DIR [--hang-step S]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from fleet import record_collectives


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hang-step", type=int, default=5)
    p.add_argument("--hang-s", type=float, default=120.0, help="the hung rank exits after this long")
    a = p.parse_args()
    rec = record_collectives(dump_dir=a.out, stall_dump_s=1.0, watch_interval_s=0.1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(16)
    for step in range(1, a.steps + 1):
        rec.step(step)
        train_step(t, step, hang_s=a.hang_s if rank == world - 1 and step == a.hang_step else 0.0)
    rec.close()
    dist.destroy_process_group()


def train_step(t: torch.Tensor, step: int, hang_s: float) -> None:
    dist.all_reduce(t)
    if hang_s:
        wait_for_data(hang_s)
    dist.all_reduce(t)


def wait_for_data(hang_s: float) -> None:
    """A data loader that never returns; after ``hang_s`` the process ends itself, so a
    test that failed to stop it leaves nothing behind for long."""
    deadline = time.monotonic() + hang_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(3)


if __name__ == "__main__":
    main()
