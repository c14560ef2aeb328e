"""fleet inside a process it did not write: tracing, the optional step API, and faults.

A ``Session`` is what fleet's launcher (``workers/shim.py``) starts in every rank of a
user program before the program's first line runs: a ``Reporter`` streaming to the node
agent, PyTorch's native flight recorder read by a ``NativeFlightTail`` (every
collective of every process group, also while the program is stuck in one), and a
watch that reports ``PG_READY`` once the program's default process group exists.

``fleet.step(step, loss=..., tokens=...)`` is the call a program may add: it reports
a ``StepEvent`` (so the step-based detectors, NaN, loss spike, straggler and ETTR by
step, work), stamps later collectives with the next step, and fires faults armed for a
step (``fleet inject-fault --at-step``). ``with fleet.phase("eval"):`` reports a named
phase (``workers/phases.py``) around a long stretch, so that the hang threshold is that
phase's ``detect.phase_timeouts_s``. Without a session (plain ``python`` or torchrun
without fleet) both do nothing and cost a global lookup.

A ``stop`` command (`fleet stop`) sends the program SIGTERM, as torchrun stops its
workers: a program that handles it (saves a checkpoint, exits) does, any other ends.

Faults a session carries out: ``crash`` (SIGKILL now, or at a step), ``hang`` (at a
step: the training thread stops inside ``fleet.step``; at once: the process is stopped
with SIGSTOP, continued after ``--duration`` if one is given) and ``slow`` at a step.
``nan`` needs fleet's built-in trainer (a program's loss is its own) and is refused
with a warning in the rank's log.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import contextlib
import sys
import threading
import time
from collections.abc import Iterator

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
from fleet.workers import native_fr
from fleet.workers.faults import FaultHooks
from fleet.workers.native_fr import NativeFlightTail
from fleet.workers.phases import Phases, check_name
from fleet.workers.reporter import Reporter
from fleet.workers.spec import WorkerSpec

log = logging.getLogger(__name__)

Status = events_pb2.WorkerStatus

_current: Session | None = None


def current() -> Session | None:
    """The session of this process, if fleet launched it (or ``record_collectives`` made one)."""
    return _current


def step(step: int, loss: float | None = None, tokens: int | None = None) -> None:
    """Report that training step ``step`` just completed (``fleet.step``).

    ``loss``: its loss (a float or a one-element tensor; NaN/Inf is reported as such
    and, under fleet, ends the attempt as a ``nan`` incident; give it on every call or on
    none, since the loss-spike detector compares them). ``tokens``: tokens this
    rank processed in the step (gives tokens/s). A no-op outside fleet."""
    session = _current
    if session is not None:
        session.step(step, loss=loss, tokens=tokens)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the block as this rank's phase ``name`` (``with fleet.phase("eval"):``).

    While any rank is in it, the controller calls no hang before
    ``detect.phase_timeouts_s.<name>`` seconds (a name not listed there changes nothing).
    ``name``: 1-64 letters, digits, ``_ . -`` (ValueError otherwise, with or without fleet).
    Phases nest; the innermost counts. A no-op outside fleet."""
    check_name(name)
    session = _current
    if session is None:
        yield
        return
    with session.phases.phase(name):
        yield


