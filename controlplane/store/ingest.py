"""Turning agent batches into rows, and writing them inside the caller's transaction.

Ingest runs in two steps so that the expensive one can run off the writer thread:
``prepare(events)`` validates a batch and builds plain row tuples/dicts (no database),
``write(session, prepared)`` executes them. A batch that fails validation raises
``InvalidBatch`` naming what is wrong; nothing of it is written.

Collectives are the volume (tens of thousands per second per controller). They arrive as
``CollectiveColumns`` blocks, column by column, and become rows with ``zip`` over the
columns: no per-row Python code on the controller. Single ``CollectiveEvent``s are
packed into a block first (``fleet.proto.columns``), so both take the same path.
Rows go to the database through the DBAPI cursor with one ``INSERT ... ON CONFLICT``
statement: ``executemany`` on SQLite, which is the cost of a raw ``executemany``; on
PostgreSQL ``COPY`` into a staging table, then one ``INSERT ... SELECT``.

Row invariants:
- Collectives: one row per (job, attempt, rank, group, seq). A completion sets
  ``exit_ns``/``state``/``exit_estimated`` on an existing row; a "started" never
  overwrites a completion that arrived first (rows are applied in batch order, so a
  start and its completion in the same batch also end as one completed row).
- Steps, worker statuses, SDC checks: plain inserts (a batch is written at most once,
  which ``ingest_batches`` guarantees).
- Process groups: upserted on (job, attempt, rank, group); a re-send changes nothing.
- Op names become canonical here (``fleet.proto.vocab.canonical_op``): every producer's
  collectives pass through this one door, so stored rows and everything read from them
  speak one vocabulary, and nothing renames them on read.
- Checkpoints: upserted on (job, step), ``valid=True`` (a re-save of a step replaces it).
  A ``CheckpointEvent`` with ``invalid`` (rank 0 found the checkpoint failing manifest
  verification) clears ``valid`` of an existing row and records why as a
  ``ckpt_invalid`` action; the manifest on disk is the truth, the row follows it.
- A RESTORED worker status sets the attempt's ``restored_step``.
- Fronts (``CollectiveFronts``, a large job's summary of its collectives) are validated
  here but not written with their batch: ``IngestWriter`` keeps the newest front of every
  (job, attempt, rank, group) and writes them to ``collective_fronts`` every few seconds.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import insert, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from fleet.controlplane.errors import FleetError
from fleet.controlplane.store.engine import upsert
from fleet.controlplane.store.schema import (
    JOB_ID_LEN,
    NAME_LEN,
    PHASE_LEN,
    Action,
    Attempt,
    Checkpoint,
    ProcessGroupRow,
    WorkerStatusRow,
    metadata,
)
from fleet.controlplane.store.records import CKPT_INVALID, CollectiveRow, StatusRow, StepRow
from fleet.proto import columns, events_pb2, fronts
from fleet.proto.fronts import FrontRow
from fleet.proto.vocab import canonical_op

_STATUS_NAMES = events_pb2.WorkerStatus.State
_RESTORED = events_pb2.WorkerStatus.RESTORED
_dumps = json.JSONEncoder(separators=(",", ":")).encode

COLLECTIVE_STATES = frozenset({"started", "completed", "failed"})
SDC_KINDS = frozenset({"fingerprint", "trigger", "replay", "verdict", "gemm"})
OP_LEN = 64
STATE_LEN = 16

#: Collective columns in table order; ``write`` and the benchmark's raw limit use it.
COLLECTIVE_COLUMNS = (
    "job_id", "attempt", "rank", "group_name", "seq", "group_size", "op", "input_sizes",
    "input_dtypes", "output_sizes", "output_dtypes", "enter_ns", "exit_ns", "state",
    "exit_estimated", "step", "duration_ns", "timing",
)
_KEY = ("job_id", "attempt", "rank", "group_name", "seq")
_ON_COMPLETION = ("exit_ns", "state", "exit_estimated", "duration_ns", "timing")


class InvalidBatch(FleetError):
    """A batch that cannot be stored as sent (the reason names the field)."""


@dataclass
class PreparedBatch:
    """One batch's rows, ready to execute. ``events`` counts the events it came from
    (a ``CollectiveColumns`` block counts as its rows)."""

    events: int = 0
    collectives: list[tuple] = field(default_factory=list)
    steps: list[tuple] = field(default_factory=list)  # ``STEP_COLUMNS`` order
    statuses: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: dict[tuple, dict[str, Any]] = field(default_factory=dict)
    invalid_checkpoints: dict[tuple, dict[str, Any]] = field(default_factory=dict)
    groups: dict[tuple, dict[str, Any]] = field(default_factory=dict)
    sdc: list[dict[str, Any]] = field(default_factory=list)
    restored: list[tuple[str, int, int]] = field(default_factory=list)
    #: the validated ``CollectiveColumns`` blocks ``collectives`` came from, in order (single
    #: events packed into one): the same collectives column by column, with op names still as
    #: sent, for readers that work on whole columns (the metrics: numpy reads a block's
    #: columns at a few ns a value, where a pass over the rows costs ~30 ns a value)
    collective_blocks: list[events_pb2.CollectiveColumns] = field(default_factory=list)
    #: validated ``CollectiveFronts`` blocks (a large job's collectives, summarised): not
    #: written per batch; the writer keeps the newest per key and persists them periodically
    fronts: list[events_pb2.CollectiveFronts] = field(default_factory=list)

    # Typed views for readers outside the store package (the watchdog), so that no one
    # there indexes these rows by position or by column name.

    def step_rows(self) -> Iterator[StepRow]:
        """The batch's steps."""
        for job_id, attempt, rank, step, loss, step_time_s, tokens_per_s, end_ns, *_, expert_load in self.steps:
            yield StepRow(job_id, attempt, rank, step, end_ns, step_time_s, loss, tokens_per_s, expert_load)

    def collective_rows(self) -> Iterator[CollectiveRow]:
        """The batch's collectives, in batch order."""
        return map(CollectiveRow._make, self.collectives)

    def front_rows(self) -> Iterator[FrontRow]:
        """The batch's fronts, block by block."""
        return iter(fronts.merge(self.fronts).rows())

    def status_rows(self) -> Iterator[StatusRow]:
        """The batch's worker statuses."""
        for s in self.statuses:
            yield StatusRow(s["job_id"], s["attempt"], s["rank"], s["state"], s["time_ns"], s["phase"])


