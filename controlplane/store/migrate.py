"""Schema migrations of the store: Alembic, driven from code (no alembic.ini).

The store upgrades itself on first use (``Store.__init__`` calls ``upgrade``); ``fleet db
upgrade`` does the same on demand, and ``fleet db current`` only looks.

Invariants:
- At head, ``upgrade`` costs one query (the version row) and takes no lock.
- Otherwise the whole upgrade runs in one transaction under a lock, so two processes
  opening the same new store both succeed, one after the other: PostgreSQL takes a
  transaction-scoped advisory lock; SQLite begins IMMEDIATE and queues on the busy timeout.
  Both run DDL transactionally, so a failed upgrade leaves the store as it was.
- A store created before migrations existed (fleet's tables, no ``alembic_version``) is
  stamped ``BASELINE`` and upgraded, keeping its rows.
- A store at a revision this fleet does not know was written by a newer fleet: it is
  refused with ``ConfigError`` and nothing is touched.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, inspect, text
from sqlalchemy.exc import DBAPIError, OperationalError

from fleet.controlplane.errors import ConfigError, FleetError, UnavailableError
from fleet.controlplane.store.engine import BUSY_TIMEOUT_S, WRITE_OPTION, make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "alembic_version"
BASELINE = "0001"  # the schema that metadata.create_all made before migrations existed
# pg_advisory_xact_lock key (any constant shared by every fleet): "fleetdb" in ASCII.
_PG_LOCK_KEY = 0x666C656574_6462
_BUSY_RETRY_S = 0.02
#: What to do about a store that cannot be opened (CLI errors show it after the message).
_OPEN_HINT = ("is the database server up, and the URL right? "
              "--store, FLEET_STORE or the cluster file's store.url name it")

# What ``SchemaState.state`` can be.
EMPTY = "empty"  # no fleet tables: upgrade creates them
UNVERSIONED = "unversioned"  # fleet tables from before migrations: stamped BASELINE, then upgraded
BEHIND = "behind"  # a known revision older than head
AT_HEAD = "head"
UNKNOWN = "unknown"  # written by a newer fleet: refused


@dataclass(frozen=True)
class SchemaState:
    url: str  # password hidden
    current: str | None  # the stored revision; None when empty or unversioned
    head: str  # the newest revision this fleet knows
    state: str  # EMPTY | UNVERSIONED | BEHIND | AT_HEAD | UNKNOWN


def _config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The newest schema revision this fleet knows."""
    return _script().get_current_head()


def _known(revision: str) -> bool:
    return revision in {s.revision for s in _script().walk_revisions()}