class Session:
    """Tracing and the step API for one rank of a program fleet launched."""

    def __init__(self, spec: WorkerSpec, *, on_pg_ready: object = None) -> None:
        """``spec``: the rank's identity and reporting settings (``agent_address`` empty:
        events are discarded). ``on_pg_ready()`` runs once the process group exists."""
        self.spec = spec
        self.hooks = FaultHooks(spec.rank)
        self.reporter = Reporter(spec, self._on_command)
        self.phases = Phases(spec.job_id, spec.attempt, spec.rank, self.reporter.emit)
        self.tail: NativeFlightTail | None = None
        if spec.fr_buffer_entries and native_fr.available():
            self.tail = NativeFlightTail(spec.job_id, spec.attempt, spec.rank, self.reporter.emit,
                                         ring_entries=spec.fr_buffer_entries, poll_interval_s=spec.fr_poll_interval_s)
            self.reporter.follow(self.tail)
        self._on_pg_ready = on_pg_ready
        self._pg_ready = False
        self._pg_lock = threading.Lock()
        self.reporter.add_source(self._watch_pg, 0.1)
        self._last_step_ns: int | None = None
        self._last_step = 0
        self._steps_seen = False
        self._closed = False

    def install(self) -> Session:
        """Make this the process's session (``fleet.step`` reports to it)."""
        global _current
        _current = self
        return self

    # -- reports ------------------------------------------------------------------------

    def status(self, state: int, detail: str = "") -> None:
        s = self.spec
        self.reporter.emit(events_pb2.Event(status=Status(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, state=state, time_ns=time.time_ns(),
            pid=os.getpid(), hostname=socket.gethostname(), detail=detail[:4000])))

    def _watch_pg(self, force: bool = False) -> None:
        """Reporter-thread source: report PG_READY once the default group exists."""
        if self._pg_ready:
            return
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            self.pg_ready()

    def pg_ready(self) -> None:
        """The default process group exists (once; from any thread)."""
        with self._pg_lock:
            if self._pg_ready:
                return
            self._pg_ready = True
        self.status(Status.PG_READY)
        if callable(self._on_pg_ready):
            self._on_pg_ready()

    def step(self, step: int, loss: float | None = None, tokens: int | None = None) -> None:
        """See ``fleet.step``."""
        now = time.time_ns()
        step = int(step)
        took = (now - self._last_step_ns) / 1e9 if self._last_step_ns is not None else 0.0
        self._last_step_ns, self._last_step, self._steps_seen = now, step, True
        value = _as_float(loss)
        s = self.spec
        tokens_per_s = tokens / took if tokens and took > 0 else 0.0
        self.reporter.emit(events_pb2.Event(step=events_pb2.StepEvent(
            job_id=s.job_id, attempt=s.attempt, rank=s.rank, step=step, loss=value, step_time_s=took,
            tokens_per_s=tokens_per_s, end_ns=now)))
        if self.tail is not None:
            self.tail.step_started(step + 1, now)
        self.hooks.before_step(step + 1)

    # -- faults -------------------------------------------------------------------------

    def _on_command(self, cmd: events_pb2.Command) -> None:
        """A command from the agent (reporter thread): faults this process can carry out,
        and a stop (`fleet stop`): SIGTERM to this process, as torchrun stops its workers;
        a program that saves a checkpoint on SIGTERM does so, any other ends."""
        if cmd.WhichOneof("kind") == "stop" and cmd.stop:
            print(f"fleet: rank {self.spec.rank}: stop requested (fleet stop): sending SIGTERM to process "
                  f"{os.getpid()}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if cmd.WhichOneof("kind") != "fault":
            self.hooks.on_command(cmd)
            return
        try:
            kind = FaultKind.from_wire(cmd.fault.kind)
        except ValueError:
            self.hooks.on_command(cmd)  # logs and ignores it
            return
        if kind is FaultKind.NAN:
            print(f"fleet: rank {self.spec.rank}: fault 'nan' needs fleet's built-in trainer (a program's loss "
                  "is its own); ignored", file=sys.stderr, flush=True)
            return
        immediate = cmd.fault.at_step <= 0 or (self._steps_seen and cmd.fault.at_step <= self._last_step)
        if kind is FaultKind.HANG and immediate:
            self._stop_process(cmd.fault.duration_s)
            return
        self.hooks.on_command(cmd)

    def _stop_process(self, duration_s: float) -> None:
        """Hang this whole process now (SIGSTOP): its peers wait in their next collective."""
        pid = os.getpid()
        how = f"for {duration_s:g} s" if duration_s > 0 else "until killed"
        print(f"fleet: rank {self.spec.rank} injected hang: process {pid} stopped {how}", file=sys.stderr, flush=True)
        if duration_s > 0:  # a stopped process cannot wake itself: a helper sends SIGCONT
            subprocess.Popen([sys.executable, "-c", f"import os,time; time.sleep({float(duration_s)!r}); "
                              f"os.kill({pid}, {int(signal.SIGCONT)})"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.kill(pid, signal.SIGSTOP)

    # -- the end ------------------------------------------------------------------------

    def close(self, state: int, detail: str = "", timeout_s: float = 5.0) -> None:
        """Ship the ring's last entries and the final status; stop the reporter (idempotent)."""
        global _current
        if self._closed:
            return
        self._closed = True
        self.hooks.release()
        if self.tail is not None:
            try:
                self.tail.poll(force=True)
            except Exception:  # noqa: BLE001 - the ring may be gone with a broken group
                log.debug("final flight-recorder read failed", exc_info=True)
        self.status(state, detail)
        self.reporter.close(timeout_s)
        if _current is self:
            _current = None


def _as_float(loss: object) -> float:
    """A reported loss as a float (a tensor's ``item()``): 0.0 when none is given (pass a
    loss on every call or on none: the loss-spike detector compares them), NaN when it
    cannot be read."""
    if loss is None:
        return 0.0
    item = getattr(loss, "item", None)
    try:
        return float(item() if callable(item) else loss)
    except (TypeError, ValueError, RuntimeError):
        return math.nan


