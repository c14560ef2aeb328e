"""The dashboards against a real Prometheus scraping a real `fleet up`.

Debian's prometheus (``tests/prometheus.py``; ``bash scripts/test.sh`` installs it) scrapes,
every second, a `fleet up` found through the controller's ``file_sd`` target file: a small
DDP job (two nodes, four gloo ranks, SDC fingerprints every 5 steps, the MoE model) with a
crash scheduled, so that there is an incident, a restart and a recovery. Every query of
every panel of every generated dashboard must return series through ``/api/v1/query``;
the incident must reach the annotation query within a scrape plus a metrics refresh of
its detection; the shipped alert rules must evaluate without error on the real series.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from fleet.controlplane.metrics import TARGETS_FILE
from tests.integration.test_fleet_up import FleetUp, controller_job, store_of, write_cluster
from tests.prometheus import (PrometheusServer, PrometheusUnavailable, annotation_expr, panel_queries,
                              substitute)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SCRAPE_S = 1.0
REFRESH_S = 1.0                 # controller.metrics_refresh_interval_s
STEPS = 20
CRASH_STEP = 6
#: what an annotation may take beyond a scrape and a refresh: the 0.2 s poll, the store
#: commit and query latency on a loaded 2-core machine
ANNOTATION_SLACK_S = 1.0
#: Panels whose data cannot exist in this run, with the reason (none: every panel has data).
NO_DATA_HERE: dict[str, str] = {}


def small_job(tmp: Path) -> Path:
    """examples/local.yaml made small: DDP (copies for the SDC fingerprints), one crash."""
    path = write_cluster(tmp, steps=STEPS, checkpoint_interval=5, data_parallel="ddp", ep_size=1)
    cfg = yaml.safe_load(path.read_text())
    cfg["controller"]["metrics_refresh_interval_s"] = REFRESH_S
    cfg["sdc"] = {"check_interval": 5}
    cfg["chaos"] = {"faults": [{"kind": "crash", "rank": 1, "at_step": CRASH_STEP}]}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    server = PrometheusServer(tmp_path, tmp_path / ".fleet" / TARGETS_FILE, interval_s=SCRAPE_S)
    try:
        server.start()
    except PrometheusUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fleet_up(tmp_path: Path) -> Iterator[FleetUp]:
    started = time.time()
    run = FleetUp(tmp_path, small_job(tmp_path))
    try:
        yield run
    finally:
        stop(run, started)


def stop(run: FleetUp, started: float) -> None:
    """End a `fleet up` still running (Ctrl-C, then SIGKILL) and the processes it started, by PID
    (those seen in its tree and created since ``started``: a PID reused since is not ours)."""
    if run.proc.poll() is None:
        run.sample(force=True)
        run.proc.send_signal(signal.SIGINT)
        try:
            run.wait(60)
        except subprocess.TimeoutExpired:
            run.proc.kill()
    run.wait(10)  # also closes its output files
    for pid in run.seen_pids:
        try:
            process = psutil.Process(pid)
            if process.create_time() >= started - 1:
                process.kill()
        except psutil.Error:
            pass


def test_every_panel_has_data_and_incidents_reach_the_annotation(
        tmp_path: Path, prometheus: PrometheusServer, fleet_up: FleetUp) -> None:
    run = fleet_up
    run.wait_until(lambda: controller_job(tmp_path), 120, "the controller to start")
    job_id = controller_job(tmp_path)
    # Prometheus finds the controller through the file_sd target file alone
    (target,) = prometheus.wait_for(prometheus.targets_up, "the fleet target to be scraped", 120)
    assert target["labels"]["fleet_job_id"] == job_id

    # the crash: from its row in the store to the annotation query
    incident = None

    def stored() -> bool:
        nonlocal incident
        with store_of(tmp_path) as store:
            incident = next(iter(store.incidents(job_id)), None)
        return incident is not None

    run.wait_until(stored, 240, "the crash incident in the store")
    row_seen = time.time()
    annotation = substitute(annotation_expr(), job_id)

    def annotated() -> list[dict]:
        return [s for s in prometheus.query(annotation) if s["metric"].get("incident") == str(incident.id)]

    (series,) = prometheus.wait_for(annotated, "the incident in the annotation query", 30, poll_s=0.2)
    appeared = time.time()
    delay_s = appeared - incident.detected_at
    print(f"incident {incident.id} ({incident.kind}): row seen {row_seen - incident.detected_at:.2f} s after "
          f"detected_at, annotation {delay_s:.2f} s after (from the row: {appeared - row_seen:.2f} s)")
    assert delay_s <= SCRAPE_S + REFRESH_S + ANNOTATION_SLACK_S, f"annotation {delay_s:.2f} s after detection"
    labels = series["metric"]
    assert (labels["kind"], labels["node"], labels["rank"]) == (incident.kind.value, incident.node, str(incident.rank))
    assert labels["action"] == "restart"
    # series value as timestamp, in milliseconds
    assert float(series["value"][1]) / 1000 == pytest.approx(incident.detected_at, abs=1e-3)

    # the restart's first step: recovery time observed
    prometheus.wait_for(lambda: prometheus.query(f'fleet_recovery_seconds_count{{kind="{incident.kind.value}"}} > 0'),
                        "the recovery to be observed", 240)

    # every panel's query returns series (at some point while the job runs)
    queries = [q for q in panel_queries() if q.panel not in NO_DATA_HERE]
    assert len(queries) >= 40
    pending = {q.expr: q for q in queries}
    started = time.monotonic()
    deadline = started + 60
    while pending and time.monotonic() < deadline and run.proc.poll() is None:
        for expr in list(pending):
            if prometheus.query(substitute(expr, job_id)):
                del pending[expr]
        time.sleep(0.5)
    print(f"{len(queries)} panel queries: all but {len(pending)} with series after {time.monotonic() - started:.1f} s")
    assert not pending, "panels without data: " + "; ".join(
        f"{q.dashboard} / {q.panel}: {q.expr}" for q in pending.values())

    # the shipped alert rules load and evaluate on the real series without error
    groups = prometheus.api("rules", type="alert")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), \
        [(r["name"], r["health"], r.get("lastError")) for r in rules]
    firing = [a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"]
    assert not firing, f"alerts firing on a healthy local run: {firing}"

    summary = run.finish()
    assert summary["state"] == "SUCCEEDED" and summary["final_step"] == STEPS
    run.assert_tree_gone()
    # the controller removes its target file at teardown: Prometheus drops the target
    assert not (tmp_path / ".fleet" / TARGETS_FILE).exists()
    prometheus.wait_for(lambda: not prometheus.targets_up(), "the target to go", 30)