def _shown(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


def _reason(e: DBAPIError) -> str:
    """The driver's message on one line (psycopg's spans several)."""
    return " ".join(str(e.orig).split())


@contextmanager
def _connect(engine: Engine) -> Iterator[Connection]:
    """A connection; ``UnavailableError`` naming the (redacted) URL when the database
    cannot be reached or fails under it."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            conn = engine.connect()
            break
        except OperationalError as e:
            # The first connections to a new SQLite file race to switch it to WAL (the
            # connect hook in engine.py); a loser gets SQLITE_BUSY at once, without the
            # busy timeout, and succeeds once the winner is done.
            if (getattr(e.orig, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY
                    and time.monotonic() < deadline):
                time.sleep(_BUSY_RETRY_S)
                continue
            raise UnavailableError(
                f"store {_shown(engine)!r}: cannot open: {_reason(e)}", hint=_OPEN_HINT) from e
    try:
        with conn:
            yield conn
    except OperationalError as e:
        raise UnavailableError(f"store {_shown(engine)!r}: {_reason(e)}", hint=_OPEN_HINT) from e


def _stored_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _has_fleet_tables(conn: Connection) -> bool:
    return inspect(conn).has_table("jobs")


def _state(engine: Engine, conn: Connection) -> SchemaState:
    current = _stored_revision(conn)
    if current is None:
        state = UNVERSIONED if _has_fleet_tables(conn) else EMPTY
    elif current == head():
        state = AT_HEAD
    else:
        state = BEHIND if _known(current) else UNKNOWN
    return SchemaState(url=_shown(engine), current=current, head=head(), state=state)


def _refuse_unknown(s: SchemaState) -> None:
    if s.state == UNKNOWN:
        raise ConfigError(
            f"store {s.url!r} is at schema revision {s.current!r}, which this fleet does not "
            f"know (its newest is {s.head!r}): a newer fleet wrote it; upgrade fleet to use "
            "this store")


def inspect_schema(engine: Engine) -> SchemaState:
    """Where the store's schema stands; reads only."""
    with _connect(engine.execution_options(**{WRITE_OPTION: False})) as conn:
        return _state(engine, conn)


def current(engine: Engine) -> str | None:
    """The store's schema revision; None when it has none (empty, or from before migrations)."""
    return inspect_schema(engine).current


def _fast_revision(engine: Engine) -> str | None:
    """The version row in one query; None when that query finds none (or no table)."""
    with _connect(engine) as conn:
        try:
            return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
        except DBAPIError:
            return None  # no version table; the locked path looks closer


def _check_baseline(conn: Connection, shown: str) -> None:
    """Refuse to stamp a pre-migration store that lacks a table or column of BASELINE:
    later revisions would fail on it halfway, or queries would."""
    expected = _baseline_columns()
    insp = inspect(conn)
    present = set(insp.get_table_names())
    missing = [t for t in sorted(expected) if t not in present]
    missing += [f"{t}.{c}" for t in sorted(expected) if t in present
                for c in sorted(expected[t] - {col["name"] for col in insp.get_columns(t)})]
    if missing:
        raise FleetError(
            f"store {shown!r} has fleet tables but no schema revision, and does not match the "
            f"first revision {BASELINE!r} (missing: {', '.join(missing)}); it was made by a "
            "development build of fleet: export what you need and start a new store")


@cache
def _baseline_columns() -> dict[str, frozenset[str]]:
    """Tables and columns of revision BASELINE, read from a scratch in-memory SQLite."""
    scratch = create_engine("sqlite://")
    try:
        with scratch.begin() as conn:
            command.upgrade(_config(conn), BASELINE)
            insp = inspect(conn)
            return {t: frozenset(c["name"] for c in insp.get_columns(t))
                    for t in insp.get_table_names() if t != VERSION_TABLE}
    finally:
        scratch.dispose()


def upgrade(engine: Engine) -> tuple[str | None, str]:
    """Bring the store's schema to head; return ``(from_revision, to_revision)``.

    ``from_revision`` is None for an empty store. Raises ``ConfigError`` for a store
    written by a newer fleet, ``UnavailableError`` when the database cannot be reached.
    """
    target = head()
    reader = engine.execution_options(**{WRITE_OPTION: False})
    found = _fast_revision(reader)
    if found == target:
        return target, target
    # SQLite: BEGIN IMMEDIATE (see engine.py), so concurrent upgraders queue here.
    writer = engine.execution_options(**{WRITE_OPTION: True})
    try:
        with _connect(writer) as conn, conn.begin():
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
            state = _state(engine, conn)  # again: another process may have upgraded meanwhile
            _refuse_unknown(state)
            if state.state == AT_HEAD:
                return target, target
            cfg = _config(conn)
            start = state.current
            if state.state == UNVERSIONED:
                _check_baseline(conn, state.url)
                command.stamp(cfg, BASELINE)
                start = BASELINE
            command.upgrade(cfg, "head")
    except DBAPIError as e:  # e.g. no right to create tables; OperationalError is mapped above
        raise FleetError(f"store {_shown(engine)!r}: cannot upgrade its schema to {target}: "
                         f"{_reason(e)}") from e
    return start, target


@contextmanager
def _engine_for(url: str) -> Iterator[Engine]:
    engine, _write, _single = make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


def upgrade_url(url: str) -> tuple[str | None, str]:
    """``upgrade`` the store at ``url`` (for ``fleet db upgrade``)."""
    with _engine_for(url) as engine:
        return upgrade(engine)


def inspect_url(url: str) -> SchemaState:
    """``inspect_schema`` of the store at ``url`` (for ``fleet db current``)."""
    with _engine_for(url) as engine:
        return inspect_schema(engine)
