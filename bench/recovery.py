"""Recovery from a killed rank, and hang detection: fleet next to torchrun and Ray Train.

    pip install -e '.[bench]'      # Ray Train (TorchTrainer) for the Ray Train peer
    python bench/recovery.py [--steps 400] [--kill-step 100] [--runs 1] [--skip-raytrain]
                             [--data-parallel ddp,fsdp] [--world-sizes 4,16]

Two jobs (4 ranks, the "tiny" preset widened to 1.02M parameters, checkpoints every 20
steps, asynchronous as fleet's default): DDP, and FSDP2 + expert parallelism over pairs
of ranks (the local example's shape; ``--data-parallel`` picks), each trained by
fleet's own loop (``workers.train.run``) under each runner, in one run of this script;
``--world-sizes`` repeats them at other sizes. The fault: rank 1 is SIGKILLed at the
start of step ``--kill-step`` (first attempt only). Each runner at its best
configuration:

* **fleet**: ``fleet up`` (2 simulated nodes, half the ranks on each, one warm spare
  process per node, in-memory snapshots every step with peer copies of sharded state on
  the other node, telemetry at its defaults: reports every 0.5 s) with the crash scheduled in the cluster.yaml's
  ``chaos:`` section (what ``fleet inject-fault`` does too).
* **torchrun**: ``torch.distributed.run --standalone --local-addr 127.0.0.1
  --max-restarts 3 --monitor-interval 0.1`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's
  default (the rendezvous TCPStore shared with the workers) every restarted gloo group
  fails in connectFullMesh and the job never trains again (pytorch issue 135712);
  ``--check-torchrun-default`` shows it. The workers restore the newest valid checkpoint
  from disk themselves (bench/recovery_worker.py).
* **Ray Train**: ``TorchTrainer`` (gloo) with ``FailureConfig(max_failures=3)`` on a
  local Ray bound to 127.0.0.1, the controller polling its workers every
  ``--raytrain-poll-s`` seconds (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``; 0.5 here, Ray's
  default is 2); same checkpoints on local disk, in fleet's format.

Figures, from one step log per run (``metrics``, the same code for every runner):

* **recovery_s**: the kill to the end of the first step >= the kill step completed
  by a restarted attempt (detection, restart, restore and the recomputed steps).
* **steps_lost**: steps completed before the kill that were computed again
  (last step completed before the kill - the step the restart restored).
* **ettr**: productive step time / wall, wall = first step start to last step end;
  productive = per step number, the ranks' mean step time in the execution that counted
  (the last one).
* **median_step_s**: median span of the steps before the kill.
* **hang_detect_s**: fleet's is measured (a hung rank to the controller's incident); the
  peers have no detector of their own: a hung collective surfaces when the process-group
  timeout fires, so theirs is the configured ``--pg-timeout-s`` (the gloo group's timeout
  in the workers; ``TorchConfig.timeout_s`` under Ray Train), labelled as configured.

Addresses: everything the script chooses is 127.0.0.1 (Ray's node, torchrun's
MASTER_ADDR, gloo on ``lo``), but two stores are torch's and listen on every interface:
torchrun's standalone rendezvous store and the one Ray Train's ``env://`` process group
starts (under torchrun, the workers' own store is fleet's, bound to MASTER_ADDR only).
* **train_wall_s**: the first step's start to the last step's end; **run_wall_s**: the
  runner's whole run (start-up, the fault and teardown included): what the user waits.

The last line of output is one JSON object: per runner ``<runner>_<figure>`` for the DDP
job, the same suffixed ``_fsdp`` for the FSDP one (and ``_w<size>`` for world sizes after
the first), and per job ``step_time_ratio_vs_torchrun`` and ``wall_ratio_vs_torchrun``
(fleet's median step time and run_wall_s over torchrun's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.recovery_worker import KILL_MARKER, STEP_LOG, RecoveryJob, read_log  # noqa: E402
from fleet.controlplane.cli.render import print_table  # noqa: E402

RUNNERS = ("fleet", "torchrun", "raytrain")
#: The worker environment every peer gets: ranks share 2 cores, gloo on loopback.
PEER_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}


@dataclass
class Outcome:
    """What one runner's run left behind."""

    runner: str
    step_rows: list[dict]          # {"rank", "attempt", "step", "end", "step_time_s"} per completed step
    kill_time: float | None        # Unix seconds the kill fired; None when it did not
    wall_s: float                  # the runner's whole run, start-up and teardown included
    note: str = ""                 # why the run did not finish, or anything the table should say
    hang_detect_s: float | None = None   # measured hang detection (fleet only)
    extra: dict = field(default_factory=dict)


