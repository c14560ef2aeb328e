"""The controller's job metrics read from the store, and the threads that refresh them.

``MetricsRefresher`` (thread ``fleet-metrics-refresh``) wakes every
``controller.metrics_refresh_interval_s``: it folds the batches ``CollectiveMetrics``
queued, then ``JobMetrics.refresh`` reads the store and sets the gauges. A scrape reads
only these cached values: it never queries the store. What the refresher spends is added
to ``fleet_exporter_collect_seconds_total``.

Read each refresh (a few small queries: grouped counts, the job's attempts, actions and
nodes, the newest incidents only):
- ``fleet_jobs{state}`` (every ``JobState``), ``fleet_attempts{job_id,state}`` (every
  ``AttemptState``), ``fleet_job_step{job_id}`` (newest step of the current attempt),
  ``fleet_job_total_steps{job_id}``, ``fleet_restarts_total{job_id}``;
- ``fleet_nodes{state}`` (every ``NodeState``), ``fleet_quarantined_nodes``,
  ``fleet_node_quarantined{node}``;
- incidents, incrementally (those stored since the last refresh): each counts once in
  ``fleet_incidents_total{job_id,kind,node}`` (pre-set to 0 for every kind on every node
  the store knows, so ``increase()`` sees the first), observes its detection lag once in
  ``fleet_detection_seconds{kind}`` (``fleet report``'s ``detected_after_s``: detection
  minus the attempt's last progress before it), and, if it ended its attempt, its recovery
  once in ``fleet_recovery_seconds{kind}`` when a later attempt completes a step (detection
  to that attempt's first step end). ``fleet_incident_timestamp_seconds{job_id,incident,
  kind,node,rank,action}`` = its ``detected_at``, one series per incident (the newest
  ``INCIDENT_SERIES``), set once its action is known (``incident_action``).

``fleet report``'s ETTR and lost time (``report.load_report``) read every step row of the
job, so they cost more as the job grows (``bench/metrics.py``: ~50 us per step row with
MoE expert loads, ~1 s for 64 ranks x 300 steps): ``fleet_ettr_ratio``,
``fleet_productive_seconds`` and ``fleet_lost_seconds{category}`` are read on a thread of
their own (``fleet-metrics-report``, so a long report never holds the other metrics back),
every interval, but no sooner than ``REPORT_COST`` times the last report's duration after
it (a report that took 1 s is read again 50 s later): at most 1/``REPORT_COST`` of a core.
Once the job has ended its report is read one last time.
Lost-time categories are named after Google's goodput ``BadputType`` where one fits
(``LOST_CATEGORIES``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleet.controlplane.collective_metrics import CollectiveMetrics
from fleet.controlplane.lifecycle import AttemptState, NodeState
from fleet.controlplane.metrics import ControllerMetrics
from fleet.controlplane.report import ending_incident, load_report
from fleet.controlplane.store import AttemptRecord, IncidentRecord, Store
from fleet.proto.kinds import IncidentKind

log = logging.getLogger(__name__)

#: ``fleet report``'s ``lost_s`` keys -> the ``category`` label (goodput's BadputType names
#: where one fits; detection has none: Google counts it inside the disruption's recovery).
LOST_CATEGORIES = {
    "startup_s": "program_startup",
    "detection_s": "disruption_detection",
    "restart_s": "infrastructure_recovery_from_disruption",
    "recomputed_s": "wasted_progress_from_disruption",
    "checkpointing_s": "unproductive_checkpoint_save_time",
    "other_s": "other",
}
#: Incident timestamp series kept (the newest); older ones are removed.
INCIDENT_SERIES = 200
#: The report is read again no sooner than this many times its last duration after it.
REPORT_COST = 50
#: An incident that does not end its attempt has its action once this old (seconds) if it
#: has none by then (a quarantine follows its recording at once)...
SIDE_SETTLE_S = 5.0
#: ... and any incident at the latest this old (its attempt may take this long to end).
ACTION_SETTLE_S = 60.0
DETECTION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RECOVERY_BUCKETS_S = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


# -- pure -----------------------------------------------------------------------------------

def lost_by_category(lost_s: Mapping[str, float]) -> dict[str, float]:
    """``fleet report``'s ``lost_s`` under the ``fleet_lost_seconds`` category names."""
    return {LOST_CATEGORIES[key]: float(value) for key, value in lost_s.items() if key in LOST_CATEGORIES}


