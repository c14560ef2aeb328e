"""The whole life of one training rank: start, join the process group, restore, train, save.

``run(spec)`` is what a Ray worker actor (``workers/ray_actor.py``) or a plain torchrun
launch (``main``) calls. Data parallel only: every rank holds the full model, gradients
are averaged with one flat all-reduce per step, and every rank's parameters stay
bit-identical.

Reported to the agent, in order: WorkerStatus STARTING -> PG_READY -> RESTORED ->
TRAINING, then per step a StepEvent (and the flight recorder's collectives), a
CheckpointEvent from rank 0 per committed checkpoint, and finally FINISHED or FAILED.
A step that saves or commits a checkpoint, and the final save, run in the phase
``checkpointing`` (workers/phases.py: a TRAINING status as it begins and ends), so the
controller's hang threshold there is ``detect.phase_timeouts_s.checkpointing``.

Invariants:
  * Every rank agrees on the restored step: rank 0 picks it and broadcasts it.
  * A run restored from step S produces bit-identical losses for steps S+1.. as an
    uninterrupted run with the same world size (seeded init, per-(step, rank) data,
    exact optimizer restore, single-threaded CPU math).
  * Ranks stop together: a ``stop`` command on any rank travels with the loss
    all-reduce, so all ranks leave after the same step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import socket
import sys
import time
import typing
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta

import pydantic
import torch
import torch.distributed as dist
from pydantic.fields import FieldInfo

from fleet.proto import events_pb2
from fleet.workers import metrics, native_fr
from fleet.workers.failures import status_fields
from fleet.workers.env import apply_worker_env
from fleet.workers.faults import FaultHooks
from fleet.workers.native_fr import NativeFlightTail
from fleet.workers.peer_links import PeerLinks
from fleet.workers.phases import CHECKPOINTING, Phases
from fleet.workers.recorder import FlightRecorder
from fleet.workers.rendezvous import rendezvous_store
from fleet.workers.reporter import Reporter
from fleet.workers.spec import PRESETS, ModelArgs, TrainArgs, WorkerSpec, documented_fields
from fleet.workers.trainer import StepResult, Trainer, backend_for, pick_device

log = logging.getLogger(__name__)

Status = events_pb2.WorkerStatus


class _Emitter:
    """Builds this rank's events with the job/attempt/rank stamped on."""

    def __init__(self, spec: WorkerSpec, reporter: Reporter) -> None:
        self.spec = spec
        self.reporter = reporter

    def status(self, state: int, *, phase_s: float = 0.0, restored_step: int = 0, detail: str = "",
               **failure: object) -> None:
        """``failure``: a FAILED report's fields (``workers.failures.status_fields``)."""
        s = self.spec
        self.reporter.emit(events_pb2.Event(status=Status(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, state=state, time_ns=time.time_ns(),
            pid=os.getpid(), hostname=socket.gethostname(), restored_step=restored_step,
            detail=detail, phase_s=phase_s, **failure)))

    def step(self, r: StepResult, trainer: Trainer) -> None:
        s = self.spec
        tokens_per_s = r.tokens / r.step_time_s if r.step_time_s > 0 else 0.0
        event = events_pb2.StepEvent(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, step=r.step, loss=r.loss,
            step_time_s=r.step_time_s, tokens_per_s=tokens_per_s, end_ns=time.time_ns(),
            grad_norm=r.grad_norm, lr=r.lr, aux_loss=r.aux_loss,
            mfu=metrics.mfu(trainer.flops_per_token, tokens_per_s, trainer.peak_flops))
        for load in r.expert_load:
            event.expert_load.add(
                layer=load.layer, tokens_per_expert=load.tokens_per_expert,
                min_share=load.min_share, max_share=load.max_share, imbalanced=load.imbalanced)
        self.reporter.emit(events_pb2.Event(step=event))

    def checkpoint(self, step: int, path: str, manifest_sha256: str, save_s: float) -> None:
        s = self.spec
        self.reporter.emit(events_pb2.Event(checkpoint=events_pb2.CheckpointEvent(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, step=step, path=path,
            manifest_sha256=manifest_sha256, save_s=save_s, time_ns=time.time_ns())))

    def checkpoint_invalid(self, step: int, path: str, reason: str) -> None:
        """Rank 0 found checkpoint ``step`` failing verification: the store marks it invalid."""
        s = self.spec
        self.reporter.emit(events_pb2.Event(checkpoint=events_pb2.CheckpointEvent(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, step=step, path=path,
            invalid=True, reason=reason, time_ns=time.time_ns())))


