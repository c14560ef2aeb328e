"""The Store: fleet's one persistence object, with domain methods over SQLAlchemy.

Invariants:
- Every method runs in its own short transaction from a pooled sessionmaker, so one
  Store is safe to share between threads (gRPC server threads and the controller).
- Nothing SQLAlchemy leaves this package: methods take and return plain values and
  the frozen records of ``records.py``.
- Every job/attempt state change is checked with ``check_transition`` and stored as a
  ``transitions`` row in the same transaction; an illegal one raises ``StateError``
  and writes nothing. Node state changes likewise, as ``node_transitions`` rows that
  also name the actor (``NodeActor``) and the job involved, if any.
- Incident kinds are ``IncidentKind`` values: ``record_incident`` refuses any other.
- ``record_batch`` is idempotent on (agent_id, epoch, seq): the batch row and its
  events commit together or not at all.
- Opening a Store brings its schema to the newest migration (``migrate.upgrade``).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from fleet.controlplane.errors import FleetError, NotFoundError, StateError, UnavailableError
from fleet.controlplane.lifecycle import AttemptState, JobState, NodeActor, NodeState, check_transition
from fleet.controlplane.store import ingest, migrate
from fleet.controlplane.store.engine import make_engine, redact, upsert
from fleet.controlplane.store.records import (
    ActionRecord,
    AttemptRecord,
    CheckpointRecord,
    CollectiveRecord,
    CollectiveSummary,
    HealthRecord,
    IncidentRecord,
    IngestDropRecord,
    JobRecord,
    NodeRecord,
    NodeTransitionRecord,
    ProcessGroupRecord,
    RankRecord,
    RecoveryRecord,
    SdcCheckRecord,
    StepRecord,
    TransitionRecord,
    WorkerStatusRecord,
)
from fleet.controlplane.store.schema import (
    Action,
    Attempt,
    Checkpoint,
    Collective,
    HealthSample,
    Incident,
    IngestBatch,
    IngestDrop,
    Job,
    Node,
    NodeTransition,
    ProcessGroupRow,
    Rank,
    Recovery,
    SdcCheck,
    Step,
    Transition,
    WorkerStatusRow,
)
from fleet.proto import events_pb2
from fleet.proto.kinds import IncidentKind

ACTION_KINDS = frozenset({"restart", "quarantine", "release", "rollback", "stop", "inject_fault",
                          "restart_agent", "shrink"})
SDC_KINDS = ingest.SDC_KINDS
DROP_SOURCES = frozenset({"agent", "controller"})
#: kept as a name: the controller compares node states with it
NODE_QUARANTINED = NodeState.QUARANTINED


def new_job_id(now: float) -> str:
    """``j-YYYYmmdd-HHMMSS-xxxx`` (UTC, 4 random hex digits)."""
    stamp = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"j-{stamp}-{secrets.token_hex(2)}"


def _sizes(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in json.loads(text))


class Store:
    """Persistence for jobs, attempts, nodes and telemetry. Thread-safe; a context manager."""

    def __init__(self, url: str) -> None:
        self._shown_url = redact(url)
        self._engine, write_engine, single_connection = make_engine(url)
        # In-memory SQLite has one shared connection: one transaction at a time.
        self._serial: AbstractContextManager[Any] = (
            threading.Lock() if single_connection else nullcontext())
        self._read = sessionmaker(self._engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(write_engine, expire_on_commit=False)
        self._closed = False
        try:
            # The store upgrades itself on first use; one query when already at head.
            migrate.upgrade(write_engine)
        except FleetError:
            self._engine.dispose()
            raise

    # -- plumbing -------------------------------------------------------------------------

    def close(self) -> None:
        """Release every pooled connection. Idempotent."""
        if not self._closed:
            self._closed = True
            self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    @contextmanager
    def _tx(self, write: bool) -> Iterator[Session]:
        if self._closed:
            raise StateError(f"store {self._shown_url!r} is closed")
        maker = self._write_sessions if write else self._read
        try:
            with self._serial, maker.begin() as session:
                yield session
        except OperationalError as e:
            raise UnavailableError(f"store {self._shown_url!r}: {e.orig}") from e

    def _job(self, s: Session, job_id: str, lock: bool = False) -> Job:
        stmt = select(Job).where(Job.id == job_id)
        job = s.scalars(stmt.with_for_update() if lock else stmt).one_or_none()
        if job is None:
            raise NotFoundError(f"job {job_id!r} not found")
        return job

    def _attempt(self, s: Session, job_id: str, number: int) -> Attempt:
        row = s.scalars(
            select(Attempt).where(Attempt.job_id == job_id, Attempt.number == number)
            .with_for_update()
        ).one_or_none()
        if row is None:
            raise NotFoundError(f"attempt {number} of job {job_id!r} not found")
        return row

    # -- jobs -----------------------------------------------------------------------------

    def create_job(self, name: str, total_steps: int, config_json: str) -> str:
        """Create a PENDING job; return its id."""
        for _ in range(5):
            now = time.time()
            job_id = new_job_id(now)
            try:
                with self._tx(write=True) as s:
                    s.add(Job(id=job_id, name=name, state=JobState.PENDING.value,
                              total_steps=total_steps, config_json=config_json,
                              created_at=now, updated_at=now, ended_at=None, reason=""))
                    s.flush()
                    s.add(Transition(job_id=job_id, attempt=None, entity="job", from_state=None,
                                     to_state=JobState.PENDING.value, reason="created", at=now))
                return job_id
            except IntegrityError:
                continue  # the same id drawn twice in one second: draw again
        raise FleetError("could not allocate a unique job id")

    def set_job_state(self, job_id: str, state: JobState, reason: str = "") -> None:
        """Move a job to ``state``; ``StateError`` if illegal. Terminal states set ended_at."""
        with self._tx(write=True) as s:
            job = self._job(s, job_id, lock=True)
            old = JobState(job.state)
            check_transition(old, state)
            now = time.time()
            job.state, job.updated_at, job.reason = state.value, now, reason
            if state.terminal:
                job.ended_at = now
            s.add(Transition(job_id=job_id, attempt=None, entity="job", from_state=old.value,
                             to_state=state.value, reason=reason, at=now))

    def set_job_reason(self, job_id: str, reason: str) -> None:
        """Say why the job is where it is (e.g. what it waits for), without a state change."""
        with self._tx(write=True) as s:
            job = self._job(s, job_id, lock=True)
            job.reason, job.updated_at = reason, time.time()

    def _job_query(self):
        steps = (select(func.coalesce(func.max(Step.step), 0))
                 .where(Step.job_id == Job.id).scalar_subquery())
        attempts = (select(func.count(Attempt.id))
                    .where(Attempt.job_id == Job.id).scalar_subquery())
        return select(Job, steps, attempts)

    @staticmethod
    def _job_record(job: Job, steps: int, attempts: int) -> JobRecord:
        return JobRecord(id=job.id, name=job.name, state=JobState(job.state),
                         total_steps=job.total_steps, steps_completed=int(steps),
                         attempts=int(attempts), created_at=job.created_at,
                         ended_at=job.ended_at, reason=job.reason, config_json=job.config_json)

    def get_job(self, job_id: str) -> JobRecord:
        with self._tx(write=False) as s:
            row = s.execute(self._job_query().where(Job.id == job_id)).one_or_none()
            if row is None:
                raise NotFoundError(f"job {job_id!r} not found")
            return self._job_record(*row)

    def list_jobs(self, limit: int = 100) -> list[JobRecord]:
        """Jobs, newest first."""
        with self._tx(write=False) as s:
            rows = s.execute(
                self._job_query().order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
            ).all()
            return [self._job_record(*r) for r in rows]

    def transitions(self, job_id: str) -> list[TransitionRecord]:
        """Every state change of the job and its attempts, oldest first."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(Transition).where(Transition.job_id == job_id)
                             .order_by(Transition.id)).all()
            return [TransitionRecord(job_id=r.job_id, attempt=r.attempt, entity=r.entity,
                                     from_state=r.from_state, to_state=r.to_state,
                                     reason=r.reason, at=r.at) for r in rows]

    # -- attempts -------------------------------------------------------------------------

    def create_attempt(self, job_id: str) -> int:
        """Create the job's next attempt (1-based) in state PLACING; return its number."""
        with self._tx(write=True) as s:
            self._job(s, job_id, lock=True)  # serializes numbering on PostgreSQL
            number = s.scalar(select(func.coalesce(func.max(Attempt.number), 0))
                              .where(Attempt.job_id == job_id)) + 1
            now = time.time()
            s.add(Attempt(job_id=job_id, number=number, state=AttemptState.PLACING.value,
                          started_at=now, ended_at=None, restored_step=None,
                          final_step=None, reason=""))
            s.add(Transition(job_id=job_id, attempt=number, entity="attempt", from_state=None,
                             to_state=AttemptState.PLACING.value, reason="created", at=now))
            return number

    def set_attempt_state(self, job_id: str, attempt: int, state: AttemptState,
                          reason: str = "") -> None:
        """Move an attempt to ``state``; ``StateError`` if illegal. Terminal sets ended_at."""
        with self._tx(write=True) as s:
            row = self._attempt(s, job_id, attempt)
            old = AttemptState(row.state)
            check_transition(old, state)
            now = time.time()
            row.state, row.reason = state.value, reason
            if state.terminal:
                row.ended_at = now
            s.add(Transition(job_id=job_id, attempt=attempt, entity="attempt",
                             from_state=old.value, to_state=state.value, reason=reason, at=now))

    def set_attempt_restored(self, job_id: str, attempt: int, step: int) -> None:
        """Record the checkpoint step the attempt restored (0 = fresh start)."""
        with self._tx(write=True) as s:
            self._attempt(s, job_id, attempt).restored_step = step

    def set_attempt_final_step(self, job_id: str, attempt: int, step: int) -> None:
        """Record the last step the attempt completed."""
        with self._tx(write=True) as s:
            self._attempt(s, job_id, attempt).final_step = step

    def get_attempts(self, job_id: str) -> list[AttemptRecord]:
        """The job's attempts by number; ``NotFoundError`` if the job does not exist."""
        with self._tx(write=False) as s:
            self._job(s, job_id)
            rows = s.scalars(select(Attempt).where(Attempt.job_id == job_id)
                             .order_by(Attempt.number)).all()
            return [AttemptRecord(job_id=r.job_id, number=r.number, state=AttemptState(r.state),
                                  started_at=r.started_at, ended_at=r.ended_at,
                                  restored_step=r.restored_step, final_step=r.final_step,
                                  reason=r.reason) for r in rows]

    # -- nodes and ranks ------------------------------------------------------------------

    def upsert_node(self, name: str, ray_node_id: str, hostname: str, resources_json: str) -> None:
        """Register a node or refresh its identity; keeps any quarantine. Sets last_seen.
        A new node starts healthy, with a first ``node_transitions`` row (actor controller)."""
        now = time.time()
        identity = {"ray_node_id": ray_node_id, "hostname": hostname,
                    "resources_json": resources_json, "last_seen": now}
        # Insert-or-nothing first, so exactly one registrant (the one that gets its row back)
        # writes the first history row; rowcount is not reliable here on every driver.
        insert = upsert(self.dialect, Node.__table__, ["name"], None).values(
            name=name, state=NodeState.HEALTHY.value, quarantine_reason="", quarantined_since=None,
            **identity).returning(Node.__table__.c.name)
        with self._tx(write=True) as s:
            if s.execute(insert).first() is not None:
                s.add(NodeTransition(node=name, from_state=None, to_state=NodeState.HEALTHY.value,
                                     reason="registered", actor=NodeActor.CONTROLLER.value,
                                     job_id=None, at=now))
            else:
                s.execute(update(Node).where(Node.name == name).values(**identity))

    def touch_node(self, name: str) -> None:
        """Set the node's last_seen to now; ``NotFoundError`` if unknown."""
        with self._tx(write=True) as s:
            res = s.execute(update(Node).where(Node.name == name).values(last_seen=time.time()))
            if res.rowcount == 0:
                raise NotFoundError(f"node {name!r} not found")

    def _move_node(self, s: Session, name: str, to: NodeState, reason: str, actor: NodeActor,
                   job_id: str | None, now: float) -> Node | None:
        """Lock the node and move it to ``to``, storing the transition; None (nothing
        written) when it is there already. ``NotFoundError`` if unknown."""
        node = s.get(Node, name, with_for_update=True)
        if node is None:
            raise NotFoundError(f"node {name!r} not found")
        old = NodeState(node.state)
        if old is to:
            return None
        check_transition(old, to)
        node.state = to.value
        s.add(NodeTransition(node=name, from_state=old.value, to_state=to.value, reason=reason,
                             actor=NodeActor(actor).value, job_id=job_id, at=now))
        return node

    def quarantine_node(self, name: str, reason: str, *, actor: NodeActor = NodeActor.OPERATOR,
                        job_id: str | None = None) -> bool:
        """Take the node out of placement with ``reason``, recording who (``actor``) and the
        job whose incidents led to it. A node already quarantined keeps its first reason and
        nothing is written: return whether it moved. ``NotFoundError`` if unknown."""
        with self._tx(write=True) as s:
            now = time.time()
            node = self._move_node(s, name, NodeState.QUARANTINED, reason, actor, job_id, now)
            if node is not None:
                node.quarantine_reason, node.quarantined_since = reason, now
            return node is not None

    def release_node(self, name: str, *, actor: NodeActor = NodeActor.OPERATOR,
                     reason: str = "released") -> bool:
        """Return a quarantined node to healthy, recording who and why. A healthy node is
        left as it is and nothing is written: return whether it moved. ``NotFoundError``
        if unknown."""
        with self._tx(write=True) as s:
            node = self._move_node(s, name, NodeState.HEALTHY, reason, actor, None, time.time())
            if node is not None:
                node.quarantine_reason, node.quarantined_since = "", None
            return node is not None

    def node_history(self, name: str) -> list[NodeTransitionRecord]:
        """Every state change of the node, oldest first (empty for a node never seen)."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(NodeTransition).where(NodeTransition.node == name)
                             .order_by(NodeTransition.id)).all()
            return [self._node_transition_record(r) for r in rows]

    def last_node_transitions(self) -> dict[str, NodeTransitionRecord]:
        """Each node's latest state change, by node name (in name order)."""
        latest = select(func.max(NodeTransition.id)).group_by(NodeTransition.node).scalar_subquery()
        with self._tx(write=False) as s:
            rows = s.scalars(select(NodeTransition).where(NodeTransition.id.in_(latest))
                             .order_by(NodeTransition.node)).all()
            return {r.node: self._node_transition_record(r) for r in rows}

    @staticmethod
    def _node_transition_record(r: NodeTransition) -> NodeTransitionRecord:
        return NodeTransitionRecord(
            node=r.node, from_state=None if r.from_state is None else NodeState(r.from_state),
            to_state=NodeState(r.to_state), reason=r.reason, actor=r.actor, job_id=r.job_id, at=r.at)

    def set_node_health(self, name: str, health: str, reason: str) -> None:
        """Store the node's latest health-check verdict and why; ``NotFoundError`` if unknown."""
        with self._tx(write=True) as s:
            res = s.execute(update(Node).where(Node.name == name)
                            .values(health=health, health_reason=reason))
            if res.rowcount == 0:
                raise NotFoundError(f"node {name!r} not found")

    def list_nodes(self) -> list[NodeRecord]:
        with self._tx(write=False) as s:
            rows = s.scalars(select(Node).order_by(Node.name)).all()
            return [NodeRecord(name=n.name, ray_node_id=n.ray_node_id, hostname=n.hostname,
                               resources_json=n.resources_json, state=NodeState(n.state),
                               quarantine_reason=n.quarantine_reason,
                               quarantined_since=n.quarantined_since, last_seen=n.last_seen,
                               health=n.health, health_reason=n.health_reason)
                    for n in rows]

    def record_rank(self, job_id: str, attempt: int, rank: int, node: str, pid: int) -> None:
        """Record (or correct) where a rank of an attempt runs."""
        stmt = upsert(self.dialect, Rank.__table__, ["job_id", "attempt", "rank"],
                      {"node": node, "pid": pid})
        try:
            with self._tx(write=True) as s:
                s.execute(stmt, [{"job_id": job_id, "attempt": attempt, "rank": rank,
                                  "node": node, "pid": pid}])
        except IntegrityError as e:
            raise NotFoundError(f"job {job_id!r} not found") from e

    def ranks(self, job_id: str, attempt: int) -> list[RankRecord]:
        with self._tx(write=False) as s:
            rows = s.scalars(select(Rank).where(Rank.job_id == job_id, Rank.attempt == attempt)
                             .order_by(Rank.rank)).all()
            return [RankRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank, node=r.node,
                               pid=r.pid) for r in rows]

    # -- ingest ---------------------------------------------------------------------------

    def record_batch(self, agent_id: str, epoch: int, seq: int,
                     events: Sequence[events_pb2.Event]) -> bool:
        """Store one agent batch atomically; False (and nothing written) if already stored.

        ``ingest.InvalidBatch`` (nothing written) when the events cannot be stored."""
        return self.record_batches([(agent_id, epoch, seq, ingest.prepare(events))])[0]

    def record_batches(self, batches: Sequence[tuple[str, int, int, ingest.PreparedBatch]]
                       ) -> list[bool]:
        """Store prepared batches ``(agent_id, epoch, seq, rows)`` in one transaction (a
        group commit); per batch, True if stored now, False if it already was. All or
        nothing: on an error none of them is stored."""
        # RETURNING tells a fresh key from one already stored (rowcount is not reliable).
        marker = upsert(self.dialect, IngestBatch.__table__, ["agent_id", "epoch", "seq"],
                        None).returning(IngestBatch.__table__.c.seq)
        fresh: list[bool] = []
        try:
            with self._tx(write=True) as s:
                now = time.time()
                for agent_id, epoch, seq, rows in batches:
                    res = s.connection().execute(marker, {
                        "agent_id": agent_id, "epoch": epoch, "seq": seq,
                        "committed_at": now, "n_events": rows.events})
                    fresh.append(res.first() is not None)
                ingest.write(s, [rows for (*_, rows), new in zip(batches, fresh) if new])
        except (IntegrityError, DataError) as e:
            raise ingest.InvalidBatch(f"the store refused it: {e.orig}") from e
        return fresh

    def committed_seq(self, agent_id: str, epoch: int) -> int:
        """Highest committed batch seq of (agent, epoch); 0 if none."""
        with self._tx(write=False) as s:
            return s.scalar(select(func.coalesce(func.max(IngestBatch.seq), 0)).where(
                IngestBatch.agent_id == agent_id, IngestBatch.epoch == epoch))

    def record_health(self, node: str, time_ns: int, cpu_percent: float, load1: float,
                      mem_used_bytes: int, mem_total_bytes: int, workers_alive: int) -> None:
        self.record_health_samples([HealthRecord(node, time_ns, cpu_percent, load1, mem_used_bytes,
                                                 mem_total_bytes, workers_alive)])

    def record_health_samples(self, samples: Sequence[HealthRecord]) -> None:
        """Store host health samples (one transaction for all)."""
        if not samples:
            return
        with self._tx(write=True) as s:
            s.execute(HealthSample.__table__.insert(), [dataclasses.asdict(h) for h in samples])

    def health_samples(self, node: str, since_ns: int = 0) -> list[HealthRecord]:
        """The node's health samples with ``time_ns >= since_ns``, oldest first."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(HealthSample).where(
                HealthSample.node == node, HealthSample.time_ns >= since_ns)
                .order_by(HealthSample.time_ns, HealthSample.id)).all()
            return [HealthRecord(node=r.node, time_ns=r.time_ns, cpu_percent=r.cpu_percent,
                                 load1=r.load1, mem_used_bytes=r.mem_used_bytes,
                                 mem_total_bytes=r.mem_total_bytes,
                                 workers_alive=r.workers_alive) for r in rows]

    # -- incidents, actions, checkpoints --------------------------------------------------

    def record_incident(self, job_id: str, attempt: int, kind: IncidentKind | str, detector: str,
                        evidence: str, rank: int | None = None, node: str | None = None,
                        detected_at: float | None = None) -> int:
        """Store a detected incident (``detected_at``: Unix time, default now); return its id.
        ``ValueError`` (nothing written) when ``kind`` is not an ``IncidentKind``."""
        try:
            kind = IncidentKind(kind)
        except ValueError:
            raise ValueError(f"unknown incident kind {kind!r}; known: {', '.join(IncidentKind)}") from None
        try:
            with self._tx(write=True) as s:
                row = Incident(job_id=job_id, attempt=attempt, kind=kind.value, rank=rank, node=node,
                               detector=detector, evidence=evidence,
                               detected_at=time.time() if detected_at is None else detected_at)
                s.add(row)
                s.flush()
                return row.id
        except IntegrityError as e:
            raise NotFoundError(f"job {job_id!r} not found") from e

    def incidents(self, job_id: str) -> list[IncidentRecord]:
        with self._tx(write=False) as s:
            rows = s.scalars(select(Incident).where(Incident.job_id == job_id)
                             .order_by(Incident.id)).all()
            return [self._incident_record(r) for r in rows]

    @staticmethod
    def _incident_record(r: Incident) -> IncidentRecord:
        return IncidentRecord(id=r.id, job_id=r.job_id, attempt=r.attempt, kind=IncidentKind(r.kind), rank=r.rank,
                              node=r.node, detector=r.detector, evidence=r.evidence,
                              detected_at=r.detected_at)

    def incidents_on_node(self, node: str, since: float) -> list[IncidentRecord]:
        """Incidents blamed on ``node`` (any job) detected at or after ``since``, oldest first."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(Incident).where(Incident.node == node, Incident.detected_at >= since)
                             .order_by(Incident.detected_at, Incident.id)).all()
            return [self._incident_record(r) for r in rows]

    def record_recovery(self, r: RecoveryRecord) -> None:
        """Store how one restart went, phase by phase."""
        try:
            with self._tx(write=True) as s:
                s.add(Recovery(**dataclasses.asdict(r)))
        except IntegrityError as e:
            raise NotFoundError(f"job {r.job_id!r} not found") from e

    def recoveries(self, job_id: str) -> list[RecoveryRecord]:
        with self._tx(write=False) as s:
            rows = s.scalars(select(Recovery).where(Recovery.job_id == job_id).order_by(Recovery.id)).all()
            return [RecoveryRecord(**{f.name: getattr(r, f.name) for f in dataclasses.fields(RecoveryRecord)})
                    for r in rows]

    def record_action(self, job_id: str, attempt: int, kind: str, cause: str) -> int:
        """Store an action (restart, quarantine, rollback, stop, inject_fault, ...); return its id."""
        if kind not in ACTION_KINDS:
            raise ValueError(f"action kind {kind!r} not in {sorted(ACTION_KINDS)}")
        try:
            with self._tx(write=True) as s:
                row = Action(job_id=job_id, attempt=attempt, kind=kind, cause=cause,
                             at=time.time())
                s.add(row)
                s.flush()
                return row.id
        except IntegrityError as e:
            raise NotFoundError(f"job {job_id!r} not found") from e

    def actions(self, job_id: str) -> list[ActionRecord]:
        with self._tx(write=False) as s:
            rows = s.scalars(select(Action).where(Action.job_id == job_id)
                             .order_by(Action.id)).all()
            return [ActionRecord(id=r.id, job_id=r.job_id, attempt=r.attempt, kind=r.kind,
                                 cause=r.cause, at=r.at) for r in rows]

    @staticmethod
    def _checkpoint_record(r: Checkpoint) -> CheckpointRecord:
        return CheckpointRecord(job_id=r.job_id, attempt=r.attempt, step=r.step, path=r.path,
                                manifest_sha256=r.manifest_sha256, save_s=r.save_s,
                                valid=r.valid, created_at=r.created_at)

    def checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        """All checkpoints of the job by step, valid or not."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                             .order_by(Checkpoint.step)).all()
            return [self._checkpoint_record(r) for r in rows]

    def latest_valid_checkpoint(self, job_id: str,
                                before_step: int | None = None) -> CheckpointRecord | None:
        """Newest valid checkpoint, optionally with ``step < before_step`` (SDC rollback)."""
        stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.valid.is_(True))
        if before_step is not None:
            stmt = stmt.where(Checkpoint.step < before_step)
        with self._tx(write=False) as s:
            row = s.scalars(stmt.order_by(Checkpoint.step.desc()).limit(1)).first()
            return None if row is None else self._checkpoint_record(row)

    def invalidate_checkpoint(self, job_id: str, step: int, reason: str = "",
                              attempt: int | None = None) -> None:
        """Mark a checkpoint invalid (it failed manifest verification, was corrupted, or was
        saved after corruption) and record ``reason`` as a ``ckpt_invalid`` action of
        ``attempt`` (default: the attempt that saved it). The manifest on disk is the
        truth; this keeps the store's flag, which replay and report show, in step with it."""
        with self._tx(write=True) as s:
            row = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id,
                                                     Checkpoint.step == step)).first()
            if row is None:
                raise NotFoundError(f"checkpoint of job {job_id!r} at step {step} not found")
            ingest.invalidate_checkpoint(s, job_id, row.attempt if attempt is None else attempt, step,
                                         reason or "marked invalid", time.time())

    # -- telemetry queries ----------------------------------------------------------------

    def steps(self, job_id: str, attempt: int | None = None,
              rank: int | None = None) -> list[StepRecord]:
        """Step metrics ordered by attempt, step, rank."""
        stmt = select(Step).where(Step.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(Step.attempt == attempt)
        if rank is not None:
            stmt = stmt.where(Step.rank == rank)
        with self._tx(write=False) as s:
            rows = s.scalars(stmt.order_by(Step.attempt, Step.step, Step.rank)).all()
            return [StepRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank, step=r.step,
                               loss=r.loss, step_time_s=r.step_time_s,
                               tokens_per_s=r.tokens_per_s, end_ns=r.end_ns,
                               grad_norm=r.grad_norm or 0.0, lr=r.lr or 0.0, mfu=r.mfu or 0.0,
                               aux_loss=r.aux_loss or 0.0, imbalanced=bool(r.imbalanced),
                               expert_load=tuple(json.loads(r.expert_load or "[]")))
                    for r in rows]

    def last_step(self, job_id: str, attempt: int | None = None) -> int:
        """Highest step recorded (in ``attempt``, or any); 0 if none."""
        stmt = select(func.max(Step.step)).where(Step.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(Step.attempt == attempt)
        with self._tx(write=False) as s:
            return s.scalar(stmt) or 0

    def step_span(self, job_id: str, attempt: int) -> tuple[int, int, int] | None:
        """``(first step's end_ns, last step, last step's end_ns)`` of ``attempt`` (over all
        ranks), or None before its first step."""
        stmt = (select(func.min(Step.end_ns), func.max(Step.step), func.max(Step.end_ns))
                .where(Step.job_id == job_id, Step.attempt == attempt))
        with self._tx(write=False) as s:
            first, last, last_end = s.execute(stmt).one()
        return None if first is None else (int(first), int(last), int(last_end))

    def collectives(self, job_id: str, attempt: int | None = None, rank: int | None = None,
                    group: str | None = None) -> list[CollectiveRecord]:
        """Collectives ordered by attempt, rank, group, seq."""
        c = Collective.__table__.c
        stmt = select(Collective.__table__).where(c.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(c.attempt == attempt)
        if rank is not None:
            stmt = stmt.where(c.rank == rank)
        if group is not None:
            stmt = stmt.where(c.group_name == group)
        stmt = stmt.order_by(c.attempt, c.rank, c.group_name, c.seq)
        with self._tx(write=False) as s:
            return [CollectiveRecord(
                job_id=r.job_id, attempt=r.attempt, rank=r.rank, group=r.group_name,
                group_size=r.group_size, seq=r.seq, op=r.op,
                input_sizes=_sizes(r.input_sizes), input_dtypes=tuple(json.loads(r.input_dtypes)),
                output_sizes=_sizes(r.output_sizes),
                output_dtypes=tuple(json.loads(r.output_dtypes)),
                enter_ns=r.enter_ns, exit_ns=r.exit_ns, state=r.state, step=r.step,
                exit_estimated=bool(r.exit_estimated),
            ) for r in s.execute(stmt)]

    def process_groups(self, job_id: str, attempt: int | None = None) -> list[ProcessGroupRecord]:
        """Process groups as the ranks declared them, ordered by attempt, group, rank."""
        stmt = select(ProcessGroupRow).where(ProcessGroupRow.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(ProcessGroupRow.attempt == attempt)
        stmt = stmt.order_by(ProcessGroupRow.attempt, ProcessGroupRow.group_name, ProcessGroupRow.rank)
        with self._tx(write=False) as s:
            return [ProcessGroupRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank, group=r.group_name,
                                       desc=r.desc, ranks=tuple(json.loads(r.ranks)))
                    for r in s.scalars(stmt)]

    def collective_summary(self, job_id: str,
                           attempt: int | None = None) -> list[CollectiveSummary]:
        """One aggregate per (attempt, rank, group), computed in SQL."""
        c = Collective.__table__.c
        done = c.state == "completed"
        keys = (c.attempt, c.rank, c.group_name)
        where: list[Any] = [c.job_id == job_id]
        if attempt is not None:
            where.append(c.attempt == attempt)
        agg = (select(*keys, func.count(), func.min(c.seq), func.max(c.seq),
                      func.sum(case((done, 1), else_=0)),
                      func.max(case((done, c.seq))),
                      func.avg(case((done & c.exit_ns.is_not(None), c.exit_ns - c.enter_ns))))
               .where(*where).group_by(*keys).order_by(*keys))
        per_op = select(*keys, c.op, func.count()).where(*where).group_by(*keys, c.op)
        with self._tx(write=False) as s:
            ops: dict[tuple, dict[str, int]] = {}
            for a, r, g, op, n in s.execute(per_op):
                ops.setdefault((a, r, g), {})[op] = n
            out = []
            for a, r, g, n, first, last, completed, last_done, mean_ns in s.execute(agg):
                out.append(CollectiveSummary(
                    attempt=a, rank=r, group=g, count=n, first_seq=first, last_seq=last,
                    consecutive=n == last - first + 1, completed=int(completed or 0),
                    last_completed_seq=last_done, ops=ops.get((a, r, g), {}),
                    mean_duration_ms=None if mean_ns is None else float(mean_ns) / 1e6,
                ))
            return out

    def worker_status(self, job_id: str, attempt: int | None = None) -> list[WorkerStatusRecord]:
        """Worker status changes ordered by attempt, time, rank."""
        stmt = select(WorkerStatusRow).where(WorkerStatusRow.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(WorkerStatusRow.attempt == attempt)
        stmt = stmt.order_by(WorkerStatusRow.attempt, WorkerStatusRow.time_ns,
                             WorkerStatusRow.rank, WorkerStatusRow.id)
        with self._tx(write=False) as s:
            return [WorkerStatusRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank,
                                       state=r.state, time_ns=r.time_ns, pid=r.pid,
                                       hostname=r.hostname, restored_step=r.restored_step,
                                       detail=r.detail, phase_s=r.phase_s)
                    for r in s.scalars(stmt)]

    # -- SDC checks and ingest drops ------------------------------------------------------

    def record_sdc_check(self, job_id: str, attempt: int, step: int, kind: str, value: str,
                         expected: str, ok: bool, detail: str = "", rank: int | None = None,
                         node: str | None = None, time_ns: int | None = None) -> int:
        """Store one SDC check (``rank`` None for a node-level check); return its id.

        ``time_ns`` defaults to now."""
        if kind not in SDC_KINDS:
            raise ValueError(f"SDC check kind {kind!r} not in {sorted(SDC_KINDS)}")
        with self._tx(write=True) as s:
            self._job(s, job_id)  # sdc_checks, like all telemetry, has no foreign key
            row = SdcCheck(job_id=job_id, attempt=attempt, rank=rank, node=node, step=step,
                           kind=kind, value=value, expected=expected, ok=ok, detail=detail,
                           time_ns=time.time_ns() if time_ns is None else time_ns)
            s.add(row)
            s.flush()
            return row.id

    def sdc_checks(self, job_id: str, attempt: int | None = None) -> list[SdcCheckRecord]:
        """The job's SDC checks ordered by attempt, step, then as recorded."""
        stmt = select(SdcCheck).where(SdcCheck.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(SdcCheck.attempt == attempt)
        stmt = stmt.order_by(SdcCheck.attempt, SdcCheck.step, SdcCheck.id)
        with self._tx(write=False) as s:
            return [SdcCheckRecord(id=r.id, job_id=r.job_id, attempt=r.attempt, rank=r.rank,
                                   node=r.node, step=r.step, kind=r.kind, value=r.value,
                                   expected=r.expected, ok=bool(r.ok), detail=r.detail,
                                   time_ns=r.time_ns)
                    for r in s.scalars(stmt)]

    def record_drop(self, agent_id: str, node: str, epoch: int, first_seq: int, last_seq: int,
                    events: int, reason: str, source: str) -> int:
        """Record events lost before the store; return the row's id.

        ``source``: "agent" (the agent lost them, e.g. its spill disk was full) or
        "controller" (the controller refused a malformed batch). A report of batches
        already recorded (an agent resends a DropReport whose stream broke) returns the
        existing row's id."""
        if source not in DROP_SOURCES:
            raise ValueError(f"drop source {source!r} not in {sorted(DROP_SOURCES)}")
        with self._tx(write=True) as s:
            if first_seq > 0:
                known = s.scalar(select(IngestDrop.id).where(
                    IngestDrop.agent_id == agent_id, IngestDrop.epoch == epoch,
                    IngestDrop.first_seq == first_seq, IngestDrop.last_seq == last_seq,
                    IngestDrop.source == source))
                if known is not None:
                    return known
            row = IngestDrop(agent_id=agent_id, node=node, epoch=epoch, first_seq=first_seq,
                             last_seq=last_seq, events=events, reason=reason, source=source,
                             at=time.time())
            s.add(row)
            s.flush()
            return row.id

    def ingest_drops(self, node: str | None = None) -> list[IngestDropRecord]:
        """Recorded drops (of ``node``, or all), oldest first."""
        stmt = select(IngestDrop)
        if node is not None:
            stmt = stmt.where(IngestDrop.node == node)
        with self._tx(write=False) as s:
            return [IngestDropRecord(id=r.id, agent_id=r.agent_id, node=r.node, epoch=r.epoch,
                                     first_seq=r.first_seq, last_seq=r.last_seq,
                                     events=r.events, reason=r.reason, source=r.source,
                                     at=r.at)
                    for r in s.scalars(stmt.order_by(IngestDrop.at, IngestDrop.id))]

    # -- live diagnosis -------------------------------------------------------------------

    #: Most process groups ``recent_collectives`` reads of one attempt.
    RECENT_GROUPS_MAX = 4096

    def recent_collectives(self, job_id: str, attempt: int, per_group: int) -> list[CollectiveRecord]:
        """The newest collectives of an attempt, for a live diagnosis: in every group,
        those within ``per_group`` sequence numbers of the group's highest, plus the last
        one of each declared member that is further behind. Ordered by rank, group, seq.

        Index lookups only: a few per group and per lagging member, and ``per_group``
        rows per group and member, however many collectives the attempt has stored."""
        t = Collective.__table__
        c = t.c
        base = (c.job_id == job_id, c.attempt == attempt)
        with self._tx(write=False) as s:
            groups: list[str] = []
            while len(groups) < self.RECENT_GROUPS_MAX:  # a skip scan over the group index
                stmt = select(func.min(c.group_name)).where(*base)
                name = s.scalar(stmt.where(c.group_name > groups[-1]) if groups else stmt)
                if name is None:
                    break
                groups.append(name)
            members: dict[str, set[int]] = {}
            for g in s.scalars(select(ProcessGroupRow).where(ProcessGroupRow.job_id == job_id,
                                                             ProcessGroupRow.attempt == attempt)):
                members.setdefault(g.group_name, set()).update(json.loads(g.ranks))
            rows = []
            for g in groups:
                top = s.scalar(select(func.max(c.seq)).where(*base, c.group_name == g))
                window = s.execute(select(t).where(*base, c.group_name == g,
                                                   c.seq > top - per_group)).all()
                rows += window
                behind = members.get(g, set()) - {r.rank for r in window}
                for rank in sorted(behind):
                    last = s.execute(select(t).where(*base, c.rank == rank, c.group_name == g)
                                     .order_by(c.seq.desc()).limit(1)).first()
                    if last is not None:
                        rows.append(last)
        rows.sort(key=lambda r: (r.rank, r.group_name, r.seq))
        return [CollectiveRecord(
            job_id=r.job_id, attempt=r.attempt, rank=r.rank, group=r.group_name,
            group_size=r.group_size, seq=r.seq, op=r.op,
            input_sizes=_sizes(r.input_sizes), input_dtypes=tuple(json.loads(r.input_dtypes)),
            output_sizes=_sizes(r.output_sizes), output_dtypes=tuple(json.loads(r.output_dtypes)),
            enter_ns=r.enter_ns, exit_ns=r.exit_ns, state=r.state, step=r.step,
            exit_estimated=bool(r.exit_estimated),
        ) for r in rows]
