"""The replay report of a large job (one whose agents sent collective fronts, not every
collective): what `fleet replay` shows of it, read from the store in bounded queries.

A large job's store holds per (rank, group) its front (``collective_fronts``), and raw
collectives only where the controller pulled them around a suspect (``TracePull``). So:
  * the verdict is the flight recorder's (``diagnosis.diagnose``) over the groups whose
    every declared member has pulled entries, and only those (the members of groups never
    pulled are not "missing"); without such a group, the fronts' own verdict
    (``controlplane.wavefront``);
  * the wavefront around the incident is ``fronts_view.standing`` of each group of the
    culprits and of the groups the diagnosis names;
  * the rest is paged: the fronts in rank order, or the groups (aggregated in SQL).

Bounded: no query per rank, member lists parsed only for the groups shown or diagnosed,
steps aggregated in SQL over the newest ``last_steps``. Returns plain dicts (the shape of
``controlplane.replay.replay_report``'s attempts, with ``mode`` "fronts" and a
``fronts`` section).
"""

from __future__ import annotations

import json

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fleet.controlplane.diagnosis import DiagnosisConfig, diagnose
from fleet.controlplane.diagnosis.source import LIVE_STATES, attempt_traces
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.fronts_view import pages, standing
from fleet.controlplane.store import Store
from fleet.controlplane.wavefront import Wavefronts
from fleet.proto.fronts import pack

#: Most groups the wavefront around an incident shows (the culprits' and the diagnosis's).
FOCUS_GROUPS = 16
#: Attempts of a large job read at once (each its own store session).
ATTEMPT_THREADS = 4
#: Page sizes a reader may ask for.
PAGE_SIZE_MAX = 10_000
PAGE_BY = ("rank", "group")
#: FrontRow fields a page leaves out: the job and attempt are the report's; ``entered``
#: (ops since the previous report) is not stored.
_NOT_SHOWN = ("job_id", "attempt", "entered")


@dataclass(frozen=True)
class Paging:
    """``--page`` (1-based), ``--page-size`` and ``--page-by`` (rank: the fronts in rank
    order; group: one row per group), with the ``--rank``/``--group`` selection."""

    page: int = 1
    size: int = 50
    by: str = "rank"
    ranks: tuple[int, ...] | None = None
    groups: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.page < 1:
            raise ConfigError(f"--page: must be >= 1, got {self.page}")
        if not 1 <= self.size <= PAGE_SIZE_MAX:
            raise ConfigError(f"--page-size: must be 1..{PAGE_SIZE_MAX}, got {self.size}")
        if self.by not in PAGE_BY:
            raise ConfigError(f"--page-by: one of {', '.join(PAGE_BY)}, got {self.by!r}")


def has_fronts(store: Store, job_id: str) -> bool:
    """True when some attempt of the job stored collective fronts (a large job)."""
    return any(store.count_fronts(job_id, a.number) for a in store.get_attempts(job_id))


def _raw_ingest_max_ranks(config_json: str) -> int:
    """``agent.raw_ingest_max_ranks`` of the job's stored config (its default when unset or
    unreadable): above it, the job sent fronts instead of every collective."""
    from fleet.controlplane.config import AgentConfig

    default = AgentConfig.model_fields["raw_ingest_max_ranks"].default
    try:
        value = (json.loads(config_json or "{}").get("agent") or {}).get("raw_ingest_max_ranks", default)
        return int(value)
    except (ValueError, TypeError, AttributeError):
        return default


def _large(store: Store, job_id: str, attempt: int, raw_max: int) -> bool:
    """Whether the attempt is a large job's: it has fronts, or placed (else, without
    placement rows, declared groups for) more ranks than ``raw_max``."""
    if store.count_fronts(job_id, attempt):
        return True
    return (store.count_ranks(job_id, attempt) or store.count_declared_ranks(job_id, attempt)) > raw_max


def pulled_traces(store: Store, job_id: str, attempt: Any) -> tuple[Any, Any, list[str], dict[str, int]]:
    """(traces, ``Diagnosis``, the groups they cover, per pulled group left out: how many of
    its members have no pulled entries); traces and diagnosis None when no group was
    pulled whole."""
    pulled = store.pulled_ranks(job_id, attempt.number)
    members = store.group_members(job_id, attempt.number, sorted(pulled)) if pulled else {}
    complete = sorted(g for g in pulled if g in members and set(members[g]) <= pulled[g])
    partial = {g: len(set(members.get(g, ())) - pulled[g]) for g in pulled if g not in complete}
    if not complete:
        return None, None, [], partial
    rows = store.collectives_of(job_id, attempt.number, complete)
    traces = attempt_traces(store, job_id, attempt.number, rows, complete)
    live = attempt.state in LIVE_STATES
    return traces, diagnose(traces, DiagnosisConfig(), now_ns=time.time_ns() if live else None), complete, partial


