"""What the controller's Prometheus metrics cost: folding batches in, refreshing from the
store, ``fleet report``'s ETTR, and a scrape, for a job of ``--ranks`` ranks.

    python bench/metrics.py [--ranks 64] [--steps 2000 5000] [--layers 4] [--experts 16]
                            [--scrapes 50] [--scrape-interval-s 15]

Every part is the real one, in this process: a ``Store`` on a fresh SQLite file holding a
job of two attempts (``--steps`` steps of every rank, with MoE expert loads, a crash and
a restart in between, incidents, nodes), ``ControllerMetrics`` with ``JobMetrics`` and
``CollectiveMetrics`` on one registry, served over HTTP on 127.0.0.1.

- **fold**: the job's last 200 steps of batches (per step 8 collectives in a
  data-parallel group of every rank plus 8 in tensor-parallel groups of 8, and every
  rank's step with its MoE loads) through ``CollectiveMetrics.observe`` + ``drain``: CPU
  ns per collective row, next to ``ingest.prepare``'s for the same rows (what ingest
  already spends before the store), and CPU us per step row.
- **refresh**: ``JobMetrics.refresh`` without the report (the every-second part) and
  ``report.load_report`` (ETTR, lost time), CPU seconds; the report's cadence follows
  (``REPORT_COST`` x its cost, at least the refresh interval).
- **scrape**: GET /metrics, median and p99 wall over ``--scrapes``, its size and series.
- **share**: the exporter's share of one core at these settings: refresh per 1 s, report
  at its cadence, a scrape every ``--scrape-interval-s``.

Each ``--steps`` value is one job (the report's cost grows with the steps stored). The last
line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RANKS_PER_NODE = 8
COLLECTIVES_PER_STEP = 8   # per group kind: dp (every rank) and tp (groups of 8)
FOLD_STEPS = 200


def _events(job_id: str, attempt: int, step: int, ranks: int, end_s: float, layers: int, experts: int,
            collectives: bool) -> list:
    from fleet.proto import events_pb2

    out = []
    for r in range(ranks):
        loads = [events_pb2.ExpertLoad(layer=layer, tokens_per_expert=[100 + (e * 7 + r) % 50 for e in range(experts)])
                 for layer in range(layers)]
        out.append(events_pb2.Event(step=events_pb2.StepEvent(
            job_id=job_id, attempt=attempt, rank=r, step=step, loss=2.0, step_time_s=0.5, tokens_per_s=8000.0,
            end_ns=int(end_s * 1e9) + r * 1000, expert_load=loads)))
    if collectives:
        cols = []
        for k in range(COLLECTIVES_PER_STEP):
            seq = step * COLLECTIVES_PER_STEP + k
            for r in range(ranks):
                enter = int((end_s - 0.4 + 0.01 * k) * 1e9) + r * 20_000
                for group, size in (("dp", ranks), (f"tp{r // 8}", 8)):
                    cols.append(events_pb2.CollectiveEvent(
                        job_id=job_id, attempt=attempt, rank=r, group=group, group_size=size, seq=seq,
                        op="all_reduce" if group == "dp" else "all_gather", enter_ns=enter,
                        exit_ns=enter + 3_000_000, state="completed", step=step,
                        input_dtypes=["bfloat16"], output_dtypes=["bfloat16"]))
        from fleet.proto import columns
        out.append(events_pb2.Event(collectives=columns.pack(cols)))
    return out


def build(store, ranks: int, steps: int, layers: int, experts: int) -> tuple[str, list]:
    """The job; returns its id and the events of its last FOLD_STEPS steps (as batches)."""
    from fleet.controlplane.lifecycle import AttemptState, JobState, NodeActor
    from fleet.controlplane.store.ingest import prepare

    nodes = [f"node-{i}" for i in range(max(1, ranks // RANKS_PER_NODE))]
    for n in nodes:
        store.upsert_node(n, f"ray-{n}", "127.0.0.1", '{"CPU": 8}')
    job_id = store.create_job("bench-metrics", steps + 100, "{}")
    start = store.get_job(job_id).created_at - steps * 0.5 - 60   # the steps lie in the past
    store.set_job_state(job_id, JobState.PLACING)
    store.create_attempt(job_id)
    store.set_attempt_state(job_id, 1, AttemptState.RUNNING)
    store.set_job_state(job_id, JobState.RUNNING)
    crash = steps // 2
    fold: list = []
    seq = 0
    for step in range(1, steps + 1):
        attempt = 1 if step <= crash else 2
        if step == crash + 1:
            store.record_incident(job_id, 1, "crash", "exit", "rank 3 exited 1", rank=3, node=nodes[0],
                                  detected_at=start + step * 0.5 + 5)
            store.set_attempt_state(job_id, 1, AttemptState.FAILED, "crash")
            store.record_action(job_id, 1, "restart", "restart 1 of 3")
            store.set_job_state(job_id, JobState.RESTARTING)
            store.set_job_state(job_id, JobState.PLACING)
            store.create_attempt(job_id)
            store.set_attempt_restored(job_id, 2, crash)
            store.set_attempt_state(job_id, 2, AttemptState.RUNNING)
            store.set_job_state(job_id, JobState.RUNNING)
        in_fold = step > steps - FOLD_STEPS
        events = _events(job_id, attempt, step, ranks, start + step * 0.5 + (20 if attempt == 2 else 0),
                         layers, experts, in_fold)
        seq += 1
        store.record_batches([("agent-bench", 1, seq, prepare(events[:ranks]))])  # collectives not stored
        if in_fold:
            fold.append(events)
    store.record_incident(job_id, 2, "straggler", "straggler", "rank 5 late", rank=5, node=nodes[-1],
                          detected_at=start + steps * 0.5)
    store.quarantine_node(nodes[-1], "bench", actor=NodeActor.POLICY, job_id=job_id)
    return job_id, fold


def measure(ranks: int, steps: int, layers: int, experts: int, scrapes: int, scrape_interval_s: float,
            folder: Path) -> dict:
    from fleet.controlplane.collective_metrics import CollectiveMetrics
    from fleet.controlplane.job_metrics import REPORT_COST, JobMetrics
    from fleet.controlplane.metrics import ControllerMetrics
    from fleet.controlplane.report import load_report
    from fleet.controlplane.store import Store
    from fleet.controlplane.store.ingest import prepare

    with Store(f"sqlite:///{folder}/metrics-{steps}.db") as store:
        t = time.monotonic()
        job_id, fold = build(store, ranks, steps, layers, experts)
        print(f"  {ranks} ranks x {steps} steps stored in {time.monotonic() - t:.1f} s", flush=True)
        metrics = ControllerMetrics()
        feed = CollectiveMetrics(metrics.registry, job_id)
        jobs = JobMetrics(metrics.registry, store, job_id)
        blocks = [evs[ranks:] for evs in fold]   # the collectives of each step, one block
        t = time.thread_time()
        prepared = [prepare(b) for b in blocks]
        prepare_s = time.thread_time() - t
        rows = sum(len(b.collectives) for b in prepared)
        t = time.thread_time()
        for b in prepared:
            feed.observe("node-0", b)
        feed.drain()
        fold_ns = (time.thread_time() - t) * 1e9 / rows
        prepare_ns = prepare_s * 1e9 / rows
        steps_in = [prepare(evs[:ranks]) for evs in fold]
        t = time.thread_time()
        for b in steps_in:
            feed.observe("node-0", b)
        feed.drain()
        fold_step_us = (time.thread_time() - t) * 1e6 / (ranks * len(fold))
        jobs.refresh()  # the first: every incident is new, the report is asked for
        if not jobs.wait_report(1, timeout_s=600):
            raise SystemExit("the report thread read no report in 600 s")
        report_s = []
        for _ in range(3):
            t = time.thread_time()
            load_report(store, job_id, time.time())
            report_s.append(time.thread_time() - t)
        refresh_s = []
        for _ in range(10):
            jobs._report_due = float("inf")  # the every-second part alone
            t = time.thread_time()
            jobs.refresh()
            refresh_s.append(time.thread_time() - t)
        port = metrics.serve("127.0.0.1", 0)
        walls, size = [], 0
        try:
            for _ in range(scrapes):
                t = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
                    body = reply.read()
                walls.append(time.perf_counter() - t)
                size = len(body)
        finally:
            metrics.close()
            jobs.close()
        series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    report = statistics.median(report_s)
    refresh = statistics.median(refresh_s)
    scrape = statistics.median(walls)
    cadence = max(1.0, REPORT_COST * report)
    folded = min(FOLD_STEPS, steps)
    per_s = folded * 0.5   # the folded steps' wall time: one every 0.5 s
    share = (refresh / 1.0 + report / cadence + scrape / scrape_interval_s
             + (fold_ns * 1e-9 * rows + fold_step_us * 1e-6 * ranks * folded) / per_s)
    return {"ranks": ranks, "steps": steps, "collective_rows_folded": rows,
            "fold_ns_per_collective": round(fold_ns), "prepare_ns_per_collective": round(prepare_ns),
            "fold_to_prepare": round(fold_ns / prepare_ns, 3), "fold_us_per_step_row": round(fold_step_us, 1),
            "refresh_s": round(refresh, 4), "report_s": round(report, 4), "report_every_s": round(cadence, 1),
            "scrape_median_s": round(scrape, 4), "scrape_p99_s": round(sorted(walls)[int(0.99 * (len(walls) - 1))], 4),
            "scrape_bytes": size, "series": series, "core_share": round(share, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, nargs="+", default=[2000, 5000], help="steps stored, one job each")
    parser.add_argument("--layers", type=int, default=4, help="MoE layers")
    parser.add_argument("--experts", type=int, default=16, help="experts per MoE layer")
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--scrape-interval-s", type=float, default=15.0)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fleet-bench-metrics-"))
    results = []
    for steps in args.steps:
        r = measure(args.ranks, steps, args.layers, args.experts, args.scrapes, args.scrape_interval_s, folder)
        results.append(r)
        print(f"  {steps} steps: fold {r['fold_ns_per_collective']} ns/collective (prepare "
              f"{r['prepare_ns_per_collective']}), {r['fold_us_per_step_row']} us/step row, "
              f"refresh {r['refresh_s'] * 1e3:.1f} ms, report {r['report_s'] * 1e3:.0f} ms (every "
              f"{r['report_every_s']} s), scrape {r['scrape_median_s'] * 1e3:.1f} ms median "
              f"({r['scrape_bytes']:,} bytes, {r['series']} series), {r['core_share'] * 100:.2f}% of a core",
              flush=True)
    print(json.dumps({"runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
