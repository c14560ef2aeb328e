"""One rank of bench/recovery.py's job under a peer launcher: torchrun or Ray Train.

Both peers run fleet's own training loop, ``workers.train.run``, on the same
``RecoveryJob``, restoring from fleet's own on-disk checkpoints. Two seams of ``run`` are
used and nothing in ``workers/`` is patched:

* ``before_step(step)``: on the kill rank, at the start of the kill step, SIGKILL this
  process, first attempt only (a marker file created with O_EXCL says it already
  happened, so the restarted rank trains on);
* ``on_step(result)``: append one row per completed step to the job's step log.

The step log (``<workdir>/steps.jsonl``) is one JSON object per line, appended with one
``write`` on an O_APPEND descriptor, so the ranks (and their restarts) share one file:
  * ``{"event": "start", "rank", "attempt", "pid", "time"}`` when a rank process starts;
  * ``{"event": "step", "rank", "attempt", "pid", "step", "end", "step_time_s"}`` per
    completed step (``end``: Unix seconds);
  * ``{"event": "kill", "rank", "attempt", "pid", "step", "time"}`` just before the kill.
``attempt`` counts this rank's earlier starts in the log; both peers restart the whole
group together, so it is the attempt number of the group.

Entry points: ``python bench/recovery_worker.py --job JSON`` under torchrun;
``train_loop_per_worker(config)`` as Ray Train's ``TorchTrainer`` loop (``config["job"]``
is ``RecoveryJob`` as a dict), driven by ``python bench/recovery_worker.py --raytrain
--job JSON``, which owns the local Ray for the run (so bench/recovery.py can stop it and
all its processes as one process group).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # torchrun runs this file as a script
    sys.path.insert(0, str(REPO))

from fleet.workers.spec import PRESETS, ModelArgs, TrainArgs, WorkerSpec  # noqa: E402

STEP_LOG = "steps.jsonl"
KILL_MARKER = "killed.marker"
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class RecoveryJob:
    """The benchmark's job and fault, the same under every runner (plain values: it
    travels as JSON to torchrun's ranks and pickled to Ray Train's)."""

    workdir: str                 # holds checkpoints/, steps.jsonl and the kill marker
    steps: int = 400             # last training step
    kill_step: int = 100         # the kill rank dies at the start of this step (0 = no kill)
    kill_rank: int = 1
    world_size: int = 4
    checkpoint_interval: int = 20
    pg_timeout_s: float = 60.0   # the peers' process-group timeout: their hang detection
    data_parallel: str = "ddp"   # "ddp" (replicated), or "fsdp": FSDP2 + expert parallelism over ep_size
    ep_size: int = 1
    # "tiny" preset with these overrides: 1.02M parameters (`fleet model-info` counts)
    dim: int = 128
    ffn_hidden: int = 344

    def __post_init__(self) -> None:
        if not 0 <= self.kill_rank < self.world_size:
            raise ValueError(f"kill_rank ({self.kill_rank}) must be a rank of {self.world_size}")
        if self.kill_step > self.steps:
            raise ValueError(f"kill_step ({self.kill_step}) must be <= steps ({self.steps})")
        if self.world_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide the world size ({self.world_size})")

    def model(self) -> ModelArgs:
        return dataclasses.replace(PRESETS["tiny"], dim=self.dim, ffn_hidden=self.ffn_hidden)

    def train_args(self) -> TrainArgs:
        # fleet's defaults otherwise (async checkpoints). In-memory snapshots are off: the
        # peers restart every process, which loses them, so they would be pure per-step cost
        return dataclasses.replace(
            TrainArgs(), steps=self.steps, checkpoint_interval=self.checkpoint_interval,
            data_parallel=self.data_parallel, ep_size=self.ep_size, memory_snapshots=False)

    def spec(self, rank: int, world_size: int, *, master_addr: str = "127.0.0.1", master_port: int = 0,
             external_store: bool = False, job_id: str = "recovery-bench") -> WorkerSpec:
        """This rank's WorkerSpec; the master address matters only where ``run`` makes the
        process group itself (torchrun), not under Ray Train, which made it already."""
        return WorkerSpec(
            job_id=job_id, attempt=0, rank=rank, world_size=world_size, node_name=socket.gethostname(),
            master_addr=master_addr, master_port=master_port,
            agent_address="",       # no fleet agent: telemetry is discarded
            checkpoint_dir=str(Path(self.workdir) / CHECKPOINTS),
            model=self.model(), train=self.train_args(), pg_timeout_s=self.pg_timeout_s,
            external_store=external_store,
            fr_buffer_entries=0,    # the flight recorder is fleet's telemetry, not the peers'
        )


class StepLog:
    """Appends rows to the shared step log, one ``write`` per row."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **row: object) -> None:
        os.write(self._fd, (json.dumps(row) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(path: Path) -> list[dict]:
    """Every row of a step log (a torn last line, from a killed writer, is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _claim(marker: Path) -> bool:
    """True exactly once per workdir: whoever creates the marker file first."""
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def run_rank(job: RecoveryJob, rank: int, world_size: int, **spec_kw: object) -> dict:
    """Train one rank of ``job`` with the kill hook and the step log; ``run``'s result."""
    workdir = Path(job.workdir)
    log_path = workdir / STEP_LOG
    attempt = sum(1 for r in read_log(log_path) if r.get("event") == "start" and r["rank"] == rank)
    pid = os.getpid()
    with StepLog(log_path) as steps:
        steps.write(event="start", rank=rank, attempt=attempt, pid=pid, time=time.time())
        from fleet.workers.train import run  # imports torch: after the start row, so it shows in the log

        def before_step(step: int) -> None:
            if (job.kill_step and rank == job.kill_rank and step >= job.kill_step
                    and _claim(workdir / KILL_MARKER)):
                steps.write(event="kill", rank=rank, attempt=attempt, pid=pid, step=step, time=time.time())
                os.kill(pid, signal.SIGKILL)

        def on_step(result) -> None:  # workers.trainer.StepResult
            steps.write(event="step", rank=rank, attempt=attempt, pid=pid, step=result.step,
                        end=time.time(), step_time_s=result.step_time_s)

        return run(job.spec(rank, world_size, **spec_kw), before_step=before_step, on_step=on_step)


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's per-worker loop: Ray Train already made the gloo process group."""
    import ray.train

    ctx = ray.train.get_context()
    run_rank(RecoveryJob(**config["job"]), ctx.get_world_rank(), ctx.get_world_size())


def raytrain_driver(job: RecoveryJob, *, max_failures: int, poll_s: float) -> None:
    """Train ``job`` with Ray Train's TorchTrainer on a local Ray bound to 127.0.0.1,
    restarting the worker group up to ``max_failures`` times; Ray is shut down after."""
    # read at import time: Ray resolves its node address to loopback only with this set
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # how often the Train controller polls its workers, so how soon it sees a dead one
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(poll_s)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from bench import recovery_worker  # by module name, so Ray pickles the loop by reference

    worker_env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "PYTHONPATH")
                  if k in os.environ}
    # address="local": a new cluster of our own, never one another process left running
    ray.init(address="local", num_cpus=job.world_size, _node_ip_address="127.0.0.1",
             include_dashboard=False, object_store_memory=128 << 20, runtime_env={"env_vars": worker_env})
    try:
        trainer = TorchTrainer(
            recovery_worker.train_loop_per_worker,
            train_loop_config={"job": dataclasses.asdict(job)},
            scaling_config=ScalingConfig(num_workers=job.world_size, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="recovery-bench", storage_path=str(Path(job.workdir) / "ray"),
                                 failure_config=FailureConfig(max_failures=max_failures)),
            # the gloo group's timeout: all Ray Train has to notice a hung collective
            torch_config=TorchConfig(backend="gloo", timeout_s=max(1, round(job.pg_timeout_s))),
        )
        trainer.fit()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Entry point under ``torchrun`` (rank, world and rendezvous from its environment),
    or with ``--raytrain`` the Ray Train driver."""
    parser = argparse.ArgumentParser(description="One rank of bench/recovery.py's job (launch with "
                                     "torchrun), or with --raytrain the Ray Train driver of the job.")
    parser.add_argument("--job", required=True, help="RecoveryJob as a JSON object")
    parser.add_argument("--raytrain", action="store_true", help="run the job under Ray Train's TorchTrainer")
    parser.add_argument("--max-failures", type=int, default=3, help="Ray Train: worker-group restarts")
    parser.add_argument("--poll-s", type=float, default=2.0,
                        help="Ray Train: controller's worker poll interval, seconds")
    args = parser.parse_args(argv)
    job = RecoveryJob(**json.loads(args.job))
    if args.raytrain:
        raytrain_driver(job, max_failures=args.max_failures, poll_s=args.poll_s)
        return
    # torchrun's contract is environment variables; this is the edge where they are read
    env = os.environ
    run_rank(job, int(env["RANK"]), int(env["WORLD_SIZE"]), master_addr=env["MASTER_ADDR"],
             master_port=int(env["MASTER_PORT"]),
             external_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


if __name__ == "__main__":
    main()