def pulled_diagnosis(store: Store, job_id: str, attempt: Any) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    """(the diagnosis JSON, the groups it covers, the pulled groups left out: ``pulled_traces``);
    without a group pulled whole, the fronts' own verdict."""
    _, diag, complete, partial = pulled_traces(store, job_id, attempt)
    if diag is None:
        return _fronts_verdict(store, job_id, attempt.number, attempt.state in LIVE_STATES), [], partial
    out = diag.to_json()
    out["source"] = f"store:{job_id} (pulled entries of {len(complete)} group(s))"
    return out, complete, partial


def _fronts_verdict(store: Store, job_id: str, attempt: int, live: bool) -> dict[str, Any]:
    """No group was pulled whole: the verdict of the stored fronts (one read of them all)."""
    w = Wavefronts(job_id, attempt)
    w.apply([pack(store.fronts(job_id, attempt))])
    settle = DiagnosisConfig().settle_s if live else 0.0
    v = w.verdict(time.time_ns(), settle)
    base = {"source": f"store:{job_id} (collective fronts; no group's raw entries were pulled whole)",
            "attempt": attempt, "findings": [], "ranks": [], "missing_ranks": [], "groups": [], "wavefront": []}
    if v is None:
        return {**base, "verdict": "ok", "culprit_ranks": [], "summary": "the fronts show no blocked group"}
    return {**base, "verdict": v.verdict, "culprit_ranks": list(v.culprits), "summary": v.summary,
            "front_groups": list(v.groups)}


def focus_groups(store: Store, job_id: str, attempt: int, diag: dict[str, Any], incident_ranks: list[int]) -> list[str]:
    """The groups the wavefront around the incident shows: the culprits' (else the incident's
    ranks') groups, then those the diagnosis's findings name."""
    blamed = list(diag["culprit_ranks"]) or incident_ranks
    names: list[str] = []
    for g in [g.group for g in store.process_groups(job_id, attempt, ranks=blamed)] + \
             [f["group"].removesuffix(":p2p") for f in diag["findings"]] + diag.get("front_groups", []):
        if g and g not in names:
            names.append(g)
    return names[:FOCUS_GROUPS]


def fronts_attempt(store: Store, job_id: str, attempt: Any, incidents: list[dict[str, Any]], paging: Paging,
                   last_steps: int) -> dict[str, Any]:
    """One attempt of a large job, as `fleet replay` shows it (module docstring)."""
    n = attempt.number
    diag, diagnosed, partial = pulled_diagnosis(store, job_id, attempt)
    incident_ranks = [i["rank"] for i in incidents if i["attempt"] == n and i["rank"] is not None]
    focus = focus_groups(store, job_id, n, diag, incident_ranks)
    fronts = store.fronts(job_id, n, groups=focus) if focus else []
    members = store.group_members(job_id, n, focus) if focus else {}
    descs = {g.group: g.desc for g in store.process_groups(job_id, n, ranks=diag["culprit_ranks"] or incident_ranks)}
    around = [standing(g, descs.get(g, ""), members.get(g, ()), fronts) for g in focus]
    named = {r for s in around for r in s["outliers"] + s["missing"][:8]} | set(diag["culprit_ranks"])
    named |= set(incident_ranks)
    page = _page(store, job_id, n, paging)
    nodes = store.rank_nodes(job_id, n, sorted(named | {r["rank"] for r in page["rows"] if "rank" in r}))
    for r in page["rows"]:
        if "rank" in r:
            r["node"] = nodes.get(r["rank"], "")
    recorded, steps = store.step_aggregates(job_id, n, last_steps)
    pulled = store.pulled_ranks(job_id, n)
    return {
        "attempt": n, "mode": "fronts", "diagnosis": diag, "state": attempt.state.value,
        "restored_step": attempt.restored_step, "final_step": attempt.final_step, "reason": attempt.reason,
        "ranks_placed": store.count_ranks(job_id, n), "nodes": {str(r): nd for r, nd in sorted(nodes.items())},
        "diagnosed_groups": diagnosed, "pulled": {g: len(rs) for g, rs in sorted(pulled.items())},
        "pulled_partial": partial,
        "fronts": {"count": store.count_fronts(job_id, n), "summary": store.front_kinds(job_id, n),
                   "around_incident": around, "page": page},
        "steps_recorded": recorded, "steps": steps,
    }