def run(spec: WorkerSpec, listen_socket: socket.socket | None = None, *,
        before_step: Callable[[int], None] | None = None,
        on_step: Callable[[StepResult], None] | None = None,
        hooks: FaultHooks | None = None) -> dict:
    """Train this rank to ``spec.train.steps`` and return ``{"rank", "final_step",
    "restored_step", "stopped", "restored_from", "sdc", "sdc_check_s", "sdc_digest", ...}``.
    Raises whatever stopped training, after reporting FAILED (``SdcError`` for a
    persistent silent data corruption, once its verdict was sent).

    ``sdc``: one record per SDC triage (``first_bad_step``, ``detected_step``,
    ``suspects``, ``verdict``, ``replays``, ``rollback_step``, ``state``, ``mechanism``);
    ``sdc_check_s``: seconds spent fingerprinting and comparing (``sdc_triage_s``: in
    re-executed steps); ``sdc_digest``: this
    rank's fingerprint of its final state (workers/sdc.py ``hex_digest``). ``hooks``:
    fault hooks to use instead of fresh ones (a benchmark arms faults on them directly
    with ``hooks.on_command``).

    ``listen_socket`` (rank 0 only): an already listening socket on master_addr:master_port
    for the rendezvous store; without it rank 0 binds one itself. If a default process
    group already exists (a launcher such as Ray Train made it), it is used as is and left
    alone at the end. ``before_step(step)`` runs at the top of every step and
    ``on_step(result)`` after every completed step (benchmark seams).

    A process may call ``run`` again for a later attempt (fleet's in-process restart): the
    in-memory snapshots of the earlier attempt (workers/snapshot.py) are still here.
    """
    apply_worker_env(spec)  # read by the process group at creation: before init_process_group
    torch.set_num_threads(1)  # ranks share the host's cores; more threads only contend
    own_pg = not dist.is_initialized()
    links: list[PeerLinks | None] = [None]  # set once the process group exists
    if hooks is None:
        hooks = FaultHooks(spec.rank, checkpoint_dir=spec.checkpoint_dir if spec.rank == 0 else "")
    reporter = Reporter(spec, hooks.on_command)
    emit = _Emitter(spec, reporter)
    hooks.on_checkpoint_damaged = emit.checkpoint_invalid  # ckpt-corrupt: the store learns at once
    tail = None
    if spec.fr_buffer_entries and native_fr.available():
        tail = NativeFlightTail(spec.job_id, spec.attempt, spec.rank, reporter.emit,
                                ring_entries=spec.fr_buffer_entries, poll_interval_s=spec.fr_poll_interval_s)
        reporter.follow(tail)
    result: dict = {}
    failed = False
    try:
        emit.status(Status.STARTING)
        result.update(_train(spec, hooks, reporter, emit, listen_socket, tail, before_step, on_step, links))
        emit.status(Status.FINISHED, detail="stopped by command" if result["stopped"] else "")
        return result
    except BaseException as exc:
        failed = True
        if links[0] is not None:  # no peer may stay blocked on this process (peer_links.py)
            links[0].sever()
        emit.status(Status.FAILED, detail=f"{type(exc).__name__}: {exc}"[:4000], **status_fields(exc))
        raise
    finally:
        if dist.is_initialized() and own_pg:
            if tail is not None:
                tail.poll(force=True)  # the ring dies with the process group: ship its last entries
            # FSDP's reference cycles can keep the group alive into interpreter shutdown,
            # which then aborts ("terminate called without an active exception")
            gc.collect()
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already failing or finished; report and move on
                log.exception("rank %d: destroy_process_group failed", spec.rank)
        # a failed rank's return is how the controller learns of it: do not wait long
        # on an agent that may be gone too
        reporter.close(timeout_s=1.0 if failed else 5.0)
        # telemetry counters for the benchmarks (bench/overhead.py)
        result.update(reporter_cpu_s=reporter.cpu_s, **(tail.counters() if tail is not None else {}))


