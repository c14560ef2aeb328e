"""The whole life of one training rank: start, join the process group, restore, train, save.

``run(spec)`` is what a Ray worker actor (``workers/ray_actor.py``) or a plain torchrun
launch (``main``) calls. Data parallel only: every rank holds the full model, gradients
are averaged with one flat all-reduce per step, and every rank's parameters stay
bit-identical.

Reported to the agent, in order: WorkerStatus STARTING -> PG_READY -> RESTORED ->
TRAINING, then per step a StepEvent (and the flight recorder's collectives), a
CheckpointEvent from rank 0 per committed checkpoint, and finally FINISHED or FAILED.

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
import json
import logging
import os
import socket
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fleet_proto import events_pb2
from workers import checkpoint, data, native_fr
from workers.faults import FaultHooks
from workers.model import Transformer
from workers.native_fr import NativeFlightTail
from workers.recorder import FlightRecorder
from workers.rendezvous import rendezvous_store
from workers.reporter import Reporter
from workers.spec import PRESETS, TrainArgs, WorkerSpec

log = logging.getLogger(__name__)

Status = events_pb2.WorkerStatus


class _Emitter:
    """Builds this rank's events with the job/attempt/rank stamped on."""

    def __init__(self, spec: WorkerSpec, reporter: Reporter) -> None:
        self.spec = spec
        self.reporter = reporter

    def status(self, state: int, *, phase_s: float = 0.0, restored_step: int = 0, detail: str = "") -> None:
        s = self.spec
        self.reporter.emit(events_pb2.Event(status=Status(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, state=state, time_ns=time.time_ns(),
            pid=os.getpid(), hostname=socket.gethostname(), restored_step=restored_step,
            detail=detail, phase_s=phase_s)))

    def step(self, step: int, loss: float, step_time_s: float, tokens: int) -> None:
        s = self.spec
        self.reporter.emit(events_pb2.Event(step=events_pb2.StepEvent(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, step=step, loss=loss,
            step_time_s=step_time_s, tokens_per_s=tokens / step_time_s if step_time_s > 0 else 0.0,
            end_ns=time.time_ns())))

    def checkpoint(self, step: int, path: str, manifest_sha256: str, save_s: float) -> None:
        s = self.spec
        self.reporter.emit(events_pb2.Event(checkpoint=events_pb2.CheckpointEvent(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, step=step, path=path,
            manifest_sha256=manifest_sha256, save_s=save_s, time_ns=time.time_ns())))


def run(spec: WorkerSpec, listen_socket: socket.socket | None = None) -> dict:
    """Train this rank to ``spec.train.steps`` and return ``{"rank", "final_step",
    "restored_step", "stopped"}``. Raises whatever stopped training, after reporting FAILED.

    ``listen_socket`` (rank 0 only): an already listening socket on master_addr:master_port
    for the rendezvous store; without it rank 0 binds one itself.
    """
    os.environ.update(spec.env)
    if spec.fr_buffer_entries:
        # read by the process group at creation: must be set before init_process_group
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(spec.fr_buffer_entries)
    torch.set_num_threads(1)  # ranks share the host's cores; more threads only contend
    hooks = FaultHooks(spec.rank)
    reporter = Reporter(spec, hooks.on_command)
    emit = _Emitter(spec, reporter)
    tail = None
    if spec.fr_buffer_entries and native_fr.available():
        tail = NativeFlightTail(spec.job_id, spec.attempt, spec.rank, reporter.emit)
        reporter.add_source(tail.poll, spec.fr_poll_interval_s)
    try:
        emit.status(Status.STARTING)
        result = _train(spec, hooks, reporter, emit, listen_socket, tail)
        emit.status(Status.FINISHED, detail="stopped by command" if result["stopped"] else "")
        return result
    except BaseException as exc:
        emit.status(Status.FAILED, detail=f"{type(exc).__name__}: {exc}"[:4000])
        raise
    finally:
        if dist.is_initialized():
            if tail is not None:
                tail.poll()  # the ring dies with the process group: ship its last entries
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - already failing or finished; report and move on
                log.exception("rank %d: destroy_process_group failed", spec.rank)
        reporter.close()


