"""Scale: simulated ranks, real gRPC streams, the real controller, ingest, watchdog and store.

    python bench/scale.py [--ranks 256,1024,4096,16384] [--store postgres|sqlite]
                          [--trials 5] [--agent-procs 4] [--per-step 100] [--step-s 1.0]
                          [--storm-nodes 2048] [--quick] [--seed 0]

Per R: a headless controller (``bench.scale_controller``: Store, AgentRegistry, Watchdog with
``send``, AgentServicer, ControllerServer on 127.0.0.1) and ``--agent-procs`` processes of
synthetic agents (``bench.scale_agents``: one asyncio loop each, one ``AgentService.Connect``
stream per node of 8 ranks, layout and schedule in ``bench.scale_schedule``: TP 8 x PP 4 x
DP R/32, ``--per-step`` collectives a step of ``--step-s``).

Measured per R, each trial a fresh attempt:
  * steady window (first trial, before the fault, after ``--warmup-s`` of the attempt):
    controller CPU seconds per second per rank (``controller_cpu_s_per_rank_s``),
    controller RSS, the agents' CPU, ingest lag (a step's ``end_ns`` -> the snapshot of
    the first store query that sees its row, polled for a few sampled ranks; p90; an upper
    bound by the poll period), acks (max gap between two acks of one stream, and the
    longest from writing a batch to its ack: ``max_ack_latency_s``). The same
    lag over the warm-up itself, the attempt's start (every rank's groups declared, every
    front new), is ``ingest_lag_start_s``;
  * hang trials: a random rank (seeded) stops entering collectives; ``detect_s`` = p90 of
    (incident's ``detected_at`` - the fault's onset) over trials whose incident names the
    right rank AND node; ``named`` counts them. A trial with no incident in
    ``--detect-timeout-s`` counts as missed;
  * desync (at the largest R, or ``--desync``): one rank enters a different op; right when
    the incident is a desync naming that rank and node;
  * refused/starved: streams never welcomed, acks rejected; starved = a batch whose ack
    came over 2 s after it was written (``max_ack_latency_s``); the largest gap between two
    acks of one stream is reported too (it adds the sending process's own jitter);
  * reconnect storm (the largest R whose nodes >= ``--storm-nodes``, or every R in
    --quick): SIGKILL the controller mid-stream, start it again on the same port and store,
    time until every stream is welcomed again (``reconnect_s_<streams>``); then freeze the
    agents, wait for every ack, and count by keys: steps rows by (job, attempt, rank, step)
    == steps sent and none doubled; ingest_batches rows per agent == batches it sent;
  * replay: ``fleet replay JOB --store URL`` on the largest R (its wall time, exit status,
    whether it names the last hang's culprit).

Prints a line per measurement as it goes; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from bench.scale_agents import STREAMS_PER_CONNECTION  # noqa: E402
from bench.scale_controller import TOKEN  # noqa: E402
from bench.scale_schedule import Layout, Schedule, Trial, fault_at, p90  # noqa: E402

LAG_SAMPLE_RANKS = 8
POLL_S = 0.25


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(text: str) -> None:
    print(text, flush=True)


class Child:
    """A child process speaking JSON lines on stdin/stdout."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, cwd=REPO)
        self.ps = psutil.Process(self.proc.pid)

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args[2]} exited ({self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def ask(self, obj: dict) -> dict:
        self.send(obj)
        return self.read()

    def _tree(self) -> list[psutil.Process]:
        """The process and its live children (a controller's ingest processes)."""
        try:
            return [self.ps, *self.ps.children(recursive=True)]
        except psutil.Error:
            return [self.ps]

    def cpu_s(self) -> float:
        """CPU seconds of the process and its live children."""
        total = 0.0
        for p in self._tree():
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def rss_mib(self) -> float:
        """Resident memory of the process and its live children."""
        total = 0
        for p in self._tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        return total / 2**20

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Run:
    """One R: the controller, the agents and the store of one job."""

    def __init__(self, args: argparse.Namespace, ranks: int, url: str, folder: Path,
                 store_pids: Callable[[], set[int]]) -> None:
        from fleet.controlplane.lifecycle import JobState
        from fleet.controlplane.store import Store

        self.args, self.ranks, self.url, self.folder = args, ranks, url, folder
        self.store_pids = store_pids
        self.layout = Layout(ranks)
        self.schedule = Schedule(args.per_step, args.step_s)
        self.store = Store(url)
        self.job = self.store.create_job(f"scale-{ranks}", 1_000_000, "{}")
        self.store.set_job_state(self.job, JobState.PLACING, "bench")
        self.store.set_job_state(self.job, JobState.RUNNING, "bench")
        self.port = _free_port()
        self.ingest_processes = ingest_processes(args, ranks)
        self.ctl = self._controller(None)
        self.address = self.ctl.read()["address"]
        nodes, procs = self.layout.nodes, max(1, min(args.agent_procs, self.layout.nodes))
        self.agents: list[Child] = []
        first = 0
        for i in range(procs):
            count = nodes // procs + (1 if i < nodes % procs else 0)
            self.agents.append(Child(["bench.scale_agents", "--address", self.address, "--token", TOKEN,
                                      "--ranks", str(ranks), "--first", str(first), "--count", str(count),
                                      "--per-step", str(args.per_step), "--step-s", str(args.step_s),
                                      "--batch-interval-s", str(batch_interval_s(args, ranks)),
                                      "--streams-per-connection", str(args.streams_per_connection),
                                      *(["--no-pull"] if args.no_pull else [])],
                                     folder / f"agents-{ranks}-{i}.log"))
            first += count
        for a in self.agents:
            a.read()  # ready
        self.attempt = 0
        self.t0_ns = 0
        self._steps_before_attempt = 0

    def _controller(self, attempt: int | None) -> Child:
        a = self.args
        extra = ["--attempt", str(attempt)] if attempt else []
        if a.hang_factor is not None:
            extra += ["--hang-factor", str(a.hang_factor)]
        extra += ["--ingest-processes", str(self.ingest_processes)]
        return Child(["bench.scale_controller", "--store", self.url, "--port", str(self.port), "--job", self.job,
                      "--ranks", str(self.ranks), *extra], self.folder / f"controller-{self.ranks}.log")

    def stats(self) -> list[dict]:
        for a in self.agents:
            a.send({"cmd": "stats"})
        return [a.read() for a in self.agents]

    def wait_welcomed(self, timeout_s: float, since: float = 0.0) -> float | None:
        """Seconds until every stream was welcomed (after ``since``, Unix time); None on timeout."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            st = self.stats()
            if all(s["connected"] == s["streams"] for s in st) and (
                    not since or all(s["newest_welcome"] >= since for s in st)):
                return time.monotonic() - start
            time.sleep(POLL_S)
        _say(f"  not every stream welcomed within {timeout_s:.0f} s: "
             f"{[(s['connected'], s['streams'], s.get('stages'), s.get('stuck_in_hello')) for s in self.stats()]}")
        return None

    def new_attempt(self) -> None:
        self.attempt = self.ctl.ask({"cmd": "attempt"})["attempt"]
        self.t0_ns = time.time_ns() + int(0.3e9)
        for a in self.agents:
            a.send({"cmd": "attempt", "job": self.job, "attempt": self.attempt, "t0_ns": self.t0_ns})

    def plant(self, kind: str, rank: int) -> Trial:
        at_ns = time.time_ns() + int(0.2e9)
        fault = fault_at(self.schedule, self.t0_ns, at_ns, kind, rank)
        for a in self.agents:
            a.send({"cmd": "fault", "kind": kind, "rank": rank, "op_index": fault.op_index})
        onset = self.schedule.op_enter_ns(self.t0_ns, fault.op_index)
        return Trial(kind, rank, self.layout.node_of(rank), onset, self.attempt)

    def wait_incident(self, trial: Trial, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [i for i in self.store.incidents(self.job)
                     if i.attempt == trial.attempt and i.kind.value in ("hang", "desync")]
            if found:
                i = found[0]
                named = i.rank == trial.rank and i.node == trial.node and i.kind.value == trial.kind
                return {"kind": i.kind.value, "rank": i.rank, "node": i.node, "named": named,
                        "detect_s": round(i.detected_at - trial.onset_ns / 1e9, 3), "detector": i.detector,
                        "evidence": i.evidence[:300]}
            time.sleep(POLL_S)
        return {"kind": None, "named": False, "detect_s": None}

    def lags(self, window_s: float) -> tuple[list[float], list[float]]:
        """For ``window_s``: (each sampled rank's new step's ingest lag, from its end to the
        snapshot of the store query that first saw it; each query's duration)."""
        from sqlalchemy import bindparam, create_engine, text

        rng = random.Random(self.ranks)
        sample = sorted(rng.sample(range(self.ranks), min(LAG_SAMPLE_RANKS, self.ranks)))
        q = text("SELECT rank, step, end_ns FROM steps WHERE job_id = :j AND attempt = :a AND step > :s "
                 "AND rank IN :r").bindparams(bindparam("r", expanding=True))
        seen: set[tuple[int, int]] = set()
        newest = 0
        lags: list[float] = []
        query_s: list[float] = []
        polls = 0
        t0 = time.monotonic()
        engine = create_engine(self.url)
        try:
            while time.monotonic() - t0 < window_s:
                with engine.connect() as c:
                    # a row this query sees was committed before its snapshot, taken as the
                    # statement starts: its lag is measured to then, not to when the answer
                    # came back (the query's own time on a loaded server is not ingest lag)
                    now = time.time()
                    rows = c.execute(q, {"j": self.job, "a": self.attempt, "s": max(0, newest - 3),
                                         "r": sample}).all()
                    query_s.append(time.time() - now)
                for rank, step, end_ns in rows:
                    if (rank, step) not in seen:
                        seen.add((rank, step))
                        newest = max(newest, step)
                        if polls:  # the first poll finds steps of before the window: a baseline
                            lags.append(now - end_ns / 1e9)
                polls += 1
                time.sleep(POLL_S)
        finally:
            engine.dispose()
        return lags, query_s

    def steady(self, window_s: float) -> dict:
        """Controller CPU, RSS, agents' CPU, ingest lag and ack gaps over ``window_s``."""
        for a in self.agents:
            a.send({"cmd": "reset"})
        ctl0, agents0, t0 = self.ctl.cpu_s(), sum(a.cpu_s() for a in self.agents), time.monotonic()
        store0 = _cpu_of(self.store_pids())
        lags, query_s = self.lags(window_s)
        took = time.monotonic() - t0
        ctl_cpu = (self.ctl.cpu_s() - ctl0) / took
        agents_cpu = (sum(a.cpu_s() for a in self.agents) - agents0) / took
        store_cpu = _delta(store0, _cpu_of(self.store_pids())) / took
        st = self.stats()
        return {"controller_cpu_s_per_s": round(ctl_cpu, 3),
                "controller_cpu_s_per_rank_s": ctl_cpu / self.ranks,
                "controller_rss_mib": round(self.ctl.rss_mib(), 1),
                "agents_cpu_s_per_s": round(agents_cpu, 3),
                "store_cpu_s_per_s": round(store_cpu, 3),
                "ingest_lag_s": round(p90(lags), 3) if lags else None, "lag_samples": len(lags),
                "lag_query_s": round(statistics.median(query_s), 3) if query_s else None,
                "max_ack_gap_s": round(max(s["max_ack_gap_s"] for s in st), 3),
                "max_ack_latency_s": round(max(s["max_ack_latency_s"] for s in st), 3),
                "agents_tick_cpu_s": round(max(s["tick_cpu_s"] for s in st), 4)}

    def storm(self) -> dict:
        """SIGKILL the controller, restart it on the same port and store; time the welcomes;
        then count every event by key."""
        from sqlalchemy import create_engine, text

        streams = self.layout.nodes
        time.sleep(self.args.settle_s)
        self.ctl.stop(signal.SIGKILL)
        killed = time.time()
        self.ctl = self._controller(self.attempt)
        self.ctl.read()
        ready = time.time()
        took = self.wait_welcomed(120, since=ready)
        reconnect_s = None
        if took is not None:
            reconnect_s = round(max(s["newest_welcome"] for s in self.stats()) - ready, 3)
        _say(f"  storm: {streams} streams; controller killed, back {ready - killed:.2f} s later; "
             f"all welcomed again {reconnect_s} s after it served")
        time.sleep(self.args.settle_s)
        for a in self.agents:
            a.send({"cmd": "freeze"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = self.stats()
            if sum(s["unacked"] for s in st) == 0:
                break
            time.sleep(POLL_S)
        st = self.stats()
        sent_batches: dict[str, int] = {}
        epochs: dict[str, int] = {}
        for s in st:
            sent_batches.update(s["batches"])
            epochs.update(s["epochs"])
        engine = create_engine(self.url)
        try:
            with engine.connect() as c:
                rows, keys = c.execute(text(
                    "SELECT count(*), count(DISTINCT CAST(rank AS BIGINT) * 1000000000 + step) FROM steps "
                    "WHERE job_id = :j AND attempt = :a"), {"j": self.job, "a": self.attempt}).one()
                stored = dict(c.execute(text(
                    "SELECT agent_id, count(*) FROM ingest_batches WHERE agent_id LIKE 'scale-agent-%' "
                    "GROUP BY agent_id")).all())
        finally:
            engine.dispose()
        # steps sent for this attempt: the agents count since its start
        sent_steps = sum(s["steps"] for s in st) - self._steps_before_attempt
        unacked = sum(s["unacked"] for s in st)
        batches_ok = all(stored.get(a, 0) == n for a, n in sent_batches.items())
        # lost or doubled can only be told once everything is acked; duplicates always
        exact = (rows == keys == sent_steps and batches_ok) if unacked == 0 else None
        verdict = {True: "exactly once", False: "NOT exactly once",
                   None: f"NOT FLUSHED: {unacked:,} batches still unacked after 60 s; "
                         f"{'no' if rows == keys else rows - keys} duplicate steps so far"}[exact]
        _say(f"  storm: steps sent {sent_steps:,}, rows {rows:,}, distinct keys {keys:,}; batches per agent "
             f"{'all equal' if batches_ok else 'differ'} ({sum(sent_batches.values()):,} sent, "
             f"{sum(stored.values()):,} stored) -> {verdict}")
        return {"streams": streams, "reconnect_s": reconnect_s, "restart_s": round(ready - killed, 3),
                "exactly_once": exact, "unacked": unacked, "duplicate_steps": rows - keys,
                "steps_sent": sent_steps, "steps_rows": rows, "steps_keys": keys,
                "batches_sent": sum(sent_batches.values()), "batches_stored": sum(stored.values())}

    def close(self) -> None:
        for a in self.agents:
            try:
                a.send({"cmd": "quit"})
            except (BrokenPipeError, OSError):
                pass
        for a in self.agents:
            a.stop(timeout_s=15)
        self.ctl.stop()
        self.store.close()


def batch_interval_s(args: argparse.Namespace, ranks: int) -> float:
    """``--batch-interval-s``, else what a real agent of an R-rank job uses under the
    default cluster.yaml (a large job batches less often)."""
    if args.batch_interval_s is not None:
        return args.batch_interval_s
    from fleet.controlplane.config import AgentConfig

    return AgentConfig().batch_interval_for(ranks)


def _cpu_of(pids: set[int]) -> dict[int, float]:
    """CPU seconds so far of each live process of ``pids``."""
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            continue
    return out


def _delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two ``_cpu_of`` readings (processes started since count whole)."""
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def limits(r: dict) -> list[str]:
    """Where R ``r`` misses the issue's targets (detect < 5 s p90, ingest lag <= 2 s, nobody
    refused or starved, RSS <= 4 GiB, every hang named, replay <= 10 s at 16,384)."""
    out = []
    if r.get("broke"):
        out.append(r["broke"])
    if r.get("detect_s") is None or r["detect_s"] >= 5:
        out.append(f"detect p90 {r.get('detect_s')} s (target < 5 s)")
    if r.get("named") is not None and r["named"] < r.get("trials", 0):
        out.append(f"hang named right {r['named']}/{r['trials']}")
    if r.get("ingest_lag_s") is None:
        out.append("ingest lag: no sampled rank's step became visible in the store within the window")
    elif r["ingest_lag_s"] > 2:
        out.append(f"ingest lag p90 {r['ingest_lag_s']} s (target <= 2 s)")
    if r.get("refused"):
        out.append(f"{r['refused']} stream(s) never welcomed")
    # starved: a batch not acked (committed) within 2 s of being written, the ingest-lag
    # bound. The gap between two acks of one stream is reported beside it but is not the
    # test: it adds the sender's own jitter (a tick that runs late) to the server's
    if r.get("max_ack_latency_s") is not None and r["max_ack_latency_s"] > 2:
        out.append(f"a batch waited {r['max_ack_latency_s']} s for its ack (starved)")
    if r.get("controller_rss_mib") is not None and r["controller_rss_mib"] > 4096:
        out.append(f"controller RSS {r['controller_rss_mib']} MiB (target <= 4 GiB)")
    if r.get("desync_ok") is False:
        out.append("desync not named right")
    if r.get("ranks") == 16384 and r.get("replay_s") is not None and r["replay_s"] > 10:
        out.append(f"replay {r['replay_s']} s (target <= 10 s at 16,384 ranks)")
    if r.get("stream_errors"):
        out.append(f"{r['stream_errors']} unexpected error(s) in the synthetic agents' streams")
    if r.get("replay_rc"):
        out.append(f"replay exited {r['replay_rc']}")
    storm = r.get("storm")
    if storm and storm["exactly_once"] is False:
        out.append("reconnect storm: events lost or doubled")
    if storm and storm["exactly_once"] is None:
        out.append(f"reconnect storm: {storm['unacked']:,} batches never acked within 60 s (ingest behind)")
    if storm and storm["reconnect_s"] is None:
        out.append("reconnect storm: not every stream was welcomed again within 120 s")
    return out


def replay(url: str, job: str, culprit: int | None) -> dict:
    fleet = shutil.which("fleet", path=str(Path(sys.executable).parent)) or "fleet"
    t = time.monotonic()
    proc = subprocess.run([fleet, "replay", job, "--store", url], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    took = time.monotonic() - t
    names = culprit is not None and f"rank {culprit}" in proc.stdout
    return {"replay_s": round(took, 3), "replay_rc": proc.returncode, "replay_names_culprit": names,
            "replay_tail": (proc.stdout + proc.stderr)[-400:] if proc.returncode else ""}


def ingest_processes(args: argparse.Namespace, ranks: int) -> int:
    """The controller's ingest processes for a job of ``ranks``: ``--ingest-processes``, or
    what ``controller.ingest_processes: auto`` (the default) starts for it."""
    from fleet.controlplane.config import AUTO_INGEST_MIN_RANKS, AUTO_INGEST_RANKS_PER_PROCESS

    if args.ingest_processes is not None:
        return args.ingest_processes
    if ranks <= AUTO_INGEST_MIN_RANKS or args.store != "postgres":
        return 0
    return -(-ranks // AUTO_INGEST_RANKS_PER_PROCESS) + 1


def run_one(args: argparse.Namespace, ranks: int, url: str, folder: Path, rng: random.Random,
            last: bool, store_pids: Callable[[], set[int]]) -> dict:
    _say(f"R={ranks:,}: {ranks // 8:,} streams over {min(args.agent_procs, ranks // 8)} agent process(es), "
         f"store {args.store}, {ingest_processes(args, ranks)} ingest process(es)")
    run = Run(args, ranks, url, folder, store_pids)
    out: dict = {"ranks": ranks, "ingest_processes": run.ingest_processes}
    try:
        took = run.wait_welcomed(120)
        st = run.stats()
        out["welcomed"] = sum(s["welcomed"] for s in st)
        out["refused"] = run.layout.nodes - out["welcomed"]
        _say(f"  {out['welcomed']:,}/{run.layout.nodes:,} streams welcomed"
             + (f" in {took:.2f} s" if took is not None else " (TIMED OUT)"))
        if took is None:
            out["broke"] = "not every stream was welcomed within 120 s"
            return out
        detect, named, trials = [], 0, []
        n_trials = args.trials if ranks == max(args.ranks) else max(1, min(args.trials, args.small_trials))
        for t in range(n_trials):
            run._steps_before_attempt = sum(s["steps"] for s in run.stats())
            run.new_attempt()
            if t == 0:
                # the attempt's start (every rank declares its groups, every front is new):
                # its backlog is measured on its own, then the steady state
                start, _ = run.lags(args.warmup_s)
                out.update(run.steady(args.window_s))
                out["ingest_lag_start_s"] = round(p90(start), 3) if start else None
                _say(f"  steady: controller {out['controller_cpu_s_per_s']:.2f} CPU s/s "
                     f"({out['controller_cpu_s_per_rank_s'] * 1e6:.1f} us per rank-second), "
                     f"RSS {out['controller_rss_mib']:.0f} MiB; agents {out['agents_cpu_s_per_s']:.2f} CPU s/s; "
                     f"ingest lag p90 {out['ingest_lag_s']} s (its query took {out['lag_query_s']} s, median); "
                     f"max ack gap {out['max_ack_gap_s']} s (batch written -> acked: at most "
                     f"{out['max_ack_latency_s']} s); in the attempt's first {args.warmup_s:g} s "
                     f"ingest lag p90 {out['ingest_lag_start_s']} s")
            else:
                time.sleep(args.trial_warmup_s)
            culprit = rng.randrange(ranks)
            trial = run.plant("hang", culprit)
            res = run.wait_incident(trial, args.detect_timeout_s)
            trials.append({"rank": culprit, **res})
            if res["named"]:
                named += 1
                detect.append(res["detect_s"])
            _say(f"  hang trial {t + 1}: culprit rank {culprit} ({trial.node}) -> "
                 f"{res['kind']} on rank {res.get('rank')} ({res.get('node')}) "
                 f"{'RIGHT' if res['named'] else 'WRONG'} after {res['detect_s']} s [{res.get('detector')}]")
            out["last_culprit"] = culprit
        out["detect_s"] = p90(detect)
        out["named"] = named
        out["trials"] = n_trials
        out["hang_trials"] = trials
        if args.desync or (last and not args.quick):
            run._steps_before_attempt = sum(s["steps"] for s in run.stats())
            run.new_attempt()
            time.sleep(args.trial_warmup_s)
            culprit = rng.randrange(ranks)
            trial = run.plant("desync", culprit)
            res = run.wait_incident(trial, args.detect_timeout_s)
            out["desync_ok"] = res["named"]
            out["desync_s"] = res["detect_s"]
            _say(f"  desync: culprit rank {culprit} ({trial.node}) -> {res['kind']} on rank {res.get('rank')} "
                 f"{'RIGHT' if res['named'] else 'WRONG'} after {res['detect_s']} s")
        if args.quick or (last and run.layout.nodes >= args.storm_nodes):
            run._steps_before_attempt = sum(s["steps"] for s in run.stats())
            run.new_attempt()
            out["storm"] = run.storm()
        st = run.stats()
        out["rejected"] = sum(s["rejected"] for s in st)
        out["stream_errors"] = sum(s["stream_errors"] for s in st)
        if out["stream_errors"]:
            _say(f"  {out['stream_errors']} unexpected stream error(s) in the synthetic agents, e.g. "
                 f"{next(s['last_stream_error'] for s in st if s['last_stream_error'])}")
        out["pulls_answered"] = sum(s["pulls"] for s in st)
        out["reconnects"] = sum(s["reconnects"] for s in st)
    finally:
        run.close()
    if last and args.replay:
        out.update(replay(url, run.job, out.get("last_culprit")))
        _say(f"  replay: {out['replay_s']} s, exit {out['replay_rc']}, names the culprit: "
             f"{out['replay_names_culprit']}")
    return out


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="256,1024,4096,16384", help="comma-separated rank counts")
    parser.add_argument("--store", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--postgres-url", help="an existing server's admin URL (default: start one)")
    parser.add_argument("--trials", type=int, default=5, help="hang trials at the largest R")
    parser.add_argument("--small-trials", type=int, default=2, help="hang trials at smaller R")
    parser.add_argument("--agent-procs", type=int, default=4)
    parser.add_argument("--per-step", type=int, default=100, help="collectives per step per rank")
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--batch-interval-s", type=float, default=None,
                        help="how often each agent sends a batch (default: what a real agent of a job "
                        "of R ranks uses under the default cluster.yaml)")
    parser.add_argument("--hang-factor", type=float, default=None, help="DetectConfig.hang_factor (default its own)")
    parser.add_argument("--warmup-s", type=float, default=12.0,
                        help="the attempt's start before the steady window (its ingest lag reported apart)")
    parser.add_argument("--trial-warmup-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--settle-s", type=float, default=2.0, help="storm: streaming before the kill and after")
    parser.add_argument("--detect-timeout-s", type=float, default=30.0)
    parser.add_argument("--storm-nodes", type=int, default=2048)
    parser.add_argument("--desync", action="store_true", help="a desync trial at every R")
    parser.add_argument("--no-pull", action="store_true",
                        help="agents ignore TracePulls: the watchdog decides on the fronts alone")
    parser.add_argument("--no-replay", dest="replay", action="store_false")
    parser.add_argument("--quick", action="store_true",
                        help="128 ranks, SQLite, one hang trial (a desync trial with --desync), a small storm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streams-per-connection", type=int, default=STREAMS_PER_CONNECTION,
                        help="agent streams sharing one TCP connection (default %(default)s, which costs the simulated "
                        "agents less CPU on the controller's own machine; 1: each its own, as real agents)")
    parser.add_argument("--ingest-processes", type=int, default=None,
                        help="controller.ingest_processes (default: what its auto starts: none up to 4,096 "
                        "ranks or on SQLite, else one per 8,192 ranks plus one)")
    args = parser.parse_args()
    if args.streams_per_connection < 1:
        parser.error(f"--streams-per-connection: {args.streams_per_connection} (must be at least 1)")
    if args.quick:
        args.ranks, args.store, args.trials, args.small_trials = "128", "sqlite", 1, 1
        args.warmup_s, args.trial_warmup_s, args.window_s, args.agent_procs = 3.0, 3.0, 2.0, 2
        args.settle_s = 1.0
        args.detect_timeout_s = min(args.detect_timeout_s, 20.0)
    try:
        args.ranks = [int(r) for r in args.ranks.split(",")]
        for r in args.ranks:
            Layout(r)
        Schedule(args.per_step, args.step_s)
    except ValueError as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    # SIGTERM as Ctrl-C: the finally blocks below stop the controller, agents and server
    signal.signal(signal.SIGTERM, _interrupted)
    folder = Path(tempfile.mkdtemp(prefix="fleet-bench-scale-"))
    _say(f"bench/scale.py: ranks {args.ranks}, {args.per_step} collectives per {args.step_s} s step, "
         f"store {args.store}; logs in {folder}")
    server = None
    results = []
    try:
        if args.store == "postgres" and not args.postgres_url:
            from tests.pg import PostgresServer
            server = PostgresServer(crash_safe=True).start()
        for i, ranks in enumerate(args.ranks):
            if args.store == "sqlite":
                url = f"sqlite:///{folder}/scale-{ranks}.db"
            elif server is not None:
                url = server.create_database()
            else:
                url = args.postgres_url
            pids = server.pids if server is not None else set
            results.append(run_one(args, ranks, url, folder, rng, i == len(args.ranks) - 1, pids))
            results[-1]["misses"] = limits(results[-1])
            _say(f"  targets missed at R={ranks:,}: {'; '.join(results[-1]['misses']) or 'none'}")
    finally:
        if server is not None:
            server.stop()
    last = results[-1]
    _say("\n    ranks  detect_s  ingest_lag_s  ctl_cpu_us/rank_s  ctl_rss_mib  agents_cpu  store_cpu  named")
    for r in results:
        cpu = r.get("controller_cpu_s_per_rank_s")
        _say(f"  {r['ranks']:7,}  {r.get('detect_s')!s:>8}  {r.get('ingest_lag_s')!s:>12}  "
             f"{'-' if cpu is None else f'{cpu * 1e6:.1f}':>17}  {r.get('controller_rss_mib')!s:>11}  "
             f"{r.get('agents_cpu_s_per_s')!s:>10}  {r.get('store_cpu_s_per_s')!s:>9}  "
             f"{r.get('named')}/{r.get('trials')}")
    first_miss = next(((r["ranks"], r["misses"]) for r in results if r["misses"]), None)
    _say("breaks first: " + (f"R={first_miss[0]:,}: {'; '.join(first_miss[1])}" if first_miss else
                             "nowhere in this run"))
    storm = next((r["storm"] for r in reversed(results) if "storm" in r), None)
    out = {
        "ranks": [r["ranks"] for r in results],
        "detect_s": [r.get("detect_s") for r in results],
        "ingest_lag_s": [r.get("ingest_lag_s") for r in results],
        "ingest_lag_start_s": [r.get("ingest_lag_start_s") for r in results],
        "controller_cpu_s_per_rank_s": [r.get("controller_cpu_s_per_rank_s") for r in results],
        "controller_rss_mib": [r.get("controller_rss_mib") for r in results],
        "agents_cpu_s_per_s": [r.get("agents_cpu_s_per_s") for r in results],
        "ingest_processes": [r.get("ingest_processes") for r in results],
        "named": [r.get("named") for r in results],
        "trials": [r.get("trials") for r in results],
        "refused": [r.get("refused") for r in results],
        "rejected": [r.get("rejected") for r in results],
        "stream_errors": [r.get("stream_errors") for r in results],
        "max_ack_gap_s": [r.get("max_ack_gap_s") for r in results],
        "max_ack_latency_s": [r.get("max_ack_latency_s") for r in results],
        "desync_ok": last.get("desync_ok"),
        "replay_s_16384": last.get("replay_s") if last["ranks"] == 16384 else None,
        "replay_s": last.get("replay_s"), "replay_ok": last.get("replay_rc") == 0,
        "replay_names_culprit": last.get("replay_names_culprit"),
        "reconnect_s_2048": storm["reconnect_s"] if storm and storm["streams"] >= 2048 else None,
        "reconnect": storm,
        "store_cpu_s_per_s": [r.get("store_cpu_s_per_s") for r in results],
        "store": args.store,
        "broke": [r.get("broke") for r in results],
        "misses": [r["misses"] for r in results],
        "breaks_first": first_miss[0] if first_miss else None,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
