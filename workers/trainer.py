"""One rank's training machinery: model, parallelism, optimizer, schedule, checkpoints.

``Trainer`` is built once the process group is up and owns everything a step needs:

* the Llama-4-style model (workers/model.py), FP8 when the model args ask for it,
  activation checkpointing per block when the recipe asks for it;
* data and expert parallelism (workers/parallel.py: FSDP2 or DDP over all ranks,
  experts sharded over the expert-parallel group);
* AdamW (workers/optim.py: it updates each rank's local shards) with fp32 master
  weights and fp32 optimizer state (FP8 copies of weights and activations exist only
  inside a matmul; keeping the master copy and both Adam moments in fp32 is what makes
  FP8 training track the high-precision loss);
* the learning-rate schedule, gradient accumulation and clipping;
* checkpoints (workers/checkpoint.py), asynchronous by default.

Every step ends with one all-reduce of a small float64 vector over all ranks that carries
the loss, the router loss, a stop vote, a "my checkpoint write is done" flag, a
non-finite-loss flag and an update-size vote per rank, the routed-token count of every
expert of every MoE layer, and on SDC check steps every rank's fingerprint digests.
Folding them into one collective means a stop command or a checkpoint commit takes
effect on every rank after the same step, MoE router biases stay identical everywhere,
and every rank sees every copy's fingerprint, without extra synchronisation.

Silent data corruption (workers/sdc.py): on a check step (every ``sdc_check_interval``
steps, every checkpoint step, and a step a trigger forced) the copies that must be
identical are compared; a mismatch, or a trigger whose check found none, is triaged on
every rank together by re-executing the steps since the newest verified in-memory
snapshot. Transient, ambiguous (once) and clean verdicts continue on the replayed state;
a persistent one (or an ambiguous one again) raises ``SdcError`` on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fleet.proto import events_pb2
from fleet.workers import buddy, checkpoint, data, flops, metrics, parallel, sdc, snapshot
from fleet.workers.failures import NonFiniteLossError, SdcError
from fleet.workers.faults import FaultHooks
from fleet.workers.model import Transformer
from fleet.workers.moe import MoE
from fleet.workers.optim import LocalAdamW
from fleet.workers.recorder import FlightRecorder
from fleet.workers.schedule import lr_at
from fleet.workers.spec import WorkerSpec

log = logging.getLogger(__name__)

#: Router-bias step for loss-free balancing ("bias" mode), per optimizer step.
BIAS_UPDATE_RATE = 1e-3

#: Slots of the per-step stats vector before the per-rank flags: loss, router loss, stop
#: vote, checkpoint-written flag.
_STATS_HEAD = 4
#: Local losses kept per rank for a triage to compare its replay with (steps).
_LOSS_HISTORY = sdc.MAX_REPLAY_STEPS + 2


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


@dataclass
class _Local:
    """One rank's part of a step before the closing all-reduce."""

    loss: float                  # this rank's mean language-model loss over its micro-batches
    aux: float
    logits: int                  # the bits of this rank's logits, summed (what a replay compares)
    counts: torch.Tensor         # routed tokens per (MoE layer, expert)
    grad_norm: float
    lr: float


@dataclass
class _Reduced:
    """The closing all-reduce of a step, parsed (the same on every rank)."""

    loss_sum: float
    aux_sum: float
    stop: bool
    saves_done: int
    nonfinite: list[int]         # ranks whose own loss was not finite
    voters: list[int]            # ranks whose update size tripped the trigger
    counts: torch.Tensor         # global routed tokens [MoE layer, expert]
    lanes: list[tuple[int, ...]] | None  # every rank's digests (check steps)
    changed: list[int]           # replays: ranks whose local loss differed from the original