# -- collectives ----------------------------------------------------------------------------

#: Strings already checked to be a JSON list of shapes (or of dtype names); bounded.
_VALID_MAX = 8192
_VALID_SHAPES: set[str] = set()
_VALID_DTYPES: set[str] = set()


def _check_json(text: str, what: str, seen: set[str]) -> None:
    if text in seen:
        return
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidBatch(f"collectives.{what}: {text[:80]!r} is not JSON") from None
    if what.endswith("sizes"):
        ok = isinstance(value, list) and all(
            isinstance(s, list) and all(type(d) is int for d in s) for s in value)
    else:
        ok = isinstance(value, list) and all(isinstance(d, str) for d in value)
    if not ok:
        raise InvalidBatch(f"collectives.{what}: {text[:80]!r} is not a list of "
                           + ("shapes" if what.endswith("sizes") else "dtype names"))
    if len(seen) < _VALID_MAX:
        seen.add(text)


_INDEX_COLUMNS = ("job_id", "group", "op", "input_sizes", "input_dtypes", "output_sizes",
                  "output_dtypes", "state")
_VALUE_COLUMNS = ("attempt", "rank", "group_size", "seq", "enter_ns", "exit_ns", "step",
                  "exit_estimated")
_OPTIONAL_COLUMNS = ("duration_ns", "timing")
_TIMING_MAX = max(events_pb2.CollectiveTiming.values())
_LIMITS = {"job_id": JOB_ID_LEN, "group": NAME_LEN, "op": OP_LEN, "state": STATE_LEN}


