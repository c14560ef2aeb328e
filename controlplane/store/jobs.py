"""The Store's jobs and attempts: creation, lifecycle transitions and their history.

Invariants:
- Every job/attempt state change is checked with ``check_transition`` and stored as a
  ``transitions`` row in the same transaction; an illegal one raises ``StateError``
  and writes nothing.
- Attempts of a job are numbered from 1 with no gaps; numbering is serialized by
  locking the job row (PostgreSQL) or the single writer (SQLite).
"""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fleet.controlplane.errors import FleetError, NotFoundError
from fleet.controlplane.lifecycle import AttemptState, JobState, check_transition
from fleet.controlplane.store.base import StoreBase
from fleet.controlplane.store.records import AttemptRecord, JobRecord, TransitionRecord
from fleet.controlplane.store.schema import Attempt, Job, Step, Transition


def new_job_id(now: float) -> str:
    """``j-YYYYmmdd-HHMMSS-xxxx`` (UTC, 4 random hex digits)."""
    stamp = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"j-{stamp}-{secrets.token_hex(2)}"


class JobMethods(StoreBase):
    """The Store's job and attempt methods (a mixin of ``store.Store``)."""

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
        """Move a job to ``state``; ``StateError`` if illegal. Terminal states set ended_at;
        leaving one (a resumed STOPPED job) clears it."""
        with self._tx(write=True) as s:
            job = self._job(s, job_id, lock=True)
            old = JobState(job.state)
            check_transition(old, state)
            now = time.time()
            job.state, job.updated_at, job.reason = state.value, now, reason
            job.ended_at = now if state.terminal else None
            s.add(Transition(job_id=job_id, attempt=None, entity="job", from_state=old.value,
                             to_state=state.value, reason=reason, at=now))

    def set_job_total_steps(self, job_id: str, total_steps: int) -> None:
        """Change the steps the job trains to (a resume told another ``job.steps``)."""
        with self._tx(write=True) as s:
            job = self._job(s, job_id, lock=True)
            job.total_steps, job.updated_at = total_steps, time.time()

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

    def job_counts(self) -> dict[JobState, int]:
        """How many jobs the store holds in each state (every state, 0 when none): one
        grouped count, for the controller's ``fleet_jobs`` gauge."""
        with self._tx(write=False) as s:
            rows = s.execute(select(Job.state, func.count()).group_by(Job.state)).all()
        counts = dict.fromkeys(JobState, 0)
        for state, n in rows:
            counts[JobState(state)] = int(n)
        return counts

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
