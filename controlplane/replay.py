"""The replay report of a job from the store: per attempt, who ran where, what each
rank's collectives looked like, the desync verdict, the step timeline and the
collectives' bandwidth (``collective_report.attempt_bandwidth``: measured durations only).

Reads only through the Store's domain methods and returns plain dicts, so the CLI can
print them as tables or JSON. Each incident carries the failed program's ``exit_code``
(negative: killed by that signal) and ``traceback`` ("" when none). The verdict itself
is the diagnosis engine's, over traces it builds from the store
(``controlplane.diagnosis.source``: the Store is a ``TraceSource``). A checkpoint's ``valid`` is the store's flag, which follows the disk
manifest's verification (see ``Store.invalidate_checkpoint``). ``sdc`` is the job's (or
attempt's) silent-data-corruption checks and incidents (``controlplane.sdc.sdc_section``).
"""

from __future__ import annotations

from statistics import median
from typing import Any

from fleet.controlplane.collective_report import attempt_bandwidth, job_topology
from fleet.controlplane.diagnosis import diagnose_attempt
from fleet.controlplane.sdc import sdc_section
from fleet.controlplane.store import Store


def replay_report(store: Store, job_id: str, attempt: int | None = None) -> dict[str, Any]:
    """Everything `fleet replay` shows about one job (all attempts, or one); each
    attempt carries its ``diagnosis`` (the engine's JSON form)."""
    job = store.get_job(job_id)
    attempts = [a for a in store.get_attempts(job_id) if attempt is None or a.number == attempt]
    summaries = store.collective_summary(job_id, attempt)
    out_attempts = []
    topology: Any = False  # read once, for the first attempt that needs it
    for a in attempts:
        steps = store.steps(job_id, attempt=a.number)
        traces, diagnosis = diagnose_attempt(store, job_id, a.number)
        placed = {r.rank: r.node for r in store.ranks(job_id, a.number)}
        if topology is False:
            topology = job_topology(job.config_json, placed.values())
        out_attempts.append(
            {
                "attempt": a.number,
                "diagnosis": diagnosis.to_json(),
                "state": a.state.value,
                "restored_step": a.restored_step,
                "final_step": a.final_step,
                "reason": a.reason,
                "ranks": [
                    {"rank": r.rank, "node": r.node, "pid": r.pid} for r in store.ranks(job_id, a.number)
                ],
                "collectives": [
                    {
                        "rank": s.rank,
                        "group": s.group,
                        "count": s.count,
                        "first_seq": s.first_seq,
                        "last_seq": s.last_seq,
                        "consecutive": s.consecutive,
                        "completed": s.completed,
                        "last_completed_seq": s.last_completed_seq,
                        "ops": dict(s.ops),
                        "mean_duration_ms": s.mean_duration_ms,
                        "measured": s.measured,
                        "timings": list(s.timings),
                    }
                    for s in summaries
                    if s.attempt == a.number
                ],
                "steps": _step_timeline(steps),
                "bandwidth": attempt_bandwidth(traces, steps, placed, topology),
            }
        )
    incidents = [i for i in store.incidents(job_id) if attempt is None or i.attempt == attempt]
    placements = {a["attempt"]: {r["rank"]: r["node"] for r in a["ranks"]} for a in out_attempts}
    return {
        "job": {
            "id": job.id,
            "name": job.name,
            "state": job.state.value,
            "steps_completed": job.steps_completed,
            "total_steps": job.total_steps,
            "attempts": job.attempts,
            "reason": job.reason,
        },
        "attempts": out_attempts,
        "incidents": [
            {"attempt": i.attempt, "kind": i.kind, "rank": i.rank, "node": i.node,
             "detector": i.detector, "evidence": i.evidence, "detected_at": i.detected_at,
             "exit_code": i.exit_code, "traceback": i.traceback}
            for i in incidents
        ],
        "sdc": sdc_section(store.sdc_checks(job_id, attempt), incidents, placements),
        "checkpoints": [
            {"step": c.step, "attempt": c.attempt, "path": c.path, "valid": c.valid}
            for c in store.checkpoints(job_id)
        ],
        "events_lost": _losses(store, job, {r["node"] for a in out_attempts for r in a["ranks"]}),
    }


def _losses(store: Store, job: Any, nodes: set[str]) -> list[dict[str, Any]]:
    """Telemetry lost on the job's nodes while it ran: a trace may lack events because of
    them, so the verdict must be read with them in mind."""
    end = job.ended_at or float("inf")
    return [{"node": d.node, "events": d.events, "source": d.source, "reason": d.reason, "at": d.at}
            for d in store.ingest_drops() if d.node in nodes and job.created_at <= d.at <= end]


def _step_timeline(steps: list) -> list[dict[str, Any]]:  # noqa: ANN001 (StepRecord)
    """One row per step: the loss, the slowest and median rank step time, total tokens/s,
    gradient norm, learning rate, router loss, mean MFU and whether any MoE layer on any
    rank was imbalanced."""
    by_step: dict[int, list] = {}
    for s in steps:
        by_step.setdefault(s.step, []).append(s)
    rows = []
    for step in sorted(by_step):
        ranks = by_step[step]
        times = [r.step_time_s for r in ranks]
        rows.append(
            {
                "step": step,
                "loss": ranks[0].loss,
                "ranks": len(ranks),
                "step_time_s_median": median(times),
                "step_time_s_max": max(times),
                "slowest_rank": max(ranks, key=lambda r: r.step_time_s).rank,
                "tokens_per_s": sum(r.tokens_per_s for r in ranks),
                "grad_norm": ranks[0].grad_norm,
                "lr": ranks[0].lr,
                "aux_loss": ranks[0].aux_loss,
                "mfu": sum(r.mfu for r in ranks) / len(ranks),
                "imbalanced_layers": sorted({
                    x["layer"] for r in ranks for x in r.expert_load if x.get("imbalanced")
                }),
            }
        )
    return rows
