"""Per-step training metrics: expert load balance and model FLOPs utilisation.

Expert imbalance is judged against the uniform share 1/E of routed tokens: an expert
is underloaded below ``LOW_FACTOR / E`` and overloaded above ``HIGH_FACTOR / E``. The
factors reproduce the usual rule for 16 experts (under 5 % or over 20 % of tokens:
0.05 = 0.8/16, 0.20 = 3.2/16) and scale it to any expert count.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LOW_FACTOR = 0.8
HIGH_FACTOR = 3.2


@dataclass(frozen=True)
class ExpertLoadStat:
    layer: int
    tokens_per_expert: tuple[int, ...]
    min_share: float
    max_share: float
    imbalanced: bool


def expert_load(layer: int, counts: Sequence[int]) -> ExpertLoadStat:
    """Shares and the imbalance flag of one MoE layer's routed-token counts."""
    total = sum(counts)
    n = len(counts)
    if total == 0 or n == 0:
        return ExpertLoadStat(layer, tuple(counts), 0.0, 0.0, False)
    shares = [c / total for c in counts]
    lo, hi = min(shares), max(shares)
    uniform = 1.0 / n
    imbalanced = n > 1 and (lo < LOW_FACTOR * uniform or hi > HIGH_FACTOR * uniform)
    return ExpertLoadStat(layer, tuple(int(c) for c in counts), lo, hi, imbalanced)


#: Dense peak throughput per device (FLOP/s) for MFU: BF16 tensor-core figures.
_GPU_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device: a table for known GPUs; on CPU a short fp32 matmul probe
    of this process (one thread), so MFU there reads as a fraction of what a core does."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK.items():
            if key in name:
                return flops
        return 312e12
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
    return flops_per_token * tokens_per_s / peak if peak > 0 else 0.0
