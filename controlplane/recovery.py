"""Recovery: a restart's phases as they are measured, what an injected fault caused, the
processes a controller started (so a controller taking over after a crash ends exactly
those), and the takeover itself (``take_over``: ``fleet up --resume``, of a job whose
controller died or of a stopped one, and which of the config's faults a resumed stop
schedules again, ``faults_after``). Pure functions,
files and store rows; no Ray, no gRPC."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from fleet.controlplane import auth, chaos
from fleet.controlplane.detectors import Incident
from fleet.controlplane.errors import ConfigError, FleetError, StateError
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.store import CheckpointRecord, JobRecord, RecoveryRecord, Store, WorkerStatusRecord
from fleet.proto.kinds import FaultKind, IncidentKind

log = logging.getLogger(__name__)


@dataclass
class PendingRecovery:
    """A restart in progress: phases measured so far (see RecoveryRecord)."""

    incident_id: int | None
    failed_attempt: int
    failed_at: float          # wall time of the failed attempt's last step
    last_step: int
    detect_s: float
    teardown_s: float
    attempt: int = 0
    place_s: float = 0.0
    t_run: float = 0.0        # wall time the new attempt's ranks were started
    reused: int = 0


def finish_recovery(job_id: str, r: PendingRecovery, span: tuple[int, int, int],
                    statuses: Sequence[WorkerStatusRecord]) -> RecoveryRecord:
    """The record of a restart whose new attempt made its first step: ``span`` is that
    attempt's ``Store.step_span``, ``statuses`` its workers' status events (process-group
    and restore phases, restored step and source)."""
    pg = [w.phase_s for w in statuses if w.state == "PG_READY"]
    restored = [w for w in statuses if w.state == "RESTORED"]
    pg_init_s = max(pg, default=0.0)
    restore_s = max((w.phase_s for w in restored), default=0.0)
    restored_step = min((w.restored_step for w in restored), default=0)
    # a detail reads "memory", "peer copy from rank 3", "disk: <why not memory>" ...
    sources = sorted({w.detail.split(":")[0].split(" from ")[0] or "fresh" for w in restored})
    first_end = span[0] / 1e9
    return RecoveryRecord(
        job_id=job_id, incident_id=r.incident_id, failed_attempt=r.failed_attempt, attempt=r.attempt,
        failed_at=r.failed_at, detect_s=r.detect_s, teardown_s=r.teardown_s, place_s=r.place_s,
        pg_init_s=pg_init_s, restore_s=restore_s,
        first_step_s=max(0.0, first_end - r.t_run - pg_init_s - restore_s), total_s=first_end - r.failed_at,
        restored_step=restored_step, steps_lost=max(0, r.last_step - restored_step),
        restored_from="+".join(sources), reused_workers=r.reused)


#: The incidents each fault kind can be seen as (a killed rank's node may be what is lost).
_CAUSES: dict[FaultKind, tuple[IncidentKind, ...]] = {
    FaultKind.CRASH: (IncidentKind.CRASH, IncidentKind.NODE_LOSS),
    FaultKind.HANG: (IncidentKind.HANG, IncidentKind.DESYNC),
    FaultKind.NAN: (IncidentKind.NAN,),
    FaultKind.SDC: (IncidentKind.SDC,),
}


def caused(order: chaos.FaultOrder, incident: Incident) -> bool:
    """Whether ``incident`` is what the injected ``order`` did."""
    kind = _CAUSES.get(order.kind, ())
    hit = incident.rank == order.rank if order.rank >= 0 else incident.node == order.node
    return incident.kind in kind and hit


def processes_file(state_dir: Path, pid: int) -> Path:
    return state_dir / f"processes-{pid}.json"


def note_processes(state_dir: Path) -> None:
    """Keep ``<state_dir>/processes-<pid>.json`` listing every process this controller
    started (Ray daemons, agents, workers), so that a controller taking over after a
    crash ends exactly those (by pid and start time) and nothing else."""
    try:
        me = psutil.Process()
        procs = [[p.pid, p.create_time()] for p in me.children(recursive=True)]
    except psutil.Error:
        return
    path = processes_file(state_dir, os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(procs))
    os.replace(tmp, path)


def end_leftovers(state_dir: Path, dead_pid: int) -> int:
    """SIGKILL the processes a dead controller listed as its own and that still run (same
    pid and start time: never a stranger that reused a pid); returns how many."""
    path = processes_file(state_dir, dead_pid)
    try:
        listed = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    ended = 0
    for pid, created in listed:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 0.01:
                p.kill()
                ended += 1
        except psutil.Error:
            continue
    path.unlink(missing_ok=True)
    return ended


@dataclass(frozen=True)
class Takeover:
    """A job taken up again by ``take_over``. After its controller died: the restart in
    progress (``recovery``) and the restarts counted so far, this one included. After a
    stop: no recovery (a resume is not a failure), the restarts so far (none added), and
    ``resumed_at``, the step of the checkpoint the next attempt restores (0: none valid)."""

    recovery: PendingRecovery | None
    restarts: int
    resumed_at: int | None = None  # None: a takeover after a controller crash


def take_over(store: Store, state_dir: Path, job_id: str, *, checkpoint_dir: Path | None = None,
              steps: int = 0, by: str = "") -> Takeover:
    """Take ``job_id`` up again (`fleet up --resume`): a job whose controller died, or one
    an operator stopped. End what a dead controller left running; after a crash, fail its
    attempt with a controller-crash incident and count a restart; after a stop, record a
    ``resume`` action by ``by`` (``auth.operator()`` when empty) and move the job STOPPED ->
    RESTARTING. Either way the next attempt restores the newest valid checkpoint in the
    job's own folder.

    ``checkpoint_dir``: the folder this run's ranks restore from (``<job.checkpoint_dir>/<job>``),
    ``steps``: its ``job.steps`` (0: a program's, whose steps are its own); a stopped job's
    are checked against its stop (``check_resume``) and a changed ``job.steps`` is stored.
    ``StateError`` when the job SUCCEEDED or FAILED or its controller still runs;
    ``ConfigError`` when the given config cannot continue it."""
    job = store.get_job(job_id)
    if job.state.terminal and not job.state.resumable:
        raise StateError(f"job {job_id} is {job.state.value}; there is nothing to resume",
                         hint=f"only a STOPPED job or one whose controller died can be resumed; "
                              f"`fleet report {job_id}` shows how it ended, `fleet up` starts a new job")
    try:
        info = auth.read_controller_info(state_dir)
    except FleetError:
        info = None
    if info is not None and info.job_id == job_id and info.pid != os.getpid() and psutil.pid_exists(info.pid):
        raise StateError(f"job {job_id} is still run by controller pid {info.pid}; stop it first "
                         f"(`fleet stop {job_id}`) or let it finish")
    newest = store.latest_valid_checkpoint(job_id)
    if job.state.resumable:
        check_resume(job, newest, checkpoint_dir, steps)
    dead_pid = info.pid if info is not None and info.job_id == job_id else 0
    ended = end_leftovers(state_dir, dead_pid) if dead_pid else 0
    restarts = sum(1 for a in store.actions(job_id) if a.kind == "restart")
    attempts = store.get_attempts(job_id)
    last = attempts[-1].number if attempts else 0
    if job.state.resumable:
        return _resume_stopped(store, job, last, newest.step if newest else 0, steps, by or auth.operator(), restarts)
    evidence = (f"the controller of job {job_id} (pid {dead_pid or '?'}) died; "
                f"taken over by pid {os.getpid()}, {ended} leftover process(es) ended")
    incident_id = store.record_incident(job_id, last, IncidentKind.CONTROLLER_CRASH.value, "resume", evidence,
                                        rank=-1, node="")
    span = store.step_span(job_id, last) if last else None
    now = time.time()
    if last and not attempts[-1].state.terminal:
        store.set_attempt_final_step(job_id, last, span[1] if span else 0)
        store.set_attempt_state(job_id, last, AttemptState.FAILED, evidence)
    if job.state in (JobState.RUNNING, JobState.PLACING):
        store.set_job_state(job_id, JobState.RESTARTING, evidence)
    store.record_action(job_id, last, "restart", f"resumed: {evidence}")
    log.warning("%s", evidence)
    failed_at = span[2] / 1e9 if span else now
    recovery = PendingRecovery(incident_id, last, failed_at, span[1] if span else 0,
                               detect_s=max(0.0, now - failed_at), teardown_s=0.0)
    return Takeover(recovery, restarts + 1)


def check_resume(job: JobRecord, newest: CheckpointRecord | None, checkpoint_dir: Path | None,
                 steps: int) -> None:
    """``ConfigError`` when a resume of the stopped ``job`` with this config could not go on
    from ``newest`` (its newest valid checkpoint): the ranks would look for it in another
    folder (``job.checkpoint_dir``, or the command runs from another folder), or
    ``job.steps`` leaves nothing past it to train. Pure."""
    if newest is None or not steps:
        return  # nothing to restore (it starts afresh), or a program's own checkpoints
    where = Path(newest.path)
    if checkpoint_dir is not None and not where.is_relative_to(checkpoint_dir):
        raise ConfigError(
            f"job.checkpoint_dir: job {job.id}'s checkpoint of step {newest.step} is {where}, outside "
            f"{checkpoint_dir}, where this run's ranks would restore from",
            hint=f"run `fleet up --resume {job.id}` from the folder the job was started in, or --set "
                 f"job.checkpoint_dir to the folder that holds {where.parent}")
    if steps <= newest.step:
        raise ConfigError(f"job.steps is {steps}, but job {job.id} stopped with a checkpoint at step "
                          f"{newest.step}: there is nothing left to train",
                          hint=f"--set job.steps=N with N > {newest.step} (the job was created with "
                               f"{job.total_steps})")


def _resume_stopped(store: Store, job: JobRecord, last: int, step: int, steps: int, by: str,
                    restarts: int) -> Takeover:
    reason = f"resumed by operator {by} after a stop"
    restore = f"the checkpoint of step {step}" if step else "no valid checkpoint: from the start"
    changed = f"; job.steps {job.total_steps} -> {steps}" if steps and steps != job.total_steps else ""
    if changed:
        store.set_job_total_steps(job.id, steps)
    store.record_action(job.id, last, "resume", f"{reason}; restores {restore}{changed}")
    store.set_job_state(job.id, JobState.RESTARTING, reason)
    log.warning("job %s %s; restores %s%s", job.id, reason, restore, changed)
    return Takeover(None, restarts, resumed_at=step)


def faults_after(orders: Sequence[chaos.FaultOrder], step: int) -> list[chaos.FaultOrder]:
    """The config's faults a job resumed from a stop at ``step`` schedules again: those timed
    at a later step (the stopped run never reached them). Those at ``step`` or before fired
    before the stop, and those timed in seconds or "at once" belonged to the run they were
    given to (at its first attempt): none of them fires again."""
    return [o for o in orders if o.at_step > step and o.after_s == 0]
