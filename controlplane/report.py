"""`fleet report`: where a job's wall time went, from the store's records (``job_report`` is pure;
``load_report`` reads its records, and each incident's last progress, from a Store).

Definitions (times in seconds; a step's time is its slowest rank's ``step_time_s``, since
a synchronous step ends when its last rank does):

- **productive**: the steps the job kept. When an attempt restores step ``r``, every
  execution of a step ``> r`` by an earlier attempt is thrown away; those are
  **recomputed**. ETTR = productive / wall, wall = job end (or now) - job creation -
  stopped.
- **stopped** (``stopped_s``, not lost time): the job sat STOPPED by an operator, from
  its STOPPED transition to the resume's STOPPED -> RESTARTING (`fleet up --resume`),
  summed over its stops (``stopped_spans``). A job still STOPPED has ended: its wall ends
  at the stop.
- **start-up**: job creation to the first step's start of attempt 1, plus, per resume
  after a stop, the resume to the first step's start of the next attempt (Ray, agents,
  placement, process group, restore again).
- **detection**, per failed attempt: its last step's end to the incident's detection.
- **restart**, per failed attempt: its incident's detection to the first step start of a
  later attempt, or to the next incident if that comes first (teardown, placement,
  process group, restore).
- **checkpointing**: the save time the checkpoints report (``save_s``, what blocked the
  loop). **other** is what is left (the end of the job, gaps between steps).

``checkpoints`` lists every checkpoint of the job with ``valid`` as the store holds it,
which follows the manifest's verification on disk (a checkpoint a restore found corrupt
is invalid), and ``invalid_checkpoints`` the causes recorded when one was marked so.

Every incident carries ``detected_at`` (Unix seconds), the failed program's ``exit_code``
(negative: killed by that signal) and ``traceback`` ("" when none), and
``detected_after_s``: detection minus the last progress fleet saw before it in the
incident's attempt (``Store.last_progress_ns``: a step end, or without the step API a
collective), None when there was none. A caller without a store may leave ``progress``
out; then the step records stand in, for the incidents that ended their attempt only:
the attempt's last step end, or its start.

Each incident that ended its attempt (the last one recorded for a failed attempt) also
gets ``recovery_s`` (detection to the first step completed by a later attempt, None when
there was none), ``next_attempt_after_s`` (detection to the start of the next attempt,
None when there was none: the restart's wall time, with or without steps), and, when the
controller timed the restart, ``phases`` (detect, teardown, place, process-group init,
restore, first step: seconds), ``restored_step``, ``restored_from`` and ``steps_lost``.
Incidents acted on while the attempt ran on (agent loss, straggler, loss spike) have
``ended_attempt`` false and no recovery. An incident only observed
(``detect.<kind>.action: observe``) has ``observed`` true and ``would``, what acting on
it would have done ("would restart the attempt (restart 1 of 3)", "would quarantine
node-1 (...) and ..."); it never ended its attempt. Acted-on incidents have ``observed``
false and ``would`` "".

``sdc`` sums up its silent-data-corruption checks and incidents (``controlplane.sdc.sdc_section``):
fingerprint checks run, mismatches, triggers, replays, every triage's verdict, and per SDC
incident its first bad step, suspect rank and node, triage steps, verdict, replays and
rollback point.

A job that ran without the step API (attempts, but no step rows at all) has ``ettr``
None: its productive time cannot come from steps. ``attempts_detail`` gives every job's
wall time by attempt (``number``, ``state``, ``started_at``, ``ended_at``, ``wall_s``,
``reason``), which is what such a job's time is accounted by, with its incidents.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fleet.controlplane.lifecycle import JobState, NodeState
from fleet.controlplane.sdc import sdc_section
from fleet.controlplane.store import (
    ActionRecord,
    AttemptRecord,
    CheckpointRecord,
    IncidentRecord,
    JobRecord,
    NodeRecord,
    RecoveryRecord,
    SdcCheckRecord,
    StepRecord,
    Store,
    TransitionRecord,
)
from fleet.controlplane.store.records import CKPT_INVALID
from fleet.proto.kinds import IncidentKind


def _timeline(steps: Sequence[StepRecord]) -> dict[int, dict[int, tuple[float, float]]]:
    """attempt -> step -> (start, end) in Unix seconds: the step ends when its last rank
    ends it and lasts as long as its slowest rank's own step time (not the span from the
    first rank's start, which overlaps the previous step on the other ranks)."""
    ends: dict[tuple[int, int], float] = {}
    durs: dict[tuple[int, int], float] = {}
    for s in steps:
        key = (s.attempt, s.step)
        ends[key] = max(ends.get(key, 0.0), s.end_ns / 1e9)
        durs[key] = max(durs.get(key, 0.0), s.step_time_s)
    out: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
    for (attempt, step), end in ends.items():
        out[attempt][step] = (end - durs[(attempt, step)], end)
    return out