def _train(
    spec: WorkerSpec, hooks: FaultHooks, reporter: Reporter, emit: _Emitter,
    listen_socket: socket.socket | None = None, tail: NativeFlightTail | None = None,
    before_step: Callable[[int], None] | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    links: list[PeerLinks | None] | None = None,
) -> dict:
    links = links if links is not None else [None]
    train = spec.train
    recorder = FlightRecorder(spec.job_id, spec.attempt, spec.rank, reporter.emit, tail=tail)
    phases = Phases(spec.job_id, spec.attempt, spec.rank, reporter.emit)
    device = pick_device(spec.rank)

    t0 = time.perf_counter()
    if not dist.is_initialized():
        store = rendezvous_store(spec, listen_socket)
        dist.init_process_group(
            backend_for(device), store=store, rank=spec.rank,
            world_size=spec.world_size, timeout=timedelta(seconds=spec.pg_timeout_s))
        links[0] = PeerLinks(store, spec.rank, spec.world_size, spec.master_port)
    pg_init_s = time.perf_counter() - t0
    emit.status(Status.PG_READY, phase_s=pg_init_s)

    t0 = time.perf_counter()
    trainer = Trainer(spec, recorder, device)
    trainer.loss_hook = getattr(hooks, "poison_loss", None)
    trainer.faults = hooks
    trainer.emit = reporter.emit
    trainer.flush = lambda: _flush(reporter, timeout_s=min(5.0, spec.pg_timeout_s))
    try:
        restored = trainer.restore()
        restore_s = time.perf_counter() - t0
        for bad in trainer.invalid_checkpoints:
            emit.checkpoint_invalid(bad.step, bad.path, bad.reason)
        emit.status(Status.RESTORED, phase_s=restore_s, restored_step=restored,
                    detail=trainer.restored_from)
        emit.status(Status.TRAINING)
        t_train = time.perf_counter()
        step, stopped = restored, False
        # whole loop iterations, hooks and reporting included: wall and process CPU (all
        # threads, the reporter's too) seconds, for bench/overhead.py
        step_wall_s: list[float] = []
        step_cpu_s: list[float] = []
        for step in range(restored + 1, train.steps + 1):
            t_step, cpu_step = time.perf_counter(), time.process_time()
            if before_step is not None:
                before_step(step)
            hooks.before_step(step)
            recorder.set_step(step)
            with phases.phase(CHECKPOINTING) if checkpoints_at(train, step) else nullcontext():
                result = trainer.step(step, hooks.stop_requested)
            emit.step(result, trainer)
            if on_step is not None:
                on_step(result)
            if result.committed is not None and spec.rank == 0:
                emit.checkpoint(*result.committed)
            stopped = result.stop
            step_wall_s.append(round(time.perf_counter() - t_step, 6))
            step_cpu_s.append(round(time.process_time() - cpu_step, 6))
            if stopped:
                log.info("rank %d: stopping after step %d by command", spec.rank, step)
                break
        with phases.phase(CHECKPOINTING):
            final = trainer.finish_checkpoints()
        if final is not None and spec.rank == 0:
            emit.checkpoint(*final)
        train_s = time.perf_counter() - t_train
    except BaseException:
        # first cut this rank's connections: peers (and the checkpoint writer's own group,
        # which close() below waits for) fail at once instead of at the group's timeout
        if links[0] is not None:
            links[0].sever()
        raise
    finally:
        trainer.close()
    return {
        "rank": spec.rank, "final_step": step, "restored_step": restored, "stopped": stopped,
        "restored_from": trainer.restored_from,
        "pg_init_s": pg_init_s, "restore_s": restore_s, "train_s": train_s,
        "step_wall_s": step_wall_s, "step_cpu_s": step_cpu_s,
        "sdc": trainer.sdc_log, "sdc_check_s": trainer.sdc_check_s, "sdc_triage_s": trainer.sdc_triage_s,
        "sdc_digest": trainer.final_digest(),
    }


