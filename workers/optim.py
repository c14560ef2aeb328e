"""AdamW that steps the tensors a rank holds, not DTensors.

With FSDP2 every parameter, gradient and Adam moment is a DTensor, and torch's AdamW
runs a dozen pointwise DTensor operations per parameter per step. Each one goes through
DTensor's dispatch, and the first time a process meets an (operator, placement, shape)
DTensor works out the output's sharding with fake tensors. On the tiny model on 4 gloo
ranks that was 15-20 % of every step, and 0.2-0.3 s of the first step of every fresh
process: the first step after a restart, which every rank waits for, ran 0.45-0.60 s
against a median of 0.25 s.

AdamW's update is elementwise, so a rank can apply it to its local shards directly:
``LocalAdamW`` gathers the same lists torch's AdamW would (``_init_group``) and hands the
update the local tensors behind them. The arithmetic is the same operation on the same
values (one tensor at a time, as torch does for DTensors, also where it would run its
foreach kernels on plain GPU tensors), so the result is bit for bit what the DTensor path
computes. The optimizer's state stays keyed by the DTensor parameters and holds DTensor
moments, so its ``state_dict``, checkpoints and in-memory snapshots are unchanged. Plain
tensors (DDP) pass through untouched.
"""

from __future__ import annotations

import torch

from fleet.workers.snapshot import local, sharded


class LocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose update runs on each tensor's local shard."""

    def _init_group(self, group, *lists):  # noqa: ANN001, ANN002, ANN202 - torch's own signature
        if group["foreach"] is None and group["fused"] is None and any(sharded(p) for p in group["params"]):
            # torch runs its one-tensor-at-a-time update for DTensor parameters (not a type its
            # foreach kernels take) and its foreach one for plain CUDA tensors: the shards keep
            # the DTensors' choice, and so their bits, on every device (set here, every step:
            # loading a state_dict resets the groups' options)
            group["foreach"] = False
        # torch 2.6's AdamW takes an extra ``amsgrad`` flag among the lists: only lists are mapped
        has_complex = super()._init_group(group, *lists)
        for found in lists:
            if isinstance(found, list):
                found[:] = [local(t) for t in found]
        return has_complex
