"""The Store's incidents, actions, recoveries and checkpoints: what went wrong, what
the controller did about it, how each restart went, and what it can restore from.

Invariants:
- Incident kinds are ``IncidentKind`` values: ``record_incident`` refuses any other.
- An incident's traceback reads back as ``""`` when none was stored (NULL in the table,
  as in every incident from before migration 0005), its exit code as ``None``.
- An observed incident (``detect.<kind>.action: observe``) keeps what acting on it would
  have done in ``observed``; ``incidents_on_node`` leaves it out, so it never counts
  towards quarantining its node.
- Action kinds are ``ACTION_KINDS``: ``record_action`` refuses any other.
- A checkpoint is invalidated together with the ``ckpt_invalid`` action saying why
  (``ingest.invalidate_checkpoint``), in one transaction.
"""

from __future__ import annotations

import dataclasses
import time

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from fleet.controlplane.errors import NotFoundError
from fleet.controlplane.store import ingest
from fleet.controlplane.store.base import StoreBase
from fleet.controlplane.store.records import ActionRecord, CheckpointRecord, IncidentRecord, RecoveryRecord
from fleet.controlplane.store.schema import Action, Checkpoint, Incident, Recovery
from fleet.proto.kinds import IncidentKind

#: The most of a traceback an incident keeps: its end, where the error is (a stderr tail
#: of a chatty program could otherwise be megabytes in one row).
TRACEBACK_MAX_CHARS = 64 * 1024

ACTION_KINDS = frozenset({"restart", "quarantine", "release", "rollback", "stop", "inject_fault",
                          "restart_agent", "shrink", "resume", "placement"})


class IncidentMethods(StoreBase):
    """The Store's incident, action, recovery and checkpoint methods (a mixin of ``store.Store``)."""

    def record_incident(self, job_id: str, attempt: int, kind: IncidentKind | str, detector: str,
                        evidence: str, rank: int | None = None, node: str | None = None,
                        detected_at: float | None = None, traceback: str = "",
                        exit_code: int | None = None, observed: str = "") -> int:
        """Store a detected incident (``detected_at``: Unix time, default now); return its id.

        ``traceback``: the failed program's traceback (its error file, else the tail of its
        stderr), kept to its last ``TRACEBACK_MAX_CHARS``; ``exit_code``: its exit status,
        negative when a signal killed it; ``observed``: what acting on it would have done,
        for an incident only observed ("" = it was acted on). ``ValueError`` (nothing
        written) when ``kind`` is not an ``IncidentKind``."""
        try:
            kind = IncidentKind(kind)
        except ValueError:
            raise ValueError(f"unknown incident kind {kind!r}; known: {', '.join(IncidentKind)}") from None
        try:
            with self._tx(write=True) as s:
                row = Incident(job_id=job_id, attempt=attempt, kind=kind.value, rank=rank, node=node,
                               detector=detector, evidence=evidence,
                               detected_at=time.time() if detected_at is None else detected_at,
                               traceback=traceback[-TRACEBACK_MAX_CHARS:] or None, exit_code=exit_code,
                               observed=observed or None)
                s.add(row)
                s.flush()
                return row.id
        except IntegrityError as e:
            raise NotFoundError(f"job {job_id!r} not found") from e

    def incidents(self, job_id: str, *, after_id: int = 0) -> list[IncidentRecord]:
        """The job's incidents, oldest first; with ``after_id``, only those stored after
        incident ``after_id`` (ids grow), so that a reader can follow them incrementally."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(Incident).where(Incident.job_id == job_id, Incident.id > after_id)
                             .order_by(Incident.id)).all()
            return [self._incident_record(r) for r in rows]

    @staticmethod
    def _incident_record(r: Incident) -> IncidentRecord:
        return IncidentRecord(id=r.id, job_id=r.job_id, attempt=r.attempt, kind=IncidentKind(r.kind), rank=r.rank,
                              node=r.node, detector=r.detector, evidence=r.evidence,
                              detected_at=r.detected_at, traceback=r.traceback or "", exit_code=r.exit_code,
                              observed=r.observed or "")

    def incidents_on_node(self, node: str, since: float) -> list[IncidentRecord]:
        """Incidents blamed on ``node`` (any job) detected at or after ``since``, oldest first;
        not the observed ones (nothing was done about them)."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(Incident).where(Incident.node == node, Incident.detected_at >= since,
                                                    Incident.observed.is_(None))
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
