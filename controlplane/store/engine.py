"""Engine construction for the store: URL validation, SQLite pragmas, dialect upserts.

Supported backends: SQLite (default, file or in-memory) and PostgreSQL.

SQLite invariants: WAL journal, ``synchronous=NORMAL``, a 30 s busy timeout and foreign
keys on every connection. Write transactions start with ``BEGIN IMMEDIATE`` so that two
writers queue on the busy timeout instead of one failing at once with "database is
locked" when it upgrades a read snapshot to a write (the classic WAL deadlock); read
transactions use a plain deferred ``BEGIN`` and never block writers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Table, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.pool import StaticPool

from fleet.controlplane.errors import ConfigError

BUSY_TIMEOUT_S = 30.0
WRITE_OPTION = "fleet_write"
SUPPORTED_BACKENDS = ("sqlite", "postgresql")


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (also for URLs that do not parse)."""
    return re.sub(r"(://[^/:@]*:)[^/@]*@", r"\1***@", url)


#: What to do about a bad store URL (CLI errors show it after the message).
URL_HINT = "--store, FLEET_STORE or the cluster file's store.url name the store (in that order)"


def parse_url(url: str) -> URL:
    """Parse and validate a store URL; raise ``ConfigError`` naming it (password hidden)."""
    shown = redact(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as e:
        raise ConfigError(
            f"store URL {shown!r} is not a database URL "
            "(expected e.g. sqlite:///.fleet/fleet.db or postgresql://user@host/db)", hint=URL_HINT
        ) from e
    if parsed.get_backend_name() not in SUPPORTED_BACKENDS:
        raise ConfigError(
            f"store URL {shown!r}: unsupported database {parsed.get_backend_name()!r} "
            f"(supported: {', '.join(SUPPORTED_BACKENDS)})", hint=URL_HINT
        )
    return parsed


def _sqlite_file(url: URL) -> Path | None:
    db = url.database or ""
    if db in ("", ":memory:") or db.startswith("file:") or url.query.get("uri"):
        return None
    return Path(db)


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite store URL; None for other databases and in-memory SQLite."""
    parsed = parse_url(url)
    return _sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None


def make_engine(url: str) -> tuple[Engine, Engine, bool]:
    """Return ``(read_engine, write_engine, single_connection)`` sharing one pool.

    The write engine differs only on SQLite, where its transactions begin IMMEDIATE.
    ``single_connection`` is True for in-memory SQLite: every thread shares one DBAPI
    connection, so the caller must run one transaction at a time.
    """
    parsed = parse_url(url)
    shown = parsed.render_as_string(hide_password=True)
    kwargs: dict[str, Any] = {}
    is_sqlite = parsed.get_backend_name() == "sqlite"
    if is_sqlite:
        path = _sqlite_file(parsed)
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": BUSY_TIMEOUT_S}
        if path is None:
            # One shared connection, or each thread would see its own empty database.
            kwargs["poolclass"] = StaticPool
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"store URL {shown!r}: cannot create folder {path.parent}: {e}") from e
            kwargs.update(pool_size=8, max_overflow=8, pool_timeout=BUSY_TIMEOUT_S)
    else:
        kwargs.update(pool_size=8, max_overflow=8, pool_timeout=BUSY_TIMEOUT_S, pool_pre_ping=True)
    try:
        engine = create_engine(parsed, **kwargs)
    except (NoSuchModuleError, ImportError, ArgumentError, TypeError) as e:
        raise ConfigError(f"store URL {shown!r}: {e}") from e
    if is_sqlite:
        _install_sqlite_hooks(engine, wal=_sqlite_file(parsed) is not None)
    single = is_sqlite and _sqlite_file(parsed) is None
    return engine, engine.execution_options(**{WRITE_OPTION: True}), single


def _install_sqlite_hooks(engine: Engine, *, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module; "begin" below issues it.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if wal:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def upsert(dialect_name: str, table: Table, keys: list[str], update: dict[str, Any] | None):
    """``INSERT ... ON CONFLICT (keys) DO UPDATE SET update`` (or DO NOTHING if None).

    ``update`` values may be callables taking the ``excluded`` pseudo-table.
    """
    module = sqlite if dialect_name == "sqlite" else postgresql
    stmt = module.insert(table)
    if update is None:
        return stmt.on_conflict_do_nothing(index_elements=keys)
    set_ = {k: (v(stmt.excluded) if callable(v) else v) for k, v in update.items()}
    return stmt.on_conflict_do_update(index_elements=keys, set_=set_)
