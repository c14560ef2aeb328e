"""Record every collective of a plain torchrun script: fleet's flight recorder as a library.

    import torch.distributed as dist
    from fleet.workers.flight import record_collectives

    with record_collectives(dump_dir="fr_dumps") as rec:   # before init_process_group
        dist.init_process_group("nccl")
        for step in range(steps):
            rec.step(step)                                  # optional: stamps events
            train_one_step()
    dist.destroy_process_group()  # after close, so group membership is still live
    # fleet replay --dumps fr_dumps

``record_collectives`` turns PyTorch's native flight recorder on (it sets
``TORCH_FR_BUFFER_SIZE`` unless the environment already does, so it must run before
the process group is created) and returns a ``FlightHandle``. This is the library
edge for scripts fleet did not launch: the user's environment wins here. fleet's own
workers get the variable from ``workers/env.py``, the one place their environment is
derived from config.

  * with an agent address (argument, or ``FLEET_AGENT_ADDRESS``), a background
    ``Reporter`` + ``NativeFlightTail`` stream every collective of every process group
    (FSDP's, DCP's, expert parallelism's included) and one ``ProcessGroupInfo`` per
    group to that fleet node agent, exactly as fleet's own workers do, also while the
    training thread is stuck inside a collective;
  * with ``dump_dir``, this rank's native dump (pickle, stack traces included) goes to
    ``dump_dir/fr_dump_<rank>``, the ``torchfrtrace`` naming ``fleet replay --dumps``
    reads: on ``dump()`` and ``close()`` (or at interpreter exit when the handle was never
    closed), and, because a hung rank never gets there, on its own when the rank stalls,
    on SIGUSR1 and shortly before a pending collective's process-group timeout (the
    ``fleet-fr-dump-watch`` thread, workers/fr_watch.py). It also sets
    ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<dump_dir>/fr_dump_``
    unless the environment sets them, so NCCL's own dump on timeout lands under the
    same names. Each dump replaces the rank's file atomically; ``FlightHandle.dumps``
    lists them.

Identity comes from torchrun's environment: ``RANK``, ``WORLD_SIZE``, the restart count
``TORCHELASTIC_RESTART_COUNT`` as the attempt, and ``FLEET_JOB_ID`` (else
``torchrun-<TORCHELASTIC_RUN_ID>``) as the job id. This module is an edge like
``workers.train.spec_from_torchrun``: it is where those variables are read.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import pickle
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist

from fleet.proto.flight_record import entry_done
from fleet.workers import native_fr
from fleet.workers.env import FR_BUFFER_VARS
from fleet.workers.fr_watch import DumpPolicy, DumpWatch
from fleet.workers.native_fr import NativeFlightTail
from fleet.workers.reporter import Reporter
from fleet.workers.spec import WorkerSpec

log = logging.getLogger(__name__)

#: Ring size when streaming: it only has to hold what arrives between two reads, and
#: every read copies the whole ring (see workers/native_fr.py).
STREAM_RING_ENTRIES = 256
#: Ring size when only dumping: the dump is all there is, so keep torch's default.
DUMP_RING_ENTRIES = 2000
#: torch's own default when TORCH_FR_BUFFER_SIZE is unset.
_TORCH_DEFAULT_RING = 2000
DUMP_PREFIX = "fr_dump_"
#: NCCL's own dump on timeout, pointed at dump_dir unless the environment says otherwise.
NCCL_DUMP_VARS = ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
#: How long dump() and close() wait for the last collectives to retire: tries x seconds.
_SETTLE_TRIES, _SETTLE_WAIT_S = 5, 0.02


class FlightRecorderError(RuntimeError):
    """The native flight recorder cannot record this process's collectives."""