def _column_rows(block: events_pb2.CollectiveColumns) -> list[tuple]:
    """Validate a columns block and return its rows (table column order)."""
    n = len(block.job_id)
    for name in _OPTIONAL_COLUMNS:  # an agent older than the column sends none: not measured
        if len(getattr(block, name)) not in (0, n):
            raise InvalidBatch(f"collectives.{name} has {len(getattr(block, name))} values, "
                               f"collectives.job_id has {n}")
    for name in _INDEX_COLUMNS + _VALUE_COLUMNS:
        if len(getattr(block, name)) != n:
            raise InvalidBatch(f"collectives.{name} has {len(getattr(block, name))} values, "
                               f"collectives.job_id has {n}")
    if n == 0:
        return []
    strings = list(block.strings)
    ops: dict[int, str] = {}  # string index -> canonical op: one lookup per distinct name
    for name in _INDEX_COLUMNS:
        used = set(getattr(block, name))
        if max(used) >= len(strings):
            raise InvalidBatch(f"collectives.{name}: index {max(used)} outside strings "
                               f"({len(strings)} entries)")
        if name == "op":
            ops = {i: canonical_op(strings[i]) for i in used}
            values = set(ops.values())
        else:
            values = {strings[i] for i in used}
        limit = _LIMITS.get(name)
        if limit is not None:
            longest = max(values, key=len)
            if len(longest) > limit:
                raise InvalidBatch(f"collectives.{name}: {longest[:80]!r} is longer than "
                                   f"{limit} characters")
            if "" in values and name != "group":
                raise InvalidBatch(f"collectives.{name}: empty string")
        if name == "state" and not values <= COLLECTIVE_STATES:
            raise InvalidBatch(f"collectives.state: {sorted(values - COLLECTIVE_STATES)} "
                               f"not in {sorted(COLLECTIVE_STATES)}")
        if name in ("input_sizes", "output_sizes"):
            for text in values:
                _check_json(text, name, _VALID_SHAPES)
        elif name in ("input_dtypes", "output_dtypes"):
            for text in values:
                _check_json(text, name, _VALID_DTYPES)
    durations, timings = _durations(block, n)
    get = strings.__getitem__
    return list(zip(
        map(get, block.job_id), block.attempt, block.rank, map(get, block.group), block.seq,
        block.group_size, map(ops.__getitem__, block.op), map(get, block.input_sizes),
        map(get, block.input_dtypes), map(get, block.output_sizes), map(get, block.output_dtypes),
        block.enter_ns, [x or None for x in block.exit_ns], map(get, block.state),
        block.exit_estimated, block.step, durations, timings,
    ))


def _durations(block: events_pb2.CollectiveColumns, n: int) -> tuple[Sequence[int | None], Sequence[int]]:
    """The block's measured durations (None: not measured) and their timing numbers,
    checked: a duration without a known source, or a negative one, is refused."""
    if not len(block.duration_ns):
        return [None] * n, [0] * n
    dur = np.asarray(block.duration_ns, dtype=np.int64)
    timing = np.asarray(block.timing, dtype=np.int64) if len(block.timing) else np.zeros(n, np.int64)
    if (dur < 0).any():
        raise InvalidBatch("collectives.duration_ns: a negative duration")
    if ((timing < 0) | (timing > _TIMING_MAX)).any():
        raise InvalidBatch(f"collectives.timing: a value outside 0..{_TIMING_MAX}")
    measured = (dur > 0) & (timing > 0)
    if not measured.any():
        return [None] * n, [0] * n
    return ([int(d) if m else None for d, m in zip(dur.tolist(), measured.tolist())],
            np.where(measured, timing, 0).tolist())


#: The columns ``_check_fronts`` bounds, and their rows in the packed layout.
_FRONT_CHECKED = ("job_id", "group", "op", "attempt", "rank", "group_size", "signature", "entered_seq",
                  "completed_seq")
_PACKED_CHECKED = np.array([fronts.PACKED_COLUMNS.index(c) for c in _FRONT_CHECKED])
_FRONT_STRING_LIMITS = (("job_id", JOB_ID_LEN), ("group", NAME_LEN), ("op", OP_LEN))
_SHORTEST_STRING_LIMIT = min(limit for _, limit in _FRONT_STRING_LIMITS)


