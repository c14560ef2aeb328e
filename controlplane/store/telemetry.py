"""The Store's telemetry: agent batches in, and steps, collectives, process groups,
worker status, SDC checks and ingest drops out.

Invariants:
- ``record_batch`` is idempotent on (agent_id, epoch, seq): the batch row and its
  events commit together or not at all; ``record_batches`` group-commits many.
- Telemetry tables have no foreign key to jobs (ingest must not block on one), so
  direct writes such as ``record_sdc_check`` check the job first.
- ``recent_collectives`` and ``last_progress_ns`` read by index only, however many
  collectives are stored.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Float, bindparam, case, cast, func, literal, select, tuple_
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DataError, IntegrityError

from fleet.controlplane.store import ingest
from fleet.controlplane.store.base import StoreBase
from fleet.controlplane.store.records import (
    CollectiveRecord,
    CollectiveSummary,
    IngestDropRecord,
    ProcessGroupRecord,
    SdcCheckRecord,
    StepRecord,
    WorkerStatusRecord,
)
from fleet.controlplane.store.schema import (
    Collective,
    CollectiveFront,
    IngestBatch,
    IngestDrop,
    ProcessGroupRow,
    SdcCheck,
    Step,
    WorkerStatusRow,
)
from fleet.proto import events_pb2
from fleet.proto.kinds import Timing
from fleet.proto.fronts import FrontRow

SDC_KINDS = ingest.SDC_KINDS
DROP_SOURCES = frozenset({"agent", "controller"})


def _collective_columns() -> tuple:
    """The ``collectives`` columns ``_collective_record`` reads, in its order."""
    c = Collective.__table__.c
    return (c.job_id, c.attempt, c.rank, c.group_name, c.group_size, c.seq, c.op, c.input_sizes, c.input_dtypes,
            c.output_sizes, c.output_dtypes, c.enter_ns, c.exit_ns, c.state, c.step, c.exit_estimated,
            c.duration_ns, c.timing)


def _collective_record(r: Any) -> CollectiveRecord:
    """One ``collectives`` row, selected as ``_collective_columns``, as a record (sizes and
    dtypes parsed from their JSON). Positional: a row's attribute lookup by name costs
    more than the rest of the record."""
    (job_id, attempt, rank, group, group_size, seq, op, in_sizes, in_dtypes, out_sizes, out_dtypes, enter_ns,
     exit_ns, state, step, estimated, duration_ns, timing) = r
    return CollectiveRecord(job_id, attempt, rank, group, group_size, seq, op, _sizes(in_sizes), _dtypes(in_dtypes),
                            _sizes(out_sizes), _dtypes(out_dtypes), enter_ns, exit_ns, state, step, bool(estimated),
                            duration_ns or None, (timing or 0) if duration_ns else 0)


# A job's collectives repeat a few shapes and dtypes: each text is parsed once (the
# results are tuples, safe to share), which halves a large read's cost.
@functools.lru_cache(maxsize=4096)
def _sizes(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in json.loads(text))


@functools.lru_cache(maxsize=1024)
def _dtypes(text: str) -> tuple[str, ...]:
    return tuple(json.loads(text))


@functools.lru_cache(maxsize=64)
def _marker_sql(n: int) -> str:
    """``INSERT`` of ``n`` ingest_batches keys that returns those not stored before
    (SQLite's form)."""
    row = "(?, ?, ?, ?, ?)"
    return ("INSERT INTO ingest_batches (agent_id, epoch, seq, committed_at, n_events) VALUES "
            + ", ".join([row] * n) + " ON CONFLICT (agent_id, epoch, seq) DO NOTHING RETURNING agent_id, epoch, seq")


#: PostgreSQL's form of ``_marker_sql``: the keys as arrays, so the statement's text (and
#: psycopg's parse of it) is the same for any number of batches.
_PG_MARKER_SQL = (
    "INSERT INTO ingest_batches (agent_id, epoch, seq, committed_at, n_events) "
    "SELECT * FROM unnest(%s::varchar[], %s::bigint[], %s::bigint[], %s::float8[], %s::integer[]) "
    "ON CONFLICT (agent_id, epoch, seq) DO NOTHING RETURNING agent_id, epoch, seq")


class TelemetryMethods(StoreBase):
    """The Store's ingest and telemetry-query methods (a mixin of ``store.Store``)."""

    #: Batches whose keys one multi-row INSERT ... RETURNING marks (SQLite's limit on
    #: bound parameters is 32,766; five per batch).
    MARKER_CHUNK = 1000

    # -- ingest ---------------------------------------------------------------------------

    def record_batch(self, agent_id: str, epoch: int, seq: int,
                     events: Sequence[events_pb2.Event]) -> bool:
        """Store one agent batch atomically; False (and nothing written) if already stored.

        ``ingest.InvalidBatch`` (nothing written) when the events cannot be stored."""
        return self.record_batches([(agent_id, epoch, seq, ingest.prepare(events))])[0]

    def record_batches(self, batches: Sequence[tuple[str, int, int, ingest.PreparedBatch]]
                       ) -> list[bool]:
        """Store prepared batches ``(agent_id, epoch, seq, rows)`` in one transaction (a
        group commit); per batch, True if stored now, False if it already was. All or
        nothing: on an error none of them is stored."""
        # RETURNING tells fresh keys from those already stored (rowcount is not reliable):
        # one multi-row statement per chunk of batches, not one per batch, through the
        # DBAPI cursor (SQLAlchemy would compile a new statement per chunk size)
        fresh: list[bool] = []
        try:
            with self._tx(write=True) as s:
                now = time.time()
                keys = [(agent_id, epoch, seq) for agent_id, epoch, seq, _ in batches]
                new_keys: set[tuple] = set()
                with ingest.dbapi_cursor(s, "ingest_batches marker") as (cursor, dialect_name):
                    if dialect_name == "postgresql":  # one short statement over arrays
                        cursor.execute(_PG_MARKER_SQL, [
                            [b[0] for b in batches], [b[1] for b in batches], [b[2] for b in batches],
                            [now] * len(batches), [b[3].events for b in batches]])
                        new_keys.update(tuple(r) for r in cursor.fetchall())
                    else:
                        for i in range(0, len(batches), self.MARKER_CHUNK):
                            chunk = batches[i:i + self.MARKER_CHUNK]
                            params = [v for agent_id, epoch, seq, rows in chunk
                                      for v in (agent_id, epoch, seq, now, rows.events)]
                            cursor.execute(_marker_sql(len(chunk)), params)
                            new_keys.update(tuple(r) for r in cursor.fetchall())
                seen: set[tuple] = set()
                for key in keys:  # the same key twice in one call: the first is the fresh one
                    fresh.append(key in new_keys and key not in seen)
                    seen.add(key)
                ingest.write(s, [rows for (*_, rows), new in zip(batches, fresh) if new])
        except (IntegrityError, DataError) as e:
            raise ingest.InvalidBatch(f"the store refused it: {e.orig}") from e
        return fresh

    def committed_seq(self, agent_id: str, epoch: int) -> int:
        """Highest committed batch seq of (agent, epoch); 0 if none."""
        return self.committed_seqs([(agent_id, epoch)])[(agent_id, epoch)]

    def committed_seqs(self, streams: Sequence[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """``committed_seq`` of many (agent, epoch) in one query (a reconnect storm's Hellos)."""
        out = dict.fromkeys(streams, 0)
        if not out:
            return out
        with self._tx(write=False) as s:
            rows = s.execute(select(IngestBatch.agent_id, IngestBatch.epoch, func.max(IngestBatch.seq))
                             .where(tuple_(IngestBatch.agent_id, IngestBatch.epoch).in_(list(out)))
                             .group_by(IngestBatch.agent_id, IngestBatch.epoch)).all()
        for agent_id, epoch, seq in rows:
            out[(agent_id, epoch)] = seq
        return out

    # -- telemetry queries ----------------------------------------------------------------

    def steps(self, job_id: str, attempt: int | None = None,
              rank: int | None = None) -> list[StepRecord]:
        """Step metrics ordered by attempt, step, rank."""
        stmt = select(Step).where(Step.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(Step.attempt == attempt)
        if rank is not None:
            stmt = stmt.where(Step.rank == rank)
        with self._tx(write=False) as s:
            rows = s.scalars(stmt.order_by(Step.attempt, Step.step, Step.rank)).all()
            return [StepRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank, step=r.step,
                               loss=r.loss, step_time_s=r.step_time_s,
                               tokens_per_s=r.tokens_per_s, end_ns=r.end_ns,
                               grad_norm=r.grad_norm or 0.0, lr=r.lr or 0.0, mfu=r.mfu or 0.0,
                               aux_loss=r.aux_loss or 0.0, imbalanced=bool(r.imbalanced),
                               expert_load=tuple(json.loads(r.expert_load or "[]")))
                    for r in rows]

    def last_step(self, job_id: str, attempt: int | None = None) -> int:
        """Highest step recorded (in ``attempt``, or any); 0 if none."""
        stmt = select(func.max(Step.step)).where(Step.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(Step.attempt == attempt)
        with self._tx(write=False) as s:
            return s.scalar(stmt) or 0

    def step_span(self, job_id: str, attempt: int) -> tuple[int, int, int] | None:
        """``(first step's end_ns, last step, last step's end_ns)`` of ``attempt`` (over all
        ranks), or None before its first step."""
        stmt = (select(func.min(Step.end_ns), func.max(Step.step), func.max(Step.end_ns))
                .where(Step.job_id == job_id, Step.attempt == attempt))
        with self._tx(write=False) as s:
            first, last, last_end = s.execute(stmt).one()
        return None if first is None else (int(first), int(last), int(last_end))

    #: How many of an attempt's newest collective entries ``last_progress_ns`` looks through
    #: for a completion: more than are in flight at once (about one per rank and group).
    PROGRESS_WINDOW = 4096

    def last_progress_ns(self, job_id: str, attempt: int, before_ns: int) -> int | None:
        """The last progress fleet saw in ``attempt`` at or before ``before_ns`` (Unix ns):
        the newest step end of any rank; without one (a program that does not call the step
        API), the newest completion among the attempt's ``PROGRESS_WINDOW`` newest
        collective entries; without one either (gloo's ring may record no completion), the
        newest collective entry. None when the attempt shows no progress at all by then.

        One index lookup on steps and one bounded index range on collectives, however
        many rows the attempt has."""
        st = Step.__table__.c
        c = Collective.__table__.c
        with self._tx(write=False) as s:
            step_end = s.scalar(select(st.end_ns).where(
                st.job_id == job_id, st.attempt == attempt, st.end_ns <= before_ns)
                .order_by(st.end_ns.desc()).limit(1))
            if step_end is not None:
                return int(step_end)
            newest = (select(c.enter_ns, c.exit_ns)
                      .where(c.job_id == job_id, c.attempt == attempt, c.enter_ns <= before_ns)
                      .order_by(c.enter_ns.desc()).limit(self.PROGRESS_WINDOW).subquery())
            done, entered = s.execute(select(
                func.max(case((newest.c.exit_ns <= before_ns, newest.c.exit_ns))),
                func.max(newest.c.enter_ns))).one()
        progress = done if done is not None else entered
        return None if progress is None else int(progress)

    def collectives(self, job_id: str, attempt: int | None = None, rank: int | None = None,
                    group: str | None = None) -> list[CollectiveRecord]:
        """Collectives ordered by attempt, rank, group, seq."""
        c = Collective.__table__.c
        stmt = select(*_collective_columns()).where(c.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(c.attempt == attempt)
        if rank is not None:
            stmt = stmt.where(c.rank == rank)
        if group is not None:
            stmt = stmt.where(c.group_name == group)
        stmt = stmt.order_by(c.attempt, c.rank, c.group_name, c.seq)
        with self._tx(write=False) as s:
            return [_collective_record(r) for r in s.execute(stmt).all()]

    def process_groups(self, job_id: str, attempt: int | None = None, *, ranks: Sequence[int] | None = None,
                       groups: Sequence[str] | None = None) -> list[ProcessGroupRecord]:
        """Process groups as the ranks declared them (the rows of ``ranks`` and/or
        ``groups`` only, when given: their member lists are the only ones parsed), ordered
        by attempt, group, rank."""
        stmt = select(ProcessGroupRow).where(ProcessGroupRow.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(ProcessGroupRow.attempt == attempt)
        if ranks is not None:
            stmt = stmt.where(ProcessGroupRow.rank.in_(list(ranks)))
        if groups is not None:
            stmt = stmt.where(ProcessGroupRow.group_name.in_(list(groups)))
        stmt = stmt.order_by(ProcessGroupRow.attempt, ProcessGroupRow.group_name, ProcessGroupRow.rank)
        with self._tx(write=False) as s:
            return [ProcessGroupRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank, group=r.group_name,
                                       desc=r.desc, ranks=tuple(json.loads(r.ranks)))
                    for r in s.scalars(stmt)]

    def collective_summary(self, job_id: str,
                           attempt: int | None = None) -> list[CollectiveSummary]:
        """One aggregate per (attempt, rank, group), computed in SQL."""
        c = Collective.__table__.c
        done = c.state == "completed"
        keys = (c.attempt, c.rank, c.group_name)
        where: list[Any] = [c.job_id == job_id]
        if attempt is not None:
            where.append(c.attempt == attempt)
        # only measured durations: an estimated exit (gloo's native entries) is when a poll
        # saw the op done, not when it finished, so exit - enter is no duration
        measured = done & (c.duration_ns > 0)
        agg = (select(*keys, func.count(), func.min(c.seq), func.max(c.seq),
                      func.sum(case((done, 1), else_=0)),
                      func.max(case((done, c.seq))),
                      func.avg(case((measured, c.duration_ns))),
                      func.sum(case((measured, 1), else_=0)))
               .where(*where).group_by(*keys).order_by(*keys))
        per_op = select(*keys, c.op, func.count()).where(*where).group_by(*keys, c.op)
        sources = select(*keys, c.timing).where(*where, measured).group_by(*keys, c.timing)
        with self._tx(write=False) as s:
            ops: dict[tuple, dict[str, int]] = {}
            for a, r, g, op, n in s.execute(per_op):
                ops.setdefault((a, r, g), {})[op] = n
            timings: dict[tuple, list[str]] = {}
            for a, r, g, t in s.execute(sources):
                timings.setdefault((a, r, g), []).append(Timing.from_wire(t or 0).value)
            out = []
            for a, r, g, n, first, last, completed, last_done, mean_ns, n_measured in s.execute(agg):
                out.append(CollectiveSummary(
                    attempt=a, rank=r, group=g, count=n, first_seq=first, last_seq=last,
                    consecutive=n == last - first + 1, completed=int(completed or 0),
                    last_completed_seq=last_done, ops=ops.get((a, r, g), {}),
                    mean_duration_ms=None if mean_ns is None else float(mean_ns) / 1e6,
                    measured=int(n_measured or 0), timings=tuple(sorted(timings.get((a, r, g), ()))),
                ))
            return out

    def worker_status(self, job_id: str, attempt: int | None = None) -> list[WorkerStatusRecord]:
        """Worker status changes ordered by attempt, time, rank."""
        stmt = select(WorkerStatusRow).where(WorkerStatusRow.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(WorkerStatusRow.attempt == attempt)
        stmt = stmt.order_by(WorkerStatusRow.attempt, WorkerStatusRow.time_ns,
                             WorkerStatusRow.rank, WorkerStatusRow.id)
        with self._tx(write=False) as s:
            return [WorkerStatusRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank,
                                       state=r.state, time_ns=r.time_ns, pid=r.pid,
                                       hostname=r.hostname, restored_step=r.restored_step,
                                       detail=r.detail, phase_s=r.phase_s, phase=r.phase or "")
                    for r in s.scalars(stmt)]

    # -- SDC checks and ingest drops ------------------------------------------------------

    def record_sdc_check(self, job_id: str, attempt: int, step: int, kind: str, value: str,
                         expected: str, ok: bool, detail: str = "", rank: int | None = None,
                         node: str | None = None, time_ns: int | None = None) -> int:
        """Store one SDC check (``rank`` None for a node-level check); return its id.

        ``time_ns`` defaults to now."""
        if kind not in SDC_KINDS:
            raise ValueError(f"SDC check kind {kind!r} not in {sorted(SDC_KINDS)}")
        with self._tx(write=True) as s:
            self._job(s, job_id)  # sdc_checks, like all telemetry, has no foreign key
            row = SdcCheck(job_id=job_id, attempt=attempt, rank=rank, node=node, step=step,
                           kind=kind, value=value, expected=expected, ok=ok, detail=detail,
                           time_ns=time.time_ns() if time_ns is None else time_ns)
            s.add(row)
            s.flush()
            return row.id

    def sdc_checks(self, job_id: str, attempt: int | None = None, *,
                   kind: str | None = None) -> list[SdcCheckRecord]:
        """The job's SDC checks (only ``kind`` ones when given) ordered by attempt, step,
        then as recorded."""
        stmt = select(SdcCheck).where(SdcCheck.job_id == job_id)
        if attempt is not None:
            stmt = stmt.where(SdcCheck.attempt == attempt)
        if kind is not None:
            stmt = stmt.where(SdcCheck.kind == kind)
        stmt = stmt.order_by(SdcCheck.attempt, SdcCheck.step, SdcCheck.id)
        with self._tx(write=False) as s:
            return [SdcCheckRecord(id=r.id, job_id=r.job_id, attempt=r.attempt, rank=r.rank,
                                   node=r.node, step=r.step, kind=r.kind, value=r.value,
                                   expected=r.expected, ok=bool(r.ok), detail=r.detail,
                                   time_ns=r.time_ns)
                    for r in s.scalars(stmt)]

    def record_drop(self, agent_id: str, node: str, epoch: int, first_seq: int, last_seq: int,
                    events: int, reason: str, source: str) -> int:
        """Record events lost before the store; return the row's id.

        ``source``: "agent" (the agent lost them, e.g. its spill disk was full) or
        "controller" (the controller refused a malformed batch). A report of batches
        already recorded (an agent resends a DropReport whose stream broke) returns the
        existing row's id."""
        if source not in DROP_SOURCES:
            raise ValueError(f"drop source {source!r} not in {sorted(DROP_SOURCES)}")
        with self._tx(write=True) as s:
            if first_seq > 0:
                known = s.scalar(select(IngestDrop.id).where(
                    IngestDrop.agent_id == agent_id, IngestDrop.epoch == epoch,
                    IngestDrop.first_seq == first_seq, IngestDrop.last_seq == last_seq,
                    IngestDrop.source == source))
                if known is not None:
                    return known
            row = IngestDrop(agent_id=agent_id, node=node, epoch=epoch, first_seq=first_seq,
                             last_seq=last_seq, events=events, reason=reason, source=source,
                             at=time.time())
            s.add(row)
            s.flush()
            return row.id

    def ingest_drops(self, node: str | None = None) -> list[IngestDropRecord]:
        """Recorded drops (of ``node``, or all), oldest first."""
        stmt = select(IngestDrop)
        if node is not None:
            stmt = stmt.where(IngestDrop.node == node)
        with self._tx(write=False) as s:
            return [IngestDropRecord(id=r.id, agent_id=r.agent_id, node=r.node, epoch=r.epoch,
                                     first_seq=r.first_seq, last_seq=r.last_seq,
                                     events=r.events, reason=r.reason, source=r.source,
                                     at=r.at)
                    for r in s.scalars(stmt.order_by(IngestDrop.at, IngestDrop.id))]

    # -- collective fronts (large jobs) ----------------------------------------------------

    def record_fronts(self, rows: Sequence[FrontRow]) -> None:
        """Write fronts (one per (job, attempt, rank, group); a stored front further on is
        kept). One transaction."""
        # the last row of a key wins within one call; PostgreSQL refuses a key twice
        unique = {(r.job_id, r.attempt, r.rank, r.group): r for r in rows}
        with self._tx(write=True) as s:
            ingest.write_fronts(s, [
                (r.job_id, r.attempt, r.rank, r.group, r.group_size, r.entered_seq, r.completed_seq,
                 r.entered_ns, r.completed_ns, r.op, r.signature, r.step) for r in unique.values()])

    def fronts(self, job_id: str, attempt: int, *, ranks: Sequence[int] | None = None,
               groups: Sequence[str] | None = None, offset: int = 0,
               limit: int | None = None) -> list[FrontRow]:
        """The stored fronts of an attempt, ordered by rank and group (``entered``, the
        per-report count, is not stored: 0). ``offset``/``limit`` page through them."""
        c = CollectiveFront.__table__.c
        stmt = select(c.job_id, c.attempt, c.rank, c.group_name, c.group_size, c.entered_seq, c.completed_seq,
                      c.entered_ns, c.completed_ns, c.op, c.signature, c.step, literal(0)
                      ).where(c.job_id == job_id, c.attempt == attempt)
        if ranks is not None:
            stmt = stmt.where(c.rank.in_(list(ranks)))
        if groups is not None:
            stmt = stmt.where(c.group_name.in_(list(groups)))
        stmt = stmt.order_by(c.rank, c.group_name).offset(offset)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._tx(write=False) as s:
            make = FrontRow._make   # positional: the columns above are FrontRow's fields
            return [make(r) for r in s.execute(stmt).all()]

    def count_fronts(self, job_id: str, attempt: int) -> int:
        """How many fronts an attempt has stored (0: it sent every collective instead)."""
        c = CollectiveFront.__table__.c
        with self._tx(write=False) as s:
            return s.scalar(select(func.count()).select_from(CollectiveFront.__table__)
                            .where(c.job_id == job_id, c.attempt == attempt))

    # -- live diagnosis -------------------------------------------------------------------

    #: Most process groups ``recent_collectives`` reads of one attempt.
    RECENT_GROUPS_MAX = 4096

    def recent_collectives(self, job_id: str, attempt: int, per_group: int,
                           groups: Sequence[str] | None = None) -> list[CollectiveRecord]:
        """The newest collectives of an attempt, for a live diagnosis: in every group (or
        only ``groups``), those within ``per_group`` sequence numbers of the group's
        highest, plus the last one of each declared member that is further behind.
        Ordered by rank, group, seq.

        Index lookups only: a few per group and per lagging member, and ``per_group``
        rows per group and member, however many collectives the attempt has stored."""
        c = Collective.__table__.c
        cols = _collective_columns()
        base = (c.job_id == job_id, c.attempt == attempt)
        with self._tx(write=False) as s:
            only = groups
            groups = []
            while only is None and len(groups) < self.RECENT_GROUPS_MAX:  # a skip scan over the group index
                stmt = select(func.min(c.group_name)).where(*base)
                name = s.scalar(stmt.where(c.group_name > groups[-1]) if groups else stmt)
                if name is None:
                    break
                groups.append(name)
            if only is not None:
                groups = sorted(set(only))
            members: dict[str, set[int]] = {}
            declared = select(ProcessGroupRow).where(ProcessGroupRow.job_id == job_id,
                                                     ProcessGroupRow.attempt == attempt)
            if only is not None:
                declared = declared.where(ProcessGroupRow.group_name.in_(groups))
            for g in s.scalars(declared):
                members.setdefault(g.group_name, set()).update(json.loads(g.ranks))
            rows = []
            for g in groups:
                top = s.scalar(select(func.max(c.seq)).where(*base, c.group_name == g))
                if top is None:
                    continue
                window = s.execute(select(*cols).where(*base, c.group_name == g,
                                                   c.seq > top - per_group)).all()
                rows += window
                behind = members.get(g, set()) - {r.rank for r in window}
                for rank in sorted(behind):
                    last = s.execute(select(*cols).where(*base, c.rank == rank, c.group_name == g)
                                     .order_by(c.seq.desc()).limit(1)).first()
                    if last is not None:
                        rows.append(last)
        rows.sort(key=lambda r: (r.rank, r.group_name, r.seq))
        return [_collective_record(r) for r in rows]

    # -- a large job's replay (``fleet replay`` of an attempt with fronts) -----------------
    # Narrow, bounded reads: aggregates computed in SQL, JSON member lists parsed only for
    # the groups asked for, nodes only of the ranks asked for; nothing per rank in Python.

    def count_fronts_of(self, job_id: str, attempt: int, *, ranks: Sequence[int] | None = None,
                        groups: Sequence[str] | None = None) -> int:
        """How many fronts ``fronts(job_id, attempt, ranks=, groups=)`` holds, over all pages."""
        c = CollectiveFront.__table__.c
        stmt = (select(func.count()).select_from(CollectiveFront.__table__)
                .where(c.job_id == job_id, c.attempt == attempt))
        if ranks is not None:
            stmt = stmt.where(c.rank.in_(list(ranks)))
        if groups is not None:
            stmt = stmt.where(c.group_name.in_(list(groups)))
        with self._tx(write=False) as s:
            return int(s.scalar(stmt) or 0)

    def _front_group_stats(self, job_id: str, attempt: int, groups: Sequence[str] | None = None):  # noqa: ANN202
        """Per group of the attempt's fronts (no join: a fresh table without statistics would
        get a nested loop): fronts, seq range, open, behind, oldest open entry, ops."""
        f = CollectiveFront.__table__.c
        where = [f.job_id == job_id, f.attempt == attempt]
        if groups is not None:
            where.append(f.group_name.in_(list(groups)))
        q = (select(f.group_name, f.entered_seq, f.entered_ns, f.op,
                    case((f.entered_seq > f.completed_seq, 1), else_=0).label("is_open"),
                    func.max(f.entered_seq).over(partition_by=f.group_name).label("top"))
             .where(*where).subquery())
        return (select(q.c.group_name, func.count(), func.min(q.c.entered_seq), func.max(q.c.entered_seq),
                       func.sum(q.c.is_open), func.sum(case((q.c.entered_seq < q.c.top, 1), else_=0)),
                       func.min(case((q.c.is_open == 1, q.c.entered_ns))), func.count(func.distinct(q.c.op)))
                .group_by(q.c.group_name).order_by(q.c.group_name))

    def _group_descs(self, s: Any, job_id: str, attempt: int, groups: Sequence[str] | None) -> dict[str, str]:
        p = ProcessGroupRow.__table__.c
        stmt = select(p.group_name, func.max(p.desc)).where(p.job_id == job_id, p.attempt == attempt)
        if groups is not None:
            stmt = stmt.where(p.group_name.in_(list(groups)))
        return {g: d or "" for g, d in s.execute(stmt.group_by(p.group_name))}

    @staticmethod
    def _group_stat(row: Any, desc: str) -> dict[str, Any]:
        g, n, lo, hi, o, b, t, ops = row
        return {"group": g, "desc": desc, "fronts": int(n), "min_seq": int(lo), "top_seq": int(hi),
                "open": int(o or 0), "behind": int(b or 0), "oldest_open_ns": None if t is None else int(t),
                "ops": int(ops)}

    def front_kinds(self, job_id: str, attempt: int) -> dict[str, Any]:
        """The whole attempt's fronts in a few numbers: ``ranks`` (with a front), ``waiting``
        (ranks with an open front: entered, not completed), and ``kinds``, one dict per
        group description (``desc``, "" for groups nobody declared): ``groups``,
        ``fronts``, ``open`` (fronts), ``behind`` (fronts below their group's newest seq),
        ``oldest_open_ns`` (the earliest entry of an open front; None without one)."""
        f = CollectiveFront.__table__.c
        where = (f.job_id == job_id, f.attempt == attempt)
        kinds: dict[str, dict[str, Any]] = {}
        with self._tx(write=False) as s:
            ranks = s.scalar(select(func.count(func.distinct(f.rank))).where(*where))
            waiting = s.scalar(select(func.count(func.distinct(f.rank)))
                               .where(*where, f.entered_seq > f.completed_seq))
            descs = self._group_descs(s, job_id, attempt, None)
            for row in s.execute(self._front_group_stats(job_id, attempt)):
                g = self._group_stat(row, descs.get(row[0], ""))
                k = kinds.setdefault(g["desc"], {"desc": g["desc"], "groups": 0, "fronts": 0, "open": 0,
                                                 "behind": 0, "oldest_open_ns": None})
                k["groups"] += 1
                for key in ("fronts", "open", "behind"):
                    k[key] += g[key]
                if g["oldest_open_ns"] is not None:
                    k["oldest_open_ns"] = min(k["oldest_open_ns"] or g["oldest_open_ns"], g["oldest_open_ns"])
        return {"ranks": int(ranks or 0), "waiting": int(waiting or 0), "kinds": [kinds[d] for d in sorted(kinds)]}

    def front_groups(self, job_id: str, attempt: int, *, groups: Sequence[str] | None = None,
                     offset: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        """Per process group of the attempt (ordered by name; ``offset``/``limit`` page): its
        ``desc``, ``fronts``, lowest and newest ``entered_seq`` (``min_seq``, ``top_seq``),
        ``open`` fronts, fronts ``behind`` the newest seq, ``oldest_open_ns`` and ``ops``
        (distinct ops entered), computed in SQL."""
        stmt = self._front_group_stats(job_id, attempt, groups).offset(offset)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._tx(write=False) as s:
            rows = s.execute(stmt).all()
            descs = self._group_descs(s, job_id, attempt, [r[0] for r in rows]) if rows else {}
        return [self._group_stat(r, descs.get(r[0], "")) for r in rows]

    def count_front_groups(self, job_id: str, attempt: int) -> int:
        """How many process groups the attempt's fronts cover (``front_groups``' rows)."""
        c = CollectiveFront.__table__.c
        with self._tx(write=False) as s:
            return int(s.scalar(select(func.count(func.distinct(c.group_name)))
                                .where(c.job_id == job_id, c.attempt == attempt)) or 0)

    def group_members(self, job_id: str, attempt: int, groups: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """The declared members of each of ``groups`` (one member's declaration read per group;
        a group nobody declared is absent)."""
        p = ProcessGroupRow.__table__.c
        # one probe of the (job, attempt, group, rank) index per group: a group's first
        # declaration, whatever the attempt's size
        stmt = (select(p.ranks).where(p.job_id == job_id, p.attempt == attempt, p.group_name == bindparam("g"))
                .order_by(p.rank).limit(1))
        out: dict[str, tuple[int, ...]] = {}
        with self._tx(write=False) as s:
            for g in dict.fromkeys(groups):
                text = s.execute(stmt, {"g": g}).scalar()
                if text is not None:
                    out[g] = tuple(json.loads(text))
        return out

    def pulled_ranks(self, job_id: str, attempt: int) -> dict[str, set[int]]:
        """Per group (``:p2p`` groups under their group's name), the ranks with stored
        collectives in the attempt: of a large job, the raw entries the controller pulled."""
        c = Collective.__table__.c
        out: dict[str, set[int]] = {}
        with self._tx(write=False) as s:
            for g, r in s.execute(select(c.group_name, c.rank).where(c.job_id == job_id, c.attempt == attempt)
                                  .group_by(c.group_name, c.rank)):
                out.setdefault(g.removesuffix(":p2p"), set()).add(int(r))
        return out

    def collectives_of(self, job_id: str, attempt: int, groups: Sequence[str]) -> list[CollectiveRecord]:
        """The stored collectives of ``groups`` (and their ``:p2p`` groups), ordered by rank,
        group, seq."""
        c = Collective.__table__.c
        names = sorted({n for g in groups for n in (g, f"{g}:p2p")})
        stmt = (select(*_collective_columns()).where(c.job_id == job_id, c.attempt == attempt,
                                                   c.group_name.in_(names))
                .order_by(c.rank, c.group_name, c.seq))
        with self._tx(write=False) as s:
            return [_collective_record(r) for r in s.execute(stmt).all()]

    def rank_nodes(self, job_id: str, attempt: int, ranks: Sequence[int]) -> dict[int, str]:
        """The node of each of ``ranks`` that the attempt placed (others absent)."""
        from fleet.controlplane.store.schema import Rank

        if not ranks:
            return {}
        r = Rank.__table__.c
        with self._tx(write=False) as s:
            return {int(rank): node for rank, node in s.execute(
                select(r.rank, r.node).where(r.job_id == job_id, r.attempt == attempt,
                                             r.rank.in_(sorted(set(ranks)))))}

    def count_declared_ranks(self, job_id: str, attempt: int) -> int:
        """How many ranks of the attempt declared a process group (an index range)."""
        g = ProcessGroupRow.__table__.c
        with self._tx(write=False) as s:
            return int(s.scalar(select(func.count(func.distinct(g.rank)))
                                .where(g.job_id == job_id, g.attempt == attempt)) or 0)

    def count_ranks(self, job_id: str, attempt: int) -> int:
        """How many ranks the attempt placed."""
        from fleet.controlplane.store.schema import Rank

        r = Rank.__table__.c
        with self._tx(write=False) as s:
            return int(s.scalar(select(func.count()).select_from(Rank.__table__)
                                .where(r.job_id == job_id, r.attempt == attempt)) or 0)

    def step_aggregates(self, job_id: str, attempt: int, last: int = 0) -> tuple[int, list[dict[str, Any]]]:
        """(steps recorded, the newest ``last`` of them, 0 = all): per step, computed in SQL,
        ``ranks``, mean ``loss``, ``step_time_s_mean`` and ``_max``, ``slowest_rank``,
        ``tokens_per_s`` (sum), mean ``grad_norm``, ``lr``, ``aux_loss`` and ``mfu``, and
        ``imbalanced_ranks`` (ranks with an imbalanced MoE layer). Index range only."""
        st = Step.__table__.c
        where = [st.job_id == job_id, st.attempt == attempt]
        postgres = self.dialect == "postgresql"
        with self._tx(write=False) as s:
            hi = s.execute(select(func.max(st.step)).where(*where)).scalar()   # an index probe
            if hi is None:
                return 0, []
            # distinct steps from the (job, attempt, step) index alone
            n = s.execute(select(func.count()).select_from(
                select(st.step).where(*where).distinct().subquery())).scalar()
            if last:
                where.append(st.step > hi - last)  # step numbers count up by one: the newest `last`
            cols = [st.step, func.count(), func.avg(st.loss), func.avg(st.step_time_s),
                    func.max(st.step_time_s), func.sum(st.tokens_per_s), func.avg(st.grad_norm),
                    func.avg(st.lr), func.avg(st.aux_loss), func.avg(st.mfu),
                    func.sum(case((st.imbalanced, 1), else_=0))]
            if postgres:
                # the slowest rank in the same pass: arrays compare element by element, so the
                # greatest [step_time_s, -rank] is the slowest step time's lowest rank
                cols.append(func.max(postgresql.array([st.step_time_s, -cast(st.rank, Float)])))
            agg = select(*cols).where(*where).group_by(st.step).order_by(st.step)
            rows = s.execute(agg).all()
            if postgres:
                slow = {row[0]: int(-row[-1][1]) for row in rows}
                rows = [row[:-1] for row in rows]
            else:
                top = agg.with_only_columns(st.step, func.max(st.step_time_s).label("t")).order_by(None).subquery()
                slow = dict(s.execute(select(st.step, func.min(st.rank))
                                      .join(top, (top.c.step == st.step) & (top.c.t == st.step_time_s))
                                      .where(*where).group_by(st.step)).all())
        return int(n), [
            {"step": int(step), "ranks": int(k), "loss": float(loss), "step_time_s_mean": float(mean),
             "step_time_s_max": float(mx), "slowest_rank": int(slow.get(step, -1)),
             "tokens_per_s": float(tok or 0), "grad_norm": float(gn or 0), "lr": float(lr or 0),
             "aux_loss": float(aux or 0), "mfu": float(mfu or 0), "imbalanced_ranks": int(imb or 0)}
            for step, k, loss, mean, mx, tok, gn, lr, aux, mfu, imb in rows]

    def kept_step_time(self, job_id: str, attempt: int, up_to: int | None = None) -> float:
        """Seconds of ``attempt``'s steps (each its slowest rank's ``step_time_s``) up to step
        ``up_to`` (None: all): `fleet report`'s productive time of an attempt whose steps
        above ``up_to`` a later restore threw away. Summed in SQL over an index range."""
        st = Step.__table__.c
        where = [st.job_id == job_id, st.attempt == attempt]
        if up_to is not None:
            where.append(st.step <= up_to)
        per_step = select(func.max(st.step_time_s).label("t")).where(*where).group_by(st.step).subquery()
        with self._tx(write=False) as s:
            return float(s.scalar(select(func.sum(per_step.c.t))) or 0.0)

    def job_nodes(self, job_id: str, attempt: int | None = None) -> set[str]:
        """The nodes the job's ranks were placed on (in ``attempt``, or any)."""
        from fleet.controlplane.store.schema import Rank

        r = Rank.__table__.c
        stmt = select(r.node).where(r.job_id == job_id).distinct()
        if attempt is not None:
            stmt = stmt.where(r.attempt == attempt)
        with self._tx(write=False) as s:
            return set(s.scalars(stmt))

    def declared_group_names(self, job_id: str, attempt: int) -> list[dict[str, str]]:
        """Each process group the attempt's ranks declared, once: {"group", "desc"} (no
        member list read), ordered by group."""
        p = ProcessGroupRow.__table__.c
        stmt = (select(p.group_name, func.max(p.desc)).where(p.job_id == job_id, p.attempt == attempt)
                .group_by(p.group_name).order_by(p.group_name))
        with self._tx(write=False) as s:
            return [{"group": g, "desc": d or ""} for g, d in s.execute(stmt)]
