"""Fault-injection hooks and controller orders a rank obeys inside its training loop.

``FaultHooks.on_command`` runs on the reporter thread whenever the agent relays a
``Command``; ``before_step`` runs on the training thread at the top of every step.

Fault kinds understood here, each fired immediately (``at_step <= 0``) or at the
start of the first step ``>= at_step``:
  * ``crash``: the process exits at once with ``FAULT_EXIT_CODE`` (no cleanup, like a
    segfault or a lost node would).
  * ``hang``: the training thread stops before its next collective for ``duration_s``
    seconds (0 = until the process is killed), like a rank whose GPU kernel or data
    loader hung: its peers block inside that collective waiting for it. The reporter
    thread keeps running, so the flight recorder shows exactly that.
Unknown kinds are logged and ignored: the controller validates kinds before sending.
A ``stop`` command only sets ``stop_requested``; the training loop decides, together
with the other ranks, where to stop.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from fleet_proto import events_pb2

log = logging.getLogger(__name__)

#: Exit status of a process killed by an injected ``crash`` fault, so the controller can
#: tell an injected crash from a real one.
FAULT_EXIT_CODE = 43


class FaultHooks:
    """Arms and fires injected faults for one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.stop_requested = False
        self._lock = threading.Lock()  # on_command (reporter thread) vs before_step (main)
        self._crash_at_step: int | None = None
        self._hang_at_step: int | None = None
        self._hang_s = 0.0
        self._hang_now = threading.Event()  # set by an immediate hang order

    @property
    def armed_crash_step(self) -> int | None:
        """The step at whose start this rank will crash, or None."""
        with self._lock:
            return self._crash_at_step

    def on_command(self, cmd: events_pb2.Command) -> None:
        """Handle one command from the agent (called on the reporter thread)."""
        kind = cmd.WhichOneof("kind")
        if kind == "stop":
            if cmd.stop:
                log.info("rank %d: stop requested (command %s)", self.rank, cmd.command_id)
                self.stop_requested = True
            return
        if kind != "fault":
            log.warning("rank %d: ignoring command %s with no known kind", self.rank, cmd.command_id)
            return
        fault = cmd.fault
        if fault.kind == "hang":
            with self._lock:
                self._hang_at_step = max(fault.at_step, 0)
                self._hang_s = max(fault.duration_s, 0.0)
            log.info("rank %d: hang armed for step %d, %s (command %s)", self.rank, fault.at_step,
                     f"{fault.duration_s:g} s" if fault.duration_s > 0 else "until killed", cmd.command_id)
            return
        if fault.kind != "crash":
            log.warning("rank %d: ignoring unknown fault kind %r (command %s)",
                        self.rank, fault.kind, cmd.command_id)
            return
        if fault.at_step <= 0:
            self._crash(f"command {cmd.command_id}, immediate")
        with self._lock:
            # Several crash orders: the earliest step wins.
            if self._crash_at_step is None or fault.at_step < self._crash_at_step:
                self._crash_at_step = fault.at_step
        log.info("rank %d: crash armed for step %d (command %s)", self.rank, fault.at_step, cmd.command_id)

    def before_step(self, step: int) -> None:
        """Fire any fault armed for ``step`` (called by the training loop before each step)."""
        at = self._crash_at_step
        if at is not None and step >= at:
            self._crash(f"armed for step {at}, now at step {step}")
        with self._lock:
            hang_at, hang_s = self._hang_at_step, self._hang_s
            if hang_at is not None and step >= hang_at:
                self._hang_at_step = None
        if hang_at is not None and step >= hang_at:
            self._hang(step, hang_s)

    def _hang(self, step: int, duration_s: float) -> None:
        print(f"fleet: rank {self.rank} injected hang at step {step} "
              f"({f'{duration_s:g} s' if duration_s > 0 else 'until killed'})", file=sys.stderr, flush=True)
        deadline = time.monotonic() + duration_s if duration_s > 0 else None
        # Event.wait in bounded slices: the thread stays interruptible and never spins
        while deadline is None or time.monotonic() < deadline:
            remaining = 60.0 if deadline is None else min(60.0, deadline - time.monotonic())
            if remaining <= 0 or self._hang_now.wait(remaining):
                break
        log.info("rank %d: hang at step %d over", self.rank, step)

    def release(self) -> None:
        """End an ongoing injected hang (tests, and a clean shutdown)."""
        self._hang_now.set()

    def _crash(self, why: str) -> None:
        # Straight to stderr, flushed: logging handlers may buffer, and nothing runs after this.
        print(f"fleet: rank {self.rank} injected crash ({why}); exiting with {FAULT_EXIT_CODE}",
              file=sys.stderr, flush=True)
        # os._exit, not sys.exit: a real crash runs no finally blocks, atexit or flushes.
        os._exit(FAULT_EXIT_CODE)
