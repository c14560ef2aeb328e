"""In-memory snapshots of a rank's training state, taken after every step, for restarts
that lose at most the step in flight.

A snapshot is a CPU copy of every tensor a step changes: parameters, buffers (MoE router
biases), AdamW's state (step, both moments) and the RNG state, plus the step and data
position. It is taken right after the step's closing all-reduce succeeded, so snapshot
``S`` means "every rank finished step S". The copy goes into buffers allocated once, with
one fused ``torch._foreach_copy_``: no allocation per step, ~1 ms per 10 MB.

Snapshots live in the worker *process* (``holder()``), not in the ``Trainer``: a worker
process that survives a failed attempt (fleet restarts the attempt in-process) still has
them when the next attempt restores.

Where the state is replicated (DDP without expert parallelism) every rank's snapshot is
the same bytes, so the ranks on other nodes are the peer copies: a replacement rank
receives the newest one by broadcast from a surviving rank. Sharded state (FSDP, expert
parallelism) is restored from memory only when every rank still holds its own shard;
otherwise the restore falls back to the newest valid checkpoint on disk.

Invariants:
  * A snapshot is used only by a trainer with the same ``layout`` key (job, model
    shape, parallel layout, and for sharded state the world size and rank).
  * The two newest snapshots are kept: ranks may disagree by one step about the last
    finished step when a failure cuts a collective half way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import nn

#: Snapshots kept per layout.
KEEP = 2


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's per-parameter state (zeros, step 0) where it does not exist yet, as
    its first ``step()`` would, so that a fresh optimizer has the tensors a snapshot
    restores into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the training state, local shards, in a fixed order."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(local(p.data))
    for _, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        out.append(local(b))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    out.append(local(state[key]))
    return out


@dataclass
class Snapshot:
    step: int
    data_position: int | None
    rng: torch.Tensor
    tensors: list[torch.Tensor] = field(default_factory=list)


class SnapshotHolder:
    """This process's snapshots, by layout key (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_layout: dict[tuple, list[Snapshot]] = {}

    def take(self, layout: tuple, step: int, live: list[torch.Tensor], data_position: int | None) -> None:
        """Copy ``live`` as the snapshot of ``step`` (reusing the oldest buffers)."""
        with self._lock:
            kept = self._by_layout.setdefault(layout, [])
            if len(kept) >= KEEP and _same_shapes(kept[0].tensors, live):
                snap = kept.pop(0)
            else:
                if len(kept) >= KEEP:
                    kept.pop(0)
                snap = Snapshot(0, None, torch.empty(0), [torch.empty_like(t, device="cpu") for t in live])
            torch._foreach_copy_(snap.tensors, live)
            snap.step, snap.data_position, snap.rng = step, data_position, torch.get_rng_state()
            kept.append(snap)

    def newest(self, layout: tuple) -> Snapshot | None:
        with self._lock:
            kept = self._by_layout.get(layout)
            return kept[-1] if kept else None

    def get(self, layout: tuple, step: int) -> Snapshot | None:
        with self._lock:
            return next((s for s in self._by_layout.get(layout, []) if s.step == step), None)

    def forget_other_jobs(self, job_id: str) -> None:
        """Drop snapshots of other jobs (a reused process must not hold them forever)."""
        with self._lock:
            for key in [k for k in self._by_layout if k[0] != job_id]:
                del self._by_layout[key]

    def clear(self) -> None:
        with self._lock:
            self._by_layout.clear()


def _same_shapes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b, strict=True))


_HOLDER = SnapshotHolder()


def holder() -> SnapshotHolder:
    """The snapshots of this process (they outlive one attempt's Trainer)."""
    return _HOLDER


def restore_into(live: list[torch.Tensor], snap: Snapshot) -> None:
    """Copy a snapshot back into the live tensors, RNG state included."""
    if not _same_shapes(snap.tensors, live):
        raise RuntimeError("in-memory snapshot does not match this trainer's state layout")
    with torch.no_grad():
        torch._foreach_copy_(live, snap.tensors)
    torch.set_rng_state(snap.rng)


def flat_groups(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indexes of ``tensors`` by dtype, for packing into one flat buffer per dtype."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups
