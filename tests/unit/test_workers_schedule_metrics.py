"""Pure functions of the training recipe: the LR schedule and the step metrics."""

from __future__ import annotations

import math

import pytest
import torch

from fleet.workers.metrics import expert_load, mfu, peak_flops
from fleet.workers.schedule import lr_at
from fleet.workers.spec import TrainArgs


def test_warmup_is_linear_then_cosine_reaches_the_floor() -> None:
    t = TrainArgs(steps=110, lr=1.0, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    assert [lr_at(t, s) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert lr_at(t, 60) == pytest.approx(0.55)           # halfway down the cosine
    assert lr_at(t, 110) == pytest.approx(0.1)
    lrs = [lr_at(t, s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))      # monotone after warm-up


def test_constant_schedule_and_no_warmup() -> None:
    t = TrainArgs(steps=50, lr=0.3, warmup_steps=0, lr_schedule="constant")
    assert {lr_at(t, s) for s in range(1, 51)} == {0.3}


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_at(TrainArgs(lr_schedule="step", warmup_steps=0), 3)


def test_expert_load_uses_the_16_expert_rule() -> None:
    balanced = expert_load(0, [100] * 16)
    assert not balanced.imbalanced and balanced.min_share == balanced.max_share == 1 / 16
    # one expert at 4 % of the tokens (< 5 %): flagged
    low = expert_load(1, [4] + [96 / 15 * 1.0] * 15)
    assert low.imbalanced and math.isclose(low.min_share, 0.04)
    # one expert at 25 % (> 20 %): flagged
    assert expert_load(2, [25] + [5] * 15).imbalanced
    # within [5 %, 20 %] everywhere: not flagged
    assert not expert_load(3, [19] + [5.4] * 15).imbalanced
    assert not expert_load(4, [0, 0]).imbalanced            # no tokens: nothing to judge


def test_mfu_and_cpu_peak() -> None:
    peak = peak_flops(torch.device("cpu"))
    assert peak > 1e8
    assert mfu(6e6, 1000.0, 1e10) == pytest.approx(0.6)
    assert mfu(1.0, 1.0, 0.0) == 0.0