def checkpoints_at(train: TrainArgs, step: int) -> bool:
    """Whether ``step`` saves a checkpoint (and commits the one before, waiting for it):
    every ``checkpoint_interval`` steps and at the last step, as ``TrainArgs`` documents.
    A stop's checkpoint is not foreseen (the stop is agreed inside the step)."""
    interval = train.checkpoint_interval
    return interval > 0 and (step % interval == 0 or step == train.steps)


def _flush(reporter: Reporter, timeout_s: float) -> None:
    """Wait (bounded) until the agent acknowledged every event emitted so far."""
    deadline = time.monotonic() + timeout_s
    while reporter.enabled and reporter.pending and time.monotonic() < deadline:
        reporter.flush_soon()
        time.sleep(0.01)


def _add_field_flags(parser: argparse.ArgumentParser, fields: dict[str, FieldInfo]) -> None:
    """One flag per field (``--batch-size`` for ``batch_size``), with the field's default,
    choices and description: the fields are defined once, in workers/spec.py."""
    for name, info in fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = (info.description or "").replace("%", "%%")
        if info.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=info.default, help=help_text)
            continue
        choices = typing.get_args(info.annotation) if typing.get_origin(info.annotation) is typing.Literal else None
        parser.add_argument(flag, type=type(info.default), default=info.default, choices=choices,
                            help=f"{help_text} (default: %(default)s)")


def spec_from_torchrun(argv: list[str] | None = None) -> WorkerSpec:
    """Build a WorkerSpec from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m fleet.workers.train",
        description="Train fleet's Llama-4-style model on one rank (launch with torchrun).")
    parser.add_argument("--checkpoint-dir", required=True, help="where step_NNNNNNNN/ checkpoints live")
    parser.add_argument("--agent-address", default="",
                        help="host:port of the node agent; empty = discard telemetry")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape")
    parser.add_argument("--fp8", default=None,
                        choices=typing.get_args(ModelArgs.__pydantic_fields__["fp8"].annotation),
                        help="FP8 compute (default: the preset's)")
    _add_field_flags(parser, documented_fields(TrainArgs))
    # the spelling from before the flags were derived, kept for existing launch scripts
    parser.add_argument("--sync-checkpoint", dest="async_checkpoint", action="store_false",
                        help="the same as --no-async-checkpoint")
    parser.add_argument("--job-id", default="", help="job id stamped on events (default: random)")
    _add_field_flags(parser, documented_fields(WorkerSpec))
    args = parser.parse_args(argv)
    try:
        model = PRESETS[args.preset]
        if args.fp8 is not None:
            model = dataclasses.replace(model, fp8=args.fp8)
        train = TrainArgs(**{name: getattr(args, name) for name in documented_fields(TrainArgs)})
    except pydantic.ValidationError as exc:  # a recipe field out of its bounds
        problem = exc.errors()[0]
        flag = "--" + "-".join(str(p) for p in problem["loc"]).replace("_", "-")
        parser.error(f"{flag}: {problem['msg']}")
    # torchrun's contract is environment variables; this is the edge where they are read.
    env = os.environ
    return WorkerSpec(
        job_id=args.job_id or f"torchrun-{uuid.uuid4().hex[:8]}",
        attempt=0,
        rank=int(env.get("RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        node_name=socket.gethostname(),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        agent_address=args.agent_address,
        checkpoint_dir=args.checkpoint_dir,
        model=model,
        train=train,
        pg_timeout_s=args.pg_timeout_s,
        fr_buffer_entries=args.fr_buffer_entries,
        fr_poll_interval_s=args.fr_poll_interval_s,
        report_interval_s=args.report_interval_s,
        external_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point for ``torchrun ... -m fleet.workers.train``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    result = run(spec_from_torchrun(argv))
    log.info("rank %d finished at step %d (restored from %d)",
             result["rank"], result["final_step"], result["restored_step"])
    # one machine-readable line per rank, for bench/startup.py's torchrun comparison
    sys.stdout.write(f"FLEET_WORKER_RESULT {json.dumps(result)}\n")  # one write: ranks share stdout
    sys.stdout.flush()


if __name__ == "__main__":
    main()