class FlightHandle:
    """What ``record_collectives`` returns; a context manager (``close`` on exit)."""

    def __init__(self, *, job_id: str, attempt: int, rank: int, ring_entries: int,
                 agent_address: str, dump_dir: Path | None, poll_interval_s: float,
                 report_interval_s: float, world_size: int, dump_policy: DumpPolicy | None = None) -> None:
        self.job_id, self.attempt, self.rank = job_id, attempt, rank
        self.ring_entries = ring_entries
        self.dump_dir = dump_dir
        self.reporter: Reporter | None = None
        self.tail: NativeFlightTail | None = None
        #: every dump written, oldest first: (reason, path); reasons of automatic dumps
        #: say why ("SIGUSR1", "no progress for 120 s ...", "collective 12 of group 0 ...")
        self.dumps: list[tuple[str, Path]] = []
        self.watch: DumpWatch | None = None
        self._steps = 0
        self._dump_lock = threading.Lock()
        self._closed = False
        if agent_address:
            spec = WorkerSpec(
                job_id=job_id, attempt=attempt, rank=rank, world_size=world_size,
                node_name=socket.gethostname(), master_addr="", master_port=0,
                agent_address=agent_address, checkpoint_dir="", report_interval_s=report_interval_s,
                fr_buffer_entries=ring_entries, fr_poll_interval_s=poll_interval_s)
            self.reporter = Reporter(spec)
            self.tail = NativeFlightTail(job_id, attempt, rank, self.reporter.emit,
                                         ring_entries=ring_entries, poll_interval_s=poll_interval_s)
            self.reporter.follow(self.tail)
        if dump_dir is not None:
            self.watch = DumpWatch(dump_policy or DumpPolicy(), self._write, lambda: self._steps)
            atexit.register(self._close_at_exit)

    @property
    def streaming(self) -> bool:
        """True when events go to a node agent."""
        return self.reporter is not None

    def step(self, step: int) -> None:
        """Mark the start of training step ``step``: later collectives carry it, and it
        counts as progress for the stall dump."""
        self._steps += 1
        if self.tail is not None:
            self.tail.step_started(step)

    def dump(self, path: str | os.PathLike | None = None) -> Path:
        """Write this rank's native dump (pickle, with stack traces) to ``path``, default
        ``dump_dir/fr_dump_<rank>``; returns the path. The file appears atomically."""
        if path is None and self.dump_dir is None:
            raise FlightRecorderError("dump() needs a path, or record_collectives(dump_dir=...)")
        _settle()
        return self._write("dump()", path)

    def _write(self, reason: str, path: str | os.PathLike | None = None) -> Path:
        path = Path(path) if path is not None else self.dump_dir / f"{DUMP_PREFIX}{self.rank}"
        with self._dump_lock:  # the watcher thread dumps too
            path.parent.mkdir(parents=True, exist_ok=True)
            data = _with_marker(native_fr.dump_bytes(include_stack_traces=True), reason)
            tmp = path.with_name(f".{path.name}.tmp")  # dot files are ignored by dump readers
            tmp.write_bytes(data)
            os.replace(tmp, path)
            self.dumps.append((reason, path))
        return path

    def counters(self) -> dict[str, float]:
        """The tail's counters (see ``NativeFlightTail.counters``); empty when not streaming."""
        return self.tail.counters() if self.tail is not None else {}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the dump watcher (restoring SIGUSR1's handler), ship the last entries,
        write the dump (with ``dump_dir``), stop the reporter. Best before
        ``destroy_process_group`` (group membership is looked up live), but the native
        ring outlives the group, so closing after it loses no entry.

        The final dump is skipped when an automatic dump was written for a collective
        near its timeout and the rank made no progress since (no ``step()``, nothing
        enqueued): gloo marks a timed-out collective retired, as if it had completed."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._finish(timeout_s, "close()")

    def _close_at_exit(self) -> None:
        if not self._closed:
            self._closed = True
            self._finish(5.0, "exit")

    def _finish(self, timeout_s: float, reason: str) -> None:
        try:
            if self.watch is not None:
                self.watch.close(timeout_s)
            if self.tail is not None:
                self.tail.poll(force=True)
            if self.dump_dir is not None:
                kept = self.watch.keep_last_dump(time.time_ns(), self._steps) if self.watch else None
                if kept:
                    log.warning("flight recorder: %s %s", reason, kept)
                else:
                    _settle()
                    self._write(reason)
        finally:
            if self.reporter is not None:
                self.reporter.close(timeout_s)
                if self.tail is not None and self.tail.lost:
                    log.warning("flight recorder: %d entries were overwritten before they were shipped; "
                                "raise buffer_entries (now %d)", self.tail.lost, self.ring_entries)

    def __enter__(self) -> FlightHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settle() -> None:
    """Wait briefly for finished collectives to be marked so: gloo retires an op
    asynchronously, just after it returned, and a dump taken at once would show the
    last collective pending."""
    for _ in range(_SETTLE_TRIES):
        if all(entry_done(e) for e in native_fr.read_ring().get("entries") or []):
            return
        time.sleep(_SETTLE_WAIT_S)


def record_collectives(
    job_id: str | None = None,
    agent_address: str | None = None,
    dump_dir: str | os.PathLike | None = None,
    buffer_entries: int | None = None,
    poll_interval_s: float = 0.5,
    report_interval_s: float = 0.5,
    stall_dump_s: float | None = 120.0,
    dump_on_signal: bool = True,
    dump_before_timeout_s: float = 5.0,
    watch_interval_s: float = 1.0,
) -> FlightHandle:
    """Record every collective of this process; call before ``init_process_group``.

    ``job_id``: stamped on events (default ``FLEET_JOB_ID``, else
    ``torchrun-<TORCHELASTIC_RUN_ID>``, else ``"local"``). ``agent_address``: host:port of
    a fleet node agent to stream to (default ``FLEET_AGENT_ADDRESS``; empty = no
    streaming). ``dump_dir``: folder for ``fr_dump_<rank>`` dumps (``dump()``, ``close()``).
    ``buffer_entries``: native ring size, used only when ``TORCH_FR_BUFFER_SIZE`` is unset
    (default 256 when streaming, 2000 when only dumping). ``poll_interval_s``: longest a
    collective waits before it is shipped (s). ``report_interval_s``: seconds between
    reports to the agent.

    With ``dump_dir``, a ``fleet-fr-dump-watch`` thread also writes the dump on its own
    (each time logging one warning line saying why; a dump replaces the previous one):
    ``stall_dump_s``: after this many seconds without a ``step()`` and without any
    collective enqueued or completed, once per stall (None = never).
    ``dump_on_signal``: on SIGUSR1 (``kill -USR1 <pid>``), also while the training
    thread is blocked in a collective; needs this call on the main thread; a previous
    SIGUSR1 handler keeps being called. ``dump_before_timeout_s``: this many seconds
    before a pending collective reaches its process-group timeout (at most half the
    timeout before it). ``watch_interval_s``: how often the thread looks (seconds).

    Raises ``FlightRecorderError`` when the recorder is off (``TORCH_FR_BUFFER_SIZE=0``)
    or this torch build has none, and ``ValueError`` for bad arguments.
    """
    env = os.environ
    agent_address = env.get("FLEET_AGENT_ADDRESS", "") if agent_address is None else agent_address
    if buffer_entries is not None and buffer_entries <= 0:
        raise ValueError(f"buffer_entries must be positive, got {buffer_entries}")
    if poll_interval_s <= 0 or report_interval_s <= 0:
        raise ValueError("poll_interval_s and report_interval_s must be positive")
    policy = DumpPolicy(stall_dump_s=stall_dump_s, dump_on_signal=dump_on_signal,
                        dump_before_timeout_s=dump_before_timeout_s, watch_interval_s=watch_interval_s)
    if not native_fr.available():
        raise FlightRecorderError("this torch build has no native flight recorder "
                                  "(torch._C._distributed_c10d._dump_fr_trace)")
    folder = None
    if dump_dir is not None:
        folder = Path(dump_dir).absolute()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"dump_dir {str(folder)!r} cannot be created: {exc.strerror or exc}") from None
    configured = next((env[name] for name in FR_BUFFER_VARS if env.get(name)), None)
    if configured is None:
        if dist.is_available() and dist.is_initialized():
            ring = _TORCH_DEFAULT_RING  # too late to size it: torch's default is on
            log.warning("record_collectives() called after init_process_group: the native ring "
                        "keeps torch's default size (%d entries)", ring)
        else:
            ring = buffer_entries or (STREAM_RING_ENTRIES if agent_address else DUMP_RING_ENTRIES)
            env["TORCH_FR_BUFFER_SIZE"] = str(ring)
    else:
        try:
            ring = int(configured)
        except ValueError:
            raise FlightRecorderError(f"TORCH_FR_BUFFER_SIZE={configured!r} is not a number") from None
    if ring <= 0:
        when = ("the process group already exists with the flight recorder off"
                if dist.is_available() and dist.is_initialized() else "the flight recorder is off")
        raise FlightRecorderError(
            f"{when} (TORCH_FR_BUFFER_SIZE={configured}); unset it or set it to a ring size "
            "before init_process_group, then call record_collectives() before init_process_group")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(env.get("RANK", "0"))
    world_size = (dist.get_world_size() if dist.is_available() and dist.is_initialized()
                  else int(env.get("WORLD_SIZE", "1")))
    if folder is not None:
        nccl_dump = {NCCL_DUMP_VARS[0]: "1", NCCL_DUMP_VARS[1]: str(folder / DUMP_PREFIX)}
        for name, value in nccl_dump.items():
            env.setdefault(name, value)
    if job_id is None:
        run_id = env.get("TORCHELASTIC_RUN_ID")
        job_id = env.get("FLEET_JOB_ID") or (f"torchrun-{run_id}" if run_id else "local")
    return FlightHandle(
        job_id=job_id, attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), rank=rank,
        ring_entries=ring, agent_address=agent_address, world_size=world_size,
        dump_dir=folder, dump_policy=policy,
        poll_interval_s=poll_interval_s, report_interval_s=report_interval_s)


def _with_marker(data: bytes, reason: str) -> bytes:
    """The dump with one more top-level key, ``fleet_dump``: when (``time_ns``) and why
    (``reason``) it was written. torch's readers ignore keys they do not know; ``fleet
    replay`` reads it to tell an op that ended by a timeout, which gloo marks retired just
    like a completed one, from a completed one."""
    was = gc.isenabled()
    gc.disable()  # unpickling allocates many short-lived containers (see native_fr)
    try:
        doc = pickle.loads(data)
        doc["fleet_dump"] = {"time_ns": time.time_ns(), "reason": reason}
        return pickle.dumps(doc, protocol=2)
    finally:
        if was:
            gc.enable()