def _check_fronts(block: events_pb2.CollectiveFronts) -> None:
    """Validate a fronts block (its columns readable, string indexes and lengths, seq
    order), column-wise: a large job sends thousands a second, so a packed block is
    bounded with one min and one max over its matrix, and its strings checked per column
    only when one of them could break a limit."""
    try:
        m = fronts.packed_matrix(block)
        col = fronts.columns(block) if m is None else None
    except fronts.BadBlock as exc:
        raise InvalidBatch(str(exc)) from None
    if m is not None:
        if not m.shape[1]:
            return
        checked = m[_PACKED_CHECKED]
        lo = dict(zip(_FRONT_CHECKED, checked.min(axis=1).tolist()))
        hi = dict(zip(_FRONT_CHECKED, checked.max(axis=1).tolist()))
        col = dict(zip(fronts.PACKED_COLUMNS, m))
    else:
        assert col is not None
        if not len(col["job_id"]):
            return
        lo = {name: int(col[name].min()) for name in _FRONT_CHECKED}
        hi = {name: int(col[name].max()) for name in _FRONT_CHECKED}
    strings = block.strings
    for name, _ in _FRONT_STRING_LIMITS:
        if lo[name] < 0 or hi[name] >= len(strings):
            bad = lo[name] if lo[name] < 0 else hi[name]
            raise InvalidBatch(f"fronts.{name}: index {bad} outside strings ({len(strings)} entries)")
    if "" in strings or max(map(len, strings)) > _SHORTEST_STRING_LIMIT:
        for name, limit in _FRONT_STRING_LIMITS:
            used = [lo[name]] if lo[name] == hi[name] else np.unique(col[name]).tolist()
            longest = max((strings[i] for i in used), key=len)
            if len(longest) > limit:
                raise InvalidBatch(f"fronts.{name}: {longest[:80]!r} is longer than {limit} characters")
            if name == "job_id" and "" in {strings[i] for i in used}:
                raise InvalidBatch("fronts.job_id: empty string")
    for name in ("attempt", "rank", "group_size", "signature"):
        if lo[name] < 0 or hi[name] >= 1 << 32:
            raise InvalidBatch(f"fronts.{name}: a value outside 0..2**32-1")
    if lo["entered_seq"] < 0 or lo["completed_seq"] < 0:
        raise InvalidBatch("fronts: a negative seq")
    if (col["completed_seq"] > col["entered_seq"]).any():
        raise InvalidBatch("fronts: completed_seq above entered_seq")


_STAGE = "fleet_stage_collectives"


@functools.cache
def collective_upsert_sql(dialect_name: str) -> str:
    """The one statement collective rows go through.

    SQLite: one row per execution (``?`` parameters), run with ``executemany``.
    PostgreSQL: every row at once from the session's staging table, filled with ``COPY``
    (a per-row ``executemany`` costs a protocol round of work per row, twice the time)."""
    cols = ", ".join(COLLECTIVE_COLUMNS)
    keep = ", ".join(
        f"{c} = CASE WHEN excluded.state <> 'started' THEN excluded.{c} ELSE collectives.{c} END"
        for c in _ON_COMPLETION)
    if dialect_name == "sqlite":
        values = f"VALUES ({', '.join(['?'] * len(COLLECTIVE_COLUMNS))})"
    else:
        values = f"SELECT {cols} FROM {_STAGE}"
    return f"INSERT INTO collectives ({cols}) {values} ON CONFLICT ({', '.join(_KEY)}) DO UPDATE SET {keep}"


def _merged(rows: list[tuple]) -> list[tuple]:
    """``rows`` with one row per key, as applying them in order would leave it.

    One statement may not touch a row twice on PostgreSQL; a start and its completion
    in the same batch are common, so they are merged here first."""
    keys = [row[:len(_KEY)] for row in rows]
    if len(set(keys)) == len(keys):
        return rows
    state_at = COLLECTIVE_COLUMNS.index("state")
    changed = [COLLECTIVE_COLUMNS.index(c) for c in _ON_COMPLETION]
    out: dict[tuple, list] = {}
    for key, row in zip(keys, rows):
        have = out.get(key)
        if have is None:
            out[key] = list(row)
        elif row[state_at] != "started":
            for i in changed:
                have[i] = row[i]
    return [tuple(r) for r in out.values()]


@contextlib.contextmanager
def dbapi_cursor(session: Session, what: str) -> Iterator[tuple[Any, str]]:
    """The session connection's raw DBAPI cursor and dialect name, its errors translated as
    SQLAlchemy's own would be (``what`` names the statement). SQLAlchemy's per-row parameter
    handling costs more than the database does for the store's bulk writes."""
    dialect = session.get_bind().dialect
    cursor = session.connection().connection.dbapi_connection.cursor()
    try:
        yield cursor, dialect.name
    except dialect.loaded_dbapi.Error as e:
        raise DBAPIError.instance(what, None, e, dialect.loaded_dbapi.Error) from e
    finally:
        cursor.close()


