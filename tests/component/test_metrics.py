"""The controller's Prometheus metrics over a real store (a SQLite file, a real PostgreSQL
database), fed real prepared batches, refreshed by the real refresher thread and scraped
from the real HTTP endpoint: every name of the metric contract with its labels and
values, Debian's ``promtool check metrics`` and fleet's own naming rules over a scrape,
and the Prometheus target file's life."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.controlplane.agent_server import AgentRegistry, AgentSession
from fleet.controlplane.collective_metrics import CollectiveMetrics
from fleet.controlplane.job_metrics import JobMetrics, MetricsRefresher
from fleet.controlplane.lifecycle import AttemptState, JobState, NodeActor, NodeState
from fleet.controlplane.metrics import ControllerMetrics
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import prepare
from fleet.proto import events_pb2
from fleet.proto.kinds import IncidentKind

pytestmark = pytest.mark.timeout(120)

NODES = ("node-0", "node-1", "node-2")
RANKS = 4
#: seconds each rank entered a collective behind rank 0 (the first)
LATE_S = {0: 0.0, 1: 0.010, 2: 0.0, 3: 0.030}
EXPERT_TOKENS = [10, 20, 30, 40]  # per rank: the layer's shares are 0.1, 0.2, 0.3, 0.4


# -- building the job -----------------------------------------------------------------------------

def _step(job_id: str, attempt: int, rank: int, step: int, end_s: float) -> events_pb2.Event:
    load = events_pb2.ExpertLoad(layer=1, tokens_per_expert=EXPERT_TOKENS, min_share=0.1, max_share=0.4)
    return events_pb2.Event(step=events_pb2.StepEvent(
        job_id=job_id, attempt=attempt, rank=rank, step=step, loss=2.0 + 0.1 * rank, step_time_s=0.02,
        tokens_per_s=1000.0 * (rank + 1), end_ns=int(end_s * 1e9), expert_load=[load]))


def _coll(job_id: str, rank: int, seq: int, enter_s: float, *, state: str = "completed", estimated: bool = False,
          group: str = "0", attempt: int = 2) -> events_pb2.Event:
    enter = int(enter_s * 1e9)
    return events_pb2.Event(collective=events_pb2.CollectiveEvent(
        job_id=job_id, attempt=attempt, rank=rank, group=group, group_size=RANKS, seq=seq, op="allreduce",
        enter_ns=enter, exit_ns=enter + 2_000_000 if state == "completed" else 0, state=state, step=6,
        exit_estimated=estimated, input_dtypes=["float32"], output_dtypes=["float32"]))


def _sdc(job_id: str, rank: int, ok: bool) -> events_pb2.Event:
    return events_pb2.Event(sdc=events_pb2.SdcCheckEvent(
        job_id=job_id, attempt=2, rank=rank, step=7, kind="fingerprint", value="ab", ok=ok))


@dataclass
class Job:
    id: str
    created: float
    crash_at: float
    first_step_2: float
    batches: list


def _build_job(store: Store) -> Job:
    """Two attempts: steps 1-5, a crash on node-1 (restart), steps 6-8 with collectives,
    MoE loads and SDC checks; an SDC incident on node-2, quarantined for it, and an observed
    straggler on node-0. All times just after the job's creation."""
    for n in NODES:
        store.upsert_node(n, f"ray-{n}", "127.0.0.1", '{"CPU": 1}')
    job_id = store.create_job("metrics-test", total_steps=100, config_json="{}")
    c = store.get_job(job_id).created_at
    store.set_job_state(job_id, JobState.PLACING)
    store.create_attempt(job_id)
    store.set_attempt_state(job_id, 1, AttemptState.RUNNING)
    store.set_job_state(job_id, JobState.RUNNING)
    batches = [prepare([_step(job_id, 1, r, s, c + 0.02 * s) for s in range(1, 6) for r in range(RANKS)])]
    crash_at = c + 0.15
    store.record_incident(job_id, 1, "crash", "exit", "rank 2 exited 1", rank=2, node="node-1", detected_at=crash_at)
    store.set_attempt_state(job_id, 1, AttemptState.FAILED, "rank 2 exited 1")
    store.record_action(job_id, 1, "restart", "restart 1 of 3")
    store.set_job_state(job_id, JobState.RESTARTING)
    store.set_job_state(job_id, JobState.PLACING)
    store.create_attempt(job_id)
    store.set_attempt_restored(job_id, 2, 5)
    store.set_attempt_state(job_id, 2, AttemptState.RUNNING)
    store.set_job_state(job_id, JobState.RUNNING)
    first_step_2 = c + 0.30
    batches.append(prepare([_step(job_id, 2, r, s, c + 0.30 + 0.02 * (s - 6)) for s in range(6, 9)
                            for r in range(RANKS)]))
    # arrival lag samples every 8th seq of a group: 8, 16 and 24 are matched, 25 is not
    colls = [_coll(job_id, 0, 8, c + 0.25 + 0.001 * 8, state="started")]  # completed in the next rows: one match
    for seq in (8, 16, 24, 25):
        late = LATE_S if seq != 25 else {r: 0.05 * r for r in range(RANKS)}
        colls += [_coll(job_id, r, seq, c + 0.25 + 0.001 * seq + late[r], estimated=seq == 24)
                  for r in range(RANKS)]
    colls.append(_coll(job_id, 0, 8, c + 0.25, group="0:p2p"))  # p2p: durations yes, arrival lag no
    batches.append(prepare(colls))
    batches.append(prepare([_sdc(job_id, r, True) for r in range(RANKS)] + [_sdc(job_id, 3, False)]))
    store.record_incident(job_id, 2, "sdc", "sdc", "fingerprint mismatch", rank=3, node="node-2",
                          detected_at=c + 0.31)
    store.quarantine_node("node-2", "sdc on rank 3", actor=NodeActor.POLICY, job_id=job_id)
    store.record_incident(job_id, 2, "straggler", "straggler", "rank 3 late", rank=3, node="node-0",
                          detected_at=c + 0.33, observed="would restart the attempt (restart 2 of 3)")
    store.record_batches([("agent-test", 1, seq, b) for seq, b in enumerate(batches, start=1)])
    return Job(job_id, c, crash_at, first_step_2, batches)


