"""The controller's Prometheus registry and endpoint, and the ingest path's metrics.

One ``ControllerMetrics`` per controller, with its own registry (so that two controllers
in one process, as in tests, count separately). It owns:

- the registry the job metrics (``job_metrics``) and the batch-fed metrics
  (``collective_metrics``) register into, and what it costs to export them:
  ``fleet_exporter_collect_seconds_total`` counts the wall time of every collection
  (a scrape's text formatting included, since the registry's collection is consumed
  while the text is written) plus what the refresher reports with ``add_cost``;
- the ingest metrics (throughput, refusals, losses, commit durations, the writer's queue,
  agent streams) and ``fleet_agent_last_heard_seconds{node}``, read at scrape time from
  the agent registry (a lock and a dict: O(nodes));
- ``BulkHistogram``, a histogram fed whole arrays (the batch-fed metrics' durations);
- serving: ``serve(host, port)`` exposes ``/metrics`` over HTTP; ``publish_targets``
  writes the Prometheus ``file_sd`` target file ``<state_dir>/prometheus/targets.json``
  (atomically), ``close`` stops the endpoint and removes the file if it is still ours.

Names follow Prometheus's rules: the ``fleet_`` prefix, base units (seconds, ratios
0-1), counters ending ``_total`` (prometheus-client appends it), label ``job_id`` (never
``job``, which Prometheus gives the scrape job). ``_created`` series are off.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from fleet.controlplane.addresses import is_wildcard, join_host_port

#: Reasons an agent message is refused or fails, the label of ``fleet_ingest_errors_total``.
ERROR_REASONS = ("unauthenticated", "malformed", "oversized", "invalid", "protocol", "store")
#: Where the controller writes its Prometheus ``file_sd`` target, under its state dir.
TARGETS_FILE = Path("prometheus") / "targets.json"

# A counter's ``_created`` sample doubles the series a scrape carries and no dashboard
# reads it; the controller process exports nothing else through prometheus-client.
disable_created_metrics()


class _TimedRegistry(CollectorRegistry):
    """A registry that adds the wall time of each collection to ``spent_s``."""

    def __init__(self) -> None:
        super().__init__()
        self._cost_lock = threading.Lock()
        self.spent_s = 0.0

    def add_cost(self, seconds: float) -> None:
        with self._cost_lock:
            self.spent_s += seconds

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            yield from super().collect()
        finally:
            self.add_cost(time.perf_counter() - started)


class _ExporterCost(Collector):
    def __init__(self, registry: _TimedRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "fleet_exporter_collect_seconds",
            "Wall time the metrics exporter spent: scrapes (collection and text) and the refresher "
            "(store reads, batch folding).", value=self._registry.spent_s)


class _AgentsHeard(Collector):
    """``fleet_agent_last_heard_seconds{node}``, computed at scrape time."""

    def __init__(self) -> None:
        self.silent_for: Callable[[float], Mapping[str, float]] | None = None

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "fleet_agent_last_heard_seconds",
            "Seconds since each connected agent was last heard from (any message).", labels=["node"])
        if self.silent_for is not None:
            for node, silent_s in sorted(self.silent_for(time.monotonic()).items()):
                family.add_metric([node], max(silent_s, 0.0))
        yield family


class BulkHistogram(Collector):
    """A Prometheus histogram fed whole arrays of observations at once (one numpy pass per
    array, not a lock and a bucket search per value): for what arrives by the thousand."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc, self._labelnames = name, documentation, tuple(labelnames)
        self._bounds = np.asarray(sorted(buckets), dtype=np.float64)
        self._les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], list[Any]] = {}  # labels -> [bucket counts, sum]
        registry.register(self)

    def observe_many(self, labels: Sequence[str], values: Iterable[float] | np.ndarray) -> None:
        arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
        if not arr.size:
            return
        # bucket i counts values <= bound i (Prometheus's "le"); the last is +Inf
        counts = np.bincount(np.searchsorted(self._bounds, arr, side="left"), minlength=len(self._les))
        total = float(arr.sum())
        with self._lock:
            series = self._series.get(tuple(labels))
            if series is None:
                self._series[tuple(labels)] = [counts.astype(np.int64), total]
            else:
                series[0] += counts
                series[1] += total

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        with self._lock:
            series = [(k, np.cumsum(v[0]).tolist(), v[1]) for k, v in self._series.items()]
        for labels, cumulative, total in sorted(series):
            family.add_metric(list(labels), list(zip(self._les, cumulative)), total)
        yield family