def _copy_rows(cursor: Any, table: str, columns: Sequence[str], rows: Sequence[tuple]) -> None:
    with cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def _copy_upsert(session: Session, sql: str, table: str, stage: str, columns: Sequence[str],
                 rows: Sequence[tuple]) -> None:
    """Run one upsert statement over ``rows`` inside the caller's transaction:
    ``executemany`` of ``sql`` on SQLite; on PostgreSQL ``COPY`` into the session's staging
    table ``stage`` (shaped like ``table``), then ``sql`` once (it selects from ``stage``)."""
    with dbapi_cursor(session, sql) as (cursor, dialect_name):
        if dialect_name == "sqlite":
            cursor.executemany(sql, rows)
        else:
            cursor.execute(f"CREATE TEMP TABLE IF NOT EXISTS {stage} (LIKE {table}) ON COMMIT DELETE ROWS")
            _copy_rows(cursor, stage, columns, rows)
            cursor.execute(sql)


def _copy_insert(session: Session, table: str, columns: Sequence[str], rows: Sequence[tuple]) -> None:
    """Insert ``rows`` into ``table`` inside the caller's transaction: ``executemany`` on
    SQLite, ``COPY`` on PostgreSQL."""
    with dbapi_cursor(session, f"insert into {table}") as (cursor, dialect_name):
        if dialect_name == "sqlite":
            cursor.executemany(f"INSERT INTO {table} ({', '.join(columns)}) "
                               f"VALUES ({', '.join(['?'] * len(columns))})", rows)
        else:
            _copy_rows(cursor, table, columns, rows)


def _write_collectives(session: Session, rows: list[tuple]) -> None:
    dialect_name = session.get_bind().dialect.name
    _copy_upsert(session, collective_upsert_sql(dialect_name), "collectives", _STAGE, COLLECTIVE_COLUMNS,
                 rows if dialect_name == "sqlite" else _merged(rows))


FRONT_COLUMNS = ("job_id", "attempt", "rank", "group_name", "group_size", "entered_seq",
                 "completed_seq", "entered_ns", "completed_ns", "op", "signature", "step")
_FRONT_KEY = ("job_id", "attempt", "rank", "group_name")
_FRONT_STAGE = "fleet_stage_fronts"


@functools.cache
def front_upsert_sql(dialect_name: str) -> str:
    """The statement fronts go through: a row replaces the stored one of its (job, attempt,
    rank, group) unless that one is further on (a higher ``entered_seq``, or as high and
    completed further), so snapshots written out of order never move a front back."""
    cols = ", ".join(FRONT_COLUMNS)
    newer = ("(excluded.entered_seq > collective_fronts.entered_seq OR (excluded.entered_seq = "
             "collective_fronts.entered_seq AND excluded.completed_seq >= collective_fronts.completed_seq))")
    keep = ", ".join(f"{c} = CASE WHEN {newer} THEN excluded.{c} ELSE collective_fronts.{c} END"
                     for c in FRONT_COLUMNS if c not in _FRONT_KEY)
    if dialect_name == "sqlite":
        values = f"VALUES ({', '.join(['?'] * len(FRONT_COLUMNS))})"
    else:
        values = f"SELECT {cols} FROM {_FRONT_STAGE}"
    return (f"INSERT INTO collective_fronts ({cols}) {values} "
            f"ON CONFLICT ({', '.join(_FRONT_KEY)}) DO UPDATE SET {keep}")


def write_fronts(session: Session, rows: Sequence[tuple]) -> None:
    """Upsert front rows (``FRONT_COLUMNS`` order, one per key) inside the caller's
    transaction (``_copy_upsert``)."""
    if rows:
        _copy_upsert(session, front_upsert_sql(session.get_bind().dialect.name), "collective_fronts",
                     _FRONT_STAGE, FRONT_COLUMNS, rows)


# -- the rest -------------------------------------------------------------------------------

#: Step columns in ``PreparedBatch.steps`` order.
STEP_COLUMNS = ("job_id", "attempt", "rank", "step", "loss", "step_time_s", "tokens_per_s", "end_ns",
                "grad_norm", "lr", "mfu", "aux_loss", "imbalanced", "expert_load")


def _phase_name(phase: str) -> str:
    """A status's phase name, refused when it cannot be one (the worker checks names)."""
    if len(phase) > PHASE_LEN or not phase.isprintable():
        raise InvalidBatch(f"status.phase: {phase[:80]!r} is not a phase name (at most {PHASE_LEN} "
                           "printable characters)")
    return phase


