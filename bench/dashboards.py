"""The dashboards' data path: incident -> annotation delay, /metrics scrape cost, exporter CPU share.

    .venv/bin/python bench/dashboards.py [--steps 120] [--scrapes 50] [--sim-ranks 4,64] [--no-ab]

One local job (examples/local.yaml's shape: two simulated nodes, four gloo ranks, FSDP2 +
expert parallelism, the tiny MoE model) with a crash (rank 2) and a hang (rank 0) scheduled
in its ``chaos:`` section, scraped every second by a real Prometheus (Debian's, started
from dashboards/prometheus.yml with the intervals at 1 s: tests/prometheus.py). Figures:

* **annotation_delay_s**: per incident, its ``detected_at`` (the store's row) to the first
  time the dashboards' annotation query returns it (polled every 0.1 s); the target is <= 5 s.
* **scrape_s_4_ranks**: the median wall time of a GET of the controller's /metrics (urllib,
  every 5 s while the job runs: 4 real ranks).
* **scrape_s_{N}_ranks_sim**, **scrape_s_64_ranks**: the same against an in-process controller
  metrics object (a real ``ControllerMetrics`` + ``CollectiveMetrics`` + ``JobMetrics`` over
  a SQLite store, served over HTTP) fed synthetic batches of N ranks (8 per node, 20
  steps: two MoE layers of 16 experts, a world all_reduce and an 8-rank all_to_all per
  step, fingerprint checks, 3 incidents per node); median of ``--scrapes`` scrapes.
* **exporter_cpu_share**: the same job run again with ``controller.metrics: false``
  (``--no-ab`` skips it): 1 - the controller process's CPU time (psutil, user + system,
  whole runs) without metrics / with them; one run each, so a few percent either way is noise.
* **exporter_wall_share**: ``fleet_exporter_collect_seconds_total`` (the wall time of the
  exporter's scrapes and refreshes, waits for the GIL and the store included: it overstates
  the CPU) over the controller's CPU time, both from the first to the last timed scrape.
* **cpu_scrape_s_{N}_ranks_sim**, **cpu_refresh_s_{N}_ranks_sim**: this thread's CPU time
  (``time.thread_time``) to render one scrape and to run one refresh of the simulated
  controller: the exporter's CPU itself, without waits.
* **panels**, **panels_with_data**: panels of the generated dashboards, and those all of
  whose queries returned series (instant queries, Grafana's variables filled in) at some
  point while the job ran.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
import yaml  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fleet.controlplane.collective_metrics import CollectiveMetrics  # noqa: E402
from fleet.controlplane.job_metrics import JobMetrics, MetricsRefresher  # noqa: E402
from fleet.controlplane.lifecycle import AttemptState, JobState  # noqa: E402
from fleet.controlplane.metrics import TARGETS_FILE, ControllerMetrics  # noqa: E402
from fleet.controlplane.store import Store  # noqa: E402
from fleet.controlplane.store.ingest import PreparedBatch, prepare  # noqa: E402
from fleet.proto import events_pb2  # noqa: E402
from tests.prometheus import PrometheusServer, annotation_expr, panel_queries, substitute  # noqa: E402

FLEET = [sys.executable, "-m", "fleet.controlplane.cli.main"]
INTERVAL_S = 1.0           # Prometheus's scrape and the controller's metrics refresh
POLL_S = 0.1               # the annotation query
TIMED_SCRAPE_EVERY_S = 5.0
PANELS_EVERY_S = 2.0
TARGET_DELAY_S = 5.0


def write_job(tmp: Path, steps: int, *, metrics: bool = True) -> Path:
    cfg = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    cfg["controller"]["metrics"] = metrics
    cfg["job"].update(steps=steps, checkpoint_interval=20, checkpoint_dir=str(tmp / ".fleet" / "checkpoints"))
    cfg["ray"]["cpus_per_node"] = 3
    cfg["controller"]["metrics_refresh_interval_s"] = INTERVAL_S
    # a crash and a hang on different nodes (two on one node would quarantine it)
    cfg["chaos"] = {"faults": [{"kind": "crash", "rank": 2, "at_step": steps // 4},
                               {"kind": "hang", "rank": 0, "at_step": steps * 3 // 5, "duration_s": 0}]}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def timed_scrape(port: int) -> tuple[float, str]:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return time.perf_counter() - started, text


def sample(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return 0.0


def controller_info(tmp: Path, *, metrics: bool = True) -> dict | None:
    try:
        info = json.loads((tmp / ".fleet" / "controller.json").read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("metrics_port") or not metrics else None


def start_job(tmp: Path, steps: int, *, metrics: bool) -> tuple[subprocess.Popen, dict]:
    """`fleet up` of the benchmark's job in ``tmp``, and its controller.json once written."""
    cluster = write_job(tmp, steps, metrics=metrics)
    with (tmp / "fleet-up.out").open("w") as out, (tmp / "fleet-up.err").open("w") as err:
        proc = subprocess.Popen([*FLEET, "up", "--cluster", str(cluster), "--json"], cwd=tmp, stdout=out, stderr=err)
    deadline = time.monotonic() + 180
    while (info := controller_info(tmp, metrics=metrics)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            raise SystemExit(f"fleet up did not start: {(tmp / 'fleet-up.err').read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, info


def cpu_s(process: psutil.Process) -> float:
    cpu = process.cpu_times()
    return cpu.user + cpu.system


def run_without_metrics(tmp: Path, steps: int) -> float:
    """The same job with ``controller.metrics: false``: the controller process's CPU seconds
    (from its start to its last sample before it exits)."""
    proc, info = start_job(tmp, steps, metrics=False)
    controller = psutil.Process(info["pid"])
    used = 0.0
    try:
        while proc.poll() is None:
            try:
                used = cpu_s(controller)
            except psutil.Error:
                break
            time.sleep(POLL_S)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return used


def run_job(tmp: Path, steps: int) -> dict:
    """The local job under a real Prometheus: delays, scrape times, CPU, panels with data."""
    queries = panel_queries()
    by_panel: dict[tuple[str, str], list[str]] = {}
    for q in queries:
        by_panel.setdefault((q.dashboard, q.panel), []).append(q.expr)
    with PrometheusServer(tmp, tmp / ".fleet" / TARGETS_FILE, interval_s=INTERVAL_S) as prom:
        proc, info = start_job(tmp, steps, metrics=True)
        try:
            job_id, port = info["job_id"], info["metrics_port"]
            controller = psutil.Process(info["pid"])
            prom.wait_for(prom.targets_up, "the fleet target", 120)
            annotation = substitute(annotation_expr(), job_id)
            pending = {q.expr for q in queries}
            first_seen: dict[int, float] = {}
            scrapes: list[float] = []
            first = last = None   # (exporter seconds, controller CPU seconds)
            total_cpu = 0.0
            next_scrape = next_panels = 0.0
            serving = True        # until the controller's teardown closes its endpoint
            while proc.poll() is None:
                tick = time.monotonic()
                try:
                    total_cpu = cpu_s(controller)
                except psutil.Error:
                    break          # the controller process is gone
                for s in prom.query(annotation):
                    first_seen.setdefault(int(s["metric"]["incident"]), time.time())
                if serving and tick >= next_scrape:
                    next_scrape = tick + TIMED_SCRAPE_EVERY_S
                    try:
                        took, text = timed_scrape(port)
                        point = (sample(text, "fleet_exporter_collect_seconds_total"), cpu_s(controller))
                    except (OSError, psutil.Error):
                        serving = False
                    else:
                        scrapes.append(took)
                        first = first or point
                        last = point
                if serving and tick >= next_panels:
                    next_panels = tick + PANELS_EVERY_S
                    pending -= {e for e in pending if prom.query(substitute(e, job_id))}
                time.sleep(max(0.0, POLL_S - (time.monotonic() - tick)))
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    summary = json.loads((tmp / "fleet-up.out").read_text() or "{}")
    with Store(f"sqlite:///{tmp}/.fleet/fleet.db") as store:
        incidents = store.incidents(job_id)
    delays = {f"{i.id}:{i.kind.value}": round(first_seen[i.id] - i.detected_at, 3) if i.id in first_seen else None
              for i in incidents}
    with_data = [p for p, exprs in by_panel.items() if not set(exprs) & pending]
    assert first is not None and last is not None, "no timed scrape: the job ended at once"
    return {
        "state": summary.get("state"), "attempts": summary.get("attempts"), "incidents": delays,
        "scrape_s_4_ranks": statistics.median(scrapes), "timed_scrapes": len(scrapes),
        "exporter_s": last[0] - first[0], "controller_cpu_s": last[1] - first[1], "controller_cpu_total_s": total_cpu,
        "panels": len(by_panel), "panels_with_data": len(with_data),
        "panels_without_data": sorted(f"{d} / {p}" for d, p in set(by_panel) - set(with_data)),
    }


# -- simulated ranks ----------------------------------------------------------------------------

RANKS_PER_NODE = 8
SIM_STEPS = 20
LAYERS, EXPERTS = (1, 3), 16


def synthetic_batches(job_id: str, ranks: int, t0: float) -> Iterator[PreparedBatch]:
    """One batch per step of ``ranks`` ranks: step rows with MoE loads, a world all_reduce
    and an all_to_all in each 8-rank group (rank r enters r microseconds late), SDC checks."""
    seq_world = 0
    for step in range(1, SIM_STEPS + 1):
        events = []
        start = t0 + step * 0.5
        seq_world += 1
        for rank in range(ranks):
            loads = [events_pb2.ExpertLoad(layer=layer, tokens_per_expert=[100 + (rank + e) % 7 for e in range(EXPERTS)])
                     for layer in LAYERS]
            events.append(events_pb2.Event(step=events_pb2.StepEvent(
                job_id=job_id, attempt=1, rank=rank, step=step, loss=3.0 - step * 0.01, step_time_s=0.4,
                tokens_per_s=2048.0, end_ns=int((start + 0.4) * 1e9), expert_load=loads)))
            enter = int((start + rank * 1e-6) * 1e9)
            for group, size, op in (("0", ranks, "allreduce"), (f"ep{rank // RANKS_PER_NODE}",
                                                                min(ranks, RANKS_PER_NODE), "all_to_all")):
                events.append(events_pb2.Event(collective=events_pb2.CollectiveEvent(
                    job_id=job_id, attempt=1, rank=rank, group=group, group_size=size, seq=seq_world, op=op,
                    enter_ns=enter, exit_ns=enter + 3_000_000, state="completed", step=step,
                    input_dtypes=["bfloat16"], output_dtypes=["bfloat16"])))
            if step % 5 == 0:
                events.append(events_pb2.Event(sdc=events_pb2.SdcCheckEvent(
                    job_id=job_id, attempt=1, rank=rank, step=step, kind="fingerprint", value="ab", ok=True)))
        yield prepare(events)


def simulated_scrape(ranks: int, scrapes: int) -> dict:
    """Median scrape time of a controller's /metrics holding ``ranks`` simulated ranks."""
    nodes = [f"node-{i}" for i in range(max(1, ranks // RANKS_PER_NODE))]
    with tempfile.TemporaryDirectory(prefix="fleet-bench-dash-") as d, Store(f"sqlite:///{d}/sim.db") as store:
        for n in nodes:
            store.upsert_node(n, f"ray-{n}", "127.0.0.1", '{"CPU": 8}')
        job_id = store.create_job(f"sim-{ranks}", total_steps=1000, config_json="{}")
        t0 = store.get_job(job_id).created_at
        store.set_job_state(job_id, JobState.PLACING)
        store.create_attempt(job_id)
        store.set_attempt_state(job_id, 1, AttemptState.RUNNING)
        store.set_job_state(job_id, JobState.RUNNING)
        for i, n in enumerate(nodes * 3):
            store.record_incident(job_id, 1, "straggler", "straggler", "late", rank=i % ranks, node=n,
                                  detected_at=t0 + 0.01 * i, observed="would restart")
        metrics = ControllerMetrics()
        feed = CollectiveMetrics(metrics.registry, job_id)
        metrics.watch_agents(lambda _now: {n: 0.3 for n in nodes})
        refresher = MetricsRefresher(metrics, JobMetrics(metrics.registry, store, job_id), feed, INTERVAL_S)
        port = metrics.serve("127.0.0.1", 0)
        try:
            batches = list(synthetic_batches(job_id, ranks, t0))
            store.record_batches([("agent-sim", 1, seq, b) for seq, b in enumerate(batches, start=1)])
            for b in batches:
                feed.observe(nodes[0], b)
            refresher.tick()
            timed_scrape(port)  # warm
            times, text = [], ""
            for _ in range(scrapes):
                took, text = timed_scrape(port)
                times.append(took)
            # CPU (this thread's) of what a scrape's handler does, and of one refresh
            started = time.thread_time()
            for _ in range(scrapes):
                generate_latest(metrics.registry)
            cpu_scrape = (time.thread_time() - started) / scrapes
            started = time.thread_time()
            for _ in range(5):
                refresher.tick()
            cpu_tick = (time.thread_time() - started) / 5
        finally:
            metrics.close()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert any(ln.startswith("fleet_collective_arrival_lag_seconds{") for ln in lines), "no arrival lag"
    return {"scrape_s": statistics.median(times), "series": len(lines), "bytes": len(text),
            "cpu_scrape_s": cpu_scrape, "cpu_refresh_s": cpu_tick}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="steps of the local job (default 120)")
    parser.add_argument("--scrapes", type=int, default=50, help="timed scrapes per simulated size (default 50)")
    parser.add_argument("--sim-ranks", default="4,64", help="simulated rank counts (default 4,64)")
    parser.add_argument("--no-ab", action="store_true",
                        help="skip the second run of the job with controller.metrics false")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sim_ranks.split(",")]
    if args.steps < 20 or args.scrapes < 1 or not sizes or min(sizes) < 1:
        parser.error("--steps must be >= 20, --scrapes >= 1, --sim-ranks positive integers")

    sim = {n: simulated_scrape(n, args.scrapes) for n in sizes}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-dash-") as d:
        job = run_job(Path(d), args.steps)
    off_cpu = None
    if not args.no_ab:
        with tempfile.TemporaryDirectory(prefix="fleet-bench-dash-") as d:
            off_cpu = run_without_metrics(Path(d), args.steps)
    delays = [v for v in job["incidents"].values() if v is not None]

    print(f"job: {job['state']} in {job['attempts']} attempts; incidents (id:kind -> annotation delay s): "
          f"{job['incidents']}")
    print(f"annotation delay: max {max(delays, default=float('nan')):.2f} s, target <= {TARGET_DELAY_S:g} s "
          f"(scrape and refresh every {INTERVAL_S:g} s, polled every {POLL_S:g} s)")
    print(f"/metrics scrape, 4 real ranks: median {job['scrape_s_4_ranks'] * 1e3:.1f} ms "
          f"over {job['timed_scrapes']} scrapes")
    for n, s in sim.items():
        print(f"/metrics scrape, {n} simulated ranks: median {s['scrape_s'] * 1e3:.1f} ms "
              f"({s['series']} series, {s['bytes'] / 1024:.0f} KiB); CPU {s['cpu_scrape_s'] * 1e3:.2f} ms "
              f"per scrape, {s['cpu_refresh_s'] * 1e3:.2f} ms per refresh")
    share = job["exporter_s"] / job["controller_cpu_s"] if job["controller_cpu_s"] > 0 else float("nan")
    print(f"exporter: {job['exporter_s']:.2f} s (fleet_exporter_collect_seconds_total) against "
          f"{job['controller_cpu_s']:.1f} s of controller CPU: {share:.1%} (the counter is wall time)")
    ab_share = None
    if off_cpu is not None:
        ab_share = (job["controller_cpu_total_s"] - off_cpu) / job["controller_cpu_total_s"]
        print(f"controller CPU, whole run: {job['controller_cpu_total_s']:.1f} s with metrics (scraped every "
              f"{INTERVAL_S:g} s), {off_cpu:.1f} s without: {ab_share:+.1%}")
    print(f"panels: {job['panels_with_data']} of {job['panels']} with data"
          + (f"; without: {job['panels_without_data']}" if job["panels_without_data"] else ""))
    result = {
        "annotation_delay_s_max": round(max(delays), 3) if delays else None,
        "annotation_delay_s": job["incidents"],
        "incidents_annotated": len(delays), "incidents": len(job["incidents"]),
        "scrape_s_4_ranks": round(job["scrape_s_4_ranks"], 5),
        **{f"scrape_s_{n}_ranks_sim": round(s["scrape_s"], 5) for n, s in sim.items()},
        **{f"series_{n}_ranks_sim": s["series"] for n, s in sim.items()},
        **{f"cpu_scrape_s_{n}_ranks_sim": round(s["cpu_scrape_s"], 6) for n, s in sim.items()},
        **{f"cpu_refresh_s_{n}_ranks_sim": round(s["cpu_refresh_s"], 6) for n, s in sim.items()},
        "exporter_s": round(job["exporter_s"], 3), "controller_cpu_s": round(job["controller_cpu_s"], 3),
        "scrape_s_64_ranks": round(sim[64]["scrape_s"], 5) if 64 in sim else None,
        "exporter_cpu_share": round(ab_share, 4) if ab_share is not None else None,
        "exporter_wall_share": round(share, 4),
        "controller_cpu_s_metrics_on": round(job["controller_cpu_total_s"], 2),
        "controller_cpu_s_metrics_off": round(off_cpu, 2) if off_cpu is not None else None,
        "panels": job["panels"], "panels_with_data": job["panels_with_data"],
        "job_state": job["state"], "cpus": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
