"""Fixtures shared by every tier: nothing a test starts may outlive it.

``no_leaks`` (autouse) fails a test that leaves behind a child process or a ``fleet-``
thread, after a bounded wait for them to end; leaked children are then killed by PID so
later tests start clean. The session's PostgreSQL server is not a leak.

``store_url`` runs a test once per store backend: a fresh SQLite file, and a fresh
database on the session's real PostgreSQL server (``postgres_server``, started on first
use; a machine without PostgreSQL fails those tests, it never skips them).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.pg import PostgresServer, PostgresUnavailable

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# the CLI's stand-ins for --store, --state-dir and --cluster: a developer's own must not
# point the suite's commands (and the processes they start) at their store or controller
for _name in ("FLEET_STORE", "FLEET_STATE_DIR", "FLEET_CLUSTER"):
    os.environ.pop(_name, None)

LEAK_WAIT_S = 15.0


def _fleet_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fleet-") and t.is_alive()}


_PG_SERVERS: list[PostgresServer] = []


def _children() -> set[int]:
    try:
        pids = {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()
    # pg_ctl daemonizes the postmaster, but where this process reaps orphans (PID 1 in a
    # container) the session's server would still show up as a child.
    for server in _PG_SERVERS:
        pids -= server.pids()
    return pids


@pytest.fixture(autouse=True)
def no_leaks():
    threads_before = _fleet_threads()
    children_before = _children()
    yield
    deadline = time.monotonic() + LEAK_WAIT_S
    while time.monotonic() < deadline:
        threads = _fleet_threads() - threads_before
        children = {
            pid for pid in _children() - children_before
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        }
        if not threads and not children:
            return
        time.sleep(0.1)
    for pid in children:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not threads, f"threads leaked: {sorted(t.name for t in threads)}"
    assert not children, f"child processes leaked: {sorted(children)}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (or the one FLEET_TEST_POSTGRES_URL names)."""
    server = PostgresServer()
    try:
        server.start()
    except PostgresUnavailable as e:
        pytest.fail(str(e), pytrace=False)
    _PG_SERVERS.append(server)
    try:
        yield server
    finally:
        _PG_SERVERS.remove(server)
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"], ids=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a fresh, empty store on each backend (a PostgreSQL one is dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/state/fleet.db"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url = server.create_database()
    yield url
    server.drop_database(url)