def _train(
    spec: WorkerSpec, hooks: FaultHooks, reporter: Reporter, emit: _Emitter,
    listen_socket: socket.socket | None = None, tail: NativeFlightTail | None = None,
) -> dict:
    train = spec.train
    recorder = FlightRecorder(spec.job_id, spec.attempt, spec.rank, reporter.emit, tail=tail)

    t0 = time.perf_counter()
    dist.init_process_group(
        "gloo", store=rendezvous_store(spec, listen_socket), rank=spec.rank,
        world_size=spec.world_size, timeout=timedelta(seconds=spec.pg_timeout_s))
    pg_init_s = time.perf_counter() - t0
    emit.status(Status.PG_READY, phase_s=pg_init_s)

    t0 = time.perf_counter()
    model = Transformer(spec.model, seed=train.seed)  # same seed everywhere: no broadcast needed
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr)
    restored = _restore(spec, recorder, model, optimizer)
    restore_s = time.perf_counter() - t0
    emit.status(Status.RESTORED, phase_s=restore_s, restored_step=restored)
    emit.status(Status.TRAINING)
    t_train = time.perf_counter()

    params = [p for p in model.parameters() if p.requires_grad]
    numels = [p.numel() for p in params]
    world = float(spec.world_size)
    tokens = train.batch_size * train.seq_len
    step, stopped = restored, False
    for step in range(restored + 1, train.steps + 1):
        hooks.before_step(step)
        recorder.set_step(step)
        t_step = time.perf_counter()
        inputs, targets = data.batch(train, spec.model.vocab_size, step, spec.rank)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # One flat buffer: one collective per step instead of one per parameter.
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        recorder.all_reduce(flat)
        flat.div_(world)
        for p, g in zip(params, flat.split(numels)):
            p.grad.copy_(g.view_as(p))
        # [loss, stop votes]: the stop decision rides on a collective every rank makes
        # anyway, so all ranks see the same verdict after the same step.
        stats = torch.tensor([loss.item(), 1.0 if hooks.stop_requested else 0.0], dtype=torch.float64)
        recorder.all_reduce(stats)
        optimizer.step()
        emit.step(step, stats[0].item() / world, time.perf_counter() - t_step, tokens)
        stopped = stats[1].item() > 0
        if _checkpoint_due(train, step, stopped):
            path, manifest_sha, save_s = checkpoint.save(
                spec.checkpoint_dir, step, model, optimizer, recorder, keep=train.keep_checkpoints)
            if spec.rank == 0:
                emit.checkpoint(step, path, manifest_sha, save_s)
                log.info("step %d loss %.4f, checkpoint %s", step, stats[0].item() / world, path)
        if stopped:
            log.info("rank %d: stopping after step %d by command", spec.rank, step)
            break
    return {
        "rank": spec.rank, "final_step": step, "restored_step": restored, "stopped": stopped,
        "pg_init_s": pg_init_s, "restore_s": restore_s, "train_s": time.perf_counter() - t_train,
    }


def _checkpoint_due(train: TrainArgs, step: int, stopping: bool) -> bool:
    if train.checkpoint_interval <= 0:
        return False
    return step % train.checkpoint_interval == 0 or step == train.steps or stopping


def _restore(spec: WorkerSpec, recorder: FlightRecorder, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> int:
    """Load the newest valid checkpoint, chosen by rank 0, on every rank; returns its step (0 = none)."""
    chosen = torch.zeros(1, dtype=torch.int64)
    if spec.rank == 0:
        found = checkpoint.latest_valid(spec.checkpoint_dir)
        if found is not None:
            chosen[0] = found[0]
    recorder.broadcast(chosen, src=0)
    step = int(chosen.item())
    if step == 0:
        return 0
    loaded = checkpoint.load(checkpoint.step_path(spec.checkpoint_dir, step), model, optimizer)
    if loaded != step:
        raise RuntimeError(f"checkpoint {checkpoint.step_path(spec.checkpoint_dir, step)} "
                           f"holds step {loaded}, expected {step}")
    log.info("rank %d: restored step %d", spec.rank, step)
    return step


def spec_from_torchrun(argv: list[str] | None = None) -> WorkerSpec:
    """Build a WorkerSpec from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m workers.train",
        description="Train fleet's Llama-style model on one rank (launch with torchrun).")
    parser.add_argument("--steps", type=int, default=TrainArgs.steps, help="last training step")
    parser.add_argument("--checkpoint-dir", required=True, help="where step_NNNNNNNN/ checkpoints live")
    parser.add_argument("--checkpoint-interval", type=int, default=TrainArgs.checkpoint_interval,
                        help="steps between checkpoints; 0 = never")
    parser.add_argument("--agent-address", default="",
                        help="host:port of the node agent; empty = discard telemetry")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model shape")
    parser.add_argument("--job-id", default="", help="job id stamped on events (default: random)")
    parser.add_argument("--pg-timeout-s", type=float, default=60.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
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
        model=PRESETS[args.preset],
        train=TrainArgs(steps=args.steps, checkpoint_interval=args.checkpoint_interval),
        pg_timeout_s=args.pg_timeout_s,
        external_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point for ``torchrun ... -m workers.train``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    result = run(spec_from_torchrun(argv))
    log.info("rank %d finished at step %d (restored from %d)",
             result["rank"], result["final_step"], result["restored_step"])
    # one machine-readable line per rank, for bench/startup.py's torchrun comparison
    sys.stdout.write(f"FLEET_WORKER_RESULT {json.dumps(result)}\n")  # one write: ranks share stdout
    sys.stdout.flush()


if __name__ == "__main__":
    main()
