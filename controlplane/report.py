"""`fleet report`: where a job's wall time went, from the store's records (pure).

Definitions (times in seconds; a step's time is its slowest rank's ``step_time_s``, since
a synchronous step ends when its last rank does):

- **productive**: the steps the job kept. When an attempt restores step ``r``, every
  execution of a step ``> r`` by an earlier attempt is thrown away; those are
  **recomputed**. ETTR = productive / wall, wall = job end (or now) - job creation.
- **start-up**: job creation to the first step's start of attempt 1.
- **detection**, per failed attempt: its last step's end to the incident's detection.
- **restart**, per failed attempt: its incident's detection to the first step start of a
  later attempt, or to the next incident if that comes first (teardown, placement,
  process group, restore).
- **checkpointing**: the save time the checkpoints report (``save_s``, what blocked the
  loop). **other** is what is left (the end of the job, gaps between steps).

``checkpoints`` lists every checkpoint of the job with ``valid`` as the store holds it,
which follows the manifest's verification on disk (a checkpoint a restore found corrupt
is invalid), and ``invalid_checkpoints`` the causes recorded when one was marked so.

Each incident that ended its attempt (the last one recorded for a failed attempt) also
gets ``detected_after_s`` (its attempt's last step end, or the attempt's start, to
detection) and ``recovery_s`` (detection to the first step completed by a later attempt,
None when there was none), and, when the controller timed the restart, ``phases`` (detect,
teardown, place, process-group init, restore, first step: seconds), ``restored_step``,
``restored_from`` and ``steps_lost``. Incidents acted on while the attempt ran on
(agent loss, straggler, loss spike) have ``ended_attempt`` false and no recovery.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from fleet.controlplane.lifecycle import NodeState
from fleet.controlplane.store import (
    ActionRecord,
    AttemptRecord,
    CheckpointRecord,
    IncidentRecord,
    JobRecord,
    NodeRecord,
    RecoveryRecord,
    StepRecord,
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


def job_report(job: JobRecord, attempts: Sequence[AttemptRecord], steps: Sequence[StepRecord],
               incidents: Sequence[IncidentRecord], actions: Sequence[ActionRecord],
               checkpoints: Sequence[CheckpointRecord], nodes: Sequence[NodeRecord],
               now: float, recoveries: Sequence[RecoveryRecord] = ()) -> dict[str, Any]:
    """The report of one job as a JSON-ready dict (see the module docstring)."""
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
    wall = max(end_of_job - job.created_at, 1e-9)

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
    # the incident that ended a failed attempt: the one its restart was timed for, else the
    # last one recorded for it that is not of a kind the attempt runs through
    failed = {a.number for a in attempts if a.state.value == "FAILED"}
    recovery_of = {r.incident_id: r for r in recoveries if r.incident_id is not None}
    by_attempt: dict[int, IncidentRecord] = {}
    for i in incidents:
        if i.attempt not in failed:
            continue
        have = by_attempt.get(i.attempt)
        if have is None or have.id not in recovery_of and (i.id in recovery_of or IncidentKind(i.kind).ends_attempt):
            by_attempt[i.attempt] = i
    detection = restart = 0.0
    out_incidents = []
    for i in incidents:
        ended = by_attempt.get(i.attempt) is i
        if not ended:
            out_incidents.append({
                "attempt": i.attempt, "kind": i.kind, "rank": i.rank, "node": i.node,
                "detector": i.detector, "evidence": i.evidence, "ended_attempt": False,
                "detected_after_s": None, "recovery_s": None,
            })
            continue
        started = next((a.started_at for a in attempts if a.number == i.attempt), job.created_at)
        last = last_end(i.attempt) or started
        # the first later attempt that completed a step (one that failed at once did not)
        nxt = next((m for m in numbers if m > i.attempt and timeline.get(m)), None)
        resumed = first_end(nxt) if nxt is not None else None
        out_incidents.append({
            "attempt": i.attempt, "kind": i.kind, "rank": i.rank, "node": i.node,
            "detector": i.detector, "evidence": i.evidence,
            "ended_attempt": True,
            "detected_after_s": round(max(i.detected_at - last, 0.0), 3),
            "recovery_s": None if resumed is None else round(resumed - i.detected_at, 3),
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
        "wall_s": round(wall, 3), "productive_s": round(productive, 3),
        "ettr": round(productive / wall, 4),
        "lost_s": {k: round(v, 3) for k, v in lost.items()},
        "attempts": len(numbers),
        "restarts": sum(1 for a in actions if a.kind == "restart"),
        "steps_lost": sum(r.steps_lost for r in recoveries),
        "incidents": out_incidents,
        "quarantined_nodes": quarantined,
        "quarantines": [a.cause for a in actions if a.kind == "quarantine"],
        "checkpoints": [{"step": c.step, "attempt": c.attempt, "valid": c.valid} for c in checkpoints],
        "invalid_checkpoints": [a.cause for a in actions if a.kind == CKPT_INVALID],
    }
