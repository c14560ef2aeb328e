"""`fleet status`: one job and its nodes at a glance, from the store and, when the
controller that runs the job answers, its live facts.

``build_status`` is pure: it turns the store's records (``StatusRecords``) and the
controller's ``LiveFacts`` (or none) into a ``Status``. ``load_status`` reads those
records from a Store; the controller (``job_control.JobService.get_status``) and the
CLI's store fallback both call it, so the two views agree field for field.
``to_proto`` / ``from_proto`` carry a ``Status`` over ControlService ``GetStatus``, and
``to_dict`` is its JSON form.

What the job view holds: state and reason, the current (last) attempt and its state, the
newest step of that attempt (its restored step before its first), the loss (mean over
ranks) and tokens/s (summed over ranks) at the newest step every rank reported, ETTR so
far (``fleet report``'s definition, summed in SQL: ``ettr_so_far``, cached by ``EttrCache``),
restarts, the newest incident, the newest valid checkpoint, and a stop in progress. Per
node: state and quarantine reason, the last health verdict, the current attempt's ranks on
it, events lost on the way to the store (``ingest_drops``), last seen, and, live only,
whether its agent is connected and how long it has been silent.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet.controlplane.report import stopped_spans
from fleet.controlplane.store import (
    AttemptRecord,
    CheckpointRecord,
    IncidentRecord,
    JobRecord,
    NodeRecord,
    RankRecord,
    Store,
)
from fleet.proto import control_pb2

#: ETTR is recomputed at most this often (seconds) ...
ETTR_MIN_REFRESH_S = 5.0
#: ... and no more often than this many times what it last took: its SQL sum reads every
#: step row of the job (about 60 ms for 80,000 rows on SQLite), which grows with a long job.
ETTR_COST_FACTOR = 50.0
#: Step aggregates read for the loss and tokens/s: the newest may lack ranks still reporting.
NEWEST_STEPS = 2


@dataclass(frozen=True)
class IncidentView:
    kind: str
    rank: int          # -1 = none named
    node: str
    evidence: str      # one line
    detected_at: float  # Unix seconds
    observed: bool     # detect.<kind>.action observe: stored, not acted on


@dataclass(frozen=True)
class JobView:
    job_id: str
    name: str
    state: str
    reason: str
    attempt: int           # 0 before the first
    attempt_state: str     # "" before the first
    step: int
    total_steps: int       # 0 for a program of yours
    loss: float | None
    tokens_per_s: float
    ettr: float | None     # None until the job has steps
    restarts: int
    last_incident: IncidentView | None
    checkpoint_step: int | None  # newest valid checkpoint
    created_at: float
    ended_at: float | None
    stopping: str          # "" | "checkpointing" | "signalled" | "tearing down" (live only)
    world_size: int        # ranks of the current attempt


@dataclass(frozen=True)
class NodeView:
    name: str
    state: str
    health: str
    quarantine_reason: str
    ranks: tuple[int, ...]
    events_lost: int
    last_seen: float
    agent_connected: bool      # live only (False from the store)
    silent_s: float | None     # live only


@dataclass(frozen=True)
class Status:
    job: JobView
    nodes: tuple[NodeView, ...]
    at: float    # Unix seconds
    live: bool   # from the running controller


@dataclass(frozen=True)
class LiveFacts:
    """What only the running controller knows: its current attempt and where each rank
    runs, its agents (connected, seconds since heard from) and a stop in progress."""

    attempt: int
    placement: Sequence[str]                 # node of each rank
    connected: frozenset[str] = frozenset()
    silent_s: Mapping[str, float] = field(default_factory=dict)
    stopping: str = ""


@dataclass(frozen=True)
class StatusRecords:
    """The store's records ``build_status`` needs (``load_status`` reads them)."""

    job: JobRecord
    attempts: Sequence[AttemptRecord]
    newest_steps: Sequence[Mapping[str, Any]]  # Store.step_aggregates of the current attempt, oldest first
    ranks: Sequence[RankRecord]                # the current attempt's
    last_incident: IncidentRecord | None
    restarts: int
    checkpoint: CheckpointRecord | None        # newest valid
    nodes: Sequence[NodeRecord]
    job_nodes: frozenset[str]                  # nodes any attempt of the job ran on
    events_lost: Mapping[str, int]             # per node
    ettr: float | None


def one_line(text: str) -> str:
    """``text`` on one line (evidence may hold a traceback's line breaks)."""
    return re.sub(r"\s+", " ", text).strip()


