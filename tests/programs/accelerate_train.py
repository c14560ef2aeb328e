"""A Hugging Face Accelerate training script with no fleet import (tests/integration/test_user_programs.py).

    torchrun --nproc-per-node 2 tests/programs/accelerate_train.py --steps 30 --ckpt /tmp/ck --out /tmp/s

``Accelerator(cpu=True)`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and creates the gloo process group; ``prepare`` wraps the model
in DDP and shards the DataLoader. Every ``--ckpt-every`` steps ``save_state`` writes the
whole training state into ``<ckpt>/step-<n>`` (then ``<ckpt>/latest`` names it, written
atomically by the main process); a new run resumes from it with ``load_state`` and skips
the batches already trained on (``skip_first_batches``). Every rank appends one JSON line
per completed step to ``<out>/rank-<r>.jsonl`` (step, wall time, restart count), as
tests/programs/ddp.py does.

Fault, for the first run only (``TORCHELASTIC_RESTART_COUNT`` 0) and one rank
(``--fault-rank``): ``--kill-at S`` sends itself SIGKILL before step S.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt", default="")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=0)
    args = p.parse_args()

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    faulty = rank == args.fault_rank and restart == 0
    torch.manual_seed(0)
    n = args.batch * accelerator.num_processes * (args.steps + 1)
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=args.batch))

    start = 0
    ckpt = Path(args.ckpt) if args.ckpt else None
    if ckpt is not None and (ckpt / "latest").exists():
        start = int((ckpt / "latest").read_text())
        accelerator.load_state(str(ckpt / f"step-{start}"))
        loader = accelerator.skip_first_batches(loader, start)
    out = None
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = open(Path(args.out) / f"rank-{rank}.jsonl", "a", buffering=1)

    step = start
    for x, y in loader:
        if step >= args.steps:
            break
        if faulty and step + 1 == args.kill_at:
            print(f"rank {rank}: SIGKILL before step {args.kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        step += 1
        if out is not None:
            out.write(json.dumps({"step": step, "t": time.time(), "restart": restart, "loss": loss.item()}) + "\n")
        if ckpt is not None and step % args.ckpt_every == 0:
            accelerator.save_state(str(ckpt / f"step-{step}"))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                (ckpt / "latest.tmp").write_text(str(step))
                os.replace(ckpt / "latest.tmp", ckpt / "latest")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    print(f"rank {rank}: done at step {step} (restart {restart}, resumed from step {start})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
