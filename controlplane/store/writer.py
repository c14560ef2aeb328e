"""The store's single ingest writer: group commits of agent batches, acks after commit.

Agent streams (``agent_server``) validate and convert each batch into rows on their own
receiver threads, then ``put`` it here; heartbeats' host samples come through
``put_health``. One named thread takes everything queued (up to ``max_group_events``)
and commits it in one transaction, then acks each batch on its stream; the health
samples of the same round go in one more. One writer suits SQLite, which has one write
lock, and on PostgreSQL it keeps the commit rate independent of the number of agents.

Invariants:
- A batch is acked only after the transaction holding it committed. Items of one stream
  are committed and acked in the order they were put, so an ack's "everything up to seq"
  meaning holds; a refused batch is acked with ``rejected`` in its place in that order.
- ``put`` blocks while ``max_queued_events`` are waiting: the stream then stops reading,
  and gRPC flow control pushes back on the agent. Nothing is dropped for being slow.
- A store outage fails the streams whose batches were in the failed transaction (their
  agents reconnect and resend); later items of a failed stream are skipped, never acked.
- A batch the store refuses (a constraint or type error) is found by retrying the group
  one batch at a time, recorded in ``ingest_drops`` and acked as rejected: one bad batch
  never blocks the others.
- Fronts of committed batches (a large job's per-(rank, group) progress) are kept, the
  newest per key, and written every ``fronts_flush_s`` (less often while a flush is slow,
  up to ``FRONTS_FLUSH_MAX_S``) and at ``close``: the store's fronts trail the live ones by
  at most that much. On PostgreSQL a thread of their own
  (``fleet-ingest-fronts``) writes them beside the commits, so that a flush of tens of
  thousands of rows holds no batch up; on SQLite (one write lock) the writer does. They are state, not events: a front
  is superseded by the next, so writing only the newest loses nothing.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fleet.controlplane.errors import UnavailableError
from fleet.controlplane.store.ingest import InvalidBatch, PreparedBatch
from fleet.controlplane.store.records import HealthRecord
from fleet.controlplane.store.store import Store
from fleet.proto import agent_pb2, fronts
from fleet.proto.events_pb2 import CollectiveFronts

if TYPE_CHECKING:  # the controller passes its metrics in; the store never builds them
    from fleet.controlplane.metrics import ControllerMetrics

log = logging.getLogger(__name__)

#: Seconds between writes of the newest fronts to the store.
FRONTS_FLUSH_S = 2.0
#: ... or less often: a flush that took t seconds is followed by the next no sooner than
#: FRONTS_FLUSH_COST * t later ...
FRONTS_FLUSH_COST = 25
#: ... but never later than this: what is not written yet is lost if the controller dies
#: (an attempt that ended since is never sent again), and its replay has no fronts.
FRONTS_FLUSH_MAX_S = 10.0
#: Host health samples stored per second at most, over all nodes.
HEALTH_ROWS_PER_S = 200.0


class Stream(Protocol):
    """What the writer needs of one agent stream: where to ack, how to fail it."""

    agent_id: str
    node_name: str
    failed: bool

    def ack(self, msg: agent_pb2.ControllerMessage) -> None: ...

    def fail(self, reason: str) -> None: ...


@dataclass
class Item:
    """One agent batch: its rows, or the reason it was refused before reaching the writer."""

    stream: Stream
    epoch: int
    seq: int
    rows: PreparedBatch | None
    events: int
    rejected: str = ""


class IngestWriter:
    """One writer thread over a bounded queue of batches. A context manager."""

    def __init__(self, store: Store, metrics: ControllerMetrics, *,
                 max_queued_events: int = 400_000, max_group_events: int = 50_000,
                 on_commit: Callable[[list[Item]], None] | None = None,
                 fronts_flush_s: float = FRONTS_FLUSH_S) -> None:
        self._store = store
        self._metrics = metrics
        self._max_queued = max_queued_events
        self._max_group = max_group_events
        self._on_commit = on_commit
        self._cond = threading.Condition()
        self._queue: collections.deque[Item] = collections.deque()
        self._health: list[HealthRecord] = []
        self._health_due: dict[str, float] = {}  # node -> monotonic time its next sample is stored
        self._queued_events = 0
        self._fronts: list[CollectiveFronts] = []  # blocks of committed batches, not yet written
        self._fronts_flush_s = fronts_flush_s
        self._fronts_due = time.monotonic() + fronts_flush_s
        self._closing = False
        # PostgreSQL takes the fronts' upsert beside the batches' commits: a flush of tens of
        # thousands of rows then holds no batch up. SQLite has one write lock: inline.
        self._flusher: threading.Thread | None = None
        self._to_flush: list[CollectiveFronts] = []
        self._flush_cond = threading.Condition()
        self._flush_stop = False
        self._thread = threading.Thread(target=self._run, name="fleet-ingest-writer", daemon=True)
        self._thread.start()
        if store.dialect != "sqlite":
            self._flusher = threading.Thread(target=self._flush_loop, name="fleet-ingest-fronts", daemon=True)
            self._flusher.start()

    def put(self, item: Item, timeout_s: float = 1.0) -> bool:
        """Queue ``item``; False if the queue stayed full for ``timeout_s`` (call again)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue and self._queued_events + item.events > self._max_queued:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    return False
                self._cond.wait(left)
            if self._closing:
                return False
            self._queue.append(item)
            self._queued_events += item.events
            self._metrics.queued.set(self._queued_events)
            self._cond.notify_all()
            return True

    def put_health(self, sample: HealthRecord) -> None:
        """Queue one host health sample (never blocks: an agent sends one a second).

        At most ``HEALTH_ROWS_PER_S`` samples a second are stored in all: with many nodes
        each node's are thinned to one per ``nodes / HEALTH_ROWS_PER_S`` seconds (2,048
        agents: one per node every ~10 s); liveness does not depend on them."""
        now = time.monotonic()
        with self._cond:
            due = self._health_due.get(sample.node, 0.0)
            if now < due:
                return
            self._health_due[sample.node] = now + len(self._health_due) / HEALTH_ROWS_PER_S
            self._health.append(sample)
            self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued (bounded), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._flusher is not None:
            with self._flush_cond:
                self._flush_stop = True
                self._flush_cond.notify_all()
            self._flusher.join(timeout_s)

    def __enter__(self) -> IngestWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread -----------------------------------------------------------------------

    def _take(self) -> tuple[list[Item], list[HealthRecord]]:
        with self._cond:
            while not self._queue and not self._health:
                if self._closing or (self._fronts and time.monotonic() >= self._fronts_due):
                    return [], []
                self._cond.wait(0.5)
            group, events = [], 0
            while self._queue and (not group or events + self._queue[0].events <= self._max_group):
                item = self._queue.popleft()
                group.append(item)
                events += item.events
            health, self._health = self._health, []
            self._queued_events -= events
            self._metrics.queued.set(self._queued_events)
            self._cond.notify_all()
            return group, health

    def _run(self) -> None:
        while True:
            group, health = self._take()
            if not group and not health and self._closing:
                self._flush_fronts()
                return
            try:
                if group:
                    self._commit(group)
                if health:
                    self._store.record_health_samples(health)
            except Exception:  # the writer must outlive anything one group does
                log.exception("ingest writer: group of %d batches and %d health samples failed",
                              len(group), len(health))
                for item in group:
                    item.stream.fail("the controller failed to store a batch")
            if self._fronts and time.monotonic() >= self._fronts_due:
                self._flush_fronts()

    def _keep_fronts(self, items: list[Item]) -> None:
        """The fronts of the fresh batches just committed, for the next flush (which keeps
        the newest per key)."""
        for item in items:
            self._fronts.extend(item.rows.fronts)  # type: ignore[union-attr]

    def _flush_fronts(self) -> None:
        """On the writer's thread: write the kept fronts, or hand them to the flusher."""
        if self._flusher is None:
            blocks, self._fronts = self._fronts, []
            self._fronts_due = self._write_fronts(blocks)
            return
        with self._flush_cond:
            self._to_flush.extend(self._fronts)
            self._flush_cond.notify_all()
        self._fronts = []
        self._fronts_due = time.monotonic() + self._fronts_flush_s

    def _flush_loop(self) -> None:
        """The flusher's thread: write what the writer handed over, no more often than
        ``_write_fronts`` allows; at close, whatever is left."""
        due = 0.0
        while True:
            with self._flush_cond:
                while not self._flush_stop and (not self._to_flush or time.monotonic() < due):
                    self._flush_cond.wait(max(0.01, due - time.monotonic()) if self._to_flush else None)
                blocks, self._to_flush = self._to_flush, []
                stop = self._flush_stop
            if blocks:
                due = self._write_fronts(blocks)
            if stop:
                return

    def _write_fronts(self, blocks: list[CollectiveFronts]) -> float:
        """Write the newest front per key of ``blocks``; returns when the next write is due."""
        started = time.monotonic()
        rows = fronts.newest(blocks)
        try:
            if rows:
                self._store.record_fronts(rows)
        except Exception:  # noqa: BLE001 - fronts are state: the next ones replace these
            log.exception("ingest writer: writing %d fronts failed (the next flush writes newer ones)", len(rows))
        # a large job's flush is tens of thousands of rows: it may take at most
        # 1/FRONTS_FLUSH_COST of the writer's time, the rest is for the batches
        now = time.monotonic()
        return now + max(self._fronts_flush_s, min(FRONTS_FLUSH_COST * (now - started), FRONTS_FLUSH_MAX_S))

    def _commit(self, group: list[Item]) -> None:
        live = [i for i in group if not i.stream.failed]
        storable = [i for i in live if i.rows is not None]
        started = time.perf_counter()
        try:
            fresh = self._store.record_batches(
                [(i.stream.agent_id, i.epoch, i.seq, i.rows) for i in storable])
        except UnavailableError as exc:
            self._metrics.errors.labels("store").inc()
            log.error("ingest: store unavailable (%s); dropping %d agent streams so they resend",
                      exc, len({id(i.stream) for i in live}))
            for item in live:
                item.stream.fail("store unavailable")
            time.sleep(0.5)  # the agents reconnect with backoff; don't spin on a dead store
            return
        except InvalidBatch as exc:
            if len(storable) > 1:
                for item in group:  # find the one the store refuses; keep the rest
                    self._commit([item])
                return
            fresh, storable[0].rejected, storable[0].rows = [], str(exc), None
        self._metrics.commit_s.observe(time.perf_counter() - started)
        by_item = dict(zip(map(id, storable), fresh))
        self._keep_fronts([i for i in storable if by_item[id(i)] and i.rows.fronts])  # type: ignore[union-attr]
        for item in live:
            if item.rows is None:
                self._reject(item)
                continue
            if by_item[id(item)]:
                self._metrics.batches.inc()
                self._metrics.events.inc(item.events)
            else:
                self._metrics.duplicates.inc()
            item.stream.ack(agent_pb2.ControllerMessage(ack=agent_pb2.Ack(epoch=item.epoch, seq=item.seq)))
        if self._on_commit is not None:
            self._on_commit(live)

    def _reject(self, item: Item) -> None:
        self._metrics.errors.labels("invalid").inc()
        self._metrics.dropped.labels("controller").inc(item.events)
        log.error("agent %s: batch %d/%d refused and recorded as dropped: %s",
                  item.stream.agent_id, item.epoch, item.seq, item.rejected)
        self._store.record_drop(item.stream.agent_id, item.stream.node_name, item.epoch, item.seq,
                                item.seq, item.events, item.rejected, "controller")
        item.stream.ack(agent_pb2.ControllerMessage(
            ack=agent_pb2.Ack(epoch=item.epoch, seq=item.seq, rejected=item.rejected)))