def _step_row(ev: events_pb2.StepEvent) -> tuple:
    loads = ev.expert_load
    return (
        ev.job_id, ev.attempt, ev.rank, ev.step,
        # SQLite keeps no NaN (it stores NULL, which steps.loss refuses): a NaN loss is kept
        # as +inf, still not finite for every reader; the watchdog saw the NaN itself
        ev.loss if not math.isnan(ev.loss) else math.inf,
        ev.step_time_s, ev.tokens_per_s, ev.end_ns, ev.grad_norm, ev.lr, ev.mfu, ev.aux_loss,
        bool(loads) and any(x.imbalanced for x in loads),
        _dumps([{"layer": x.layer, "tokens_per_expert": list(x.tokens_per_expert),
                 "min_share": x.min_share, "max_share": x.max_share, "imbalanced": x.imbalanced}
                for x in loads]) if loads else "[]",
    )


def count_events(events: Sequence[events_pb2.Event]) -> int:
    """Events in a batch as the store counts them: a ``CollectiveColumns`` or
    ``CollectiveFronts`` block counts as its rows, any other event as one."""
    n = 0
    for e in events:
        kind = e.WhichOneof("kind")
        n += (len(e.collectives.job_id) if kind == "collectives" else
              fronts.rows_in(e.fronts) if kind == "fronts" else 1)
    return n


def prepare(events: Sequence[events_pb2.Event], counted: int | None = None) -> PreparedBatch:
    """Validate ``events`` and build their rows; ``InvalidBatch`` names the first problem.
    ``counted``: ``count_events(events)`` when the caller has it already."""
    out = PreparedBatch(events=count_events(events) if counted is None else counted)
    singles: list[events_pb2.CollectiveEvent] = []  # a run of single collectives, in order
    for i, event in enumerate(events):
        kind = event.WhichOneof("kind")
        try:
            if kind == "collective":
                singles.append(event.collective)
                continue
            if singles:
                _add_singles(out, singles, i)
            if kind == "collectives":
                out.collectives.extend(_column_rows(event.collectives))
                out.collective_blocks.append(event.collectives)
            elif kind == "fronts":
                _check_fronts(event.fronts)
                out.fronts.append(event.fronts)
            elif kind == "step":
                out.steps.append(_step_row(event.step))
            elif kind == "status":
                ev = event.status
                out.statuses.append({
                    "job_id": ev.job_id, "attempt": ev.attempt, "rank": ev.rank,
                    "state": _STATUS_NAMES.Name(ev.state), "time_ns": ev.time_ns, "pid": ev.pid,
                    "hostname": ev.hostname, "restored_step": ev.restored_step,
                    "detail": ev.detail, "phase_s": ev.phase_s, "phase": _phase_name(ev.phase),
                })
                if ev.state == _RESTORED:
                    out.restored.append((ev.job_id, ev.attempt, ev.restored_step))
            elif kind == "checkpoint" and event.checkpoint.invalid:
                ev = event.checkpoint
                out.invalid_checkpoints[(ev.job_id, ev.step)] = {
                    "job_id": ev.job_id, "attempt": ev.attempt, "step": ev.step,
                    "reason": ev.reason or "failed manifest verification",
                    "at": ev.time_ns / 1e9 if ev.time_ns else time.time()}
            elif kind == "checkpoint":
                ev = event.checkpoint
                # a re-save after an invalidation in the same batch is valid again;
                # invalidations are written after the saves, so the reverse order holds too
                out.invalid_checkpoints.pop((ev.job_id, ev.step), None)
                # Same (job, step) twice in one statement would make PostgreSQL refuse it.
                out.checkpoints[(ev.job_id, ev.step)] = {
                    "job_id": ev.job_id, "attempt": ev.attempt, "step": ev.step, "path": ev.path,
                    "manifest_sha256": ev.manifest_sha256, "save_s": ev.save_s, "valid": True,
                    "created_at": ev.time_ns / 1e9 if ev.time_ns else time.time(),
                }
            elif kind == "group":
                ev = event.group
                out.groups[(ev.job_id, ev.attempt, ev.rank, ev.group)] = {
                    "job_id": ev.job_id, "attempt": ev.attempt, "rank": ev.rank,
                    "group_name": ev.group, "desc": ev.desc, "ranks": _dumps(sorted(ev.ranks))}
            elif kind == "sdc":
                ev = event.sdc
                if ev.kind not in SDC_KINDS or len(ev.value) > NAME_LEN or len(ev.expected) > NAME_LEN:
                    raise InvalidBatch(f"sdc: kind must be one of {sorted(SDC_KINDS)} and value, "
                                       f"expected at most {NAME_LEN} characters")
                out.sdc.append({
                    "job_id": ev.job_id, "attempt": ev.attempt,
                    "rank": ev.rank if ev.rank >= 0 else None, "node": ev.node or None,
                    "step": ev.step, "kind": ev.kind, "value": ev.value,
                    "expected": ev.expected, "ok": ev.ok, "detail": ev.detail,
                    "time_ns": ev.time_ns,
                })
            # An empty Event (no kind set) carries nothing to store.
        except InvalidBatch as exc:
            raise InvalidBatch(f"event {i}: {exc}") from None
    if singles:
        _add_singles(out, singles, len(events))
    return out