def incident_action(incident: IncidentRecord, *, quarantined_at: float | None, attempt_over: bool,
                    ended_it: bool, restarted: bool, age_s: float) -> str | None:
    """What the controller did about ``incident``: observe | quarantine | restart | none,
    or None while that is not known yet.

    ``quarantined_at``: when this job quarantined the incident's node (None: it did not);
    ``attempt_over``: the incident's attempt has ended; ``ended_it``: the incident is the
    one that ended it (``ending_incident``); ``restarted``: a restart followed that attempt;
    ``age_s``: seconds since the incident's detection."""
    if incident.observed:
        return "observe"
    if quarantined_at is not None and quarantined_at >= incident.detected_at - 1.0:
        return "quarantine"
    if attempt_over:
        return "restart" if ended_it and restarted else "none"
    settle = ACTION_SETTLE_S if IncidentKind(incident.kind).ends_attempt else SIDE_SETTLE_S
    return "none" if age_s >= settle else None


# -- the metrics ----------------------------------------------------------------------------

class JobMetrics:
    """The store-derived metrics of one job (``refresh`` from one thread)."""

    def __init__(self, registry: CollectorRegistry, store: Store, job_id: str) -> None:
        self.store, self.job_id = store, job_id
        r = registry
        self.jobs = Gauge("fleet_jobs", "Jobs in the store, by state.", ["state"], registry=r)
        self.attempts = Gauge("fleet_attempts", "The job's attempts, by state.", ["job_id", "state"], registry=r)
        self.step = Gauge("fleet_job_step", "Newest step completed by the job's current attempt.", ["job_id"],
                          registry=r)
        self.total_steps = Gauge("fleet_job_total_steps", "Steps the job runs to (0: a program decides).",
                                 ["job_id"], registry=r)
        self.ettr = Gauge("fleet_ettr_ratio", "Effective training time ratio so far: productive step time / wall "
                          "time (fleet report's ETTR).", ["job_id"], registry=r)
        self.productive = Gauge("fleet_productive_seconds", "Step time the job kept so far (fleet report).",
                                ["job_id"], registry=r)
        self.lost = Gauge("fleet_lost_seconds", "Wall time lost so far, by category (fleet report's lost_s; "
                          "goodput BadputType names).", ["job_id", "category"], registry=r)
        self.restarts = Counter("fleet_restarts", "Restarts of the job (a new attempt after a failed one).",
                                ["job_id"], registry=r)
        self.incidents = Counter("fleet_incidents", "Incidents recorded, by kind and node.",
                                 ["job_id", "kind", "node"], registry=r)
        self.incident_at = Gauge(
            "fleet_incident_timestamp_seconds",
            "Detection time (Unix seconds) of each recent incident, with what was done about it.",
            ["job_id", "incident", "kind", "node", "rank", "action"], registry=r)
        self.detection = Histogram("fleet_detection_seconds", "Last progress before an incident to its detection.",
                                   ["kind"], buckets=DETECTION_BUCKETS_S, registry=r)
        self.recovery = Histogram("fleet_recovery_seconds",
                                  "Detection of an incident that ended its attempt to the first step of the next.",
                                  ["kind"], buckets=RECOVERY_BUCKETS_S, registry=r)
        self.nodes = Gauge("fleet_nodes", "Nodes in the store, by state.", ["state"], registry=r)
        self.quarantined = Gauge("fleet_quarantined_nodes", "Nodes quarantined now.", registry=r)
        self.node_quarantined = Gauge("fleet_node_quarantined", "1 while the node is quarantined, else 0.",
                                      ["node"], registry=r)
        self.restarts.labels(job_id)
        self.current_attempt = 0
        self._restarts_counted = 0
        self._last_incident = 0
        self._nodes_seen: set[str] = set()
        self._by_attempt: dict[int, list[IncidentRecord]] = collections.defaultdict(list)
        self._unsettled: list[IncidentRecord] = []     # their action is not known yet
        self._unrecovered: list[IncidentRecord] = []   # ended their attempt, no later step yet
        self._series: collections.deque[tuple[str, ...]] = collections.deque()
        self._report_due = 0.0                         # monotonic
        self._report_final = False                     # the report of the ended job was read
        self._report_lock = threading.Condition()
        self._report_asked: tuple[float, bool] | None = None  # (now, final) for the report thread
        self._report_thread: threading.Thread | None = None
        self._closed = False
        self.reports = 0                               # reports read (or failed)
        #: where the report thread's time goes (``MetricsRefresher`` points it at
        #: ``ControllerMetrics.add_cost``: fleet_exporter_collect_seconds_total)
        self.on_cost: Callable[[float], None] = lambda seconds: None
        self._ettr_shown = False
        self.report_s = 0.0                            # the last report's duration

    def refresh(self, now: float | None = None) -> None:
        """Read the store and set the gauges (``now``: Unix seconds)."""
        now = time.time() if now is None else now
        job_id = self.job_id
        for state, n in self.store.job_counts().items():
            self.jobs.labels(state.value).set(n)
        attempts = self.store.get_attempts(job_id)
        by_state = collections.Counter(a.state for a in attempts)
        for state in AttemptState:
            self.attempts.labels(job_id, state.value).set(by_state[state])
        job = self.store.get_job(job_id)
        self.total_steps.labels(job_id).set(job.total_steps)
        if attempts:
            self.current_attempt = attempts[-1].number
        # one index lookup (step_span's three aggregates would scan the attempt's rows)
        self.step.labels(job_id).set(self.store.last_step(job_id, self.current_attempt) if attempts else 0)
        actions = self.store.actions(job_id)
        restarted = {a.attempt for a in actions if a.kind == "restart"}
        restarts = sum(1 for a in actions if a.kind == "restart")
        if restarts > self._restarts_counted:
            self.restarts.labels(job_id).inc(restarts - self._restarts_counted)
            self._restarts_counted = restarts
        quarantined_at = self._nodes()
        self._new_incidents()
        self._settle(attempts, restarted, quarantined_at, now)
        self._recoveries(attempts)
        # an ended job's report no longer changes: read once more, then never again
        if not self._report_final and (job.state.terminal or time.monotonic() >= self._report_due):
            self._ask_report(now, final=job.state.terminal)

    def _ask_report(self, now: float, *, final: bool) -> None:
        """Have the report thread read the report (started on first use); never waits."""
        with self._report_lock:
            if self._report_asked is not None or self._closed:
                return  # one in flight: the next refresh asks again if still due
            self._report_asked = (now, final)
            if self._report_thread is None:
                self._report_thread = threading.Thread(target=self._report_loop, name="fleet-metrics-report",
                                                       daemon=True)
                self._report_thread.start()
            self._report_lock.notify_all()

    def _report_loop(self) -> None:
        while True:
            with self._report_lock:
                while self._report_asked is None and not self._closed:
                    self._report_lock.wait()
                if self._closed:
                    return
                now, final = self._report_asked
            started = time.perf_counter()
            try:
                self._report(now, final=final)
            except Exception:  # noqa: BLE001 - a store outage must not end the report thread
                log.warning("metrics: reading the job's report failed", exc_info=True)
                self._report_due = time.monotonic() + REPORT_COST * max(self.report_s, 1.0)
            self.on_cost(time.perf_counter() - started)
            with self._report_lock:
                self._report_asked = None
                self.reports += 1
                self._report_lock.notify_all()

    def wait_report(self, reports: int, timeout_s: float) -> bool:
        """Wait until ``reports`` reports were read (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._report_lock:
            while self.reports < reports:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._report_lock.wait(left)
            return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the report thread: at once when idle; a report in flight is waited for up
        to ``timeout_s`` (a daemon thread: it never holds the process up)."""
        with self._report_lock:
            self._closed = True
            self._report_lock.notify_all()
            thread = self._report_thread
        if thread is not None:
            thread.join(timeout_s)

    def _nodes(self) -> dict[str, float]:
        """Node gauges; returns node -> when this job quarantined it (its last transition)."""
        nodes = self.store.list_nodes()
        counts = collections.Counter(n.state for n in nodes)
        for state in NodeState:
            self.nodes.labels(state.value).set(counts[state])
        self.quarantined.set(counts[NodeState.QUARANTINED])
        for n in nodes:
            self.node_quarantined.labels(n.name).set(1 if n.state == NodeState.QUARANTINED else 0)
            if n.name not in self._nodes_seen:
                self._nodes_seen.add(n.name)
                for kind in IncidentKind:
                    self.incidents.labels(self.job_id, kind.value, n.name)
        if not counts[NodeState.QUARANTINED]:
            return {}
        return {name: t.at for name, t in self.store.last_node_transitions().items()
                if t.to_state == NodeState.QUARANTINED and t.job_id == self.job_id}

    def _new_incidents(self) -> None:
        job_id = self.job_id
        for i in self.store.incidents(job_id, after_id=self._last_incident):
            self._last_incident = max(self._last_incident, i.id)
            self.incidents.labels(job_id, i.kind.value, i.node or "").inc()
            seen = self.store.last_progress_ns(job_id, i.attempt, int(i.detected_at * 1e9))
            if seen is not None:
                self.detection.labels(i.kind.value).observe(max(i.detected_at - seen / 1e9, 0.0))
            self._by_attempt[i.attempt].append(i)
            self._unsettled.append(i)

    def _settle(self, attempts: Sequence[AttemptRecord], restarted: set[int], quarantined_at: Mapping[str, float],
                now: float) -> None:
        """Publish the timestamp series of incidents whose action is now known."""
        over = {a.number for a in attempts if a.state.terminal}
        failed = {a.number for a in attempts if a.state is AttemptState.FAILED}
        waiting = []
        for i in self._unsettled:
            ended = i.attempt in failed and ending_incident(self._by_attempt[i.attempt]) is i
            action = incident_action(i, quarantined_at=quarantined_at.get(i.node or ""),
                                     attempt_over=i.attempt in over, ended_it=ended,
                                     restarted=i.attempt in restarted, age_s=now - i.detected_at)
            if action is None:
                waiting.append(i)
                continue
            labels = (self.job_id, str(i.id), i.kind.value, i.node or "", "" if i.rank is None else str(i.rank),
                      action)
            self.incident_at.labels(*labels).set(i.detected_at)
            self._series.append(labels)
            while len(self._series) > INCIDENT_SERIES:
                self.incident_at.remove(*self._series.popleft())
            if ended:
                self._unrecovered.append(i)
        self._unsettled = waiting

    def _recoveries(self, attempts: Sequence[AttemptRecord]) -> None:
        """Observe the recovery of incidents whose attempt a later one has stepped after."""
        if not self._unrecovered:
            return
        later_first_end: dict[int, float | None] = {}
        waiting = []
        for i in self._unrecovered:
            resumed = None
            for a in attempts:
                if a.number <= i.attempt:
                    continue
                if a.number not in later_first_end:
                    # read only until the next attempt has stepped: few rows by then
                    span = self.store.step_span(self.job_id, a.number)
                    later_first_end[a.number] = None if span is None else span[0] / 1e9
                if later_first_end[a.number] is not None:
                    resumed = later_first_end[a.number]
                    break
            if resumed is None:
                waiting.append(i)
            else:
                self.recovery.labels(i.kind.value).observe(max(resumed - i.detected_at, 0.0))
        self._unrecovered = waiting
        for number in [n for n in self._by_attempt if n < self.current_attempt - 1]:
            if not any(i.attempt == number for i in (*self._unsettled, *self._unrecovered)):
                del self._by_attempt[number]

    def _report(self, now: float, *, final: bool) -> None:
        started = time.monotonic()
        report: dict[str, Any] = load_report(self.store, self.job_id, now)
        self.report_s = time.monotonic() - started
        self._report_due = time.monotonic() + REPORT_COST * self.report_s
        self._report_final = final
        job_id = self.job_id
        if report["ettr"] is not None:
            # a ratio stays 0-1: step ends come from the ranks' host clocks, which may run
            # ahead of the controller's by a little
            self.ettr.labels(job_id).set(min(max(report["ettr"], 0.0), 1.0))
            self._ettr_shown = True
        elif self._ettr_shown:  # absent while the report has none
            self.ettr.remove(job_id)
            self._ettr_shown = False
        self.productive.labels(job_id).set(report["productive_s"])
        for category, seconds in lost_by_category(report["lost_s"]).items():
            self.lost.labels(job_id, category).set(seconds)


