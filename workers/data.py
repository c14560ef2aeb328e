"""Training data as packed documents: a deterministic synthetic stream, or a memory-mapped
token file.

Both sources give a ``Batch`` of ``[batch_size, seq_len]`` int64 tensors:
  * ``inputs``: token ids; documents are packed back to back, each followed by the
    end-of-document token ``EOS`` (id 0);
  * ``targets``: the next token, except at an ``EOS`` position, whose next token starts
    an unrelated document: those are ``IGNORE`` (-100, ``F.cross_entropy``'s default
    ``ignore_index``). A document's last real token keeps its target, the ``EOS``;
  * ``doc_ids``: per row, the index (0, 1, ...) of the document each position belongs
    to; an ``EOS`` belongs to the document it ends, so ``doc_ids`` steps up right
    after each ``EOS`` (for document-masked attention).

Synthetic documents have random lengths around ``mean_doc_len`` and follow a learnable
rule: ``s[t+1] = (a * s[t] + b) mod (V - 1)`` with ``(a, b)`` from ``RULES`` per
document, emitted as token ``s + 1`` (so never ``EOS``).

Token files are flat arrays of token ids; the dtype comes from the file name:
``.u16`` or ``.bin`` (nanoGPT's layout) = uint16, ``.u32`` = uint32, native byte order,
no header. Window ``w`` is tokens ``[w*seq_len, w*seq_len + seq_len]`` (seq_len + 1 of
them: inputs and shifted targets), wrapping around after the last whole window.

Invariant: a batch depends only on its arguments (seed, step, rank, shapes; for a file,
its content and the window position), never on process state, so a restored run sees
exactly the data the original would have.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fleet.workers.spec import TrainArgs

EOS = 0
IGNORE = -100

#: The recurrences a synthetic document may follow, as (multiplier, increment) on
#: ``s = token - 1`` modulo ``V - 1``. Few on purpose, so the tiny model learns them in
#: tens of steps (packed 24-token documents: loss 5.4 -> 3.6 in 30 steps). For V = 256
#: the multipliers 3 and 5 share factors with 255, so those maps are not permutations;
#: documents are short, so no document collapses onto a trivial cycle in practice.
RULES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (3, 1), (5, 3))

TOKEN_FILE_DTYPES = {".u16": np.uint16, ".bin": np.uint16, ".u32": np.uint32}

# Large odd multipliers keep the seeds of neighbouring (step, rank) pairs far apart.
_STEP_MIX = 1_000_003
_RANK_MIX = 7_919


@dataclass(frozen=True)
class Batch:
    """One rank's micro-batch; see the module docstring. ``position`` is the first
    token-file window it holds (None for synthetic data), the "data position" a
    checkpoint records."""

    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor
    position: int | None = None

    def __iter__(self):
        # Callers written before doc_ids unpack ``inputs, targets = batch(...)``.
        return iter((self.inputs, self.targets))

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.inputs, self.targets)[i]


def batch(train: TrainArgs, vocab_size: int, step: int, rank: int, *, dp_size: int = 1) -> Batch:
    """The micro-batch of data-parallel ``rank`` (of ``dp_size``) at ``step``.

    ``dp_size`` only matters for a token file, where ranks read disjoint windows; it
    must be the number of ranks reading different data (all ranks, with or without EP).
    """
    if train.dataset == "synthetic":
        return synthetic_batch(train, vocab_size, step, rank)
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank ({rank}) must be in [0, dp_size ({dp_size})) to read {train.dataset}")
    ds = open_token_file(train.dataset)
    return ds.batch_at(ds.position(step, rank, dp_size, train.batch_size), train.batch_size,
                       train.seq_len, vocab_size)


def _generator(seed: int, step: int, rank: int) -> torch.Generator:
    mixed = (seed * 2_147_483_647 + step * _STEP_MIX + rank * _RANK_MIX) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def doc_ids_of(inputs: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the document of each position (EOS closes a document)."""
    ends = (inputs == EOS).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


def _packed(tokens: torch.Tensor, position: int | None = None) -> Batch:
    """``tokens`` [B, S+1] -> inputs, masked next-token targets and doc ids."""
    inputs = tokens[:, :-1].contiguous()
    targets = tokens[:, 1:].clone()
    targets[inputs == EOS] = IGNORE
    return Batch(inputs, targets, doc_ids_of(inputs), position)