def _page(store: Store, job_id: str, attempt: int, p: Paging) -> dict[str, Any]:
    ranks = list(p.ranks) if p.ranks is not None else None
    groups = list(p.groups) if p.groups is not None else None
    if p.by == "group":
        total = len(groups) if groups is not None else store.count_front_groups(job_id, attempt)
        unit = "groups"
    else:
        total = store.count_fronts_of(job_id, attempt, ranks=ranks, groups=groups)
        unit = "fronts"
    last = pages(total, p.size)
    if p.page > last:
        raise ConfigError(f"--page {p.page}: past the last page; attempt {attempt} has {total} {unit}, "
                          f"{last} page(s) of {p.size}")
    offset = (p.page - 1) * p.size
    if p.by == "group":
        rows = store.front_groups(job_id, attempt, groups=groups, offset=offset, limit=p.size)
    else:
        rows = [{**{k: v for k, v in f._asdict().items() if k not in _NOT_SHOWN}, "open": f.open}
                for f in store.fronts(job_id, attempt, ranks=ranks, groups=groups, offset=offset, limit=p.size)]
    return {"by": p.by, "page": p.page, "pages": last, "page_size": p.size, "total": total, "unit": unit,
            "rows": rows}


def fronts_report(store: Store, job_id: str, attempt: int | None, paging: Paging,
                  last_steps: int) -> dict[str, Any]:
    """``replay_report``'s dict for a job with fronts: its attempts with fronts built by
    ``fronts_attempt``, any other attempt by ``replay_report`` itself."""
    from fleet.controlplane.replay import replay_report
    from fleet.controlplane.sdc import SdcVerdict, sdc_section

    job = store.get_job(job_id)
    attempts = [a for a in store.get_attempts(job_id) if attempt is None or a.number == attempt]
    records = [i for i in store.incidents(job_id) if attempt is None or i.attempt == attempt]
    incidents = [{"attempt": i.attempt, "kind": i.kind, "rank": i.rank, "node": i.node, "detector": i.detector,
                  "evidence": i.evidence, "detected_at": i.detected_at, "exit_code": i.exit_code,
                  "traceback": i.traceback} for i in records]
    out = []
    raw_max = _raw_ingest_max_ranks(job.config_json)
    # an attempt of a large job whose fronts were never written (it ended, or the
    # controller died, before a flush) is still a large job's: read around its pulled
    # entries, never its every rank's groups
    large = [a for a in attempts if _large(store, job_id, a.number, raw_max)]
    # attempts are read side by side: most of one's time is the database's (a PostgreSQL
    # server works on several queries at once), not this process's
    with ThreadPoolExecutor(max_workers=max(1, min(ATTEMPT_THREADS, len(large))),
                            thread_name_prefix="fleet-replay") as pool:
        built = {a.number: pool.submit(fronts_attempt, store, job_id, a, incidents, paging, last_steps)
                 for a in large}
        for a in attempts:
            if a.number in built:
                out.append(built[a.number].result())
            else:
                out.extend(replay_report(store, job_id, a.number)["attempts"])
    checks = store.sdc_checks(job_id, attempt)
    suspects: dict[int, set[int]] = {}
    for c in checks:
        if c.kind == "verdict":
            suspects.setdefault(c.attempt, set()).add(SdcVerdict.from_row(c).suspect)
    placements = {n: store.rank_nodes(job_id, n, sorted(rs)) for n, rs in suspects.items()}
    end = job.ended_at or float("inf")
    nodes = store.job_nodes(job_id, attempt)
    lost = [{"node": d.node, "events": d.events, "source": d.source, "reason": d.reason, "at": d.at}
            for d in store.ingest_drops() if d.node in nodes and job.created_at <= d.at <= end]
    return {
        "job": {"id": job.id, "name": job.name, "state": job.state.value, "steps_completed": job.steps_completed,
                "total_steps": job.total_steps, "attempts": job.attempts, "reason": job.reason},
        "attempts": out, "incidents": incidents,
        "sdc": sdc_section(checks, records, placements),
        "checkpoints": [{"step": c.step, "attempt": c.attempt, "path": c.path, "valid": c.valid}
                        for c in store.checkpoints(job_id)],
        "events_lost": lost,
    }
