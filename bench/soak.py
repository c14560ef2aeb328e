"""Soak: the local example under a random fault every minute, for ten minutes.

    python bench/soak.py [--minutes 10] [--fault-every 60] [--seed 0] [--workdir DIR]

One `fleet up` of examples/local.yaml (2 simulated nodes x 2 ranks, the tiny MoE model,
FSDP2 + expert parallelism, in-memory snapshots, async checkpoints) with ``job.steps``
large enough that the soak, not the job, decides when it ends. Overrides: up to 1000
restarts, everything under one work folder, and automatic quarantine off
(``--quarantine-after 0``): the faults are drawn at random, not from bad hardware, and with
two nodes and a job that needs both, one quarantined node would leave the job waiting
``capacity_wait_s`` (300 s) and then fail.
Disk checkpoints come every ``--checkpoint-interval`` steps, by default the example's own
``job.checkpoint_interval`` (50): a dead rank restores from its buddy's memory, so the
interval no longer bounds what a fault recomputes (it did before peer copies, when the
soak used 10).

The soak clock starts at the first completed step. Every ``--fault-every`` seconds after
that (the last one before ``--minutes`` are up) one fault, drawn from
``FAULT_KINDS`` in shuffled rounds (each kind once per five faults) with a random target (seeded: ``--seed``), goes to the controller as
`fleet inject-fault` would send it (``ControlClient.inject_fault``); while the
controller is between attempts it refuses, and the order is retried for up to
``--inject-retry-s`` seconds: a fault counts only once accepted. At the end the job is
stopped (`fleet up` then exits non-zero, as it does for a stopped job) and the figures
come from `fleet report` and the store:

* **ettr**: `fleet report`'s: productive step time / (job end - job creation), start-up
  included. **ettr_after_startup**: the same productive time / (job end - the first
  step's start). ``meets_target``: ettr >= ``TARGET_ETTR`` (the issue's target; Llama 3
  reported > 90 % effective training time, torchft's public test committed ~82 % of
  steps at one failure per 60 s).
* **recovered**: faults after which the job completed a step beyond the last step
  completed before the fault, within ``--recover-within-s`` seconds (cut short by the
  next fault and by the end of the soak), by an attempt that did not fail in that window
  (so steps an attempt finished before the fault took hold do not count).
  ``progress_s``: the fault to that step's end.
* **restarts**, **steps_lost** (steps recomputed beyond the restore points, summed over
  restarts), per-incident ``recovery_s`` (detection to the first step of the next
  attempt): `fleet report`'s. Incident kinds are the controller's (``node-down`` shows
  as ``node_loss`` or ``crash``, ``agent-down`` as ``agent_loss``, ``slow`` perhaps as
  ``straggler``).
* **wall_s**: the soak, first completed step to the stop order; ``run_wall_s`` is
  `fleet up`'s launch to its exit, ``job_wall_s`` ETTR's denominator.

Figures depend on the machine's load: on 2 shared cores, compare within one run. The
last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleet.controlplane.cli.render import print_table  # noqa: E402

#: The fault mix, drawn uniformly.
FAULT_KINDS = ("crash", "hang", "slow", "node-down", "agent-down")
RANK_FAULTS = frozenset({"crash", "hang", "slow"})
TARGET_ETTR = 0.97  # issue 17 (ByteRobust holds 97 %)
FLEET = [sys.executable, "-m", "fleet.controlplane.cli.main"]


# -- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One fault order: ``rank`` -1 for node faults, ``node`` "" for rank faults."""

    kind: str
    rank: int = -1
    node: str = ""
    duration_s: float = 0.0
    delay_s: float = 0.0

    def describe(self) -> str:
        target = f"rank {self.rank}" if self.rank >= 0 else self.node
        extra = f" for {self.duration_s:g} s" if self.duration_s else ""
        extra += f", +{self.delay_s:g} s/step" if self.delay_s else ""
        return f"{self.kind} on {target}{extra}"