def stopped_spans(transitions: Sequence[TransitionRecord]) -> list[tuple[float, float]]:
    """(stopped at, resumed at) in Unix seconds for each stop of the job that a resume
    ended: a job transition to STOPPED and the STOPPED -> RESTARTING that followed it."""
    spans: list[tuple[float, float]] = []
    stopped_at: float | None = None
    for t in sorted((t for t in transitions if t.entity == "job"), key=lambda t: t.at):
        if t.to_state == JobState.STOPPED.value:
            stopped_at = t.at
        elif t.from_state == JobState.STOPPED.value and stopped_at is not None:
            spans.append((stopped_at, t.at))
            stopped_at = None
    return spans


def ending_incident(incidents: Sequence[IncidentRecord], timed: Iterable[int] = ()) -> IncidentRecord | None:
    """The incident that ended a failed attempt, among ``incidents`` (the attempt's, oldest
    first): the first one a restart was timed for (``timed``: incident ids of the job's
    recovery records), else the last one of a kind that ends an attempt, else the first
    one; never an observed one. `fleet report` and the incident metrics both judge by it."""
    acted = [i for i in incidents if not i.observed]
    timed = set(timed)
    for i in acted:
        if i.id in timed:
            return i
    ending = [i for i in acted if IncidentKind(i.kind).ends_attempt]
    return ending[-1] if ending else (acted[0] if acted else None)


def job_report(job: JobRecord, attempts: Sequence[AttemptRecord], steps: Sequence[StepRecord],
               incidents: Sequence[IncidentRecord], actions: Sequence[ActionRecord],
               checkpoints: Sequence[CheckpointRecord], nodes: Sequence[NodeRecord],
               now: float, recoveries: Sequence[RecoveryRecord] = (),
               progress: Mapping[int, float | None] | None = None, sdc_checks: Sequence[SdcCheckRecord] = (),
               placements: Mapping[int, Mapping[int, str]] | None = None,
               transitions: Sequence[TransitionRecord] = ()) -> dict[str, Any]:
    """The report of one job as a JSON-ready dict (see the module docstring).

    ``progress``: incident id -> the last progress before it in its attempt (Unix
    seconds, None when there was none), as ``load_report`` reads it from the store;
    ``sdc_checks``: the job's SDC check rows; ``placements``: attempt -> rank -> node;
    ``transitions``: the job's state changes (its stops and resumes, ``stopped_spans``)."""
    timeline = _timeline(steps)
    numbers = sorted(a.number for a in attempts)
    restored = {a.number: a.restored_step or 0 for a in attempts}
    productive = recomputed = 0.0
    for n in numbers:
        # a later attempt that restored r throws away this attempt's steps above r
        kept_up_to = min((restored[m] for m in numbers if m > n), default=None)
        for step, (start, end) in timeline.get(n, {}).items():
            if kept_up_to is None or step <= kept_up_to:
                productive += end - start
            else:
                recomputed += end - start
    end_of_job = job.ended_at or now
    pauses = stopped_spans(transitions)
    stopped = sum(max(b - a, 0.0) for a, b in pauses)
    wall = max(end_of_job - job.created_at - stopped, 1e-9)

    def first_start(n: int) -> float | None:
        t = timeline.get(n)
        return min(v[0] for v in t.values()) if t else None

    def first_end(n: int) -> float | None:
        t = timeline.get(n)
        return min(v[1] for v in t.values()) if t else None

    def last_end(n: int) -> float | None:
        t = timeline.get(n)
        return max(v[1] for v in t.values()) if t else None

    startup = (first_start(numbers[0]) - job.created_at) if numbers and first_start(numbers[0]) else 0.0
    started_at = {a.number: a.started_at for a in attempts}
    for _, resumed in pauses:  # a resume starts the job again: its start-up is lost time too
        nxt = next((m for m in numbers if started_at[m] >= resumed), None)
        begin = first_start(nxt) if nxt is not None else None
        startup += max(begin - resumed, 0.0) if begin is not None else 0.0
    failed = {a.number for a in attempts if a.state.value == "FAILED"}
    recovery_of = {r.incident_id: r for r in recoveries if r.incident_id is not None}
    of_attempt: dict[int, list[IncidentRecord]] = defaultdict(list)
    for i in incidents:
        if i.attempt in failed:
            of_attempt[i.attempt].append(i)
    by_attempt = {n: ending_incident(incs, recovery_of) for n, incs in of_attempt.items()}
    detection = restart = 0.0
    out_incidents = []
    for i in incidents:
        ended = by_attempt.get(i.attempt) is i
        base = {"attempt": i.attempt, "kind": i.kind, "rank": i.rank, "node": i.node,
                "detector": i.detector, "evidence": i.evidence, "detected_at": i.detected_at,
                "exit_code": i.exit_code, "traceback": i.traceback,
                "observed": bool(i.observed), "would": i.observed}
        seen = None if progress is None else progress.get(i.id)
        after = None if seen is None else round(max(i.detected_at - seen, 0.0), 3)
        if not ended:
            out_incidents.append({**base, "ended_attempt": False, "detected_after_s": after,
                                  "recovery_s": None, "next_attempt_after_s": None})
            continue
        last = last_end(i.attempt) or started_at.get(i.attempt, job.created_at)
        if progress is None:
            after = round(max(i.detected_at - last, 0.0), 3)
        # the first later attempt that completed a step (one that failed at once did not)
        nxt = next((m for m in numbers if m > i.attempt and timeline.get(m)), None)
        resumed = first_end(nxt) if nxt is not None else None
        following = next((started_at[m] for m in numbers if m > i.attempt), None)
        out_incidents.append({
            **base, "ended_attempt": True, "detected_after_s": after,
            "recovery_s": None if resumed is None else round(resumed - i.detected_at, 3),
            "next_attempt_after_s": None if following is None else round(max(following - i.detected_at, 0.0), 3),
        })
        rec = recovery_of.get(i.id)
        if rec is not None:
            out_incidents[-1].update(
                phases={p.removesuffix("_s"): round(getattr(rec, p), 3) for p in RecoveryRecord.PHASES},
                failure_to_first_step_s=round(rec.total_s, 3), restored_step=rec.restored_step,
                restored_from=rec.restored_from, steps_lost=rec.steps_lost, reused_workers=rec.reused_workers)
        if ended:
            detection += max(i.detected_at - last, 0.0)
            # until the next attempt steps, or the next incident takes over the count
            later = [j.detected_at for j in by_attempt.values() if j.attempt > i.attempt]
            begin = min([t for t in (first_start(nxt) if nxt else None, *later) if t is not None],
                        default=None)
            if begin is not None:
                restart += max(begin - i.detected_at, 0.0)
    checkpointing = sum(c.save_s for c in checkpoints)
    lost = {"startup_s": startup, "detection_s": detection, "restart_s": restart,
            "recomputed_s": recomputed, "checkpointing_s": checkpointing}
    lost["other_s"] = max(wall - productive - sum(lost.values()), 0.0)
    quarantined = sorted(n.name for n in nodes if n.state == NodeState.QUARANTINED and n.quarantined_since
                         and job.created_at <= n.quarantined_since <= end_of_job)
    return {
        "job": job.id, "name": job.name, "state": job.state.value,
        "final_step": job.steps_completed, "total_steps": job.total_steps,
        "wall_s": round(wall, 3), "productive_s": round(productive, 3), "stopped_s": round(stopped, 3),
        # attempts that ran and never reported a step: a program without the step API
        "ettr": None if numbers and not timeline else round(productive / wall, 4),
        "lost_s": {k: round(v, 3) for k, v in lost.items()},
        "attempts": len(numbers),
        "attempts_detail": [
            {"number": a.number, "state": a.state.value, "started_at": a.started_at, "ended_at": a.ended_at,
             "wall_s": round(max((a.ended_at or end_of_job) - a.started_at, 0.0), 3), "reason": a.reason}
            for a in sorted(attempts, key=lambda a: a.number)],
        "restarts": sum(1 for a in actions if a.kind == "restart"),
        "steps_lost": sum(r.steps_lost for r in recoveries),
        "incidents": out_incidents,
        "quarantined_nodes": quarantined,
        "quarantines": [a.cause for a in actions if a.kind == "quarantine"],
        # with a topology: why each attempt's nodes, in their order (placement.explain)
        "placements": [{"attempt": a.attempt, "reasons": a.cause} for a in actions if a.kind == "placement"],
        "checkpoints": [{"step": c.step, "attempt": c.attempt, "valid": c.valid} for c in checkpoints],
        "invalid_checkpoints": [a.cause for a in actions if a.kind == CKPT_INVALID],
        "sdc": sdc_section(sdc_checks, incidents, placements or {}),
    }