def _add_singles(out: PreparedBatch, singles: list[events_pb2.CollectiveEvent], end: int) -> None:
    """Rows of the single CollectiveEvents just before event ``end``; clears ``singles``."""
    block = columns.pack(singles)
    try:
        rows = _column_rows(block)
    except InvalidBatch as exc:
        raise InvalidBatch(f"events {end - len(singles)}..{end - 1} (single collectives): "
                           f"{str(exc).replace('collectives.', 'collective.')}") from None
    out.collectives.extend(rows)
    out.collective_blocks.append(block)
    singles.clear()


def write(session: Session, batches: Sequence[PreparedBatch]) -> None:
    """Execute the rows of ``batches``, in order, through ``session`` (inside the caller's
    transaction). Call it once per transaction: on PostgreSQL the collectives of all
    batches go through the staging table in one statement."""
    dialect_name = session.get_bind().dialect.name
    collectives = list(itertools.chain.from_iterable(b.collectives for b in batches))
    if collectives:
        _write_collectives(session, collectives)
    # plain inserts and idempotent upserts: one statement each for all the batches (a
    # thousand agents' small batches must not cost a thousand statements)
    steps = list(itertools.chain.from_iterable(b.steps for b in batches))
    if steps:
        _copy_insert(session, "steps", STEP_COLUMNS, steps)
    groups = {k: v for b in batches for k, v in b.groups.items()}
    if groups:
        session.execute(
            upsert(dialect_name, ProcessGroupRow.__table__, ["job_id", "attempt", "rank", "group_name"],
                   {col: (lambda ex, col=col: ex[col]) for col in ("desc", "ranks")}),
            list(groups.values()))
    statuses = list(itertools.chain.from_iterable(b.statuses for b in batches))
    if statuses:
        session.execute(insert(WorkerStatusRow.__table__), statuses)
    for batch in batches:
        _write_other(session, dialect_name, batch)


def _write_other(session: Session, dialect_name: str, batch: PreparedBatch) -> None:
    """What must be applied batch by batch, in order (checkpoints, SDC checks, restores)."""
    if batch.checkpoints:
        cols = ["attempt", "path", "manifest_sha256", "save_s", "valid", "created_at"]
        session.execute(
            upsert(dialect_name, Checkpoint.__table__, ["job_id", "step"],
                   {col: (lambda ex, col=col: ex[col]) for col in cols}),
            list(batch.checkpoints.values()))
    for bad in batch.invalid_checkpoints.values():
        invalidate_checkpoint(session, bad["job_id"], bad["attempt"], bad["step"], bad["reason"], bad["at"])
    if batch.sdc:
        session.execute(insert(metadata.tables["sdc_checks"]), batch.sdc)
    for job_id, attempt, step in batch.restored:
        session.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)
                        .values(restored_step=step))


def invalidate_checkpoint(session: Session, job_id: str, attempt: int, step: int, reason: str,
                          at: float) -> bool:
    """Clear ``valid`` of checkpoint ``step`` of the job and record why (a ``ckpt_invalid``
    action of ``attempt``); False, and nothing written, when the store has no such row
    (e.g. a step directory that was never committed)."""
    res = session.execute(update(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
                          .values(valid=False))
    if res.rowcount == 0:
        return False
    session.add(Action(job_id=job_id, attempt=attempt, kind=CKPT_INVALID,
                       cause=f"checkpoint of step {step} invalid: {reason}", at=at))
    return True