def plan_faults(rng: random.Random, count: int, world_size: int, nodes: int,
                slow_s: float, slow_delay_s: float, node_down_s: float) -> list[Fault]:
    """``count`` faults: the kinds drawn in shuffled rounds of all of ``FAULT_KINDS`` (so
    every kind comes up once in each run of five), targets uniform. A hang lasts until
    the controller kills the rank; an agent-down until the controller restarts the agent."""
    out: list[Fault] = []
    kinds: list[str] = []
    for _ in range(count):
        if not kinds:
            kinds = list(FAULT_KINDS)
            rng.shuffle(kinds)
        kind = kinds.pop()
        if kind in RANK_FAULTS:
            rank = rng.randrange(world_size)
            if kind == "slow":
                out.append(Fault(kind, rank=rank, duration_s=slow_s, delay_s=slow_delay_s))
            else:
                out.append(Fault(kind, rank=rank))
        else:
            node = f"node-{rng.randrange(nodes)}"
            out.append(Fault(kind, node=node, duration_s=node_down_s if kind == "node-down" else 0.0))
    return out


@dataclass
class Injection:
    """What became of one planned fault."""

    fault: Fault
    due_s: float                    # soak seconds it was due
    at: float | None = None         # Unix seconds the controller accepted it; None = never
    attempt: int = 0                # the attempt it was aimed at
    waited_s: float = 0.0           # refusals retried (no running worker group) before that
    error: str = ""


# -- figures (pure) ---------------------------------------------------------------------------


def complete_steps(rows: Sequence, world_size: int) -> list[tuple[int, int, float, float]]:
    """(attempt, step, start, end) of every step all ``world_size`` ranks of an attempt
    finished, in Unix seconds; a synchronous step ends when its slowest rank does."""
    spans: dict[tuple[int, int], list[float]] = {}
    ranks: dict[tuple[int, int], set[int]] = defaultdict(set)
    for r in rows:
        key, end = (r.attempt, r.step), r.end_ns / 1e9
        have = spans.get(key)
        spans[key] = [min(have[0], end - r.step_time_s), max(have[1], end)] if have else [end - r.step_time_s, end]
        ranks[key].add(r.rank)
    return sorted((a, s, v[0], v[1]) for (a, s), v in spans.items() if len(ranks[(a, s)]) >= world_size)


def failed_until(attempts: Sequence) -> dict[int, float]:
    """Per attempt, when it ended if it failed (Unix seconds), else infinity. An attempt
    failed by the *next* fault ends after that fault, so its steps still count for the one
    before it; one failed by this fault ends inside its window, and its steps do not."""
    out: dict[int, float] = defaultdict(lambda: math.inf)
    for a in attempts:
        if a.state.value == "FAILED":
            out[a.number] = a.ended_at if a.ended_at is not None else a.started_at
    return out


def progress_after(spans: Sequence[tuple[int, int, float, float]], lasted: dict[int, float],
                   t: float, limit: float) -> float | None:
    """Seconds from ``t`` to the end of the first step beyond the last one completed by
    ``t``, by an attempt that lasted past ``limit``; None if none ended by ``limit``."""
    before = max((s for _, s, _, end in spans if end <= t), default=0)
    ends = [end for a, s, _, end in spans if s > before and t < end <= limit and lasted[a] > limit]
    return min(ends) - t if ends else None