def synthetic_batch(train: TrainArgs, vocab_size: int, step: int, rank: int) -> Batch:
    """Packed synthetic documents, a pure function of (seed, step, rank, shapes)."""
    if vocab_size < 3:
        raise ValueError(f"vocab_size ({vocab_size}) must be >= 3 for synthetic documents")
    if train.mean_doc_len < 1:
        raise ValueError(f"mean_doc_len ({train.mean_doc_len}) must be >= 1")
    gen = _generator(train.seed, step, rank)
    n, length, mean = train.batch_size, train.seq_len + 1, train.mean_doc_len
    lo, hi = mean - mean // 2, mean + mean // 2         # content lengths, uniform; mean ~ mean_doc_len
    per_row = length // (lo + 1) + 1                    # enough documents to fill any row
    content = torch.randint(lo, hi + 1, (n, per_row), generator=gen)
    rules = torch.tensor(RULES, dtype=torch.int64)[torch.randint(len(RULES), (n, per_row), generator=gen)]
    mod = vocab_size - 1
    state = torch.randint(mod, (n, per_row), generator=gen)
    # Every document's tokens up to the longest length, one vectorised step at a time.
    table = torch.empty(n, per_row, hi + 1, dtype=torch.int64)
    for t in range(hi + 1):
        table[:, :, t] = state + 1
        state = (rules[..., 0] * state + rules[..., 1]) % mod
    ends = torch.cumsum(content + 1, dim=1)             # exclusive end of each doc incl. its EOS
    pos = torch.arange(length).repeat(n, 1)
    doc = torch.searchsorted(ends, pos, right=True)
    start = torch.where(doc > 0, ends.gather(1, (doc - 1).clamp(min=0)), 0)
    offset = pos - start
    tokens = table[torch.arange(n)[:, None], doc, offset.clamp(max=hi)]
    tokens = torch.where(offset == content.gather(1, doc), EOS, tokens)
    return _packed(tokens)


class TokenFileDataset:
    """A flat token file, memory-mapped read-only; see the module docstring for the format."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        dtype = TOKEN_FILE_DTYPES.get(self.path.suffix)
        if dtype is None:
            raise ValueError(f"token file {self.path}: unknown suffix {self.path.suffix!r}; "
                             f"expected one of {sorted(TOKEN_FILE_DTYPES)}")
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise ValueError(f"token file {self.path}: cannot read it ({exc.strerror})") from exc
        itemsize = np.dtype(dtype).itemsize
        if size == 0 or size % itemsize:
            raise ValueError(f"token file {self.path}: {size} bytes is not a whole, non-zero "
                             f"number of {np.dtype(dtype).name} tokens")
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def position(step: int, rank: int, dp_size: int, batch_size: int) -> int:
        """First window of ``rank`` at ``step``: ranks and steps tile the windows in order."""
        return (step * dp_size + rank) * batch_size

    def n_windows(self, seq_len: int) -> int:
        return (len(self.tokens) - 1) // seq_len

    def batch_at(self, position: int, batch_size: int, seq_len: int, vocab_size: int) -> Batch:
        """Windows ``position .. position + batch_size - 1`` (modulo the window count)."""
        n_windows = self.n_windows(seq_len)
        if n_windows < 1:
            raise ValueError(f"token file {self.path}: {len(self.tokens)} tokens, fewer than "
                             f"seq_len + 1 ({seq_len + 1})")
        rows = []
        for w in range(position, position + batch_size):
            start = (w % n_windows) * seq_len
            rows.append(np.asarray(self.tokens[start:start + seq_len + 1], dtype=np.int64))
        tokens = torch.from_numpy(np.stack(rows))
        top = int(tokens.max())
        if top >= vocab_size:
            raise ValueError(f"token file {self.path}: token id {top} >= vocab_size ({vocab_size})")
        return _packed(tokens, position)


@functools.lru_cache(maxsize=4)
def open_token_file(path: str) -> TokenFileDataset:
    """The (cached) dataset of ``path``: a training loop reads one file every step."""
    return TokenFileDataset(path)
