"""Learning-rate schedule: linear warm-up, then cosine decay or constant.

Pure function of the step, so a restored run continues on exactly the same curve.
"""

from __future__ import annotations

import math

from fleet.workers.spec import TrainArgs


def lr_at(train: TrainArgs, step: int) -> float:
    """Learning rate for optimizer step ``step`` (1-based)."""
    if train.warmup_steps and step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    if train.lr_schedule == "constant":
        return train.lr
    if train.lr_schedule != "cosine":
        raise ValueError(f"unknown lr_schedule {train.lr_schedule!r}")
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.lr * train.min_lr_ratio
    return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
