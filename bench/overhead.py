"""Cost of the flight recorder and event streaming on training step time.

    python bench/overhead.py [--cluster examples/local.yaml] [--steps 120] [--warmup-steps 20] [--pairs 3]
                             [--fr-buffer-entries N] [--report-interval-s S] [--with-ring-only]

Trains the cluster file's job (the local example: 4 ranks, tiny preset, FSDP, ep_size 2,
asynchronous checkpoints) for ``--steps`` steps, alternately

  * **on** — the real telemetry pipeline: PyTorch's native flight recorder with a ring
    of ``job.flight_recorder_entries``, each rank's ``NativeFlightTail`` + ``Reporter``
    shipping to the ``agent.node_agent.NodeAgent`` of its simulated node (2 nodes x 2
    ranks, each agent its own process, as under Ray), which streams to a real controller
    gRPC server (``controlplane.grpc_server`` + ``AgentService``, its own process) that
    commits every batch to a real SQLite store; and
  * **off** — ``TORCH_FR_BUFFER_SIZE=0`` and no agent (telemetry discarded).

Ranks are launched the way torchrun launches them (``RANK``/``WORLD_SIZE``/``MASTER_*``
in the environment, ``python -m fleet.workers.train``; rank 0 serves the rendezvous on
127.0.0.1). A step's time is the whole loop iteration (hooks and reporting included) as
the worker measures it; per run the figure is the median over steps after
``--warmup-steps`` and over ranks; per mode the median over runs. Runs alternate
(off/on, then on/off, ...) so machine noise hits both sides alike; ``overhead_ratio`` is
the ratio of the two medians, ``pair_ratios`` compare runs made back to back. Every
"on" run checks that the store holds one row per collective each rank's tail saw (none
lost), so the comparison is honest.

Wall time on a shared machine is noisy; two figures are less so: ``cpu_overhead_ratio``
(CPU the whole job spends per step: all rank processes, plus the agents' and the
controller's CPU rate times the step time) and ``telemetry_cpu_ms_per_s`` (CPU per
second of run by component: reporter threads, of which ring reads, agents, controller).
``--fr-buffer-entries`` and ``--report-interval-s`` override the cluster file, to
compare settings. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleet.controlplane.config import DEFAULT_CLUSTER_FILE, ClusterConfig, load_cluster_config  # noqa: E402

_RESULT = re.compile(r"FLEET_WORKER_RESULT (\{.*\})")
TOKEN = "overhead-bench-token-0123456789"


# ---- the control plane, in child processes ---------------------------------------------

def _serve_controller(db: str, steps: int) -> None:
    """Child: a controller gRPC server over a SQLite store; prints its address and job id,
    serves until stdin closes, then prints what the store holds."""
    from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
    from fleet.controlplane.control_server import ControlServicer
    from fleet.controlplane.errors import NotFoundError
    from fleet.controlplane.grpc_server import ControllerServer
    from fleet.controlplane.store import Store

    class _NoJobs:  # ControlService is served but unused by the bench
        def __getattr__(self, name: str):  # noqa: ANN204
            def refuse(*args: object) -> None:
                raise NotFoundError("the overhead bench serves no control calls")
            return refuse

    with Store(f"sqlite:///{db}") as store:
        job_id = store.create_job("overhead-bench", steps, "{}")
        server = ControllerServer(AgentServicer(store, AgentRegistry(), TOKEN, controller_id="ctl-bench"),
                                  ControlServicer(_NoJobs(), TOKEN)).start()
        try:
            cpu0 = time.process_time()  # imports and start-up are not the pipeline's cost
            _say({"address": server.address, "job_id": job_id})
            sys.stdin.read()  # the parent closes stdin when the run is over
            summary = store.collective_summary(job_id)
            _say({
                "collectives": sum(s.count for s in summary),
                "completed": sum(s.completed for s in summary),
                "per_rank": {str(r): sum(s.count for s in summary if s.rank == r)
                             for r in sorted({s.rank for s in summary})},
                "steps": len(store.steps(job_id)),
                "cpu_s": round(time.process_time() - cpu0, 3),
            })
        finally:
            server.close()


def _serve_agent(node: str, controller: str, cfg: ClusterConfig) -> None:
    """Child: one node's NodeAgent; prints its local address, serves until stdin closes,
    then waits until everything it received is committed and prints its counters."""
    from fleet.agent.node_agent import NodeAgent
    from fleet.agent.settings import AgentSettings

    agent = NodeAgent(node_name=node, controller_address=controller, token=TOKEN,
                      settings=AgentSettings(batch_max_events=cfg.agent.batch_max_events,
                                             batch_interval_s=cfg.agent.batch_interval_s,
                                             heartbeat_interval_s=cfg.controller.heartbeat_interval_s))
    address = agent.start()
    try:
        cpu0 = time.process_time()
        _say({"address": address})
        sys.stdin.read()
        flushed = agent.flush(timeout_s=60)
        _say({**agent.stats(), "flushed": flushed, "cpu_s": round(time.process_time() - cpu0, 3)})
    finally:
        agent.close()


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class _Child:
    """A control-plane child process speaking JSON lines on stdout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        self.hello = self._line()

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise SystemExit(f"bench child {self.proc.args[2:]} exited {self.proc.returncode}")
        return json.loads(line)

    def finish(self, timeout_s: float = 90) -> dict:
        self.proc.stdin.close()
        out = self._line()
        self.proc.wait(timeout_s)
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ---- one training run -----------------------------------------------------------------