# -- metrics ----------------------------------------------------------------------------


def metrics(step_rows: Sequence[dict], kill_time: float | None, kill_step: int) -> dict:
    """Recovery figures of one run from its step rows (see the module docstring).

    ``step_rows``: one dict per completed step per rank with ``rank``, ``attempt`` (any
    number that grows with each restart), ``step``, ``end`` (Unix seconds) and
    ``step_time_s``. Times are seconds; figures that need a recovery are None without one.
    """
    if not step_rows:
        return {"recovery_s": None, "steps_lost": None, "restored_step": None, "ettr": None,
                "median_step_s": None, "train_wall_s": None, "productive_s": None, "final_step": None}
    # per attempt: its first step end; attempts that started training after the kill
    first_end: dict = {}
    for r in step_rows:
        first_end[r["attempt"]] = min(first_end.get(r["attempt"], r["end"]), r["end"])
    later = {a for a, t in first_end.items() if kill_time is not None and t > kill_time}
    first_attempt = min(first_end)

    # (attempt, step) -> (first rank's start, last rank's end): a synchronous step ends
    # when its slowest rank does (as in `fleet report`)
    spans: dict[tuple, tuple[float, float]] = {}
    for r in step_rows:
        key, start = (r["attempt"], r["step"]), r["end"] - r["step_time_s"]
        have = spans.get(key)
        spans[key] = (min(have[0], start), max(have[1], r["end"])) if have else (start, r["end"])
    last_run: dict[int, tuple] = {}  # step -> the attempt whose execution counted
    for attempt, step in spans:
        if step not in last_run or attempt > last_run[step]:
            last_run[step] = attempt
    # a step's productive time: its ranks' mean step time (the spans above overlap the
    # neighbouring steps by the ranks' skew, so their sum can exceed the wall time)
    durations: dict[tuple, list[float]] = defaultdict(list)
    for r in step_rows:
        durations[(r["attempt"], r["step"])].append(r["step_time_s"])
    productive = sum(statistics.fmean(durations[(a, s)]) for s, a in last_run.items())
    wall = max(e for _, e in spans.values()) - min(s for s, _ in spans.values())

    recovery_s = steps_lost = restored = None
    if later:
        done_after = [end for (a, s), (_, end) in spans.items() if a in later and s >= kill_step]
        if done_after:
            recovery_s = min(done_after) - kill_time
        restored = min(s for (a, s) in spans if a in later) - 1
        # a step some rank finished before the kill was done: its all-reduce had every rank
        done_before = [r["step"] for r in step_rows if r["attempt"] not in later and r["end"] <= kill_time]
        steps_lost = max(0, max(done_before, default=0) - restored)
    healthy = [end - start for (a, s), (start, end) in spans.items()
               if a == first_attempt and (not kill_step or s < kill_step)]
    return {
        "recovery_s": recovery_s,
        "steps_lost": steps_lost,
        "restored_step": restored,
        "ettr": productive / wall if wall > 0 else None,
        "median_step_s": statistics.median(healthy) if healthy else None,
        "train_wall_s": wall,
        "productive_s": productive,
        "final_step": max(last_run),
    }


def _outcome_from_log(runner: str, workdir: Path, job: RecoveryJob, wall_s: float,
                      note: str, extra: dict | None = None) -> Outcome:
    rows = read_log(workdir / STEP_LOG)
    steps = [r for r in rows if r.get("event") == "step"]
    kills = [r["time"] for r in rows if r.get("event") == "kill"]
    finished = any(r["step"] == job.steps for r in steps)
    return Outcome(runner, steps, min(kills) if kills else None, wall_s,
                   note or ("" if finished else f"never reached step {job.steps}"), extra=extra or {})


