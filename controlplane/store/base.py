"""The shared base of the Store: engine, session factories, transactions and lookups.

``StoreBase`` owns what every domain's methods need: the engine pair built by
``engine.make_engine``, the pooled read and write sessionmakers, ``_tx`` (one short
transaction per call, with OperationalError mapped to ``UnavailableError``), the
``dialect`` name for upserts, and ``_job``, the locked-or-not job lookup that several
domains check against. The domain mixins (``jobs``, ``nodes``, ``telemetry``,
``incidents``) subclass it and ``store.Store`` combines them.

Invariants:
- Every method runs in its own short transaction from a pooled sessionmaker, so one
  Store is safe to share between threads (gRPC server threads and the controller).
- In-memory SQLite has one shared connection, so its transactions are serialized.
- Opening a Store brings its schema to the newest migration (``migrate.upgrade``).
- A closed Store refuses every call with ``StateError``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Self

from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from fleet.controlplane.errors import FleetError, NotFoundError, StateError, UnavailableError
from fleet.controlplane.store import migrate
from fleet.controlplane.store.engine import make_engine, redact
from fleet.controlplane.store.schema import Job


class StoreBase:
    """The engine, sessions and transaction helper shared by the Store's domain mixins."""

    def __init__(self, url: str) -> None:
        self._shown_url = redact(url)
        self._engine, write_engine, single_connection = make_engine(url)
        # In-memory SQLite has one shared connection: one transaction at a time.
        self._serial: AbstractContextManager[Any] = (
            threading.Lock() if single_connection else nullcontext())
        self._read = sessionmaker(self._engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(write_engine, expire_on_commit=False)
        self._closed = False
        try:
            # The store upgrades itself on first use; one query when already at head.
            migrate.upgrade(write_engine)
        except FleetError:
            self._engine.dispose()
            raise

    # -- plumbing -------------------------------------------------------------------------

    def close(self) -> None:
        """Release every pooled connection. Idempotent."""
        if not self._closed:
            self._closed = True
            self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    @contextmanager
    def _tx(self, write: bool) -> Iterator[Session]:
        if self._closed:
            raise StateError(f"store {self._shown_url!r} is closed")
        maker = self._write_sessions if write else self._read
        try:
            with self._serial, maker.begin() as session:
                yield session
        except OperationalError as e:
            raise UnavailableError(f"store {self._shown_url!r}: {e.orig}") from e

    def _job(self, s: Session, job_id: str, lock: bool = False) -> Job:
        stmt = select(Job).where(Job.id == job_id)
        job = s.scalars(stmt.with_for_update() if lock else stmt).one_or_none()
        if job is None:
            raise NotFoundError(f"job {job_id!r} not found")
        return job