def load_report(store: Store, job_id: str, now: float) -> dict[str, Any]:
    """``job_report`` of one job from the store, with each incident's last progress
    (``Store.last_progress_ns``, one bounded lookup per incident)."""
    incidents = store.incidents(job_id)
    progress: dict[int, float | None] = {}
    for i in incidents:
        seen = store.last_progress_ns(job_id, i.attempt, int(i.detected_at * 1e9))
        progress[i.id] = None if seen is None else seen / 1e9
    checks = store.sdc_checks(job_id)
    return job_report(store.get_job(job_id), store.get_attempts(job_id), store.steps(job_id), incidents,
                      store.actions(job_id), store.checkpoints(job_id), store.list_nodes(), now,
                      store.recoveries(job_id), progress=progress, sdc_checks=checks,
                      placements=sdc_placements(store, job_id, checks), transitions=store.transitions(job_id))


def sdc_placements(store: Store, job_id: str, checks: Sequence[SdcCheckRecord]) -> dict[int, dict[int, str]]:
    """attempt -> rank -> node for the attempts that have a triage verdict (a verdict row
    names its suspect rank, not its node)."""
    attempts = sorted({c.attempt for c in checks if c.kind == "verdict"})
    return {a: {r.rank: r.node for r in store.ranks(job_id, a)} for a in attempts}