class Trainer:
    """Builds and trains one rank's share of the model (collective construction)."""

    def __init__(self, spec: WorkerSpec, recorder: FlightRecorder, device: torch.device) -> None:
        self.spec = spec
        self.train = spec.train
        self.args = spec.model
        self.recorder = recorder
        self.device = device
        mesh_kwargs = {"ranks_per_node": spec.local_world_size} if self.train.data_parallel == "hsdp" else {}
        self.meshes = parallel.build_meshes(spec.world_size, self.train.ep_size, self.args.n_experts,
                                            device_type=device.type, **mesh_kwargs)
        ep_group = self.meshes.ep_group if self.train.ep_size > 1 else None
        model = Transformer(self.args, seed=self.train.seed, ep_group=ep_group).to(device)
        self.moe = model.moe_layers()  # before any wrapping hides the blocks' types
        self.moe_layer_ids = [i for i in range(self.args.n_layers) if self.args.is_moe_layer(i)]
        # where an activation fault can strike: every Linear and MoE output
        self._act_modules = [m for m in model.modules() if isinstance(m, (nn.Linear, MoE))]
        if self.train.activation_checkpointing:
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        self.model = parallel.parallelize(model, self.meshes, self.train.data_parallel)
        if self.train.data_parallel == "ddp" and spec.world_size > 2:
            self._settle_ddp_buckets()
        self.optimizer = LocalAdamW(self.model.parameters(), lr=self.train.lr, weight_decay=self.train.weight_decay)
        self.flops_per_token = flops.flops_per_token(self.args, self.train.seq_len)
        self.peak_flops = metrics.peak_flops(device)
        self.ckpt: checkpoint.AsyncCheckpointer | None = None
        self._pending_save_s = 0.0
        self._data_position: int | None = None  # token-file window of the last micro-batch
        # in-memory snapshots (workers/snapshot.py): replicated state can come from any rank
        self.replicated = self.train.data_parallel == "ddp" and self.train.ep_size == 1
        self.layout = (spec.job_id, repr(self.args), self.train.data_parallel, self.train.ep_size,
                       0 if self.replicated else spec.world_size, -1 if self.replicated else spec.rank)
        self.snapshots = self.train.memory_snapshots != "off"
        # peer copies (workers/buddy.py): a sharded rank's snapshot also lives on another node
        self.buddies = buddy.Buddies(spec.rank, spec.local_world_size, spec.group_rank, spec.group_world_size)
        self.peers: buddy.PeerLink | None = None
        if (self.train.memory_snapshots == "peer" and self.train.sharded and self.buddies.active
                and spec.world_size == spec.local_world_size * spec.group_world_size):
            ward_layout = (*self.layout[:-1], self.buddies.ward)
            self.peers = buddy.PeerLink(self.buddies, dist.new_group(backend="gloo",
                                        timeout=timedelta(seconds=spec.pg_timeout_s)),
                                        self.layout, ward_layout, timedelta(seconds=spec.pg_timeout_s))
        #: why the restore could not come from memory ("" when it did, or nothing was there)
        self.restore_reason = ""
        self._live: list[torch.Tensor] = []
        #: "memory", "memory from rank N", "peer copy from rank N", "disk", "disk: <why not memory>"
        #: or "" (a fresh start)
        self.restored_from = ""
        #: rank 0: checkpoints ``restore`` found failing verification (to be reported)
        self.invalid_checkpoints: list[checkpoint.InvalidCheckpoint] = []
        #: called with (step, micro-batch loss) -> loss; fault injection's NaN hook
        self.loss_hook = None
        #: injected faults (workers/faults.py): sdc faults fire inside the step
        self.faults: FaultHooks | None = None
        # -- silent data corruption (workers/sdc.py) --
        #: ships an event (the reporter's ``emit``); None drops them
        self.emit: Callable[[events_pb2.Event], None] | None = None
        #: sends what was emitted before a rank raises SdcError (bounded)
        self.flush: Callable[[], None] | None = None
        self.sdc_interval = spec.sdc_check_interval
        self.triggers = sdc.Triggers(spec.sdc_trigger_factor)
        self.sets = parallel.replica_sets(self.meshes, self.train.data_parallel)
        self.sdc_log: list[dict] = []    # one record per triage (run()'s "sdc")
        self.sdc_check_s = 0.0           # seconds spent fingerprinting and comparing
        self.sdc_triage_s = 0.0          # seconds spent re-executing steps in triage
        self._forced: dict[int, sdc.Trigger] = {}   # step -> the trigger that forces its check
        #: step -> this rank's (loss, router loss, logits digest): a replay's evidence
        self._local_loss: dict[int, tuple[float, float, int]] = {}
        self._last_trigger_triage = -sdc.TRIGGER_TRIAGE_EVERY
        self._verified_step = 0          # newest step whose check passed (for rollback without snapshots)
        self._verified_saved = 0         # newest such step a checkpoint was started from
        self._prev_norms: torch.Tensor | None = None
        self._ambiguous_base: int | None = None  # rollback step of the first ambiguous verdict
        self._checked: tuple[int, list[tuple[int, ...]]] | None = None  # the last check: step, every rank's digests
        self._lanes: list[int] = []
        self._scratch: snapshot.FlatState | None = None  # fingerprint copy when snapshots are off
        self._bias_idx: list[int] = []

    def _settle_ddp_buckets(self) -> None:
        """One forward and backward, gradients dropped: DDP rebuilds its gradient buckets
        after its first backward, and a bucket's layout decides the order in which gloo
        sums an element over 3+ ranks. Settled here, every step reduces in the same order,
        so a step re-executed from a snapshot (SDC triage, a restart) is bit-identical."""
        b = data.batch(self.train, self.args.vocab_size, 1, self.spec.rank, dp_size=self.spec.world_size)
        with self._autocast():
            logits = self.model(b.inputs.to(self.device), b.doc_ids.to(self.device))
            loss = logits.float().mean() + self._aux_loss()
        loss.backward()
        for p in self.model.parameters():
            p.grad = None

    @property
    def sdc_active(self) -> bool:
        return self.sdc_interval > 0 or self.triggers.enabled

    # -- checkpoints ------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest state every rank can get, on every rank; its step or 0.

        One all-reduce tells every rank each rank's newest in-memory snapshot and rank 0's
        newest valid checkpoint on disk; every rank then makes the same choice: memory
        when it is at least as new as the disk (for replicated state from the lowest rank
        holding the newest snapshot, by broadcast; for sharded state only when every rank
        holds its own shard of the same step), else the disk checkpoint, else a fresh start.
        ``spec.restore_at_most`` > 0: no snapshot or checkpoint newer than that step (the
        state verified before silent data corruption). With SDC checks on, the restored
        state is fingerprinted and compared across copies once (it becomes the first
        verified snapshot a triage can replay from).
        """
        world, rank = self.spec.world_size, self.spec.rank
        ceiling = self.spec.restore_at_most
        holder, peers = snapshot.holder(), buddy.holder()
        holder.forget_other_jobs(self.spec.job_id)
        peers.forget_other_jobs(self.spec.job_id)
        snapshot.ensure_adam_state(self.optimizer)
        keep = snapshot.KEEP
        # [own snapshot steps per rank | steps of each rank's copy its buddy holds | disk]
        info = torch.zeros(2 * world * keep + 1, dtype=torch.int64, device=self.device)
        if self.snapshots:
            own = holder.steps(self.layout, at_most=ceiling)[:keep]
            info[rank * keep:rank * keep + len(own)] = torch.tensor(own, dtype=torch.int64)
        if self.peers is not None:
            held = [s for s in peers.steps(self.peers.ward_layout) if ceiling <= 0 or s <= ceiling][:keep]
            at = (world + self.buddies.ward) * keep
            info[at:at + len(held)] = torch.tensor(held, dtype=torch.int64)
        if rank == 0:
            found = checkpoint.latest_valid(self.spec.checkpoint_dir, skipped=self.invalid_checkpoints,
                                            at_most=ceiling)
            if found is not None:
                info[-1] = found[0]
        self.recorder.all_reduce(info)
        steps = info.tolist()
        own_steps = [[s for s in steps[r * keep:(r + 1) * keep] if s] for r in range(world)]
        held_steps = [[s for s in steps[(world + r) * keep:(world + r + 1) * keep] if s] for r in range(world)]
        disk = int(steps[-1])
        mem = [max(s, default=0) for s in own_steps]
        step = 0
        if self.replicated and max(mem) > 0 and max(mem) >= disk:
            step = max(mem)
            self._restore_replicated(step, src=mem.index(step))
        elif not self.replicated and (found_plan := self._plan(own_steps, held_steps, disk)).step:
            step = found_plan.step
            self._restore_sharded(found_plan)
        elif disk:
            step = disk
            self._restore_disk(step)
        holder.drop_newer(self.layout, step)  # a future this attempt does not continue
        if self.peers is not None:
            peers.drop_newer(self.peers.ward_layout, step)
        self._live = snapshot.state_tensors(self.model, self.optimizer)
        self._lanes = sdc.state_lanes(self.model, self.optimizer)
        biases = [id(layer.expert_bias) for layer in self.moe]
        self._bias_idx = [i for i, t in enumerate(self._live) if id(t) in biases]
        if self.train.checkpoint_interval > 0:
            self.ckpt = checkpoint.AsyncCheckpointer(
                self.spec.checkpoint_dir, keep=self.train.keep_checkpoints, resume_step=step,
                timeout=timedelta(seconds=self.spec.pg_timeout_s),
                ep_rank=self.meshes.ep_rank, ep_size=self.train.ep_size)
        log.info("rank %d: restored step %d (%s)", rank, step, self.restored_from or "fresh start")
        if self.sdc_active:
            self._check_restored(step)
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
        self.restored_from = f"disk: {self.restore_reason}" if self.restore_reason else "disk"

    def _plan(self, own: list[list[int]], held: list[list[int]], disk: int) -> buddy.Plan:
        """Where each rank's shard comes from: its own snapshot, its buddy's copy, or (step
        0) not from memory, ``restore_reason`` saying why when some memory was there."""
        world = self.spec.world_size
        buddy_of = [self.buddies.buddy_of(r) if self.peers is not None else -1 for r in range(world)]
        if self.peers is None:
            held = [[] for _ in range(world)]
        found = buddy.plan(own, held, buddy_of, disk)
        if not found.step and any(own) and not (self.spec.restore_at_most and disk):
            self.restore_reason = found.reason if self.peers is not None else (
                "a rank's shard has no copy in memory (memory_snapshots is local, or the job is on one node)")
        return found

    def _restore_sharded(self, found: buddy.Plan) -> None:
        """Every rank restores its own snapshot of ``found.step``, or receives its buddy's
        copy of it when its own is gone (a replacement process)."""
        rank, step = self.spec.rank, found.step
        live = snapshot.state_tensors(self.model, self.optimizer)
        sending = []
        if self.peers is not None:
            ward = self.buddies.ward
            if found.sources[ward] == rank:
                sending = self.peers.send_copy(step, to=ward)
        src = found.sources[rank]
        if src < 0:
            snap = snapshot.holder().get(self.layout, step)
            if snap is None:  # cannot happen: the plan only names steps this rank reported
                raise RuntimeError(f"rank {rank} lost its in-memory snapshot of step {step}")
            self.restored_from = "memory"
        else:
            snap = snapshot.holder().stage(self.layout, step, live, None, sdc.state_lanes(self.model, self.optimizer))
            self.peers.receive_into(snap, src)
            snapshot.holder().commit(self.layout, snap)
            self.restored_from = f"peer copy from rank {src}"
        for work in sending:
            work.wait(self.peers.timeout)
        snapshot.restore_into(live, snap)
        self._data_position = snap.data_position

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

    def _extra(self, step: int) -> dict:
        extra: dict = {"router_bias": [layer.expert_bias.detach().cpu().clone() for layer in self.moe]}
        if self._checked is not None and self._checked[0] == step:
            # the checkpoint carries the fingerprints its state was verified with
            extra["sdc"] = {"step": step, "verified": self._verified_step == step,
                            "digests": [sdc.hex_digest(d) for d in self._checked[1]]}
        return extra

    def _checkpoint_step(self, step: int) -> bool:
        interval = self.train.checkpoint_interval
        return interval > 0 and (step % interval == 0 or step == self.train.steps)

    def _save_due(self, step: int, stopping: bool) -> bool:
        return self.train.checkpoint_interval > 0 and (self._checkpoint_step(step) or stopping)

    def _start_save(self, step: int) -> None:
        assert self.ckpt is not None
        if self._verified_step == step:
            self._verified_saved = step
        self._pending_save_s = self.ckpt.start(step, self.model, self.optimizer, extra=self._extra(step),
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
        world = self.spec.world_size
        trigger = self._forced.pop(step, None)
        check = trigger is not None or self._periodic_check(step)
        local = self._compute(step)
        self._local_loss[step] = (local.loss, local.aux, local.logits)
        self._local_loss.pop(step - _LOSS_HISTORY, None)
        vote = False
        if self.triggers.enabled:
            grad = self.triggers.grad_norm(step, local.grad_norm)
            if grad is not None:  # the norm is global: every rank checks this step
                self._trigger_event(grad, global_value=True)
                trigger, check = trigger or grad, True
            vote = self._update_vote(step)

        staged = (snapshot.holder().stage(self.layout, step, self._live, self._data_position, self._lanes)
                  if self.snapshots else None)
        mine = None
        if check:
            t_fp = time.perf_counter()
            mine = self._fingerprint(staged)
            self.sdc_check_s += time.perf_counter() - t_fp
        save_done = self.ckpt is not None and self.ckpt.poll_local_done()
        red = self._reduce(local, stop=stop_requested, save_done=save_done, vote=vote, lanes=mine)
        if red.nonfinite or not math.isfinite(red.loss_sum):
            # before any snapshot or checkpoint of this step: the last good state stays newest
            if self.triggers.enabled:
                self._trigger_event(sdc.Trigger("nonfinite", step, red.loss_sum / world, 0.0,
                                                f"non-finite loss on ranks {red.nonfinite}"), global_value=True)
            raise NonFiniteLossError(step, red.nonfinite)
        if self.triggers.enabled:
            spike = self.triggers.loss(step, red.loss_sum / world)
            if spike is not None:
                self._trigger_event(spike, global_value=True)
                self._forced.setdefault(step + 1, spike)
            if red.voters:
                self._forced.setdefault(step + 1, sdc.Trigger(
                    "update_size", step, float(len(red.voters)), 0.0,
                    f"update size above {self.triggers.factor:g} x its running median on ranks {red.voters}"))

        replayed = None
        if check:
            t_fp = time.perf_counter()
            replayed = self._check(step, red.lanes, mine, staged, trigger)  # may raise SdcError
            self.sdc_check_s += time.perf_counter() - t_fp
        final = replayed if replayed is not None else red
        if replayed is None:
            self._apply_counts(red.counts)
        committed = None
        if self.ckpt is not None and self.ckpt.step is not None and red.saves_done == world:
            committed = self._commit(wait=False)
        loads = [metrics.expert_load(layer_id, [int(x) for x in c.tolist()])
                 for layer_id, c in zip(self.moe_layer_ids, final.counts, strict=True)]
        if self._save_due(step, red.stop):
            if self.ckpt.step is not None:
                committed = self._commit(wait=True)  # the previous save must land first
            if check or self.sdc_interval <= 0 or self._check_alone(step, staged, "before the stop checkpoint"):
                self._start_save(step)
        if staged is not None:
            for i in self._bias_idx:  # router biases moved after the copy
                staged.tensors[i].copy_(self._live[i])
            snapshot.holder().commit(self.layout, staged)
            if self.peers is not None:
                self.peers.exchange(staged)
        return StepResult(
            step=step, loss=final.loss_sum / world, aux_loss=final.aux_sum / world,
            grad_norm=local.grad_norm, lr=local.lr, step_time_s=time.perf_counter() - t0,
            tokens=self.train.batch_size * self.train.seq_len * self.train.grad_accum_steps,
            stop=red.stop, expert_load=loads, committed=committed,
        )

    def _compute(self, step: int) -> _Local:
        """Forward, backward, gradient sync and clipping, optimizer step (sdc faults fire here)."""
        train, world = self.train, self.spec.world_size
        lr = lr_at(train, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        counts = torch.zeros(len(self.moe), max(self.args.n_experts, 1), dtype=torch.float64)
        loss_sum = aux_sum = 0.0
        logit_bits = 0
        accum = train.grad_accum_steps
        hook = None
        fault = self._sdc_fault(step, "activation")
        if fault is not None:
            module = self._act_modules[fault.pick(self.spec.rank, len(self._act_modules))]
            hook = module.register_forward_hook(self.faults.sdc_forward_hook(fault, step))
        try:
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
                # an activation fault can move the loss by less than its last bit; not the logits
                if self.sdc_active:
                    logit_bits += sdc.bit_sum(logits.detach())
                loss_sum += loss.item() / accum
                aux_sum += aux.detach().item() / accum
                for i, layer in enumerate(self.moe):
                    counts[i] += layer.last_tokens_per_expert.double().cpu()
        finally:
            if hook is not None:
                hook.remove()
        if train.data_parallel == "ddp":
            parallel.sync_expert_grads(self.model, self.meshes)
        grad_norm = parallel.clip_grad_norm_(self.model, train.grad_clip, self.meshes)
        fault = self._sdc_fault(step, "grad")
        if fault is not None:
            self.faults.inject_sdc(fault, step, [snapshot.local(p.grad) for p in self.model.parameters()
                                                 if p.grad is not None])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        fault = self._sdc_fault(step, "weight")
        if fault is not None:
            self.faults.inject_sdc(fault, step, [snapshot.local(p.data) for p in self.model.parameters()])
        fault = self._sdc_fault(step, "optimizer")
        if fault is not None:
            moments = [snapshot.local(st[k]) for st in self.optimizer.state.values()
                       for k in ("exp_avg", "exp_avg_sq") if k in st]
            self.faults.inject_sdc(fault, step, moments)
        return _Local(loss_sum, aux_sum, sdc.fold(logit_bits), counts, grad_norm, lr)

    def _reduce(self, local: _Local, *, stop: bool = False, save_done: bool = False, vote: bool = False,
                lanes: tuple[int, ...] | None = None, changed: bool | None = None) -> _Reduced:
        """The step's one all-reduce: [loss, router loss, stop, save done | non-finite per
        rank | update-size vote per rank | token counts | digests per rank (check steps) |
        loss changed per rank (replays)]. A rank writes only its own slots, so the sums
        carry every rank's digests exactly."""
        world, rank = self.spec.world_size, self.spec.rank
        n_lanes = len(sdc.LANES)
        flags = torch.zeros(2 * world, dtype=torch.float64)
        flags[rank] = float(not math.isfinite(local.loss))
        flags[world + rank] = float(vote)
        parts = [torch.tensor([local.loss, local.aux, float(stop), float(save_done)], dtype=torch.float64),
                 flags, local.counts.flatten()]
        if lanes is not None:
            own = torch.zeros(world * n_lanes, dtype=torch.float64)
            own[rank * n_lanes:(rank + 1) * n_lanes] = torch.tensor(lanes, dtype=torch.float64)
            parts.append(own)
        if changed is not None:
            own = torch.zeros(world, dtype=torch.float64)
            own[rank] = float(changed)
            parts.append(own)
        stats = torch.cat(parts).to(self.device)
        self.recorder.all_reduce(stats)
        stats = stats.cpu()
        offset = _STATS_HEAD + 2 * world
        n_counts = local.counts.numel()
        counts = stats[offset:offset + n_counts].view(len(self.moe), -1)
        offset += n_counts
        all_lanes = None
        if lanes is not None:
            block = [int(x) for x in stats[offset:offset + world * n_lanes].tolist()]
            all_lanes = [tuple(block[r * n_lanes:(r + 1) * n_lanes]) for r in range(world)]
            offset += world * n_lanes
        changed_ranks = [r for r in range(world) if changed is not None and stats[offset + r].item() > 0]
        return _Reduced(
            loss_sum=stats[0].item(), aux_sum=stats[1].item(), stop=stats[2].item() > 0,
            saves_done=int(stats[3].item()),
            nonfinite=[r for r in range(world) if stats[_STATS_HEAD + r].item() > 0],
            voters=[r for r in range(world) if stats[_STATS_HEAD + world + r].item() > 0],
            counts=counts, lanes=all_lanes, changed=changed_ranks)

    def _apply_counts(self, counts: torch.Tensor) -> None:
        if self.args.load_balance == "bias":
            for layer, c in zip(self.moe, counts, strict=True):
                layer.update_bias(BIAS_UPDATE_RATE, c)

    # -- silent data corruption (workers/sdc.py) ---------------------------------------

    def _periodic_check(self, step: int) -> bool:
        """Every ``sdc_check_interval`` steps, and at every checkpoint step (so a checkpoint
        is verified before its save starts); all ranks agree without talking."""
        n = self.sdc_interval
        return n > 0 and (step % n == 0 or self._checkpoint_step(step))

    def _sdc_fault(self, step: int, target: str):
        return self.faults.sdc_due(step, target) if self.faults is not None else None

    def _fingerprint(self, staged: snapshot.Snapshot | None) -> tuple[int, ...]:
        """This rank's digests of the live state, read from the staged snapshot's copy (or a
        private copy when snapshots are off)."""
        if staged is not None:
            return sdc.digests(staged.state)
        if self._scratch is None:
            self._scratch = snapshot.FlatState(self._live, self._lanes)
        self._scratch.copy_from(self._live)
        return sdc.digests(self._scratch)

    def _update_vote(self, step: int) -> bool:
        """This rank's update size (the change of its parameters' per-tensor norms) against
        its running median; a vote forces a check of the next step on every rank."""
        params = [snapshot.local(p.data) for p in self.model.parameters()]
        norms = torch.stack(torch._foreach_norm(params)).double().cpu()
        prev, self._prev_norms = self._prev_norms, norms
        if prev is None:
            return False
        found = self.triggers.update_size(step, float((norms - prev).norm()))
        if found is not None:
            self._trigger_event(found, global_value=False)
        return found is not None

    def _event(self, kind: str, *, step: int, value: str, expected: str = "", ok: bool = False,
               detail: str = "", rank: int | None = None, node: str | None = None) -> None:
        if self.emit is None:
            return
        s = self.spec
        self.emit(events_pb2.Event(sdc=events_pb2.SdcCheckEvent(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank if rank is None else rank,
            node=s.node_name if node is None else node, step=step, kind=kind, value=value[:255],
            expected=expected[:255], ok=ok, detail=detail, time_ns=time.time_ns())))

    def _trigger_event(self, t: sdc.Trigger, *, global_value: bool) -> None:
        # a global value is the same on every rank: rank 0 reports it once
        if not global_value or self.spec.rank == 0:
            self._event("trigger", step=t.step, value=f"{t.measured:.6g}", expected=f"{t.threshold:.6g}",
                        detail=t.detail)

    def _fingerprint_events(self, step: int, found: sdc.Comparison, mine: tuple[int, ...], note: str = "") -> None:
        rank = self.spec.rank
        expected = found.expected.get(rank)
        self._event("fingerprint", step=step, value=sdc.hex_digest(mine),
                    expected=sdc.hex_digest(expected) if expected is not None else "",
                    ok=expected == tuple(mine), detail=note + found.detail[rank])

    def _check_alone(self, step: int, staged: snapshot.Snapshot | None, note: str) -> bool:
        """A check outside a step's all-reduce (the restored state, a stop checkpoint):
        one all-reduce of the digests (its wait is not counted in ``sdc_check_s``). True
        when every copy agrees."""
        t0 = time.perf_counter()
        world, rank, n = self.spec.world_size, self.spec.rank, len(sdc.LANES)
        mine = self._fingerprint(staged)
        vec = torch.zeros(world * n, dtype=torch.float64)
        vec[rank * n:(rank + 1) * n] = torch.tensor(mine, dtype=torch.float64)
        vec = vec.to(self.device)
        self.sdc_check_s += time.perf_counter() - t0
        self.recorder.all_reduce(vec)
        t0 = time.perf_counter()
        block = [int(x) for x in vec.cpu().tolist()]
        lanes = [tuple(block[r * n:(r + 1) * n]) for r in range(world)]
        found = sdc.compare(lanes, self.sets)
        self._checked = (step, lanes)
        self._fingerprint_events(step, found, mine, f"{note}: ")
        if staged is not None:
            staged.digests, staged.verified = mine, found.ok
        if found.ok:
            self._verified_step = step
        else:
            log.error("rank %d: copies of step %d differ %s (%s)", rank, step, note, found.detail[rank])
        self.sdc_check_s += time.perf_counter() - t0
        return found.ok

    def _check_restored(self, step: int) -> None:
        staged = (snapshot.holder().stage(self.layout, step, self._live, self._data_position, self._lanes)
                  if self.snapshots else None)
        if self._check_alone(step, staged, "restored state"):
            self._verified_saved = max(self._verified_saved, step)
        if staged is not None:
            snapshot.holder().commit(self.layout, staged)

    def _check(self, step: int, lanes: list[tuple[int, ...]], mine: tuple[int, ...],
               staged: snapshot.Snapshot | None, trigger: sdc.Trigger | None) -> _Reduced | None:
        """Compare the copies; triage a mismatch (or a trigger) by re-executing steps from
        the newest verified snapshot. Returns the replay's last all-reduce when the state
        was replaced by the replayed one, None when nothing changed. Raises SdcError on
        every rank for a persistent fault."""
        found = sdc.compare(lanes, self.sets)
        self._checked = (step, lanes)
        self._fingerprint_events(step, found, mine)
        holder = snapshot.holder()
        if found.ok:
            self._verified_step = step
            if staged is not None:
                staged.digests, staged.verified = mine, True
            if trigger is None or step - self._last_trigger_triage < sdc.TRIGGER_TRIAGE_EVERY:
                return None
            self._last_trigger_triage = step
        base = holder.newest_verified(self.layout, before=trigger.step if found.ok else step) \
            if staged is not None else None
        if base is None or step - base.step > sdc.MAX_REPLAY_STEPS:
            if found.ok:
                return None
            self._unreplayable(step, found, lanes)
        t_triage = time.perf_counter()
        replays: list[sdc.Replay] = []
        last = None
        for i in range(sdc.MAX_REPLAYS):
            rep, last = self._replay(base, step, staged)
            replays.append(rep)
            rank = self.spec.rank
            self._event("replay", step=step, value=sdc.hex_digest(rep.lanes[rank]),
                        expected=sdc.hex_digest(lanes[rank]), ok=tuple(rep.lanes[rank]) == tuple(lanes[rank]),
                        detail=f"replay {i + 1} of steps {base.step + 1}..{step} from the snapshot of step {base.step}")
            verdict = sdc.judge(lanes, found, replays, self.sets, step=step, base=base.step, trigger=trigger)
            if verdict.value != "ambiguous":
                break
        self.sdc_triage_s += time.perf_counter() - t_triage
        self.sdc_check_s -= time.perf_counter() - t_triage  # the caller times the whole check
        if verdict.value == "ambiguous" and self._ambiguous_base is not None:
            # the copies still differ and still reproduce: a fault that repeats on one of
            # them, which no majority names; the last agreeing state is the rollback
            verdict.rollback_step = min(self._ambiguous_base, base.step)
            verdict.evidence += f"; ambiguous again since step {self._ambiguous_base}: giving up"
        self._verdict(verdict, found)
        if verdict.value == "persistent" or (verdict.value == "ambiguous" and self._ambiguous_base is not None):
            holder.drop_newer(self.layout, verdict.rollback_step)
            self._raise(verdict)
        if verdict.value == "ambiguous":
            self._ambiguous_base = base.step
        if verdict.value == "transient":
            holder.drop_newer(self.layout, base.step)  # V+1.. held the corrupted state
        again = sdc.compare(replays[-1].lanes, self.sets)
        self._checked = (step, replays[-1].lanes)
        staged.digests, staged.verified = replays[-1].lanes[self.spec.rank], again.ok
        if again.ok:
            self._verified_step = step
        # the next update size is measured against the replayed state
        self._prev_norms = torch.stack(torch._foreach_norm(
            [snapshot.local(p.data) for p in self.model.parameters()])).double().cpu()
        return last

    def _replay(self, base: snapshot.Snapshot, upto: int, staged: snapshot.Snapshot) -> tuple[sdc.Replay, _Reduced]:
        """Re-execute steps ``base.step + 1 .. upto`` from ``base`` on every rank: same
        batches, schedule, RNG and router-bias updates; no events, checkpoints or
        snapshots (the staged one of ``upto`` is refilled for its digests)."""
        snapshot.restore_into(self._live, base)
        self._data_position = base.data_position
        changed: dict[int, list[int]] = {}
        first_mismatch = None
        red = None
        for s in range(base.step + 1, upto + 1):
            local = self._compute(s)
            before = self._local_loss.get(s)
            # bits, not values: NaN != NaN, -0.0 == 0.0
            differs = before is not None and _bits(before) != _bits((local.loss, local.aux, local.logits))
            # every replayed step is compared across copies: a fault that repeats shows
            # the first step it strikes
            staged.state.copy_from(self._live)
            red = self._reduce(local, lanes=sdc.digests(staged.state), changed=differs)
            changed[s] = red.changed
            if first_mismatch is None and not sdc.compare(red.lanes, self.sets).ok:
                first_mismatch = s
            self._apply_counts(red.counts)
        assert red is not None and red.lanes is not None
        staged.rng, staged.data_position = torch.get_rng_state(), self._data_position
        return sdc.Replay(red.lanes, changed, first_mismatch), red

    def _verdict(self, verdict: sdc.Verdict, found: sdc.Comparison) -> None:
        self.sdc_log.append(verdict.record())
        log.warning("rank %d: sdc verdict %s at step %d: %s", self.spec.rank, verdict.value,
                    verdict.detected_step, verdict.evidence)
        reporter = next((r for r in range(self.spec.world_size) if r not in verdict.suspects), 0)
        if self.spec.rank == reporter:
            expected = next((e for r, e in found.expected.items() if e is not None and r in verdict.suspects), None)
            self._event("verdict", rank=verdict.suspect, node="", step=verdict.first_bad_step,
                        value=verdict.value, expected=sdc.hex_digest(expected) if expected else "",
                        ok=verdict.value == "clean", detail=verdict.detail())

    def _unreplayable(self, step: int, found: sdc.Comparison, lanes: list[tuple[int, ...]]) -> None:
        """A mismatch with no verified snapshot to replay from (snapshots off, or too old):
        reported as persistent, rolled back to the newest verified checkpoint."""
        suspects = found.suspects or sorted({r for m in found.undecided for r in m})
        rollback = self._verified_saved
        verdict = sdc.Verdict("persistent", suspects, step, step, rollback, found.state, 0, "fingerprint",
                              [f"check of step {step}: {found.state} differ on ranks {suspects}",
                               "no verified in-memory snapshot to replay from (memory_snapshots off or too old)"],
                              f"copies differ at step {step}, not replayed; roll back to the verified checkpoint "
                              f"of step {rollback}")
        self._verdict(verdict, found)
        self._raise(verdict)

    def _raise(self, verdict: sdc.Verdict) -> None:
        if self.flush is not None:
            self.flush()
        raise SdcError(step=verdict.first_bad_step, rank=verdict.suspect, verdict=verdict.value,
                       rollback_step=verdict.rollback_step, evidence=verdict.evidence)

    def final_digest(self) -> str:
        """This rank's fingerprint of its state now (workers/sdc.py ``hex_digest``)."""
        if self._scratch is None:
            self._scratch = snapshot.FlatState(self._live, self._lanes)
        self._scratch.copy_from(self._live)
        return sdc.hex_digest(sdc.digests(self._scratch))

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


def _bits(observed: tuple[float, float, int]) -> bytes:
    return struct.pack("<2dQ", *observed)


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