# -- supervising a launcher process -----------------------------------------------------


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM a launcher still running, then SIGKILL whatever is left of its process
    group (its workers, Ray's processes), whether or not it exited by itself."""
    if proc.poll() is None:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _supervise(cmd: list[str], env: dict[str, str], workdir: Path, timeout_s: float,
               stall_s: float) -> tuple[int | None, float, str]:
    """Run a launcher in its own process group until it exits, ``timeout_s`` passes, or
    no step row is logged for ``stall_s`` seconds after the kill (a launcher that never
    recovers); returns (exit status or None, wall seconds, why it was stopped or "")."""
    log_path = workdir / STEP_LOG
    with open(workdir / "launcher.log", "wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        size, changed, why = -1, t0, ""
        try:
            while proc.poll() is None:
                now = time.monotonic()
                new = log_path.stat().st_size if log_path.exists() else 0
                if new != size:
                    size, changed = new, now
                if now - t0 > timeout_s:
                    why = f"timed out after {timeout_s:g} s"
                elif (workdir / KILL_MARKER).exists() and now - changed > stall_s:
                    why = f"no step for {stall_s:g} s after the kill"
                if why:
                    break
                time.sleep(0.5)
        finally:
            _stop_group(proc)
        return (None if why else proc.returncode), time.monotonic() - t0, why


def _failure_note(returncode: int | None, why: str, workdir: Path) -> str:
    if why:
        return why
    if returncode:
        lines = (workdir / "launcher.log").read_text(errors="replace").splitlines()
        errors = [ln.strip() for ln in lines if "Error" in ln]
        return f"exit status {returncode}" + (f": {errors[-1][:200]}" if errors else "")
    return ""


# -- runners ----------------------------------------------------------------------------


def _fleet_cluster(job: RecoveryJob, workdir: Path, fault: dict) -> Path:
    """The benchmark's job as a cluster.yaml: 2 simulated nodes x 2 ranks, the same model,
    recipe and checkpoints as the peers, the fault in its `chaos:` section."""
    import yaml

    cfg = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    assert job.world_size % 2 == 0, "fleet's run places the ranks on two nodes"
    cfg["ray"]["cpus_per_node"] = max(cfg["ray"]["cpus_per_node"], job.world_size // 2 + 2)  # ranks + spares
    cfg["job"].update(
        nodes=2, ranks_per_node=job.world_size // 2, steps=job.steps,
        checkpoint_interval=job.checkpoint_interval, checkpoint_dir=str(workdir / "checkpoints"),
        data_parallel=job.data_parallel, ep_size=job.ep_size, pg_timeout_s=job.pg_timeout_s,
        memory_snapshots="peer",
        model={"preset": "tiny", "fp8": "off", "dim": job.dim, "ffn_hidden": job.ffn_hidden})
    cfg["state_dir"] = str(workdir / ".fleet")
    cfg["store"] = {"url": f"sqlite:///{workdir}/.fleet/fleet.db"}
    # the default telemetry settings (reports every 0.5 s): what a user runs, and what the
    # step-time comparison with torchrun must carry
    cfg["chaos"] = {"faults": [fault]}
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fleet_up(job: RecoveryJob, workdir: Path, fault: dict, timeout_s: float) -> tuple[dict, float, str]:
    """Run `fleet up` on the job with ``fault``; return (fleet report, wall s, note)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = _fleet_cluster(job, workdir, fault)
    fleet = [sys.executable, "-m", "fleet.controlplane.cli.main"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    out = subprocess.run([*fleet, "up", "--cluster", str(cluster), "--json"], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - t0
    if out.returncode != 0:
        return {}, wall, f"fleet up exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"
    job_id = json.loads(out.stdout)["job_id"]
    rep = subprocess.run([*fleet, "report", job_id, "--json", "--store", f"sqlite:///{workdir}/.fleet/fleet.db"],
                         cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads(rep.stdout) if rep.returncode == 0 else {}
    report["job_id"] = job_id
    return report, wall, "" if report.get("state") == "SUCCEEDED" else f"fleet job ended {report.get('state')}"


def run_fleet(job: RecoveryJob, workdir: Path, timeout_s: float) -> Outcome:
    """Train ``job`` under `fleet up` (2 nodes x 2 ranks on a local Ray cluster), rank
    ``job.kill_rank`` SIGKILLed at the start of step ``job.kill_step`` by the `crash` fault
    (scheduled in the cluster.yaml's `chaos:` section: `fleet inject-fault` would do the
    same). Then a second run where that rank hangs at that step instead, for the hang
    detection time. Step rows come from fleet's store; the kill time is the end of the
    step before the kill step (the fault fires at the top of the next one, ~1 ms later)."""
    from fleet.controlplane.store import Store

    crash_dir = workdir / "crash"
    report, wall, note = _fleet_up(job, crash_dir, {"kind": "crash", "rank": job.kill_rank,
                                                    "at_step": job.kill_step}, timeout_s)
    rows: list[dict] = []
    kill_time = None
    if report.get("job_id"):
        with Store(f"sqlite:///{crash_dir}/.fleet/fleet.db") as st:
            for s in st.steps(report["job_id"]):
                rows.append({"rank": s.rank, "attempt": s.attempt, "step": s.step, "end": s.end_ns / 1e9,
                             "step_time_s": s.step_time_s})
        # the killed rank's own last reports die with it: any rank's end of the step
        # before the kill (the fault fires at the top of the next step, ~1 ms later)
        before = [r["end"] for r in rows if r["attempt"] == 1 and r["step"] == job.kill_step - 1]
        kill_time = max(before) if before else None
    extra = {"incidents": report.get("incidents", []), "report_ettr": report.get("ettr")}
    hang_job = dataclasses.replace(job, steps=min(job.steps, job.kill_step + 20))
    hang_report, _, hang_note = _fleet_up(hang_job, workdir / "hang", {
        "kind": "hang", "rank": job.kill_rank, "at_step": job.kill_step}, timeout_s)
    hangs = [i for i in hang_report.get("incidents", []) if i["kind"] == "hang"]
    extra["hang_incident"] = hangs[0] if hangs else None
    note = "; ".join(n for n in (note, hang_note and f"hang run: {hang_note}") if n)
    return Outcome("fleet", rows, kill_time, wall, note,
                   hang_detect_s=hangs[0]["detected_after_s"] if hangs else None, extra=extra)


def run_torchrun(job: RecoveryJob, workdir: Path, *, share_store: bool = False, max_restarts: int = 3,
                 monitor_interval_s: float = 0.1, timeout_s: float = 600, stall_s: float = 60) -> Outcome:
    """Train ``job`` under ``torchrun --standalone --max-restarts``; ``share_store``:
    torch's default (workers reuse the rendezvous TCPStore), which cannot restart gloo."""
    # --local-addr: MASTER_ADDR is 127.0.0.1 (else the host's FQDN), so rank 0's store binds there
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
           "--nproc-per-node", str(job.world_size), "--max-restarts", str(max_restarts),
           "--monitor-interval", str(monitor_interval_s),
           str(REPO / "bench" / "recovery_worker.py"), "--job", json.dumps(dataclasses.asdict(job))]
    env = {**os.environ, **PEER_ENV, "LOGLEVEL": "INFO"}  # LOGLEVEL: the agent logs its restarts
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    rc, wall, why = _supervise(cmd, env, workdir, timeout_s, stall_s)
    launcher_log = (workdir / "launcher.log").read_text(errors="replace")
    extra = {"gloo_connect_failures": launcher_log.count("connectFullMesh failed"),
             "restarts": launcher_log.count("will restart worker group")}
    runner = "torchrun" if not share_store else "torchrun (shared store)"
    return _outcome_from_log(runner, workdir, job, wall, _failure_note(rc, why, workdir), extra)


def run_raytrain(job: RecoveryJob, workdir: Path, *, max_failures: int = 3, poll_s: float = 0.5,
                 timeout_s: float = 600, stall_s: float = 60) -> Outcome:
    """Train ``job`` under Ray Train's TorchTrainer with ``FailureConfig(max_failures)``,
    on a local Ray that the driver subprocess (bench/recovery_worker.py --raytrain)
    starts on 127.0.0.1 and shuts down."""
    cmd = [sys.executable, str(REPO / "bench" / "recovery_worker.py"), "--raytrain",
           "--max-failures", str(max_failures), "--poll-s", str(poll_s),
           "--job", json.dumps(dataclasses.asdict(job))]
    env = {**os.environ, **PEER_ENV}
    rc, wall, why = _supervise(cmd, env, workdir, timeout_s, stall_s)
    return _outcome_from_log("raytrain", workdir, job, wall, _failure_note(rc, why, workdir))


# -- report -----------------------------------------------------------------------------


FIGURES = ("recovery_s", "steps_lost", "ettr", "median_step_s", "train_wall_s", "run_wall_s")


def _median(values: Sequence[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _run(runner: str, job: RecoveryJob, args: argparse.Namespace) -> Outcome:
    workdir = Path(job.workdir)
    if runner == "fleet":
        return run_fleet(job, workdir, args.timeout_s)
    if runner == "torchrun":
        return run_torchrun(job, workdir, timeout_s=args.timeout_s, stall_s=args.stall_s)
    return run_raytrain(job, workdir, poll_s=args.raytrain_poll_s, timeout_s=args.timeout_s,
                        stall_s=args.stall_s)


def summarize(base: RecoveryJob, outcomes: dict[str, list[Outcome]]) -> tuple[dict, list[list[str]]]:
    """Medians per runner: the result dict (JSON) and the table's rows. The peers' hang
    detection is their configured process-group timeout; fleet's is measured."""
    result: dict = {}
    rows = []
    for runner in RUNNERS:
        runs = outcomes.get(runner, [])
        if not runs:
            result.update({f"{runner}_{k}": None for k in (*FIGURES, "hang_detect_s")})
            continue
        figs = [{**metrics(o.step_rows, o.kill_time, base.kill_step), "run_wall_s": o.wall_s} for o in runs]
        med = {k: _median([f[k] for f in figs]) for k in FIGURES}
        if runner == "fleet":
            hang, basis = _median([o.hang_detect_s for o in runs]), "measured"
        else:
            hang, basis = base.pg_timeout_s, "configured process-group timeout"
        result.update({f"{runner}_{k}": None if v is None else round(v, 4) for k, v in med.items()})
        result[f"{runner}_hang_detect_s"] = hang
        result[f"{runner}_hang_detect_basis"] = basis
        notes = [o.note for o in runs if o.note]
        if notes:
            result[f"{runner}_notes"] = notes
        rows.append([runner, _fmt(med["recovery_s"]), _fmt(med["steps_lost"], 0), _fmt(med["ettr"], 3),
                     _fmt(med["median_step_s"], 3), _fmt(med["run_wall_s"], 1), f"{_fmt(hang, 1)} ({basis})",
                     "; ".join(notes)])
    result["median_step_s"] = _median([result[f"{r}_median_step_s"] for r in outcomes])
    return result, rows


def ratios(figures: dict) -> dict:
    """fleet against torchrun on one job: median step time and the whole run's wall clock."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {"step_time_ratio_vs_torchrun": ratio(figures.get("fleet_median_step_s"),
                                                 figures.get("torchrun_median_step_s")),
            "wall_ratio_vs_torchrun": ratio(figures.get("fleet_run_wall_s"), figures.get("torchrun_run_wall_s"))}


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ddp", "fsdp")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--data-parallel takes ddp and/or fsdp, not {text!r}")
    return modes


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 2 or n % 2 for n in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes takes even sizes >= 2, not {text!r}")
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="last training step")
    parser.add_argument("--kill-step", type=int, default=100, help="rank 1 is killed at the start of this step")
    parser.add_argument("--checkpoint-interval", type=int, default=20)
    parser.add_argument("--runs", type=int, default=1, help="runs per runner (interleaved); medians reported")
    parser.add_argument("--pg-timeout-s", type=float, default=60.0,
                        help="the peers' process-group timeout (their hang detection), seconds")
    parser.add_argument("--raytrain-poll-s", type=float, default=0.5,
                        help="Ray Train controller's worker poll interval (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S)")
    parser.add_argument("--skip-fleet", action="store_true")
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--skip-raytrain", action="store_true")
    parser.add_argument("--check-torchrun-default", action="store_true",
                        help="also run torchrun with torch's default shared rendezvous store (does not recover)")
    parser.add_argument("--data-parallel", type=_modes, default=["ddp", "fsdp"],
                        help="comma-separated jobs: ddp (replicated) and/or fsdp (FSDP2 + expert parallelism "
                        "over 2, the local example's shape); ddp's keys unsuffixed, fsdp's _fsdp")
    parser.add_argument("--world-sizes", type=_sizes, default=[4],
                        help="comma-separated world sizes (even: two nodes); keys of the first unsuffixed, "
                        "the others' _w<size>")
    parser.add_argument("--timeout-s", type=float, default=900, help="per runner and run")
    parser.add_argument("--stall-s", type=float, default=60,
                        help="stop a runner that logs no step for this long after the kill")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep each run's checkpoints, step log and launcher log here")
    args = parser.parse_args()

    runners = [r for r in RUNNERS if not getattr(args, f"skip_{r}")]
    jobs = []  # (key suffix, job): ddp's keys and the first world size's unsuffixed
    for mode in args.data_parallel:
        for j, world in enumerate(args.world_sizes):
            suffix = ("" if mode == "ddp" else f"_{mode}") + ("" if j == 0 else f"_w{world}")
            jobs.append((suffix, RecoveryJob(
                workdir="", steps=args.steps, kill_step=args.kill_step, checkpoint_interval=args.checkpoint_interval,
                pg_timeout_s=args.pg_timeout_s, world_size=world, data_parallel=mode,
                ep_size=2 if mode == "fsdp" else 1)))
    from fleet.workers.flops import describe

    params = describe(jobs[0][1].model())["total_params"]
    for suffix, job in jobs:
        shape = "DDP" if job.data_parallel == "ddp" else f"FSDP2 + expert parallelism over {job.ep_size}"
        print(f"job{suffix or ' (unsuffixed keys)'}: {job.world_size} ranks, {shape}, {params / 1e6:.2f}M "
              f"parameters, {job.steps} steps, checkpoint every {job.checkpoint_interval}, rank {job.kill_rank} "
              f"SIGKILLed at step {job.kill_step}", flush=True)
    print(f"runners {', '.join(runners)}; {args.runs} run(s) each, interleaved", flush=True)

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="fleet-bench-recovery-")
    root = args.workdir.resolve() if args.workdir else Path(tmp.name)
    outcomes: dict[str, dict[str, list[Outcome]]] = {suffix: defaultdict(list) for suffix, _ in jobs}
    shared_store: Outcome | None = None
    base = jobs[0][1]
    try:
        for i in range(args.runs):
            for suffix, job in jobs:
                for runner in runners:  # interleaved, so machine noise hits every runner alike
                    workdir = root / f"run{i + 1}{suffix}-{runner}"
                    workdir.mkdir(parents=True, exist_ok=True)
                    out = _run(runner, dataclasses.replace(job, workdir=str(workdir)), args)
                    outcomes[suffix][runner].append(out)
                    m = metrics(out.step_rows, out.kill_time, job.kill_step)
                    print(f"  run {i + 1}{suffix} {runner}: recovery {_fmt(m['recovery_s'])} s, steps lost "
                          f"{m['steps_lost']}, ETTR {_fmt(m['ettr'], 3)}, median step "
                          f"{_fmt(m['median_step_s'], 3)} s, wall {out.wall_s:.1f} s"
                          + (f" ({out.note})" if out.note else ""), flush=True)
        if args.check_torchrun_default:
            workdir = root / "torchrun-shared-store"
            workdir.mkdir(parents=True, exist_ok=True)
            shared_store = run_torchrun(dataclasses.replace(base, workdir=str(workdir)), workdir,
                                        share_store=True, timeout_s=args.timeout_s, stall_s=min(args.stall_s, 30))
    finally:
        if tmp is not None:
            tmp.cleanup()

    result: dict = {"steps": base.steps, "kill_step": base.kill_step, "kill_rank": base.kill_rank,
                    "world_size": base.world_size, "params": params,
                    "checkpoint_interval": base.checkpoint_interval, "runs": args.runs}
    tables = []
    for suffix, job in jobs:
        figures, rows = summarize(job, outcomes[suffix])
        figures.update(ratios(figures))
        result.update({f"{k}{suffix}": v for k, v in figures.items()})
        tables.append((suffix, job, rows))
    if shared_store is not None:
        m = metrics(shared_store.step_rows, shared_store.kill_time, base.kill_step)
        recovered = m["recovery_s"] is not None
        x = shared_store.extra
        print(f"  torchrun with torch's default shared store: recovered {recovered}; {x['restarts']} "
              f"restart(s), {x['gloo_connect_failures']} gloo connectFullMesh failure lines; "
              f"{shared_store.note or 'finished'}", flush=True)
        result.update(torchrun_shared_store_recovered=recovered,
                      torchrun_shared_store_restarts=x["restarts"],
                      torchrun_shared_store_gloo_failures=x["gloo_connect_failures"])
    for suffix, job, rows in tables:
        if rows:
            print()
            print_table(f"{job.world_size} ranks, {job.data_parallel}: kill of rank {job.kill_rank} at step "
                        f"{job.kill_step}, medians over {args.runs} run(s)",
                        ["runner", "recovery s", "steps lost", "ETTR", "median step s", "wall s",
                         "hang detection s", "note"], rows)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