# -- scraping ------------------------------------------------------------------------------------

def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def samples(text: str) -> dict[str, dict[tuple, float]]:
    """sample name -> (sorted label items) -> value."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class Served:
    metrics: ControllerMetrics
    feed: CollectiveMetrics
    jobs: JobMetrics
    refresher: MetricsRefresher
    port: int


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    with Store(store_url) as s:
        yield s


def _serve(store: Store, job_id: str, agents: AgentRegistry | None = None) -> Served:
    metrics = ControllerMetrics()
    feed = CollectiveMetrics(metrics.registry, job_id)
    if agents is not None:
        metrics.watch_agents(agents.silent_for)
    jobs = JobMetrics(metrics.registry, store, job_id)
    refresher = MetricsRefresher(metrics, jobs, feed, 0.05)
    metrics.on_close(refresher.close)
    port = metrics.serve("127.0.0.1", 0)
    return Served(metrics, feed, jobs, refresher, port)


# -- the contract ----------------------------------------------------------------------------------

def test_every_contract_metric_is_served_with_its_labels_and_values(store: Store) -> None:
    job = _build_job(store)
    agents = AgentRegistry()
    agents.attach(AgentSession("agent-node-0", "node-0", 1, "127.0.0.1:1", last_heard=time.monotonic() - 3.0))
    wait_for(lambda: time.time() > job.created + 0.4, "the job's timeline to be in the past")
    served = _serve(store, job.id, agents)
    try:
        for b in job.batches:
            served.feed.observe("node-0", b)
        served.refresher.start()
        # a refresh sets the gauges one after the other: scrape once one has finished, and
        # the report (ETTR, lost time) its own thread reads
        wait_for(lambda: served.refresher.ticks >= 1, "a refresh")
        assert served.jobs.wait_report(1, timeout_s=30)
        text = scrape(served.port)
    finally:
        served.metrics.close()
    got = samples(text)
    j = ("job_id", job.id)

    def value(name: str, **labels: str) -> float:
        key = tuple(sorted({**({"job_id": job.id} if name not in _UNLABELLED_JOB else {}), **labels}.items()))
        assert key in got.get(name, {}), f"{name}{dict(key)} missing; have {sorted(got.get(name, {}))[:8]}"
        return got[name][key]

    # jobs, attempts, steps
    assert {dict(k)["state"]: v for k, v in got["fleet_jobs"].items()} == {
        s.value: (1 if s is JobState.RUNNING else 0) for s in JobState}
    assert {dict(k)["state"]: v for k, v in got["fleet_attempts"].items()} == {
        s.value: {AttemptState.FAILED: 1, AttemptState.RUNNING: 1}.get(s, 0) for s in AttemptState}
    assert (value("fleet_job_step"), value("fleet_job_total_steps")) == (8, 100)
    assert value("fleet_step_duration_seconds_count") == RANKS * 8
    assert value("fleet_step_duration_seconds_sum") == pytest.approx(RANKS * 8 * 0.02)
    assert value("fleet_step_duration_seconds_bucket", le="0.025") == RANKS * 8
    assert value("fleet_step_duration_seconds_bucket", le="0.01") == 0
    assert value("fleet_tokens_per_second") == 1000 * (1 + 2 + 3 + 4)
    assert value("fleet_loss") == pytest.approx(2.15)
    # goodput, as fleet report has it
    assert 0 < value("fleet_ettr_ratio") <= 1
    assert value("fleet_productive_seconds") == pytest.approx(8 * 0.02, abs=1e-3)
    lost = {dict(k)["category"]: v for k, v in got["fleet_lost_seconds"].items()}
    assert set(lost) == {"program_startup", "disruption_detection", "infrastructure_recovery_from_disruption",
                         "wasted_progress_from_disruption", "unproductive_checkpoint_save_time", "other"}
    assert lost["disruption_detection"] == pytest.approx(0.05, abs=2e-3)
    assert lost["infrastructure_recovery_from_disruption"] == pytest.approx(0.13, abs=2e-3)  # to step 6's start
    # restarts and incidents
    assert value("fleet_restarts_total") == 1
    assert value("fleet_incidents_total", kind="crash", node="node-1") == 1
    assert value("fleet_incidents_total", kind="sdc", node="node-2") == 1
    assert value("fleet_incidents_total", kind="straggler", node="node-0") == 1
    assert value("fleet_incidents_total", kind="hang", node="node-2") == 0  # pre-set for increase()
    assert len(got["fleet_incidents_total"]) == len(IncidentKind) * len(NODES)
    stamps = {(dict(k)["kind"], dict(k)["node"], dict(k)["rank"], dict(k)["action"]): v
              for k, v in got["fleet_incident_timestamp_seconds"].items()}
    assert stamps == {("crash", "node-1", "2", "restart"): pytest.approx(job.crash_at),
                      ("sdc", "node-2", "3", "quarantine"): pytest.approx(job.created + 0.31),
                      ("straggler", "node-0", "3", "observe"): pytest.approx(job.created + 0.33)}
    assert all(dict(k)["incident"].isdigit() and j in k for k in got["fleet_incident_timestamp_seconds"])
    assert got["fleet_detection_seconds_count"][(("kind", "crash"),)] == 1
    assert got["fleet_detection_seconds_sum"][(("kind", "crash"),)] == pytest.approx(0.05, abs=1e-3)
    assert got["fleet_recovery_seconds_count"] == {(("kind", "crash"),): 1}
    assert got["fleet_recovery_seconds_sum"][(("kind", "crash"),)] == pytest.approx(0.15, abs=1e-3)
    # nodes
    assert {dict(k)["state"]: v for k, v in got["fleet_nodes"].items()} == {
        NodeState.HEALTHY.value: 2, NodeState.QUARANTINED.value: 1}
    assert got["fleet_quarantined_nodes"] == {(): 1}
    assert {dict(k)["node"]: v for k, v in got["fleet_node_quarantined"].items()} == {
        "node-0": 0, "node-1": 0, "node-2": 1}
    # collectives
    lags = {dict(k)["rank"]: v for k, v in got["fleet_collective_arrival_lag_seconds"].items()}
    assert lags == {str(r): pytest.approx(s, abs=1e-6) for r, s in LATE_S.items()}
    assert value("fleet_collective_duration_seconds_count", op="all_reduce", timing="measured") == 12 + 1
    assert value("fleet_collective_duration_seconds_count", op="all_reduce", timing="poll_upper_bound") == 4
    assert value("fleet_collective_duration_seconds_sum", op="all_reduce", timing="poll_upper_bound") == \
        pytest.approx(4 * 0.002)
    # MoE
    shares = {dict(k)["expert"]: v for k, v in got["fleet_moe_expert_token_share_ratio"].items()
              if dict(k)["layer"] == "1"}
    assert shares == {"0": 0.1, "1": 0.2, "2": 0.3, "3": 0.4}
    assert (value("fleet_moe_layer_min_share_ratio", layer="1"),
            value("fleet_moe_layer_max_share_ratio", layer="1")) == (0.1, 0.4)
    # SDC
    assert value("fleet_sdc_checks_total", kind="fingerprint", result="ok") == 4
    assert value("fleet_sdc_checks_total", kind="fingerprint", result="mismatch") == 1
    assert value("fleet_sdc_checks_total", kind="gemm", result="mismatch") == 0
    # ingest, agents and the exporter's own cost
    for name in ("fleet_ingest_batches_total", "fleet_ingest_events_total", "fleet_ingest_duplicate_batches_total",
                 "fleet_ingest_commit_seconds_count", "fleet_ingest_queued_events", "fleet_agents_connected"):
        assert got[name] == {(): 0}, name
    assert len(got["fleet_ingest_errors_total"]) == 6 and len(got["fleet_ingest_dropped_events_total"]) == 2
    assert got["fleet_agent_last_heard_seconds"][(("node", "node-0"),)] >= 3.0
    assert got["fleet_exporter_collect_seconds_total"][()] > 0


_UNLABELLED_JOB = {"fleet_jobs", "fleet_nodes", "fleet_quarantined_nodes", "fleet_node_quarantined",
                   "fleet_detection_seconds_count", "fleet_recovery_seconds_count"}


def test_ettr_is_absent_while_the_report_has_none_and_a_new_attempt_resets_the_gauges(store: Store) -> None:
    job_id = store.create_job("no-steps", total_steps=0, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING)
    store.create_attempt(job_id)
    store.set_attempt_state(job_id, 1, AttemptState.RUNNING)
    served = _serve(store, job_id)
    try:
        served.feed.observe("node-0", prepare([_coll(job_id, r, 8, 1.0 + LATE_S[r], attempt=1) for r in range(RANKS)]))
        served.refresher.start()
        wait_for(lambda: served.refresher.ticks >= 2, "two refreshes")
        assert served.jobs.wait_report(1, timeout_s=30)
        first = samples(scrape(served.port))
        store.set_attempt_state(job_id, 1, AttemptState.FAILED, "crash")
        store.create_attempt(job_id)
        ticks = served.refresher.ticks
        wait_for(lambda: served.refresher.ticks >= ticks + 2, "two more refreshes")
        second = samples(scrape(served.port))
    finally:
        served.metrics.close()
    # a program without the step API: attempts but no steps, so no ETTR (not a made-up 0)
    assert "fleet_ettr_ratio" not in first and first["fleet_productive_seconds"] == {(("job_id", job_id),): 0}
    # the collectives were attempt 1's; attempt 2 is newer: its gauges start over
    assert len(first["fleet_collective_arrival_lag_seconds"]) == RANKS
    assert "fleet_collective_arrival_lag_seconds" not in second
    assert second["fleet_tokens_per_second"] == {(("job_id", job_id),): 0}


# -- naming rules ------------------------------------------------------------------------------------

#: Units Prometheus wants written in base units (seconds, bytes, ratios) instead.
_NOT_BASE_UNITS = re.compile(r"_(ms|us|ns|millis|milliseconds|microseconds|nanoseconds|minutes|hours|days|"
                             r"percent|pct|kb|mb|gb|kilobytes|megabytes|gigabytes)(_|$)")


def naming_problems(text: str) -> list[str]:
    """fleet's rules over a scrape: the fleet_ prefix, base units, counters (and only they)
    ending _total with the unit before it, ratios within 0-1, seconds not negative."""
    problems = []
    for family in text_string_to_metric_families(text):
        name = family.name
        if not name.startswith("fleet_"):
            problems.append(f"{name}: no fleet_ prefix")
        if _NOT_BASE_UNITS.search(name):
            problems.append(f"{name}: not in base units")
        if re.search(r"_total_(seconds|bytes|ratio)", name):
            problems.append(f"{name}: the unit goes before _total")
        for s in family.samples:
            if family.type == "counter" and not s.name.endswith("_total"):
                problems.append(f"{s.name}: a counter not ending _total")
            if family.type != "counter" and s.name.endswith("_total"):
                problems.append(f"{s.name}: a {family.type} ending _total")
            if "_ratio" in name and not 0 <= s.value <= 1:
                problems.append(f"{s.name}{s.labels} = {s.value}: a ratio outside 0-1")
            if "_seconds" in name and not s.value >= 0:
                problems.append(f"{s.name}{s.labels} = {s.value}: negative seconds")
            if "job" in s.labels:
                problems.append(f"{s.name}: label job (Prometheus's own); use job_id")
    return problems


def test_a_scrape_passes_promtool_and_the_naming_rules(store: Store, tmp_path: Path) -> None:
    job = _build_job(store)
    wait_for(lambda: time.time() > job.created + 0.4, "the job's timeline to be in the past")
    served = _serve(store, job.id)
    try:
        for b in job.batches:
            served.feed.observe("node-0", b)
        served.refresher.tick()   # on this thread: a scrape after it and its report sees every metric
        assert served.jobs.wait_report(1, timeout_s=30)
        text = scrape(served.port)
    finally:
        served.metrics.close()
    assert "fleet_moe_layer_max_share_ratio" in text and "fleet_recovery_seconds" in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing (Debian's prometheus package; scripts/test.sh installs it)"
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stdout + check.stderr
    assert naming_problems(text) == []
    # the rules catch what they are for
    bad = ("# TYPE foo_ms gauge\nfoo_ms 1\n# TYPE fleet_x_ratio gauge\nfleet_x_ratio 1.5\n"
           "# TYPE fleet_y_total gauge\nfleet_y_total 1\n# TYPE fleet_z_seconds gauge\nfleet_z_seconds{job=\"a\"} -1\n")
    assert len(naming_problems(bad)) == 6


def test_target_file_names_the_endpoint_and_goes_at_close(tmp_path: Path) -> None:
    metrics = ControllerMetrics()
    try:
        port = metrics.serve("127.0.0.1", 0)
        path = metrics.publish_targets(tmp_path, "127.0.0.1", port, "j-42")
        assert path == tmp_path / "prometheus" / "targets.json"
        assert json.loads(path.read_text()) == [{"targets": [f"127.0.0.1:{port}"], "labels": {"fleet_job_id": "j-42"}}]
        assert [p.name for p in path.parent.iterdir()] == ["targets.json"]  # no temporary file left
        assert "fleet_ingest_events_total 0.0" in scrape(port)
    finally:
        metrics.close()
    assert not path.exists()
    with pytest.raises(OSError):
        scrape(port)
    # a file another controller rewrote since is not ours to remove
    other = ControllerMetrics()
    path = other.publish_targets(tmp_path, "0.0.0.0", 9, "j-1")
    assert json.loads(path.read_text())[0]["targets"] == ["127.0.0.1:9"]  # a wildcard is reached on loopback
    path.write_text(json.dumps([{"targets": ["127.0.0.1:10"], "labels": {}}]))
    other.close()
    assert path.exists()


def test_wake_refreshes_at_once_not_at_the_next_interval(store: Store) -> None:
    """The controller wakes the refresher when the job changes (an incident, a restart):
    the new incident's count is exported long before the interval (an hour here) is out."""
    job_id = store.create_job("wake", 10, "{}")
    attempt = store.create_attempt(job_id)
    metrics = ControllerMetrics()
    refresher = MetricsRefresher(metrics, JobMetrics(metrics.registry, store, job_id), None, 3600.0)
    metrics.on_close(refresher.close)
    try:
        refresher.start()
        wait_for(lambda: refresher.ticks >= 1, "the first refresh", timeout_s=30)
        assert metrics.value("fleet_incidents_total", job_id=job_id, kind="crash", node="node-0") == 0
        store.record_incident(job_id, attempt, "crash", "exit", "rank 0 exited 1", rank=0, node="node-0")
        assert refresher.ticks == 1  # nothing refreshes by itself within the hour
        refresher.wake()
        wait_for(lambda: refresher.ticks >= 2, "the woken refresh", timeout_s=30)
        assert metrics.value("fleet_incidents_total", job_id=job_id, kind="crash", node="node-0") == 1
    finally:
        t0 = time.monotonic()
        metrics.close()
        assert time.monotonic() - t0 < 10  # close does not wait out the interval either
