"""A DDP loop that reports its steps to fleet with the one-line step API.

    python tests/programs/stepapi.py --steps 60 --ckpt DIR [--nan-at S --nan-attempt A]

``fleet.step(step, loss=..., tokens=...)`` after every step (a no-op outside fleet);
checkpoints every 10 steps and resumes from the newest; ``--nan-at S`` makes rank 1's
loss NaN at step S on attempt ``--nan-attempt`` (``FLEET_ATTEMPT``).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fleet


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument("--nan-attempt", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step also takes")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt, start = Path(args.ckpt), 0
    if (ckpt / "latest.pt").exists():
        state = torch.load(ckpt / "latest.pt", weights_only=True)
        model.load_state_dict(state["model"])
        start = int(state["step"])
    ddp = DistributedDataParallel(model)
    poisoned = rank == 1 and os.environ.get("FLEET_ATTEMPT") == str(args.nan_attempt)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(8, 16)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
        value = math.nan if poisoned and step == args.nan_at else loss.item()
        fleet.step(step, loss=value, tokens=x.numel())
        if rank == 0 and step % 10 == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "step": step}, ckpt / "latest.tmp")
            os.replace(ckpt / "latest.tmp", ckpt / "latest.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