class ControllerMetrics:
    """The registry, the ingest metrics (thread-safe, as prometheus-client is) and the endpoint."""

    def __init__(self) -> None:
        self.registry = _TimedRegistry()
        r = self.registry
        self.batches = Counter("fleet_ingest_batches", "Agent batches committed.", registry=r)
        self.events = Counter("fleet_ingest_events", "Events committed to the store.", registry=r)
        self.duplicates = Counter(
            "fleet_ingest_duplicate_batches",
            "Batches received again after their commit (acked again, not rewritten).", registry=r)
        self.errors = Counter("fleet_ingest_errors", "Agent messages refused or failed, by reason.",
                              ["reason"], registry=r)
        self.dropped = Counter(
            "fleet_ingest_dropped_events",
            "Events lost, by who lost them: agent (spill disk failed) or controller (refused "
            "as malformed). Every loss is also a row in the store's ingest_drops.",
            ["source"], registry=r)
        self.commit_s = Histogram(
            "fleet_ingest_commit_seconds", "Duration of one group commit of agent batches.",
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10), registry=r)
        self.queued = Gauge("fleet_ingest_queued_events",
                            "Events received and waiting for the store writer.", registry=r)
        self.agents = Gauge("fleet_agents_connected", "Agent streams open now.", registry=r)
        for reason in ERROR_REASONS:
            self.errors.labels(reason)
        for source in ("agent", "controller"):
            self.dropped.labels(source)
        self._heard = _AgentsHeard()
        r.register(self._heard)
        r.register(_ExporterCost(r))
        self._closers: list[Callable[[], None]] = []
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._targets: tuple[Path, str] | None = None  # (file, the target it names)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample, e.g. ``value("fleet_ingest_errors_total", reason="invalid")``."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def add_cost(self, seconds: float) -> None:
        """Count ``seconds`` of exporter work done outside a scrape (the refresher's)."""
        self.registry.add_cost(seconds)

    def watch_agents(self, silent_for: Callable[[float], Mapping[str, float]]) -> None:
        """Read ``fleet_agent_last_heard_seconds`` from ``silent_for(monotonic now)`` (node ->
        seconds, e.g. ``AgentRegistry.silent_for``) at every scrape."""
        self._heard.silent_for = silent_for

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` at ``close``, before the endpoint stops (a refresher's own stop)."""
        self._closers.append(fn)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = any free port); return the port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self._thread.name = "fleet-metrics-http"
        return int(self._server.server_port)

    def publish_targets(self, state_dir: Path, host: str, port: int, job_id: str) -> Path:
        """Write the ``file_sd`` target file naming this endpoint (atomically: Prometheus
        never reads half a file); ``close`` removes it. A wildcard ``host`` is published as
        127.0.0.1, where a Prometheus on this machine reaches it."""
        target = join_host_port("127.0.0.1" if is_wildcard(host) else host, port)
        path = state_dir / TARGETS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([{"targets": [target], "labels": {"fleet_job_id": job_id}}], indent=2) + "\n")
        os.replace(tmp, path)
        self._targets = (path, target)
        return path

    def close(self) -> None:
        """Stop what ``on_close`` registered, the endpoint, and remove the target file if it
        still names this endpoint (another controller may have taken it over). Idempotent."""
        closers, self._closers = self._closers, []
        for fn in closers:
            fn()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._targets is not None:
            path, target = self._targets
            self._targets = None
            try:
                if target in json.loads(path.read_text())[0]["targets"]:
                    path.unlink()
            except (OSError, ValueError, LookupError, TypeError):
                pass
