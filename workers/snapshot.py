"""In-memory snapshots of a rank's training state, taken after every step, for restarts
that lose at most the step in flight.

A snapshot is a CPU copy of every tensor a step changes: parameters, buffers (MoE router
biases), AdamW's state (step, both moments) and the RNG state, plus the step and data
position. It is staged (copied) right after the optimizer step and committed once the
step's closing all-reduce succeeded, so a committed snapshot ``S`` means "every rank
finished step S". The copy goes into buffers allocated once (``FlatState``: one buffer
of 64-bit words per tensor group and dtype, which is also what SDC fingerprints sum),
with one fused ``torch._foreach_copy_``: no allocation per step, ~1 ms per 10 MB.

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
    finished step when a failure cuts a collective half way. So is the newest one whose
    SDC check passed (``verified``), however old: triage replays from it, and after a
    persistent fault the next attempt restores it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

#: Snapshots kept per layout.
KEEP = 2


def sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (duck-typed: torch.distributed.tensor is not imported)."""
    return getattr(t, "to_local", None) is not None


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if sharded(t) else t


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
            state["exp_avg"] = zeros_like(p)
            state["exp_avg_sq"] = zeros_like(p)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = zeros_like(p)


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """Zeros shaped and placed as ``t``. A DTensor's are built from zeros of its local
    shard: ``torch.zeros_like`` of a DTensor goes through DTensor's sharding propagation,
    which a fresh process (a restart's replacement rank) works out once per shape, on the
    restore's critical path."""
    if not sharded(t):
        return torch.zeros_like(t, memory_format=torch.preserve_format)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(torch.zeros_like(local(t), memory_format=torch.preserve_format), t.device_mesh,
                              t.placements, run_check=False, shape=t.shape, stride=t.stride())


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


