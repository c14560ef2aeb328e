"""One rank of a user program: a warm interpreter started early, launched, watched to its end.

``RankProcess`` starts ``python -m fleet.workers.shim`` (see there) as soon as the worker
actor is warmed, with the program's base environment and working directory, so that
torch is imported before an attempt needs the process. ``run_rank`` hands it the rank's
launch (torchrun's variables, the log file, the rendezvous socket for rank 0), waits for
it to end and returns, or raises ``RankExitError`` with its exit code (negative: the
signal), when it exited, whether it had created its process group and its traceback:
torch's ``@record`` error file (``TORCHELASTIC_ERROR_FILE``) when the program wrote one,
else the uncaught exception the shim caught, else the tail of its log.

This runs in the worker actor's process (a Ray worker), which imports no torch: the
rank's process is a child of it and dies with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fleet.workers.env import launch_env
from fleet.workers.failures import RankExitError
from fleet.workers.shim import send
from fleet.workers.spec import Launch, WorkerSpec

log = logging.getLogger(__name__)

#: Longest a new interpreter may take to import torch and say it is ready.
READY_TIMEOUT_S = 300.0
#: Bytes of a log's end searched for a traceback when the program left no other.
LOG_TAIL_BYTES = 16_384
LOG_TAIL_LINES = 40


class RankProcess:
    """A warm interpreter for one rank (``workers/shim.py``), and what it says while it runs."""

    def __init__(self, launch: Launch) -> None:
        self.base = (tuple(sorted(launch.env.items())), launch.workdir)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # what the interpreter prints before its launch (an import failure) lands here
        self._early = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.workers.shim", str(child.fileno())], pass_fds=(child.fileno(),),
            env=launch.env or None, cwd=launch.workdir or None, stdin=subprocess.DEVNULL,
            stdout=self._early, stderr=subprocess.STDOUT)
        child.close()
        self._sock = parent
        self.ready = threading.Event()
        self.reached_pg = False
        self.traceback = ""
        self._reader = threading.Thread(target=self._read, name=f"fleet-rank-{self.proc.pid}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def matches(self, launch: Launch) -> bool:
        """Whether this interpreter was started with ``launch``'s environment and directory."""
        return self.base == (tuple(sorted(launch.env.items())), launch.workdir) and self.proc.poll() is None

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                kind = msg.get("kind")
                if kind == "ready":
                    self.ready.set()
                elif kind == "pg":
                    self.reached_pg = True
                elif kind == "traceback":
                    self.traceback = str(msg.get("text", ""))
        self.ready.set()  # the process ended: nobody waits for a ready that never comes

    def launch(self, spec: WorkerSpec, listen_socket: socket.socket | None) -> None:
        """Tell the interpreter to run ``spec``'s program (waits for it to be ready)."""
        launch = spec.launch
        assert launch is not None
        if not self.ready.wait(READY_TIMEOUT_S) or self.proc.poll() is not None:
            raise RankExitError(spec.rank, self.proc.poll() if self.proc.poll() is not None else -9,
                                "fleet's interpreter for this rank did not start:\n" + self._early_output(),
                                time.time(), False)
        Path(launch.log_dir).mkdir(parents=True, exist_ok=True)
        Path(launch.error_file(spec.rank)).unlink(missing_ok=True)
        message = {
            "kind": "launch", "env": launch_env(spec), "workdir": launch.workdir or os.getcwd(),
            "module": launch.module, "script": launch.script, "args": list(launch.args),
            "log_path": launch.log_path(spec.rank), "pg_timeout_s": spec.pg_timeout_s,
            # the shim's session reports with the rank's own spec, but for what it does not need
            "spec": {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                     if f.name not in ("model", "train", "launch", "env")},
        }
        data = (json.dumps(message) + "\n").encode()
        if listen_socket is not None:
            socket.send_fds(self._sock, [data], [listen_socket.fileno()])
        else:
            self._sock.sendall(data)

    def wait(self) -> tuple[int, float]:
        """Block until the program ends: (exit code, Unix time it was seen to end)."""
        code = self.proc.wait()
        exited_at = time.time()
        self._reader.join(timeout=2.0)
        return code, exited_at

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close()

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
        self._early.close()

    def _early_output(self) -> str:
        try:
            self._early.seek(0)
            return self._early.read()[-LOG_TAIL_BYTES:].decode(errors="replace")
        except (OSError, ValueError):
            return ""


def run_rank(spec: WorkerSpec, process: RankProcess, listen_socket: socket.socket | None) -> dict:
    """Run ``spec``'s program in ``process`` to its end (see the module docstring)."""
    launch = spec.launch
    assert launch is not None
    process.launch(spec, listen_socket)
    if listen_socket is not None:
        listen_socket.close()  # the rank's process holds its own copy
    t0 = time.monotonic()
    code, exited_at = process.wait()
    process.close()
    if code == 0:
        return {"rank": spec.rank, "exit_code": 0, "wall_s": round(time.monotonic() - t0, 3),
                "reached_pg": process.reached_pg}
    raise RankExitError(spec.rank, code, rank_traceback(launch, spec.rank, process.traceback), exited_at,
                        process.reached_pg)


def rank_traceback(launch: Launch, rank: int, captured: str) -> str:
    """What a failed rank left: torch's error file, else ``captured``, else its log's tail."""
    from_file = _error_file_traceback(Path(launch.error_file(rank)))
    if from_file:
        return from_file
    if captured:
        return captured
    return log_tail(Path(launch.log_path(rank)))


def _error_file_traceback(path: Path) -> str:
    """The traceback in a ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record`` format:
    ``{"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}``)."""
    try:
        data = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        text = stack or message.get("message")
        return str(text) if text else ""
    return str(message) if message else ""


def log_tail(path: Path) -> str:
    """The last Python traceback in the end of a log, else its last lines."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    start = text.rfind("Traceback (most recent call last):")
    if start >= 0:
        return text[start:].strip()
    return "\n".join(text.strip().splitlines()[-LOG_TAIL_LINES:])