def _train_args(cfg: ClusterConfig, steps: int) -> list[str]:
    job = cfg.job
    args = [
        "--steps", str(steps), "--checkpoint-interval", str(job.checkpoint_interval),
        "--preset", job.model.preset, "--fp8", job.model.args().fp8,
        "--batch-size", str(job.batch_size), "--seq-len", str(job.seq_len),
        "--ep-size", str(job.ep_size), "--data-parallel", job.data_parallel,
        "--grad-accum-steps", str(job.grad_accum_steps), "--warmup-steps", str(job.warmup_steps),
        "--lr", str(job.lr), "--pg-timeout-s", str(job.pg_timeout_s),
    ]
    if not job.async_checkpoint:
        args.append("--sync-checkpoint")
    return args


def _free_port() -> int:
    from fleet.workers.rendezvous import listen_on
    sock = listen_on("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def _launch(cfg: ClusterConfig, steps: int, tmp: Path, job_id: str, fr_entries: int,
            agents: list[str], timeout_s: float) -> list[dict]:
    """Run every rank of the job; return each rank's FLEET_WORKER_RESULT."""
    world, per_node = cfg.job.world_size, cfg.job.ranks_per_node
    port = _free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCH_FR_BUFFER_SIZE": str(fr_entries),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "fleet.workers.train", "--checkpoint-dir", str(tmp / "ckpt"),
               "--job-id", job_id, "--fr-buffer-entries", str(fr_entries), *_train_args(cfg, steps)]
        if agents:
            cmd += ["--agent-address", agents[rank // per_node],
                    "--report-interval-s", str(cfg.agent.report_interval_s),
                    "--fr-poll-interval-s", str(cfg.agent.fr_poll_interval_s)]
        log = open(tmp / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
        wall_s = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        text = log.read()
        log.close()
        found = _RESULT.findall(text)
        if p.returncode != 0 or not found:
            raise SystemExit(f"rank {rank} exited {p.returncode}:\n{text[-3000:]}")
        results.append({**json.loads(found[-1]), "wall_s": wall_s})
    return results


def run_once(mode: str, cfg: ClusterConfig, steps: int, warmup: int, timeout_s: float) -> dict:
    """One training run in ``mode`` ("off", "ring" or "on")."""
    ring = cfg.job.flight_recorder_entries
    with tempfile.TemporaryDirectory(prefix=f"fleet-overhead-{mode}-") as tmp_name:
        tmp = Path(tmp_name)
        if mode in ("off", "ring"):
            results = _launch(cfg, steps, tmp, f"overhead-{mode}", ring if mode == "ring" else 0, [],
                              timeout_s)
            extra: dict = {}
        else:
            controller = _Child("--serve-controller", str(tmp / "fleet.db"), "--steps", str(steps))
            agents: list[_Child] = []
            try:
                for n in range(cfg.job.nodes):
                    agents.append(_Child("--serve-agent", f"node-{n}", "--controller",
                                         controller.hello["address"]))
                results = _launch(cfg, steps, tmp, controller.hello["job_id"], ring,
                                  [a.hello["address"] for a in agents], timeout_s)
                agent_stats = [a.finish() for a in agents]
                stored = controller.finish()
            finally:
                for child in (*agents, controller):
                    child.kill()
            seen = sum(r.get("fr_records", 0) for r in results)
            extra = {
                "stored_collectives": stored["collectives"],
                "stored_completed": stored["completed"],
                "stored_steps": stored["steps"],
                "fr_records": seen,
                "fr_lost": sum(r.get("fr_lost", 0) for r in results),
                "agents_flushed": all(a["flushed"] for a in agent_stats),
                "cpu_s_controller": stored["cpu_s"],
                "cpu_s_agents": round(sum(a["cpu_s"] for a in agent_stats), 3),
                "cpu_s_reporters": round(sum(r.get("reporter_cpu_s", 0.0) for r in results), 3),
                "cpu_s_ring_reads": round(sum(r.get("fr_dump_cpu_s", 0.0) for r in results), 3),
                "ring_reads": sum(r.get("fr_dumps", 0) for r in results),
                "probe_only_polls": sum(r.get("fr_skipped_polls", 0) for r in results),
                "max_unread": max(r.get("fr_max_unread", 0) for r in results),
            }
            per_rank = {str(r["rank"]): r.get("fr_collectives", 0) for r in results}
            if stored["per_rank"] != per_rank or extra["fr_lost"]:
                raise SystemExit(f"the store did not receive every collective: stored {stored['per_rank']}, "
                                 f"ranks saw {per_rank}, lost {extra['fr_lost']}")
    wall = results[0]["wall_s"]
    median_step = statistics.median(statistics.median(r["step_wall_s"][warmup:]) for r in results)
    # CPU the whole job spends per step: every rank's process (training and reporter
    # threads) plus the agents' and controller's share; far less exposed to other load
    # on the machine than wall time
    cpu_per_step = sum(statistics.median(r["step_cpu_s"][warmup:]) for r in results)
    if mode == "on":
        cpu_per_step += (extra["cpu_s_agents"] + extra["cpu_s_controller"]) / wall * median_step
    return {"mode": mode, "median_step_s": median_step, "cpu_per_step_s": cpu_per_step,
            "train_s": max(r["train_s"] for r in results), "wall_s": wall, **extra}


def _cpu_ms_per_s(runs: list[dict]) -> dict[str, float]:
    """Median CPU milliseconds per second of run wall time, by telemetry component."""
    keys = [k for k in runs[0] if k.startswith("cpu_s_")]
    return {k.removeprefix("cpu_s_"): round(statistics.median(r[k] / r["wall_s"] for r in runs) * 1e3, 1)
            for k in keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER_FILE)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps left out of the medians")
    parser.add_argument("--pairs", type=int, default=3, help="on/off pairs")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--fr-buffer-entries", type=int, default=None,
                        help="override the cluster file's job.flight_recorder_entries (ring size)")
    parser.add_argument("--report-interval-s", type=float, default=None,
                        help="override the cluster file's agent.report_interval_s")
    parser.add_argument("--with-ring-only", action="store_true",
                        help="also run 'ring': the native recorder on, nothing streamed (its own cost)")
    parser.add_argument("--serve-controller", metavar="DB", help=argparse.SUPPRESS)
    parser.add_argument("--serve-agent", metavar="NODE", help=argparse.SUPPRESS)
    parser.add_argument("--controller", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = load_cluster_config(args.cluster.resolve())
    if args.serve_controller:
        _serve_controller(args.serve_controller, args.steps)
        return 0
    if args.serve_agent:
        _serve_agent(args.serve_agent, args.controller, cfg)
        return 0
    if args.steps <= args.warmup_steps:
        parser.error("--steps must exceed --warmup-steps")

    if args.fr_buffer_entries is not None:
        cfg = cfg.model_copy(update={"job": cfg.job.model_copy(
            update={"flight_recorder_entries": args.fr_buffer_entries})})
    if args.report_interval_s is not None:
        cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(
            update={"report_interval_s": args.report_interval_s})})
    ring = cfg.job.flight_recorder_entries
    print(f"{cfg.job.nodes} nodes x {cfg.job.ranks_per_node} ranks, model {cfg.job.model.preset}, "
          f"{cfg.job.data_parallel}, ep_size {cfg.job.ep_size}, {args.steps} steps "
          f"(first {args.warmup_steps} left out), ring {ring}, report every "
          f"{cfg.agent.report_interval_s} s, ring read every {cfg.agent.fr_poll_interval_s} s, "
          f"{args.pairs} pairs", flush=True)
    runs: dict[str, list[dict]] = {"on": [], "off": [], "ring": []}
    modes = ("off", "ring", "on") if args.with_ring_only else ("off", "on")
    for i in range(args.pairs):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            r = run_once(mode, cfg, args.steps, args.warmup_steps, args.timeout_s)
            runs[mode].append(r)
            detail = ""
            if mode == "on":
                detail = (f"  stored {r['stored_collectives']} collectives ({r['fr_records']} recorded, "
                          f"{r['fr_lost']} lost), cpu s: reporters {r['cpu_s_reporters']}, "
                          f"agents {r['cpu_s_agents']}, controller {r['cpu_s_controller']}")
            print(f"  pair {i + 1} {mode:>3}: median step {r['median_step_s'] * 1e3:7.2f} ms "
                  f"(CPU {r['cpu_per_step_s'] * 1e3:6.1f} ms), training {r['train_s']:.2f} s{detail}",
                  flush=True)

    on = statistics.median(r["median_step_s"] for r in runs["on"])
    off = statistics.median(r["median_step_s"] for r in runs["off"])
    # each pair ran back to back, so its ratio is the least exposed to machine noise
    pair_ratios = [a["median_step_s"] / b["median_step_s"] for a, b in zip(runs["on"], runs["off"], strict=True)]
    cpu = _cpu_ms_per_s(runs["on"])
    cpu_on = statistics.median(r["cpu_per_step_s"] for r in runs["on"])
    cpu_off = statistics.median(r["cpu_per_step_s"] for r in runs["off"])
    pipeline = sum(v for k, v in cpu.items() if k != "ring_reads")  # ring reads are part of reporters
    result = {
        "cluster": str(args.cluster.resolve()),
        "steps": args.steps, "warmup_steps": args.warmup_steps, "pairs": args.pairs,
        "world_size": cfg.job.world_size, "fr_buffer_entries": ring,
        "report_interval_s": cfg.agent.report_interval_s, "fr_poll_interval_s": cfg.agent.fr_poll_interval_s,
        "median_step_s_on": round(on, 6),
        "median_step_s_off": round(off, 6),
        "overhead_ratio": round(on / off, 4),
        "runs_on_s": [round(r["median_step_s"], 6) for r in runs["on"]],
        "runs_off_s": [round(r["median_step_s"], 6) for r in runs["off"]],
        "events_stored": [r["stored_collectives"] for r in runs["on"]],
        "events_completed": [r["stored_completed"] for r in runs["on"]],
        "collectives_recorded": [r["fr_records"] for r in runs["on"]],
        "collectives_lost": sum(r["fr_lost"] for r in runs["on"]),
        "cpu_per_step_s_on": round(cpu_on, 6),
        "cpu_per_step_s_off": round(cpu_off, 6),
        "cpu_overhead_ratio": round(cpu_on / cpu_off, 4),
        "pair_ratios": [round(x, 4) for x in pair_ratios],
        "median_pair_ratio": round(statistics.median(pair_ratios), 4),
        "telemetry_cpu_ms_per_s": cpu,
        "telemetry_cpu_share": round(pipeline / 1e3 / (os.cpu_count() or 1), 4),
        "ring_reads_per_rank_s": round(statistics.median(
            r["ring_reads"] / r["wall_s"] / cfg.job.world_size for r in runs["on"]), 2),
        "max_unread_at_a_read": max(r["max_unread"] for r in runs["on"]),
    }
    if runs["ring"]:
        ring_only = statistics.median(r["median_step_s"] for r in runs["ring"])
        result["median_step_s_ring_only"] = round(ring_only, 6)
        result["ring_only_ratio"] = round(ring_only / off, 4)
    print(f"\nmedian step: on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, ratio {on / off:.4f} "
          f"(pairs: {', '.join(f'{x:.3f}' for x in pair_ratios)}); CPU per step: on {cpu_on * 1e3:.1f} ms, "
          f"off {cpu_off * 1e3:.1f} ms, ratio {cpu_on / cpu_off:.4f}")
    print("telemetry CPU, ms per s of run: " + ", ".join(f"{k} {v}" for k, v in cpu.items())
          + f"  = {result['telemetry_cpu_share']:.1%} of {os.cpu_count()} CPUs")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
