"""A throwaway PostgreSQL server for the store's tests, or the one named by the environment.

``PostgresServer.start()`` runs initdb into a fresh temporary folder (trust auth, fsync
off) and starts the server with pg_ctl on 127.0.0.1 and a free port, its unix socket
inside that folder; ``stop()`` stops it and removes the folder. As root, the server
programs run as the ``postgres`` system user (PostgreSQL refuses to run as root).

With ``FLEET_TEST_POSTGRES_URL`` set (e.g. ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``)
no server is started: databases are created on that one and dropped by ``stop()``.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import psutil
import psycopg
from sqlalchemy.engine import URL, make_url

ENV_URL = "FLEET_TEST_POSTGRES_URL"
START_TIMEOUT_S = 60
CMD_TIMEOUT_S = 120
INSTALL_HINT = "run `bash scripts/test.sh`, which installs them (Debian package postgresql)"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be started here; the message says why and what to do."""


def find_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding initdb, else initdb's folder on PATH."""
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")

    def version(path: str) -> tuple[int, ...]:
        name = Path(path).parent.parent.name
        return tuple(int(p) for p in name.split(".") if p.isdigit())

    if found:
        return Path(max(found, key=version)).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent
    raise PostgresUnavailable(
        f"PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin "
        f"or on PATH: {INSTALL_HINT}, or set {ENV_URL} to a server's URL")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conninfo(url: URL) -> str:
    """psycopg's form of a SQLAlchemy URL (``postgresql+psycopg://`` -> ``postgresql://``)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class PostgresServer:
    """One PostgreSQL server for a test session; ``create_database()`` per test."""

    def __init__(self, *, crash_safe: bool = False) -> None:
        """``crash_safe``: keep fsync and full-page writes on (benchmarks); commits still do
        not wait for the disk (``synchronous_commit=off``, like SQLite's WAL with
        ``synchronous=NORMAL``). Tests run with both off: faster, and they never crash the OS."""
        self._crash_safe = crash_safe
        self._dir: Path | None = None
        self._bindir: Path | None = None
        self._as_user: list[str] = []
        self._admin: URL | None = None
        self._external = False
        self._created: list[str] = []

    @property
    def admin_url(self) -> str:
        """URL of the maintenance database (``postgres``), for tests that need one."""
        assert self._admin is not None, "server not started"
        return self._admin.render_as_string(hide_password=False)

    def start(self) -> PostgresServer:
        env_url = os.environ.get(ENV_URL)
        if env_url:
            self._external = True
            self._admin = make_url(env_url).set(drivername="postgresql+psycopg")
            return self
        self._bindir = find_bindir()
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable(
                    "running as root, and PostgreSQL will not run as root, but there is no "
                    f"`postgres` system user to run it as: {INSTALL_HINT}, or run the tests "
                    "as an ordinary user") from None
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self._dir = Path(tempfile.mkdtemp(prefix="fleet-pg-"))
        if self._as_user:
            os.chown(self._dir, user.pw_uid, user.pw_gid)
        data = self._dir / "data"
        self._run("initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")
        last_error = ""
        for _ in range(3):  # the free port may be taken between probing and binding
            port = _free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {port} -k {self._dir} "
                       "-c synchronous_commit=off -c max_connections=200")
            if not self._crash_safe:
                options += " -c fsync=off -c full_page_writes=off"
            try:
                self._run("pg_ctl", "-D", str(data), "-l", str(self._dir / "server.log"),
                          "-o", options, "-w", "-t", str(START_TIMEOUT_S), "start")
            except PostgresUnavailable as e:
                last_error = str(e)
                continue
            self._admin = URL.create("postgresql+psycopg", username="postgres",
                                     host="127.0.0.1", port=port, database="postgres")
            return self
        log = self._dir / "server.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        self.stop()
        raise PostgresUnavailable(f"PostgreSQL did not start: {last_error}\n{tail}")

    def _run(self, program: str, *args: str) -> None:
        assert self._bindir is not None and self._dir is not None
        cmd = [*self._as_user, str(self._bindir / program), *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                                  cwd=self._dir, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PostgresUnavailable(f"{' '.join(cmd)}: {e}") from e
        if proc.returncode != 0:
            raise PostgresUnavailable(
                f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")

    def pids(self) -> set[int]:
        """The postmaster and its backends (empty for an external server or when stopped)."""
        if self._dir is None:
            return set()
        try:
            postmaster = int((self._dir / "data" / "postmaster.pid").read_text().split()[0])
            proc = psutil.Process(postmaster)
            return {postmaster, *(p.pid for p in proc.children(recursive=True))}
        except (OSError, ValueError, IndexError, psutil.Error):
            return set()

    def create_database(self) -> str:
        """Create an empty database; return its ``postgresql+psycopg://`` URL."""
        assert self._admin is not None, "server not started"
        name = f"fleet_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(_conninfo(self._admin), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self._created.append(name)
        return self._admin.set(database=name).render_as_string(hide_password=False)

    def drop_database(self, url: str) -> None:
        """Drop a database made by ``create_database`` (closing any connection left to it)."""
        assert self._admin is not None, "server not started"
        name = make_url(url).database
        assert name in self._created, f"{name!r} was not made here"
        with psycopg.connect(_conninfo(self._admin), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self._created.remove(name)

    def stop(self) -> None:
        """Stop the server and remove its folder (or drop the databases made on an external one)."""
        if self._external:
            if self._admin is not None and self._created:
                with psycopg.connect(_conninfo(self._admin), autocommit=True,
                                     connect_timeout=10) as conn:
                    for name in self._created:
                        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            self._created.clear()
            return
        if self._dir is None:
            return
        if (self._dir / "data" / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self._dir / "data"), "-m", "fast", "-w",
                          "-t", str(START_TIMEOUT_S), "stop")
            finally:
                shutil.rmtree(self._dir, ignore_errors=True)
        else:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        self._admin = None
