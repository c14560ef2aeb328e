"""A PyTorch Lightning training script with no fleet import (tests/integration/test_user_programs.py).

    torchrun --nnodes 1 --nproc-per-node 2 tests/programs/lightning_train.py --steps 30 --ckpt /tmp/ck --out /tmp/s

A tiny regression LightningModule on CPU with ``strategy="ddp"`` (gloo): Lightning finds
torchrun's environment (``TorchElasticEnvironment``, from RANK, GROUP_RANK, LOCAL_RANK and
LOCAL_WORLD_SIZE) and joins the process group torchrun's variables describe, so
``devices`` and ``num_nodes`` come from LOCAL_WORLD_SIZE and GROUP_WORLD_SIZE.
``ModelCheckpoint`` saves every ``--ckpt-every`` steps (``save_last``) into ``--ckpt``,
and a new run resumes with ``ckpt_path="last"`` when a checkpoint is there. Every rank
appends one JSON line per completed step to ``<out>/rank-<r>.jsonl`` (step, wall time,
restart count), as tests/programs/ddp.py does.

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

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Progress(pl.Callback):
    """One JSON line per completed step; SIGKILL before ``kill_at`` on the faulty rank."""

    def __init__(self, out: str, rank: int, restart: int, kill_at: int) -> None:
        self.rank, self.restart, self.kill_at = rank, restart, kill_at
        self.file = None
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(out) / f"rank-{rank}.jsonl", "a", buffering=1)

    def on_train_batch_start(self, trainer: pl.Trainer, *_: object) -> None:
        if self.kill_at and trainer.global_step + 1 == self.kill_at:
            print(f"rank {self.rank}: SIGKILL before step {self.kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: pl.Trainer, _module: pl.LightningModule, outputs: object,
                           *_: object) -> None:
        if self.file is not None:
            loss = float(outputs["loss"]) if isinstance(outputs, dict) else float("nan")
            self.file.write(json.dumps({"step": trainer.global_step, "t": time.time(), "restart": self.restart,
                                        "loss": loss}) + "\n")


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

    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faulty = rank == args.fault_rank and restart == 0
    torch.manual_seed(0)
    world = int(os.environ["WORLD_SIZE"])
    n = args.batch * world * (args.steps + 1)
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 1))
    callbacks: list[pl.Callback] = [Progress(args.out, rank, restart, args.kill_at if faulty else 0)]
    resume = None
    if args.ckpt:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt, every_n_train_steps=args.ckpt_every,
                                                      save_last=True, save_top_k=1))
        if (Path(args.ckpt) / "last.ckpt").exists():
            resume = "last"
    trainer = pl.Trainer(
        accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), max_steps=args.steps, max_epochs=-1,
        enable_progress_bar=False, enable_model_summary=False, logger=False, callbacks=callbacks,
        default_root_dir=args.ckpt or None,
    )
    trainer.fit(Regression(args.width), DataLoader(data, batch_size=args.batch), ckpt_path=resume)
    print(f"rank {rank}: done at step {trainer.global_step} (restart {restart}, resumed from "
          f"{resume or 'scratch'})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