class MetricsRefresher:
    """The one thread that folds queued batches in and refreshes the store-derived metrics
    (a context manager; ``close`` stops it). Either may be None (a benchmark's controller
    has batches but no job row)."""

    def __init__(self, metrics: ControllerMetrics, jobs: JobMetrics | None, feed: CollectiveMetrics | None,
                 interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"metrics refresh interval must be > 0 s, got {interval_s}")
        self._metrics, self._jobs, self._feed, self._interval_s = metrics, jobs, feed, interval_s
        if jobs is not None:
            jobs.on_cost = metrics.add_cost
        self._stop = threading.Event()
        self._nudged = threading.Event()  # wake(): refresh now, not at the next interval
        self._failed = False
        self.ticks = 0
        self._thread = threading.Thread(target=self._run, name="fleet-metrics-refresh", daemon=True)

    def start(self) -> MetricsRefresher:
        self._thread.start()
        return self

    def wake(self) -> None:
        """Refresh now (any thread; returns at once): the job changed (an incident, an
        attempt's end, a restart), and its metrics should not wait out the interval."""
        self._nudged.set()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._nudged.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._jobs is not None:
            self._jobs.close()

    def __enter__(self) -> MetricsRefresher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tick(self) -> None:
        """One refresh: fold the queued batches, read the store, count the time spent."""
        started = time.perf_counter()
        try:
            if self._feed is not None:
                self._feed.drain()
            if self._jobs is not None:
                self._jobs.refresh()
                if self._feed is not None:
                    self._feed.start_attempt(self._jobs.current_attempt)
        finally:
            self._metrics.add_cost(time.perf_counter() - started)
            self.ticks += 1

    def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a store outage must not end the metrics
                if not self._failed:
                    self._failed = True
                    log.exception("metrics refresh failed (retried every %.1f s)", self._interval_s)
                else:
                    log.debug("metrics refresh failed again", exc_info=True)
            self._nudged.wait(self._interval_s)
            self._nudged.clear()
            if self._stop.is_set():
                return
