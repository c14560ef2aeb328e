"""The controller's Prometheus metrics: ingest throughput, refusals and losses.

One ``ControllerMetrics`` per controller, with its own registry (so that two controllers
in one process, as in tests, count separately). ``serve(host, port)`` exposes it over
HTTP for Prometheus; the dashboards in ``dashboards/`` read these names.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

#: Reasons an agent message is refused or fails, the label of ``fleet_ingest_errors_total``.
ERROR_REASONS = ("unauthenticated", "malformed", "oversized", "invalid", "protocol", "store")


class ControllerMetrics:
    """Counters and histograms of the ingest path (thread-safe, as prometheus-client is)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample, e.g. ``value("fleet_ingest_errors_total", reason="invalid")``."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = any free port); return the port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self._thread.name = "fleet-metrics-http"
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