def _node_key(name: str) -> tuple[Any, ...]:
    """node-2 before node-10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def build_status(r: StatusRecords, now: float, live: LiveFacts | None = None) -> Status:
    """The status of ``r.job`` (see the module docstring); ``live``: the controller's facts
    when it runs this job."""
    job = r.job
    attempt = r.attempts[-1] if r.attempts else None
    number = live.attempt if live is not None and live.attempt else (attempt.number if attempt else 0)
    this = next((a for a in r.attempts if a.number == number), None)
    if live is not None and live.placement:
        rank_nodes = {rank: node for rank, node in enumerate(live.placement)}
    else:
        rank_nodes = {x.rank: x.node for x in r.ranks}
    world = len(rank_nodes)
    newest = list(r.newest_steps)
    step = int(newest[-1]["step"]) if newest else (this.restored_step or 0) if this else 0
    # the newest step every rank has reported: the very newest may still be arriving
    full = [s for s in newest if world and s["ranks"] >= world]
    shown = full[-1] if full else (newest[-1] if newest else None)
    incident = None
    if r.last_incident is not None:
        i = r.last_incident
        incident = IncidentView(str(i.kind), -1 if i.rank is None else i.rank, i.node or "", one_line(i.evidence),
                                i.detected_at, bool(i.observed))
    view = JobView(
        job_id=job.id, name=job.name, state=job.state.value, reason=job.reason,
        attempt=number, attempt_state=this.state.value if this else "", step=step, total_steps=job.total_steps,
        loss=None if shown is None else float(shown["loss"]),
        tokens_per_s=0.0 if shown is None else float(shown["tokens_per_s"]),
        ettr=r.ettr, restarts=r.restarts, last_incident=incident,
        checkpoint_step=None if r.checkpoint is None else r.checkpoint.step,
        created_at=job.created_at, ended_at=job.ended_at,
        stopping=live.stopping if live is not None else "", world_size=world)
    by_name = {n.name: n for n in r.nodes}
    names = set(r.job_nodes) | set(rank_nodes.values())
    if live is not None:
        names |= live.connected
    elif not job.state.terminal:  # the cluster's nodes (spares too) registered for this job
        names |= {n.name for n in r.nodes if n.last_seen >= job.created_at}
    nodes = []
    for name in sorted(names, key=_node_key):
        rec = by_name.get(name)
        nodes.append(NodeView(
            name=name, state=str(rec.state) if rec else "unknown", health=rec.health if rec else "unknown",
            quarantine_reason=rec.quarantine_reason if rec else "",
            ranks=tuple(sorted(rank for rank, node in rank_nodes.items() if node == name)),
            events_lost=int(r.events_lost.get(name, 0)), last_seen=rec.last_seen if rec else 0.0,
            agent_connected=live is not None and name in live.connected,
            silent_s=None if live is None or name not in live.silent_s else round(live.silent_s[name], 3)))
    return Status(job=view, nodes=tuple(nodes), at=now, live=live is not None)


def ettr_so_far(store: Store, job: JobRecord, attempts: Sequence[AttemptRecord], now: float) -> float | None:
    """`fleet report`'s ETTR (``report.job_report``: productive step time / wall, a step's
    time its slowest rank's, steps thrown away by a later attempt's restore not counted),
    summed in SQL (``Store.kept_step_time``) instead of over every step row in Python, the
    time it sat stopped left out (``report.stopped_spans``); None before the job's first step."""
    if not job.steps_completed:
        return None
    numbers = sorted(a.number for a in attempts)
    restored = {a.number: a.restored_step or 0 for a in attempts}
    productive = 0.0
    for n in numbers:
        kept_up_to = min((restored[m] for m in numbers if m > n), default=None)
        productive += store.kept_step_time(job.id, n, kept_up_to)
    # time the job sat STOPPED before a resume is not its wall time (as in the report)
    stopped = sum(b - a for a, b in stopped_spans(store.transitions(job.id)))
    wall = max((job.ended_at or now) - job.created_at - stopped, 1e-9)
    return round(productive / wall, 4)


