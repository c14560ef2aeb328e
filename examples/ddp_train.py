"""A plain torchrun DDP training script: it never imports fleet.

It runs the same under torchrun and under fleet (examples/user_script.yaml, or
`fleet run`), because both give every rank torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...):

    .venv/bin/torchrun --nproc-per-node 2 examples/ddp_train.py --checkpoint-dir /tmp/ddp-ckpt
    fleet run --nodes 2 --nproc-per-node 2 examples/ddp_train.py --checkpoint-dir /tmp/ddp-ckpt

A small MLP learns a fixed random regression on CPU (gloo, env:// rendezvous). Rank 0
saves a checkpoint every --checkpoint-every steps (written to a temporary name, then
renamed, so a killed rank never leaves a torn file); on start every rank resumes from
the newest one, so a restarted job goes on where it was. Every rank prints its loss
every --log-every steps.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

CHECKPOINT = re.compile(r"^step-(\d+)\.pt$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="Steps to train in all.")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("ddp-checkpoints"),
                   help="Where rank 0 saves checkpoints and every rank resumes from.")
    p.add_argument("--checkpoint-every", type=int, default=50, help="Steps between checkpoints.")
    p.add_argument("--keep", type=int, default=3, help="Checkpoints kept (the newest).")
    p.add_argument("--log-every", type=int, default=20, help="Steps between loss lines.")
    p.add_argument("--batch-size", type=int, default=32, help="Samples per rank and step.")
    p.add_argument("--hidden", type=int, default=64, help="Width of the MLP's hidden layers.")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the model and the data.")
    p.add_argument("--step-delay-s", type=float, default=0.0,
                   help="Extra seconds per step (to make the job last long enough to watch or disturb).")
    return p.parse_args(argv)


def newest_checkpoint(folder: Path) -> tuple[int, Path | None]:
    """(step, path) of the newest checkpoint in ``folder``; (0, None) when there is none."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := CHECKPOINT.match(p.name))]
    return max(found) if found else (0, None)


def save_checkpoint(folder: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, keep: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".step-{step}.pt.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
    os.replace(tmp, folder / f"step-{step}.pt")
    old = sorted((int(m.group(1)), p) for p in folder.glob("step-*.pt") if (m := CHECKPOINT.match(p.name)))
    for _, path in old[:-keep]:
        path.unlink(missing_ok=True)


def batch(step: int, rank: int, args: argparse.Namespace, target: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of ``rank`` at ``step``: the same after a restart."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(args.batch_size, 16, generator=g)
    with torch.no_grad():
        return x, target(x)


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    target = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # rank 0 picks the checkpoint so that every rank resumes from the same step
    step_t = torch.tensor([newest_checkpoint(args.checkpoint_dir)[0] if rank == 0 else 0])
    dist.broadcast(step_t, src=0)
    start = int(step_t.item())
    if start:
        state = torch.load(args.checkpoint_dir / f"step-{start}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    print(f"rank {rank}/{world}: {'resuming from step ' + str(start) if start else 'starting fresh'}, "
          f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)

    ddp = DistributedDataParallel(model)
    loss_fn = nn.MSELoss()
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, args, target)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        if args.step_delay_s:
            time.sleep(args.step_delay_s)
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        if rank == 0 and (step % args.checkpoint_every == 0 or step == args.steps):
            save_checkpoint(args.checkpoint_dir, step, model, opt, args.keep)
    dist.barrier()
    print(f"rank {rank}: done, {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
