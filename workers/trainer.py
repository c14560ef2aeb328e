"""One rank's training machinery: model, parallelism, optimizer, schedule, checkpoints.

``Trainer`` is built once the process group is up and owns everything a step needs:

* the Llama-4-style model (workers/model.py), FP8 when the model args ask for it,
  activation checkpointing per block when the recipe asks for it;
* data and expert parallelism (workers/parallel.py: FSDP2 or DDP over all ranks,
  experts sharded over the expert-parallel group);
* AdamW with fp32 master weights and fp32 optimizer state (FP8 copies of weights and
  activations exist only inside a matmul; keeping the master copy and both Adam
  moments in fp32 is what makes FP8 training track the high-precision loss);
* the learning-rate schedule, gradient accumulation and clipping;
* checkpoints (workers/checkpoint.py), asynchronous by default.

Every step ends with one all-reduce of a small float64 vector over all ranks that carries
the loss, the router loss, a stop vote, a "my checkpoint write is done" flag and the
routed-token count of every expert of every MoE layer. Folding them into one collective
means a stop command or a checkpoint commit takes effect on every rank after the same
step, and MoE router biases stay identical everywhere, without extra synchronisation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fleet.workers import checkpoint, data, flops, metrics, parallel, snapshot
from fleet.workers.failures import NonFiniteLossError
from fleet.workers.model import Transformer
from fleet.workers.recorder import FlightRecorder
from fleet.workers.schedule import lr_at
from fleet.workers.spec import WorkerSpec

log = logging.getLogger(__name__)

#: Router-bias step for loss-free balancing ("bias" mode), per optimizer step.
BIAS_UPDATE_RATE = 1e-3

#: Slots of the per-step stats vector before the per-rank flags: loss, router loss, stop
#: vote, checkpoint-written flag.
_STATS_HEAD = 4


@dataclass
class StepResult:
    """What one optimizer step produced (global values are the same on every rank)."""

    step: int
    loss: float                  # global mean of the language-model loss
    aux_loss: float              # global mean of the weighted router loss
    grad_norm: float             # before clipping
    lr: float
    step_time_s: float
    tokens: int                  # tokens this rank processed
    stop: bool                   # some rank was asked to stop
    expert_load: list[metrics.ExpertLoadStat] = field(default_factory=list)
    committed: tuple[int, str, str, float] | None = None  # (step, path, sha, save_s) on rank 0


class Trainer:
    """Builds and trains one rank's share of the model (collective construction)."""

    def __init__(self, spec: WorkerSpec, recorder: FlightRecorder, device: torch.device) -> None:
        self.spec = spec
        self.train = spec.train
        self.args = spec.model
        self.recorder = recorder
        self.device = device
        self.meshes = parallel.build_meshes(spec.world_size, self.train.ep_size, self.args.n_experts,
                                            device_type=device.type)
        ep_group = self.meshes.ep_group if self.train.ep_size > 1 else None
        model = Transformer(self.args, seed=self.train.seed, ep_group=ep_group).to(device)
        self.moe = model.moe_layers()  # before any wrapping hides the blocks' types
        self.moe_layer_ids = [i for i in range(self.args.n_layers) if self.args.is_moe_layer(i)]
        if self.train.activation_checkpointing:
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        self.model = parallel.parallelize(model, self.meshes, self.train.data_parallel)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.train.lr, weight_decay=self.train.weight_decay)
        self.flops_per_token = flops.flops_per_token(self.args, self.train.seq_len)
        self.peak_flops = metrics.peak_flops(device)
        self.ckpt: checkpoint.AsyncCheckpointer | None = None
        self._pending_save_s = 0.0
        self._data_position: int | None = None  # token-file window of the last micro-batch
        # in-memory snapshots (workers/snapshot.py): replicated state can come from any rank
        self.replicated = self.train.data_parallel == "ddp" and self.train.ep_size == 1
        self.layout = (spec.job_id, repr(self.args), self.train.data_parallel, self.train.ep_size,
                       0 if self.replicated else spec.world_size, -1 if self.replicated else spec.rank)
        self.snapshots = self.train.memory_snapshots
        self._live: list[torch.Tensor] = []
        self.restored_from = ""  # "memory", "memory from rank N", "disk" or "" (fresh)
        #: rank 0: checkpoints ``restore`` found failing verification (to be reported)
        self.invalid_checkpoints: list[checkpoint.InvalidCheckpoint] = []
        #: called with (step, micro-batch loss) -> loss; fault injection's NaN hook
        self.loss_hook = None

    # -- checkpoints ------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest state every rank can get, on every rank; its step or 0.

        One all-reduce tells every rank each rank's newest in-memory snapshot and rank 0's
        newest valid checkpoint on disk; every rank then makes the same choice: memory
        when it is at least as new as the disk (for replicated state from the lowest rank
        holding the newest snapshot, by broadcast; for sharded state only when every rank
        holds its own shard of the same step), else the disk checkpoint, else a fresh start.
        """
        world, rank = self.spec.world_size, self.spec.rank
        holder = snapshot.holder()
        holder.forget_other_jobs(self.spec.job_id)
        snapshot.ensure_adam_state(self.optimizer)
        mine = holder.newest(self.layout) if self.snapshots else None
        info = torch.zeros(world + 1, dtype=torch.int64, device=self.device)
        info[rank] = mine.step if mine is not None else 0
        if rank == 0:
            found = checkpoint.latest_valid(self.spec.checkpoint_dir, skipped=self.invalid_checkpoints)
            if found is not None:
                info[world] = found[0]
        self.recorder.all_reduce(info)
        mem = [int(x) for x in info[:world].tolist()]
        disk = int(info[world].item())
        step = 0
        if self.replicated and max(mem) > 0 and max(mem) >= disk:
            step = max(mem)
            self._restore_replicated(step, src=mem.index(step))
        elif not self.replicated and min(mem) > 0 and max(mem) - min(mem) <= 1 and min(mem) >= disk:
            step = min(mem)
            self._restore_own_shard(step)
        elif disk:
            step = disk
            self._restore_disk(step)
        self._live = snapshot.state_tensors(self.model, self.optimizer)
        if self.train.checkpoint_interval > 0:
            self.ckpt = checkpoint.AsyncCheckpointer(
                self.spec.checkpoint_dir, keep=self.train.keep_checkpoints, resume_step=step,
                timeout=timedelta(seconds=self.spec.pg_timeout_s),
                ep_rank=self.meshes.ep_rank, ep_size=self.train.ep_size)
        log.info("rank %d: restored step %d (%s)", rank, step, self.restored_from or "fresh start")
        return step

    def _restore_disk(self, step: int) -> None:
        path = checkpoint.step_path(self.spec.checkpoint_dir, step)
        loaded, extra = checkpoint.load(path, self.model, self.optimizer,
                                        ep_rank=self.meshes.ep_rank, ep_size=self.train.ep_size)
        if loaded != step:
            raise RuntimeError(f"checkpoint {path} holds step {loaded}, expected {step}")
        for layer, bias in zip(self.moe, extra.get("router_bias", []), strict=False):
            layer.expert_bias.copy_(bias)
        self._data_position = extra.get(checkpoint.DATA_POSITION)
        self.restored_from = "disk"

    def _restore_own_shard(self, step: int) -> None:
        snap = snapshot.holder().get(self.layout, step)
        if snap is None:  # cannot happen: snapshots are kept for the last two steps
            raise RuntimeError(f"rank {self.spec.rank} lost its in-memory snapshot of step {step}")
        snapshot.restore_into(snapshot.state_tensors(self.model, self.optimizer), snap)
        self._data_position = snap.data_position
        self.restored_from = "memory"

    def _restore_replicated(self, step: int, src: int) -> None:
        """Every rank gets rank ``src``'s snapshot of ``step``: one broadcast per dtype."""
        live = snapshot.state_tensors(self.model, self.optimizer)
        snap = snapshot.holder().get(self.layout, step) if self.spec.rank == src else None
        for dtype, idx in snapshot.flat_groups(live).items():
            numel = sum(live[i].numel() for i in idx)
            if snap is not None:
                flat = torch.cat([snap.tensors[i].reshape(-1) for i in idx]).to(self.device)
            else:
                flat = torch.empty(numel, dtype=dtype, device=self.device)
            self.recorder.broadcast(flat, src=src)
            with torch.no_grad():
                offset = 0
                for i in idx:
                    n = live[i].numel()
                    live[i].copy_(flat[offset:offset + n].view_as(live[i]))
                    offset += n
        if snap is not None:
            torch.set_rng_state(snap.rng)
            self._data_position = snap.data_position
        self.restored_from = "memory" if self.spec.rank == src else f"memory from rank {src}"

    def _extra(self) -> dict:
        return {"router_bias": [layer.expert_bias.detach().cpu().clone() for layer in self.moe]}

    def _save_due(self, step: int, stopping: bool) -> bool:
        interval = self.train.checkpoint_interval
        return interval > 0 and (step % interval == 0 or step == self.train.steps or stopping)

    def _start_save(self, step: int) -> None:
        assert self.ckpt is not None
        self._pending_save_s = self.ckpt.start(step, self.model, self.optimizer, extra=self._extra(),
                                               data_position=self._data_position)
        if not self.train.async_checkpoint:
            # synchronous mode: the loop waits for the write itself
            t0 = time.perf_counter()
            self.ckpt.wait_local(timeout_s=self.spec.pg_timeout_s)
            self._pending_save_s += time.perf_counter() - t0

    def _commit(self, wait: bool) -> tuple[int, str, str, float]:
        """Commit the save in flight on every rank; ``wait``: first let it land everywhere
        (otherwise the step's all-reduce already said every rank is done)."""
        assert self.ckpt is not None and self.ckpt.step is not None
        if wait:
            self.ckpt.wait_local(timeout_s=self.spec.pg_timeout_s)
            self.recorder.barrier()  # every rank's part is on disk
        step = self.ckpt.step
        path, sha = self.ckpt.commit(step)
        return step, path, sha, self._pending_save_s

    def finish_checkpoints(self) -> tuple[int, str, str, float] | None:
        """End of training: wait for the save in flight, then commit it everywhere."""
        if self.ckpt is None or self.ckpt.step is None:
            return None
        return self._commit(wait=True)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()

    # -- one optimizer step -----------------------------------------------------------

    def step(self, step: int, stop_requested: bool) -> StepResult:
        t0 = time.perf_counter()
        train, world = self.train, self.spec.world_size
        lr = lr_at(train, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n_experts = self.args.n_experts
        counts = torch.zeros(len(self.moe), max(n_experts, 1), dtype=torch.float64)
        loss_sum = aux_sum = 0.0
        accum = train.grad_accum_steps
        for micro in range(accum):
            # every micro-batch of every step reads its own, reproducible data
            b = data.batch(train, self.args.vocab_size, (step - 1) * accum + micro + 1,
                           self.spec.rank, dp_size=world)
            self._data_position = b.position
            inputs, targets, doc_ids = (t.to(self.device) for t in (b.inputs, b.targets, b.doc_ids))
            with self._autocast():
                logits = self.model(inputs, doc_ids)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                       ignore_index=data.IGNORE)
                if self.loss_hook is not None:
                    loss = self.loss_hook(step, loss)
                aux = self._aux_loss()
            ((loss + aux) / accum).backward()
            loss_sum += loss.item() / accum
            aux_sum += aux.detach().item() / accum
            for i, layer in enumerate(self.moe):
                counts[i] += layer.last_tokens_per_expert.double().cpu()
        if train.data_parallel == "ddp":
            parallel.sync_expert_grads(self.model, self.meshes)
        grad_norm = parallel.clip_grad_norm_(self.model, train.grad_clip, self.meshes)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        save_done = self.ckpt is not None and self.ckpt.poll_local_done()
        nonfinite = torch.zeros(world, dtype=torch.float64)
        nonfinite[self.spec.rank] = float(not math.isfinite(loss_sum))
        stats = torch.cat([
            torch.tensor([loss_sum, aux_sum, float(stop_requested), float(save_done)],
                         dtype=torch.float64),
            nonfinite,
            counts.flatten(),
        ]).to(self.device)
        self.recorder.all_reduce(stats)
        stats = stats.cpu()
        bad = [r for r in range(world) if stats[_STATS_HEAD + r].item() > 0]
        if bad or not math.isfinite(stats[0].item()):
            # before any snapshot or checkpoint of this step: the last good state stays newest
            raise NonFiniteLossError(step, bad)
        stop = stats[2].item() > 0
        committed = None
        if self.ckpt is not None and self.ckpt.step is not None and int(stats[3].item()) == world:
            committed = self._commit(wait=False)
        global_counts = stats[_STATS_HEAD + world:].view(len(self.moe), -1)
        if self.args.load_balance == "bias":
            for layer, c in zip(self.moe, global_counts, strict=True):
                layer.update_bias(BIAS_UPDATE_RATE, c)
        loads = [metrics.expert_load(layer_id, [int(x) for x in c.tolist()])
                 for layer_id, c in zip(self.moe_layer_ids, global_counts, strict=True)]
        if self._save_due(step, stop):
            if self.ckpt.step is not None:
                committed = self._commit(wait=True)  # the previous save must land first
            self._start_save(step)
        if self.snapshots:
            snapshot.holder().take(self.layout, step, self._live, self._data_position)
        return StepResult(
            step=step, loss=stats[0].item() / world, aux_loss=stats[1].item() / world,
            grad_norm=grad_norm, lr=lr, step_time_s=time.perf_counter() - t0,
            tokens=train.batch_size * train.seq_len * accum, stop=stop, expert_load=loads,
            committed=committed,
        )

    def _aux_loss(self) -> torch.Tensor:
        """Weighted router loss of the last forward (0 without MoE or in "bias" mode)."""
        if self.args.load_balance != "aux_loss" or not self.moe:
            return torch.zeros((), device=self.device)
        return self.args.aux_loss_coef * sum(layer.last_aux_loss for layer in self.moe)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # GPUs run the high-precision parts in bf16 (FP8 linears cast for themselves);
        # on CPU everything not FP8 stays fp32, which is what the tests compare against.
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def pick_device(local_rank: int) -> torch.device:
    """cuda:<local_rank> when a GPU is visible, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for GPU tensors, with gloo alongside for CPU-side collectives; gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