class EttrCache:
    """``ettr_so_far`` per job, recomputed at most every ``ETTR_MIN_REFRESH_S`` seconds and
    never more often than ``ETTR_COST_FACTOR`` times its last cost (the sum grows with the
    job's step rows); an ended job's is computed once. Safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cached: dict[str, tuple[float, float, float | None, bool]] = {}  # job -> (at, cost, ettr, ended)

    def get(self, store: Store, job: JobRecord, attempts: Sequence[AttemptRecord], now: float) -> float | None:
        with self._lock:
            hit = self._cached.get(job.id)
            ended = job.state.terminal
            if hit is not None:
                at, cost, ettr, was_ended = hit
                if was_ended or (not ended and time.monotonic() - at < max(ETTR_MIN_REFRESH_S,
                                                                           ETTR_COST_FACTOR * cost)):
                    return ettr
            t0 = time.monotonic()
            ettr = ettr_so_far(store, job, attempts, now)
            self._cached[job.id] = (time.monotonic(), time.monotonic() - t0, ettr, ended)
            return ettr


def load_status(store: Store, job_id: str, now: float, live: LiveFacts | None = None,
                ettr: EttrCache | None = None) -> Status:
    """``build_status`` of ``job_id`` from ``store``; ``NotFoundError`` when there is no such
    job. ``ettr``: where ETTR is cached between calls (a `--watch` or the controller)."""
    job = store.get_job(job_id)
    attempts = store.get_attempts(job_id)
    number = live.attempt if live is not None and live.attempt else (attempts[-1].number if attempts else 0)
    newest = store.step_aggregates(job_id, number, last=NEWEST_STEPS)[1] if number else []
    incidents = store.incidents(job_id)
    drops: dict[str, int] = {}
    for d in store.ingest_drops():
        drops[d.node] = drops.get(d.node, 0) + d.events
    records = StatusRecords(
        job=job, attempts=attempts, newest_steps=newest, ranks=store.ranks(job_id, number) if number else [],
        last_incident=incidents[-1] if incidents else None,
        restarts=sum(1 for a in store.actions(job_id) if a.kind == "restart"),
        checkpoint=store.latest_valid_checkpoint(job_id), nodes=store.list_nodes(),
        job_nodes=frozenset(store.job_nodes(job_id)), events_lost=drops,
        ettr=(ettr or EttrCache()).get(store, job, attempts, now))
    return build_status(records, now, live)


# -- the wire and JSON forms ------------------------------------------------------------------


def to_proto(s: Status) -> control_pb2.StatusReply:
    j = s.job
    job = control_pb2.JobView(
        job_id=j.job_id, name=j.name, state=j.state, reason=j.reason, attempt=j.attempt,
        attempt_state=j.attempt_state, step=j.step, total_steps=j.total_steps, tokens_per_s=j.tokens_per_s,
        restarts=j.restarts, created_at=j.created_at, ended_at=j.ended_at or 0.0, stopping=j.stopping,
        world_size=j.world_size)
    if j.loss is not None:
        job.loss = j.loss
    if j.ettr is not None:
        job.ettr = j.ettr
    if j.checkpoint_step is not None:
        job.checkpoint_step = j.checkpoint_step
    if j.last_incident is not None:
        job.last_incident.CopyFrom(control_pb2.IncidentView(**dataclasses.asdict(j.last_incident)))
    nodes = []
    for n in s.nodes:
        msg = control_pb2.NodeView(
            name=n.name, state=n.state, health=n.health, quarantine_reason=n.quarantine_reason, ranks=n.ranks,
            events_lost=n.events_lost, last_seen=n.last_seen, agent_connected=n.agent_connected)
        if n.silent_s is not None:
            msg.silent_s = n.silent_s
        nodes.append(msg)
    return control_pb2.StatusReply(job=job, nodes=nodes, at=s.at, live=s.live)


def from_proto(m: control_pb2.StatusReply) -> Status:
    j = m.job
    incident = None
    if j.HasField("last_incident"):
        i = j.last_incident
        incident = IncidentView(i.kind, i.rank, i.node, i.evidence, i.detected_at, i.observed)
    job = JobView(
        job_id=j.job_id, name=j.name, state=j.state, reason=j.reason, attempt=j.attempt,
        attempt_state=j.attempt_state, step=j.step, total_steps=j.total_steps,
        loss=j.loss if j.HasField("loss") else None, tokens_per_s=j.tokens_per_s,
        ettr=j.ettr if j.HasField("ettr") else None, restarts=j.restarts, last_incident=incident,
        checkpoint_step=j.checkpoint_step if j.HasField("checkpoint_step") else None,
        created_at=j.created_at, ended_at=j.ended_at or None, stopping=j.stopping, world_size=j.world_size)
    nodes = tuple(NodeView(
        name=n.name, state=n.state, health=n.health, quarantine_reason=n.quarantine_reason, ranks=tuple(n.ranks),
        events_lost=n.events_lost, last_seen=n.last_seen, agent_connected=n.agent_connected,
        silent_s=n.silent_s if n.HasField("silent_s") else None) for n in m.nodes)
    return Status(job=job, nodes=nodes, at=m.at, live=m.live)


def to_dict(s: Status) -> dict[str, Any]:
    """The JSON form: ``source`` ("controller" or "store"), ``at``, ``job``, ``nodes``."""
    job = dataclasses.asdict(s.job)
    return {"source": "controller" if s.live else "store", "at": s.at, "job": job,
            "nodes": [{**dataclasses.asdict(n), "ranks": list(n.ranks)} for n in s.nodes]}
