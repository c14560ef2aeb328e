"""Writing one agent batch of telemetry events inside the caller's transaction.

Invariants:
- Collectives: one row per (job, attempt, rank, group, seq). A batch is first merged in
  memory (a "started" and its completion in the same batch become one row), then
  written with one bulk upsert: a completion sets ``exit_ns``/``state`` on an existing
  row, a "started" never overwrites a completion that arrived first, and a completion
  whose start was never seen is inserted as is.
- Steps, worker statuses: bulk inserts (batch idempotency comes from ``ingest_batches``).
- Process groups: upserted on (job, attempt, rank, group); a re-send changes nothing.
- Checkpoints: upserted on (job, step), ``valid=True`` (a re-save of a step replaces it).
- A RESTORED worker status sets the attempt's ``restored_step``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import case, insert, update
from sqlalchemy.orm import Session

from controlplane.store.engine import upsert
from controlplane.store.schema import (
    Attempt,
    Checkpoint,
    Collective,
    ProcessGroupRow,
    Step,
    WorkerStatusRow,
)
from fleet_proto import events_pb2

_COLLECTIVE_KEY = ["job_id", "attempt", "rank", "group_name", "seq"]
_STATUS_NAMES = events_pb2.WorkerStatus.State
_RESTORED = events_pb2.WorkerStatus.RESTORED
_dumps = json.JSONEncoder(separators=(",", ":")).encode


#: JSON of shapes and dtype lists, by value: a job repeats a few hundred distinct ones
#: millions of times, and encoding is most of a row's cost. Bounded; races are harmless
#: (two threads store the same string).
_JSON_CACHE: dict[tuple, str] = {}
_JSON_CACHE_MAX = 8192


def _cached_json(key: tuple, make: Any) -> str:
    out = _JSON_CACHE.get(key)
    if out is None:
        if len(_JSON_CACHE) >= _JSON_CACHE_MAX:
            _JSON_CACHE.clear()
        out = _JSON_CACHE[key] = _dumps(make())
    return out


def _shapes_json(shapes: Any) -> str:
    key = ("s", *(tuple(s.dims) for s in shapes))
    return _cached_json(key, lambda: [list(k) for k in key[1:]])


def _dtypes_json(dtypes: Any) -> str:
    key = ("d", *dtypes)
    return _cached_json(key, lambda: list(key[1:]))


def _collective_row(ev: events_pb2.CollectiveEvent) -> dict[str, Any]:
    return {
        "job_id": ev.job_id,
        "attempt": ev.attempt,
        "rank": ev.rank,
        "group_name": ev.group,
        "seq": ev.seq,
        "group_size": ev.group_size,
        "op": ev.op,
        "input_sizes": _shapes_json(ev.input_sizes),
        "input_dtypes": _dtypes_json(ev.input_dtypes),
        "output_sizes": _shapes_json(ev.output_sizes),
        "output_dtypes": _dtypes_json(ev.output_dtypes),
        "enter_ns": ev.enter_ns,
        "exit_ns": ev.exit_ns or None,
        "state": ev.state or "started",
        "step": ev.step,
        "exit_estimated": ev.exit_estimated,
    }


def _merge_collectives(events: list[events_pb2.CollectiveEvent]) -> list[dict[str, Any]]:
    merged: dict[tuple, dict[str, Any]] = {}
    for ev in events:
        key = (ev.job_id, ev.attempt, ev.rank, ev.group, ev.seq)
        row = merged.get(key)
        if row is None:
            merged[key] = _collective_row(ev)
        elif ev.state and ev.state != "started":
            row["state"] = ev.state
            row["exit_ns"] = ev.exit_ns or None
            row["exit_estimated"] = ev.exit_estimated
    return list(merged.values())


def _collective_upsert(dialect_name: str):
    c = Collective.__table__.c

    def keep_completion(col: str):
        return lambda ex: case((ex.state != "started", ex[col]), else_=c[col])

    return upsert(
        dialect_name,
        Collective.__table__,
        _COLLECTIVE_KEY,
        {"exit_ns": keep_completion("exit_ns"), "state": keep_completion("state"),
         "exit_estimated": keep_completion("exit_estimated")},
    )


def _group_upsert(dialect_name: str):
    return upsert(dialect_name, ProcessGroupRow.__table__, ["job_id", "attempt", "rank", "group_name"],
                  {col: (lambda ex, col=col: ex[col]) for col in ("desc", "ranks")})


def _checkpoint_upsert(dialect_name: str):
    cols = ["attempt", "path", "manifest_sha256", "save_s", "valid", "created_at"]
    return upsert(
        dialect_name,
        Checkpoint.__table__,
        ["job_id", "step"],
        {col: (lambda ex, col=col: ex[col]) for col in cols},
    )


def write_events(session: Session, events: Sequence[events_pb2.Event]) -> None:
    """Write ``events`` through ``session`` (inside the caller's transaction)."""
    collectives: list[events_pb2.CollectiveEvent] = []
    steps: list[dict[str, Any]] = []
    statuses: list[dict[str, Any]] = []
    checkpoints: list[dict[str, Any]] = []
    restored: list[dict[str, Any]] = []
    groups: dict[tuple, dict[str, Any]] = {}
    for event in events:
        kind = event.WhichOneof("kind")
        if kind == "collective":
            collectives.append(event.collective)
        elif kind == "step":
            ev = event.step
            steps.append({
                "job_id": ev.job_id, "attempt": ev.attempt, "rank": ev.rank, "step": ev.step,
                "loss": ev.loss, "step_time_s": ev.step_time_s,
                "tokens_per_s": ev.tokens_per_s, "end_ns": ev.end_ns,
                "grad_norm": ev.grad_norm, "lr": ev.lr, "mfu": ev.mfu, "aux_loss": ev.aux_loss,
                "imbalanced": any(x.imbalanced for x in ev.expert_load),
                "expert_load": _dumps([
                    {"layer": x.layer, "tokens_per_expert": list(x.tokens_per_expert),
                     "min_share": x.min_share, "max_share": x.max_share, "imbalanced": x.imbalanced}
                    for x in ev.expert_load
                ]),
            })
        elif kind == "status":
            ev = event.status
            statuses.append({
                "job_id": ev.job_id, "attempt": ev.attempt, "rank": ev.rank,
                "state": _STATUS_NAMES.Name(ev.state), "time_ns": ev.time_ns, "pid": ev.pid,
                "hostname": ev.hostname, "restored_step": ev.restored_step,
                "detail": ev.detail, "phase_s": ev.phase_s,
            })
            if ev.state == _RESTORED:
                restored.append({"j": ev.job_id, "a": ev.attempt, "s": ev.restored_step})
        elif kind == "checkpoint":
            ev = event.checkpoint
            checkpoints.append({
                "job_id": ev.job_id, "attempt": ev.attempt, "step": ev.step, "path": ev.path,
                "manifest_sha256": ev.manifest_sha256, "save_s": ev.save_s, "valid": True,
                "created_at": ev.time_ns / 1e9 if ev.time_ns else time.time(),
            })
        elif kind == "group":
            ev = event.group
            key = (ev.job_id, ev.attempt, ev.rank, ev.group)
            groups[key] = {"job_id": ev.job_id, "attempt": ev.attempt, "rank": ev.rank,
                           "group_name": ev.group, "desc": ev.desc, "ranks": _dumps(sorted(ev.ranks))}
        # An empty Event (no kind set) carries nothing to store.

    dialect_name = session.get_bind().dialect.name
    if collectives:
        session.execute(_collective_upsert(dialect_name), _merge_collectives(collectives))
    if steps:
        session.execute(insert(Step.__table__), steps)
    if groups:
        session.execute(_group_upsert(dialect_name), list(groups.values()))
    if statuses:
        session.execute(insert(WorkerStatusRow.__table__), statuses)
    if checkpoints:
        # Same (job, step) twice in one batch would make PostgreSQL reject the statement.
        by_key = {(r["job_id"], r["step"]): r for r in checkpoints}
        session.execute(_checkpoint_upsert(dialect_name), list(by_key.values()))
    for r in restored:
        session.execute(
            update(Attempt)
            .where(Attempt.job_id == r["j"], Attempt.number == r["a"])
            .values(restored_step=r["s"])
        )
