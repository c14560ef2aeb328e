"""The running job as operators see it: its live state, and the ``JobControl`` behind
ControlService (list, status, inject a fault, stop).

``LiveJob`` is the state the controller's thread changes and the gRPC threads read
(current attempt and placement, the stop request and how far the stop has got), under one
lock. ``JobService`` answers ControlService from it, the store and the agent registry
(``get_status``: ``controlplane.status``); a fault order is checked, aimed at the current
placement and handed to the chaos scheduler, which fires it when due; an sdc fault on an
attempt whose layout has no copy to compare is refused (``ConfigError``). A stop is a
request: the attempt runner carries it out (``attempts``: the ranks checkpoint and leave,
then teardown); the first request's words are kept, a second one changes nothing, and a
job that has ended refuses it (``StateError``, saying how it ended).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.controlplane import chaos, status
from fleet.controlplane.agent_server import AgentRegistry
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
    _stop_phase: str = ""

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

    @property
    def stop_phase(self) -> str:
        """How far a stop has got: "" (none, or not begun), "checkpointing" (the built-in
        trainer's ranks were told to save and leave), "signalled" (a program's ranks got
        SIGTERM), "tearing down"."""
        with self._lock:
            return self._stop_phase

    def set_stop_phase(self, phase: str) -> None:
        with self._lock:
            self._stop_phase = phase

    def request_stop(self, reason: str, by: str = "") -> bool:
        """Ask the job to stop; ``stop_reason`` becomes "stopped by operator[ <by>][: <reason>]".
        Returns False (and changes nothing) when a stop was already asked for."""
        with self._lock:
            if self.stopping.is_set():
                return False
            who = f"stopped by operator {by}" if by else "stopped by operator"
            self.stop_reason = f"{who}: {reason}" if reason else who
            self.stopping.set()
            return True


class JobService:
    """``control_server.JobControl`` for the job a controller runs (gRPC threads)."""

    def __init__(self, store: Store, job: LiveJob, agents: AgentRegistry | None = None,
                 stop_timeout_s: float = 0.0) -> None:
        """``agents``: the registry whose connected agents `fleet status` shows (None:
        none shown); ``stop_timeout_s``: job.stop_timeout_s, told to whoever stops the job
        (0: not told)."""
        self._store = store
        self._job = job
        self._agents = agents
        self._stop_timeout_s = stop_timeout_s
        self._ettr = status.EttrCache()
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

    def get_status(self, job_id: str) -> control_pb2.StatusReply:
        """`fleet status` of ``job_id`` ("" = this controller's job); live facts only for
        the job this controller runs (another is answered from the store)."""
        job_id = job_id or self._job.job_id
        live = None
        if job_id == self._job.job_id:
            attempt, placement = self._job.position()
            agents = self._agents
            now = time.monotonic()
            live = status.LiveFacts(
                attempt=attempt, placement=placement,
                connected=frozenset(agents.connected_nodes()) if agents is not None else frozenset(),
                silent_s=agents.silent_for(now) if agents is not None else {}, stopping=self._job.stop_phase)
        return status.to_proto(status.load_status(self._store, job_id, time.time(), live, self._ettr))

    def stop_job(self, job_id: str, reason: str, by: str = "") -> control_pb2.StopJobReply:
        """Ask the running job to stop (``attempts`` carries it out: checkpoint, then
        teardown). ``NotFoundError`` for another job, ``StateError`` for one that has ended."""
        job_id = job_id or self._job.job_id
        if job_id != self._job.job_id:
            other = self._find(job_id)
            if other is not None and other.state.terminal:
                raise self._ended(other)
            raise NotFoundError(f"this controller runs job {self._job.job_id}, not {job_id}",
                                hint="`fleet status` shows the job this controller runs; `fleet jobs` lists "
                                     "the store's")
        job = self._store.get_job(job_id)
        if job.state.terminal:
            raise self._ended(job)
        if self._job.request_stop(reason.strip(), by.strip()):
            log.warning("job %s: %s", job_id, self._job.stop_reason)
        return control_pb2.StopJobReply(state="STOPPING", attempt=self._job.attempt,
                                        stop_timeout_s=self._stop_timeout_s)

    def _find(self, job_id: str) -> JobRecord | None:
        try:
            return self._store.get_job(job_id)
        except NotFoundError:
            return None

    @staticmethod
    def _ended(job: JobRecord) -> StateError:
        return StateError(f"job {job.id} has already ended: {job.state.value}"
                          + (f" ({job.reason})" if job.reason else ""),
                          hint=f"nothing to stop; `fleet report {job.id}` shows how it went")

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