class FlatState:
    """Copies of a list of tensors packed into one buffer of 64-bit words per (group, dtype).

    ``tensors[i]`` is a CPU view shaped like the i-th tensor it was built for; ``words``
    holds ``(group, int64 buffer)`` pairs, zero-padded to whole words. Allocated once and
    refilled with one fused copy, the packed words let a fingerprint sum a whole group of
    tensors' bits in one call (workers/sdc.py) instead of once per tensor.
    """

    def __init__(self, like: list[torch.Tensor], groups: list[int] | None = None) -> None:
        groups = groups if groups is not None else [0] * len(like)
        if len(groups) != len(like):
            raise ValueError(f"{len(groups)} group numbers for {len(like)} tensors")
        by_key: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, (t, g) in enumerate(zip(like, groups, strict=True)):
            by_key.setdefault((g, t.dtype), []).append(i)
        self.tensors: list[torch.Tensor] = [torch.empty(0)] * len(like)
        self.words: list[tuple[int, torch.Tensor]] = []
        for (group, dtype), idx in by_key.items():
            size = torch.empty((), dtype=dtype).element_size()
            nbytes = sum(like[i].numel() for i in idx) * size
            buf = torch.zeros((nbytes + 7) // 8, dtype=torch.int64)
            flat = buf.view(dtype)
            offset = 0
            for i in idx:
                n = like[i].numel()
                self.tensors[i] = flat[offset:offset + n].view(like[i].shape)
                offset += n
            self.words.append((group, buf))

    def copy_from(self, live: list[torch.Tensor]) -> None:
        torch._foreach_copy_(self.tensors, live)

    def group_sums(self, n_groups: int) -> list[int]:
        """Per group, the sum of its 64-bit words as a Python int (int64 wrap-around)."""
        out = [0] * n_groups
        for group, buf in self.words:
            out[group] += int(buf.sum().item())
        return out


@dataclass
class Snapshot:
    step: int
    data_position: int | None
    rng: torch.Tensor
    state: FlatState
    #: this rank's fingerprint of the state (workers/sdc.py), when a check covered it
    digests: tuple[int, ...] | None = None
    #: the check of this step found every copy of the state equal
    verified: bool = False

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.state.tensors


class SnapshotHolder:
    """This process's snapshots, by layout key (thread-safe).

    A snapshot is taken in two parts: ``stage`` copies the state into a free buffer
    (before the step's closing all-reduce, so a fingerprint can be read from the copy),
    ``commit`` makes it the newest once the all-reduce succeeded. Kept per layout: the
    ``KEEP`` newest and, when older, the newest verified one (SDC triage replays from it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_layout: dict[tuple, list[Snapshot]] = {}
        self._spare: dict[tuple, Snapshot] = {}

    def stage(self, layout: tuple, step: int, live: list[torch.Tensor], data_position: int | None,
              groups: list[int] | None = None) -> Snapshot:
        """Copy ``live`` as the (not yet committed) snapshot of ``step``, reusing the buffers
        of a snapshot the commit will drop when there is one."""
        with self._lock:
            kept = self._by_layout.setdefault(layout, [])
            snap = None
            if len(kept) >= KEEP:
                protected = (kept[-1], _newest_verified(kept))
                victim = next((s for s in kept if all(s is not p for p in protected)), None)
                if victim is not None and _same_shapes(victim.tensors, live):
                    kept.remove(victim)
                    snap = victim
            if snap is None:
                spare = self._spare.pop(layout, None)
                if spare is not None and _same_shapes(spare.tensors, live):
                    snap = spare
            if snap is None:
                snap = Snapshot(0, None, torch.empty(0), FlatState(live, groups))
        snap.state.copy_from(live)
        snap.step, snap.data_position, snap.rng = step, data_position, torch.get_rng_state()
        snap.digests, snap.verified = None, False
        return snap

    def commit(self, layout: tuple, snap: Snapshot) -> None:
        """Make a staged snapshot the newest (replacing one of the same step)."""
        with self._lock:
            kept = self._by_layout.setdefault(layout, [])
            for old in [s for s in kept if s.step >= snap.step and s is not snap]:
                kept.remove(old)
                self._spare[layout] = old
            if snap not in kept:
                kept.append(snap)
            self._trim(layout, kept)

    def take(self, layout: tuple, step: int, live: list[torch.Tensor], data_position: int | None) -> None:
        """Copy ``live`` as the snapshot of ``step`` and commit it at once."""
        self.commit(layout, self.stage(layout, step, live, data_position))

    def _trim(self, layout: tuple, kept: list[Snapshot]) -> None:
        verified = _newest_verified(kept)
        while len(kept) > KEEP:
            victim = next((s for s in kept[:-KEEP] if s is not verified), None)
            if victim is None:
                break
            kept.remove(victim)
            self._spare[layout] = victim

    def newest(self, layout: tuple, at_most: int = 0) -> Snapshot | None:
        """The newest snapshot (no newer than ``at_most`` when that is > 0)."""
        with self._lock:
            kept = [s for s in self._by_layout.get(layout, []) if at_most <= 0 or s.step <= at_most]
            return kept[-1] if kept else None

    def steps(self, layout: tuple, at_most: int = 0) -> list[int]:
        """The steps held for ``layout`` (no newer than ``at_most`` when > 0), newest first."""
        with self._lock:
            return sorted((s.step for s in self._by_layout.get(layout, []) if at_most <= 0 or s.step <= at_most),
                          reverse=True)

    def newest_verified(self, layout: tuple, before: int = 0) -> Snapshot | None:
        """The newest snapshot whose check passed (older than step ``before`` when > 0)."""
        with self._lock:
            kept = [s for s in self._by_layout.get(layout, []) if before <= 0 or s.step < before]
            return _newest_verified(kept)

    def get(self, layout: tuple, step: int) -> Snapshot | None:
        with self._lock:
            return next((s for s in self._by_layout.get(layout, []) if s.step == step), None)

    def drop_newer(self, layout: tuple, step: int) -> None:
        """Forget the snapshots newer than ``step`` (they hold corrupted state)."""
        with self._lock:
            kept = self._by_layout.get(layout, [])
            for s in [s for s in kept if s.step > step]:
                kept.remove(s)
                self._spare[layout] = s

    def forget_other_jobs(self, job_id: str) -> None:
        """Drop snapshots of other jobs (a reused process must not hold them forever)."""
        with self._lock:
            for key in [k for k in self._by_layout if k[0] != job_id]:
                del self._by_layout[key]
            for key in [k for k in self._spare if k[0] != job_id]:
                del self._spare[key]

    def clear(self) -> None:
        with self._lock:
            self._by_layout.clear()
            self._spare.clear()

    def nbytes(self) -> int:
        """Bytes held in snapshots and spare buffers."""
        with self._lock:
            snaps = [s for kept in self._by_layout.values() for s in kept] + list(self._spare.values())
        return sum(sum(w.numel() * 8 for _, w in s.state.words) + s.rng.numel() for s in snaps)


def _newest_verified(kept: list[Snapshot]) -> Snapshot | None:
    return next((s for s in reversed(kept) if s.verified), None)


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
