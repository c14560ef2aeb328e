"""The named phases a rank is in, reported to the controller as they begin and end.

A phase is a stretch of work that may legitimately run much longer than a step:
``checkpointing`` (fleet's built-in trainer, around a step that saves or commits a
checkpoint, and its final save), ``eval``, or any name a program gives through
``fleet.phase(name)``. The controller's hang threshold follows the phase
(``detect.phase_timeouts_s``), so a rank in a long synchronous checkpoint is not called
hung before that phase's timeout.

Each change is one ``WorkerStatus`` (state TRAINING, ``phase``: the innermost phase now,
"" when none; on the way out ``phase_s`` says how long the phase that ended took). Phases
nest: leaving the inner one reports the outer one again. Names are checked here, where
they enter (``check_name``), and are matched as written.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

from fleet.proto import events_pb2

#: The built-in trainer's phase around checkpoint saves and commits.
CHECKPOINTING = "checkpointing"
#: The conventional name of an evaluation pass (``with fleet.phase("eval"):``).
EVAL = "eval"
#: What a phase name may look like (a ``detect.phase_timeouts_s`` key too).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_name(name: object) -> str:
    """``name`` if it is a valid phase name, else ValueError saying what one looks like."""
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise ValueError(f"phase name {name!r}: 1-64 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit")
    return name


class Phases:
    """One rank's phase stack; ``emit`` takes the status events (``Reporter.emit``)."""

    def __init__(self, job_id: str, attempt: int, rank: int,
                 emit: Callable[[events_pb2.Event], None]) -> None:
        self._ident = (job_id, attempt, rank)
        self._emit = emit
        self._stack: list[tuple[str, float]] = []  # (name, perf_counter when it began)
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        """The innermost phase, "" outside every phase."""
        with self._lock:
            return self._stack[-1][0] if self._stack else ""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Report ``name`` as this rank's phase while the block runs (ValueError for a bad name)."""
        name = check_name(name)
        with self._lock:
            self._stack.append((name, time.perf_counter()))
        self._report(name, 0.0)
        try:
            yield
        finally:
            with self._lock:
                _, began = self._stack.pop()
                now = self._stack[-1][0] if self._stack else ""
            self._report(now, time.perf_counter() - began)

    def _report(self, phase: str, took_s: float) -> None:
        job_id, attempt, rank = self._ident
        self._emit(events_pb2.Event(status=events_pb2.WorkerStatus(
            job_id=job_id, attempt=attempt, rank=rank, state=events_pb2.WorkerStatus.TRAINING,
            time_ns=time.time_ns(), pid=os.getpid(), hostname=socket.gethostname(), phase=phase,
            phase_s=took_s)))