def _median(values: Sequence[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return round(statistics.median(have), 3) if have else None


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# -- running fleet up -----------------------------------------------------------------------


def write_cluster(workdir: Path, args: argparse.Namespace) -> tuple[Path, dict]:
    """examples/local.yaml with the soak's overrides (module docstring), in ``workdir``."""
    import yaml

    cfg = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    cfg["state_dir"] = str(workdir / ".fleet")
    cfg["store"] = {"url": f"sqlite:///{workdir}/.fleet/fleet.db"}
    if args.checkpoint_interval is None:
        args.checkpoint_interval = cfg["job"]["checkpoint_interval"]
    cfg["job"].update(steps=1_000_000, checkpoint_interval=args.checkpoint_interval, max_restarts=1000,
                      checkpoint_dir=str(workdir / "checkpoints"))
    cfg["policy"]["quarantine_after_incidents"] = args.quarantine_after
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def _session_members(sid: int) -> list[int]:
    """Live processes whose session is ``sid`` (`fleet up`'s: Ray and the workers too)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


class FleetUp:
    """`fleet up --json` in its own session; ``stop`` ends it and everything it started."""

    def __init__(self, cluster: Path, workdir: Path) -> None:
        self.workdir = workdir
        self.t0 = time.monotonic()
        self.ended_at: float | None = None
        self.leftovers: list[int] = []
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(workdir / "fleet-up.json", "wb") as out, open(workdir / "fleet-up.err", "wb") as err:
            self.proc = subprocess.Popen([*FLEET, "up", "--cluster", str(cluster), "--json"], cwd=workdir,
                                         env=env, stdout=out, stderr=err, start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def _wait(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, state_dir: Path, job_id: str, reason: str, timeout_s: float) -> list[str]:
        """Stop the job through the controller and wait ``timeout_s`` for `fleet up` to
        exit; then SIGINT (its own teardown), SIGTERM, SIGKILL in turn. Whatever of its
        session is still alive after it exited is SIGKILLed by PID and noted."""
        notes = []
        if self.running() and job_id:
            from fleet.controlplane.client import ControlClient
            from fleet.controlplane.errors import FleetError

            try:
                with ControlClient.from_state_dir(state_dir, None) as client:
                    client.stop_job(job_id, reason)
            except FleetError as exc:
                notes.append(f"stop_job failed: {exc}")
        for sig, wait_s in ((None, timeout_s), (signal.SIGINT, 60.0), (signal.SIGTERM, 15.0)):
            if sig is not None and self.running():
                notes.append(f"fleet up still running; sent {sig.name}")
                os.kill(self.proc.pid, sig)
            if self._wait(wait_s):
                break
        if self.running():
            notes.append("fleet up still running; SIGKILL")
            self.proc.kill()
            self._wait(10.0)
        self.ended_at = time.monotonic()
        for _ in range(3):  # Ray's processes go down in the background; give them a moment
            self.leftovers = _session_members(self.proc.pid)
            if not self.leftovers:
                break
            time.sleep(2.0)
        if self.leftovers:
            notes.append(f"{len(self.leftovers)} process(es) of fleet up's session outlived it; SIGKILLed")
            for pid in self.leftovers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return notes


@contextmanager
def _no_interrupts() -> Iterator[None]:
    """A bounded teardown runs to its end even on a second Ctrl-C."""
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM takes Ctrl-C's way out: stop the job, end fleet up, report."""
    raise KeyboardInterrupt


def wait_first_step(fleet: FleetUp, state_dir: Path, timeout_s: float) -> str:
    """Block until the job's first step is done; return the job id."""
    from fleet.controlplane import auth
    from fleet.controlplane.client import ControlClient
    from fleet.controlplane.errors import FleetError

    deadline = time.monotonic() + timeout_s
    job_id = ""
    while time.monotonic() < deadline:
        if not fleet.running():
            raise RuntimeError(f"fleet up exited {fleet.proc.returncode} before the first step; "
                               f"see {fleet.workdir / 'fleet-up.err'}")
        try:
            job_id = auth.read_controller_info(state_dir).job_id
            with ControlClient.from_state_dir(state_dir, None) as client:
                if any(r.last_step > 0 for r in client.job_status(job_id).ranks):
                    return job_id
        except FleetError:
            pass  # no controller yet, or no attempt yet
        time.sleep(0.5)
    raise RuntimeError(f"no step completed within {timeout_s:g} s of launch (job {job_id or '?'})")


def inject(client, job_id: str, fault: Fault, retry_s: float) -> tuple[float | None, int, float, str]:  # noqa: ANN001
    """Send ``fault``, retrying refusals (between attempts, controller busy) for up to
    ``retry_s``; return (Unix time accepted or None, attempt, seconds waited, error)."""
    from fleet.controlplane.errors import FleetError, StateError, UnavailableError

    t0 = time.monotonic()
    error = ""
    while True:
        try:
            reply = client.inject_fault(job_id, fault.kind, rank=fault.rank, node=fault.node,
                                        duration_s=fault.duration_s, delay_s=fault.delay_s)
            return time.time(), reply.attempt, time.monotonic() - t0, ""
        except (StateError, UnavailableError) as exc:
            error = str(exc)
        except FleetError as exc:
            return None, 0, time.monotonic() - t0, str(exc)
        if time.monotonic() - t0 >= retry_s:
            return None, 0, time.monotonic() - t0, f"refused for {retry_s:g} s: {error}"
        time.sleep(0.5)


def soak(fleet: FleetUp, state_dir: Path, job_id: str, plan: list[Fault], args: argparse.Namespace,
         injections: list[Injection]) -> float:
    """Inject the planned faults on schedule until the soak is over (or `fleet up` exits);
    append each to ``injections``; return the soak's Unix start (first step seen)."""
    from fleet.controlplane.client import ControlClient

    t_start, m0 = time.time(), time.monotonic()
    end = m0 + args.minutes * 60
    with ControlClient.from_state_dir(state_dir, None) as client:
        for k, fault in enumerate(plan, start=1):
            due = m0 + k * args.fault_every
            while time.monotonic() < due and fleet.running():
                time.sleep(min(1.0, due - time.monotonic()))
            if not fleet.running():
                return t_start
            inj = Injection(fault, round(due - m0, 1))
            inj.at, inj.attempt, inj.waited_s, inj.error = inject(client, job_id, fault, args.inject_retry_s)
            injections.append(inj)
            status = f"accepted (attempt {inj.attempt}" + (f", after {inj.waited_s:.1f} s of refusals)"
                                                          if inj.waited_s >= 0.5 else ")")
            print(f"  [{time.monotonic() - m0:6.1f} s] {fault.describe()}: "
                  f"{status if inj.at else 'NOT injected: ' + inj.error}", flush=True)
    while time.monotonic() < end and fleet.running():
        time.sleep(min(1.0, end - time.monotonic()))
    return t_start


# -- the report -----------------------------------------------------------------------------


def fleet_report(workdir: Path, url: str, job_id: str) -> dict:
    out = subprocess.run([*FLEET, "report", job_id, "--json", "--store", url], cwd=workdir,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"fleet report exited {out.returncode}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def summarize(report: dict, store_url: str, job_id: str, world_size: int, injections: list[Injection],
              t_start: float, t_stop: float, window_s: float) -> tuple[dict, list[list[str]]]:
    """The result dict and one table row per injection (module docstring)."""
    from fleet.controlplane.store import Store

    with Store(store_url) as st:
        rows = st.steps(job_id)
        incidents = st.incidents(job_id)
        attempts = st.get_attempts(job_id)
        job = st.get_job(job_id)
    spans = complete_steps(rows, world_size)
    lasted = failed_until(attempts)
    accepted = [i for i in injections if i.at is not None]
    times = [i.at for i in accepted] + [t_stop]
    table, progress = [], []
    for n, inj in enumerate(accepted):
        limit = min(inj.at + window_s, times[n + 1])
        p = progress_after(spans, lasted, inj.at, limit)
        progress.append(p)
        seen = Counter(i.kind for i in incidents if inj.at <= i.detected_at < limit)
        table.append([str(n + 1), f"{inj.at - t_start:.1f}", inj.fault.describe(), str(inj.attempt),
                      "yes" if p is not None else "NO", _fmt(p), f"{limit - inj.at:.0f}",
                      ", ".join(f"{k} x{c}" if c > 1 else k for k, c in seen.items()) or "-"])
    first_start = min((start for _, _, start, _ in spans), default=None)
    job_end = job.ended_at or time.time()
    productive = report["productive_s"]
    ettr_after = productive / (job_end - first_start) if first_start and job_end > first_start else None
    by_kind: dict[str, list[float | None]] = defaultdict(list)
    for inj, p in zip(accepted, progress):
        by_kind[inj.fault.kind].append(p)
    ended = [i for i in report["incidents"] if i["ended_attempt"]]
    recovery: dict[str, list[float | None]] = defaultdict(list)
    for i in ended:
        recovery[i["kind"]].append(i["recovery_s"])
    result = {
        "ettr": report["ettr"],
        "ettr_basis": "fleet report: productive step time / (job end - job creation), start-up included",
        "ettr_after_startup": None if ettr_after is None else round(ettr_after, 4),
        "ettr_after_startup_basis": "productive step time / (job end - first step start)",
        "target_ettr": TARGET_ETTR,
        "meets_target": report["ettr"] >= TARGET_ETTR,
        "faults": len(accepted),
        "faults_by_kind": dict(Counter(i.fault.kind for i in accepted)),
        "faults_not_injected": [f"{i.fault.describe()}: {i.error}" for i in injections if i.at is None],
        "recovered": sum(p is not None for p in progress),
        "unrecovered": [f"#{n + 1} {inj.fault.describe()} at {inj.at - t_start:.1f} s"
                        for n, (inj, p) in enumerate(zip(accepted, progress)) if p is None],
        "recover_within_s": window_s,
        "recovered_by_kind": {k: sum(p is not None for p in v) for k, v in sorted(by_kind.items())},
        "median_progress_s_by_fault": {k: _median(v) for k, v in sorted(by_kind.items())},
        "restarts": report["restarts"],
        "attempts": report["attempts"],
        "steps_lost": report["steps_lost"],
        "median_recovery_s_by_incident": {k: _median(v) for k, v in sorted(recovery.items())},
        "incidents_by_kind": dict(Counter(i["kind"] for i in report["incidents"])),
        "incidents_ending_attempt_by_kind": dict(Counter(i["kind"] for i in ended)),
        "wall_s": round(t_stop - t_start, 3),
        "job_wall_s": report["wall_s"],
        "productive_s": productive,
        "lost_s": report["lost_s"],
        "final_step": report["final_step"],
        "job_state": report["state"],
        "job_id": job_id,
    }
    return result, table


def print_results(result: dict, table: list[list[str]]) -> None:
    """The tables and the one-line verdict (the JSON follows)."""
    print()
    print_table("faults", ["#", "at s", "fault", "attempt", "recovered", "progress s", "window s",
                           "incidents in window"], table)
    print_table("faults by kind", ["fault", "injected", "recovered", "median progress s"],
                [[k, n, result["recovered_by_kind"][k], _fmt(result["median_progress_s_by_fault"][k])]
                 for k, n in sorted(result["faults_by_kind"].items())])
    print_table("incidents by kind (fleet report)", ["incident", "count", "ended attempt", "median recovery s"],
                [[k, n, result["incidents_ending_attempt_by_kind"].get(k, 0),
                  _fmt(result["median_recovery_s_by_incident"].get(k))]
                 for k, n in sorted(result["incidents_by_kind"].items())])
    print(f"ETTR {result['ettr']:.3f} (job creation to end; {result['ettr_after_startup'] or 0:.3f} from "
          f"the first step) vs target {TARGET_ETTR:.2f}: {'met' if result['meets_target'] else 'NOT met'}; "
          f"{result['recovered']}/{result['faults']} faults recovered, {result['restarts']} restarts, "
          f"{result['steps_lost']} steps lost", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="soak length from the first completed step")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault kinds and targets")
    parser.add_argument("--checkpoint-interval", type=int, default=None,
                        help="steps between disk checkpoints (default: examples/local.yaml's)")
    parser.add_argument("--quarantine-after", type=int, default=0,
                        help="policy.quarantine_after_incidents (0 = off; see the module docstring)")
    parser.add_argument("--slow-s", type=float, default=20.0, help="how long a slow fault lasts, seconds")
    parser.add_argument("--slow-delay-s", type=float, default=0.3, help="a slow rank's extra seconds per step")
    parser.add_argument("--node-down-s", type=float, default=5.0, help="how long a node-down lasts, seconds")
    parser.add_argument("--recover-within-s", type=float, default=60.0,
                        help="a fault is recovered if training passes its step within this many seconds")
    parser.add_argument("--inject-retry-s", type=float, default=30.0,
                        help="retry a refused fault order (no running worker group) this long")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="launch to the first step")
    parser.add_argument("--stop-timeout-s", type=float, default=120.0,
                        help="wait this long for fleet up to exit after the stop, then signal it")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep cluster.yaml, the store, checkpoints and logs here (default: a temporary "
                             "folder, kept only when something went wrong)")
    args = parser.parse_args()

    if args.workdir:
        workdir = args.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="fleet-bench-soak-"))
    cluster, cfg = write_cluster(workdir, args)
    state_dir, url = workdir / ".fleet", cfg["store"]["url"]
    job = cfg["job"]
    world_size, nodes = job["nodes"] * job["ranks_per_node"], job["nodes"]
    count = max(0, math.ceil(args.minutes * 60 / args.fault_every) - 1)
    plan = plan_faults(random.Random(args.seed), count, world_size, nodes,
                       args.slow_s, args.slow_delay_s, args.node_down_s)
    print(f"soak: examples/local.yaml ({nodes} nodes x {job['ranks_per_node']} ranks), {args.minutes:g} min "
          f"from the first step, {count} faults every {args.fault_every:g} s (seed {args.seed}, kinds "
          f"{', '.join(FAULT_KINDS)}), checkpoint every {args.checkpoint_interval} steps; workdir {workdir}",
          flush=True)

    signal.signal(signal.SIGTERM, _interrupt)
    injections: list[Injection] = []
    notes: list[str] = []
    job_id, t_start, t_stop = "", None, None
    fleet = FleetUp(cluster, workdir)
    try:
        job_id = wait_first_step(fleet, state_dir, args.startup_timeout_s)
        print(f"job {job_id}: first step after {time.monotonic() - fleet.t0:.1f} s; soaking", flush=True)
        t_start = soak(fleet, state_dir, job_id, plan, args, injections)
        if not fleet.running():
            notes.append(f"fleet up exited {fleet.proc.returncode} during the soak")
    except KeyboardInterrupt:
        notes.append("interrupted")
    except Exception as exc:  # noqa: BLE001 -- reported below, after the teardown
        notes.append(f"{type(exc).__name__}: {exc}")
    finally:
        t_stop = time.time()
        with _no_interrupts():
            if not job_id:
                try:
                    from fleet.controlplane import auth

                    job_id = auth.read_controller_info(state_dir).job_id
                except Exception:  # noqa: BLE001 -- no controller came up: nothing to stop by id
                    pass
            notes += fleet.stop(state_dir, job_id, "soak over", args.stop_timeout_s)
    run_wall = fleet.ended_at - fleet.t0
    print(f"fleet up exited {fleet.proc.returncode} after {run_wall:.1f} s", flush=True)

    result: dict = {"ettr": None, "faults": sum(i.at is not None for i in injections), "recovered": None,
                    "wall_s": None}
    table: list[list[str]] = []
    if job_id and t_start is not None:
        try:
            report = fleet_report(workdir, url, job_id)
            result, table = summarize(report, url, job_id, world_size, injections, t_start, t_stop,
                                      args.recover_within_s)
        except Exception as exc:  # noqa: BLE001 -- still print what there is
            notes.append(f"report: {type(exc).__name__}: {exc}")
    result.update(run_wall_s=round(run_wall, 3), minutes=args.minutes, fault_every_s=args.fault_every,
                  seed=args.seed, checkpoint_interval=args.checkpoint_interval,
                  quarantine_after=args.quarantine_after, notes=notes)
    if notes or result.get("unrecovered") or result.get("faults_not_injected"):
        result["workdir"] = str(workdir)  # kept: controller.log says what happened
    elif not args.workdir:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)

    if table:
        print_results(result, table)
    for note in notes:
        print(f"note: {note}", flush=True)
    print(json.dumps(result))
    return 0 if not notes or notes == ["interrupted"] else 1


if __name__ == "__main__":
    sys.exit(main())
