"""The running job as operators see it: its live state, and the ``JobControl`` behind
ControlService (list, status, inject a fault, stop).

``LiveJob`` is the state the controller's thread changes and the gRPC threads read
(current attempt and placement, the stop request), under one lock. ``JobService``
answers ControlService from it and the store; a fault order is checked, aimed at the
current placement and handed to the chaos scheduler, which fires it when due; an sdc
fault on an attempt whose layout has no copy to compare is refused (``ConfigError``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.controlplane import chaos
from fleet.controlplane.chaos_fire import order_of, target
from fleet.controlplane.errors import ConfigError, NotFoundError, StateError
from fleet.controlplane.store import JobRecord, Store
from fleet.proto import control_pb2, events_pb2
from fleet.proto.kinds import FaultKind

log = logging.getLogger(__name__)


@dataclass
class LiveJob:
    """One job's live state. ``job_id`` is set once, before any gRPC thread runs."""

    job_id: str = ""
    restarts: int = 0
    stop_reason: str = ""
    stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _attempt: int = 0
    _placement: list[str] = field(default_factory=list)
    _no_copies: str = ""

    def position(self) -> tuple[int, list[str]]:
        """(current attempt, node name of each rank); (0, []) before the first."""
        with self._lock:
            return self._attempt, list(self._placement)

    def move_to(self, attempt: int, placement: list[str], no_copies: str = "") -> None:
        """The job runs ``attempt`` on ``placement`` (node of each rank); ``no_copies``: why
        its layout has no copy of the state for SDC checks to compare ("" = it has)."""
        with self._lock:
            self._attempt, self._placement, self._no_copies = attempt, list(placement), no_copies

    @property
    def no_copies(self) -> str:
        with self._lock:
            return self._no_copies

    @property
    def attempt(self) -> int:
        with self._lock:
            return self._attempt

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason or "stopped by operator"
        self.stopping.set()


class JobService:
    """``control_server.JobControl`` for the job a controller runs (gRPC threads)."""

    def __init__(self, store: Store, job: LiveJob) -> None:
        self._store = store
        self._job = job
        self._submit: Callable[[chaos.FaultOrder], None] | None = None

    def take_faults(self, submit: Callable[[chaos.FaultOrder], None]) -> None:
        """Hand fault orders to ``submit`` (the chaos scheduler) from now on; before,
        ``inject_fault`` is refused."""
        self._submit = submit

    def list_jobs(self) -> list[control_pb2.JobSummary]:
        return [summary(j) for j in self._store.list_jobs()]

    def job_status(self, job_id: str) -> control_pb2.JobStatus:
        job = self._store.get_job(job_id or self._job.job_id)
        status = control_pb2.JobStatus(job=summary(job))
        if job.id == self._job.job_id:
            attempt, placement = self._job.position()
            status.current_attempt = attempt
            status.nodes.extend(sorted(set(placement)))
            attempts = self._store.get_attempts(job.id)
            if attempts:
                status.attempt_state = attempts[-1].state.value
            last = {s.rank: s.step for s in self._store.steps(job.id, attempt=attempt)} if attempt else {}
            pids = {r.rank: r.pid for r in self._store.ranks(job.id, attempt)} if attempt else {}
            for rank, node in enumerate(placement):
                status.ranks.add(rank=rank, node=node, pid=pids.get(rank, 0), last_step=last.get(rank, 0))
        return status

    def inject_fault(
        self, job_id: str, rank: int, node: str, fault: events_pb2.FaultSpec
    ) -> control_pb2.InjectFaultReply:
        """Check a fault order and hand it to the chaos scheduler (which fires it now or
        when due)."""
        self._require_this_job(job_id)
        order = order_of(fault, rank, node)
        chaos.validate_order(order)
        attempt, placement = self._job.position()
        submit = self._submit
        if not placement or submit is None:
            raise StateError(f"job {self._job.job_id} has no running worker group yet")
        no_copies = self._job.no_copies
        if order.kind == FaultKind.SDC and no_copies:
            raise ConfigError(f"--kind sdc: job {self._job.job_id} has no copy of the corrupted state to "
                              f"compare, so the corruption could not be caught: {no_copies}")
        node, ranks = target(order, placement)
        submit(order)
        command_id = uuid.uuid4().hex[:12]
        self._store.record_action(self._job.job_id, attempt, "inject_fault", order.describe())
        log.info("fault %s accepted (ranks %s on %s)", order.describe(), ranks, node)
        return control_pb2.InjectFaultReply(command_id=command_id, attempt=attempt, ranks=ranks, node=node)

    def stop_job(self, job_id: str, reason: str) -> str:
        self._require_this_job(job_id)
        self._job.request_stop(reason)
        return "STOPPING"

    def _require_this_job(self, job_id: str) -> None:
        if job_id and job_id != self._job.job_id:
            raise NotFoundError(f"this controller runs job {self._job.job_id}, not {job_id}")


def summary(job: JobRecord) -> control_pb2.JobSummary:
    """The wire summary of a stored job."""
    return control_pb2.JobSummary(
        job_id=job.id,
        name=job.name,
        state=job.state.value,
        attempts=job.attempts,
        steps_completed=job.steps_completed,
        total_steps=job.total_steps,
        created_at=job.created_at,
    )
