"""A plain torchrun DDP training script with no fleet import (tests and bench/byo.py).

    torchrun --nproc-per-node 2 tests/programs/ddp.py --steps 200 --ckpt /tmp/ck --out /tmp/steps

It trains a small MLP on gloo, checkpoints every ``--ckpt-every`` steps (rank 0 writes,
atomically) and resumes from the newest checkpoint when it starts again. Every rank
appends one JSON line per completed step to ``<out>/rank-<r>.jsonl`` (step, wall time,
restart count), after one line per run with the times it started, joined the process
group, restored and wrapped the model (``"phase": "start"``): that is how the tests and
the benchmark see progress from outside.

Faults, for the first run only (``TORCHELASTIC_RESTART_COUNT`` 0) and one rank
(``--fault-rank``): ``--kill-at S`` sends itself SIGKILL at step S, ``--hang-at S``
stops forever before step S's all-reduce, ``--raise-at S`` raises. ``--fail-at-start``
raises before ``init_process_group`` on every run; ``--exit-early`` makes the fault
rank exit 0 before ``init_process_group``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--ckpt", default="")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--hang-at", type=int, default=0)
    p.add_argument("--raise-at", type=int, default=0)
    p.add_argument("--fail-at-start", action="store_true")
    p.add_argument("--exit-early", action="store_true")
    p.add_argument("--pg-timeout-s", type=float, default=1800.0)
    args = p.parse_args()

    t_start = time.time()
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faulty = rank == args.fault_rank and restart == 0
    if args.fail_at_start:
        raise RuntimeError(f"cannot open the dataset on rank {rank} (on purpose)")
    if args.exit_early and faulty:
        print(f"rank {rank}: leaving before init_process_group", flush=True)
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout_s))
    t_pg = time.time()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.ReLU(),
                                torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                torch.nn.Linear(args.width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    ckpt = Path(args.ckpt) if args.ckpt else None
    if ckpt is not None and (ckpt / "latest.pt").exists():
        state = torch.load(ckpt / "latest.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    t_restored = time.time()
    ddp = DistributedDataParallel(model)
    out = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = open(Path(args.out) / f"rank-{rank}.jsonl", "a", buffering=1)
        out.write(json.dumps({"phase": "start", "t": t_start, "pg": t_pg, "restored": t_restored,
                              "ddp": time.time(), "restart": restart}) + "\n")
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, args.steps + 1):
        if faulty and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and step == args.hang_at:
            print(f"rank {rank}: hanging before step {step}", flush=True)
            while True:
                time.sleep(3600)
        if faulty and step == args.raise_at:
            raise ValueError(f"rank {rank} failed at step {step} (on purpose)")
        x = torch.randn(args.batch, 64, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if out is not None:
            out.write(json.dumps({"step": step, "t": time.time(), "restart": restart, "loss": loss.item()}) + "\n")
        if ckpt is not None and rank == 0 and step % args.ckpt_every == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
            tmp = ckpt / "latest.pt.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt / "latest.pt")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done at step {args.steps} (restart {restart})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
