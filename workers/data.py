"""Deterministic synthetic training data: a learnable token stream with no files.

Each sequence follows an affine recurrence ``x[t+1] = (a * x[t] + b) mod V`` with
``(a, b)`` drawn per sequence from a small fixed set, so a model can learn the rule from
context and the loss falls visibly within a few dozen steps.

Invariant: ``batch(train, V, step, rank)`` depends only on ``(train.seed, step, rank,
train.batch_size, train.seq_len, V)``; the same arguments give bit-identical tensors in
any process, at any time, so a restored run sees exactly the data the original would.
"""

from __future__ import annotations

import torch

from workers.spec import TrainArgs

#: The recurrences a sequence may follow, as (multiplier, increment). Few on purpose, so
#: the tiny model learns them in tens of steps; odd multipliers keep ``x -> a*x + b`` a
#: permutation when V is a power of two, so no sequence collapses onto a short cycle.
RULES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (3, 1), (5, 3))

# Large odd multipliers keep the seeds of neighbouring (step, rank) pairs far apart.
_STEP_MIX = 1_000_003
_RANK_MIX = 7_919


def _generator(seed: int, step: int, rank: int) -> torch.Generator:
    mixed = (seed * 2_147_483_647 + step * _STEP_MIX + rank * _RANK_MIX) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def batch(train: TrainArgs, vocab_size: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for data-parallel ``rank`` at ``step``.

    Returns two int64 tensors of shape ``[train.batch_size, train.seq_len]``; the
    targets are the inputs shifted left by one token.
    """
    gen = _generator(train.seed, step, rank)
    n, length = train.batch_size, train.seq_len + 1
    rules = torch.tensor(RULES, dtype=torch.int64)
    pick = torch.randint(len(RULES), (n,), generator=gen)
    mult, inc = rules[pick, 0], rules[pick, 1]
    x = torch.randint(vocab_size, (n,), generator=gen)
    seq = torch.empty(n, length, dtype=torch.int64)
    for t in range(length):
        seq[:, t] = x
        x = (mult * x + inc) % vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
