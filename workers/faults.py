"""Fault-injection hooks and controller orders a rank obeys inside its training loop.

``FaultHooks.on_command`` runs on the reporter thread whenever the agent relays a
``Command``; ``before_step`` runs on the training thread at the top of every step, and
``poison_loss`` right after each micro-batch's loss is computed.

Fault kinds understood here (``WORKER_KINDS``), each armed for the first step
``>= at_step`` (``at_step`` 0 = at once):
  * ``crash``: the process sends itself SIGKILL, like a segfault or a lost GPU: no
    finally blocks, atexit handlers or flushes run. Its parent sees ``FAULT_EXIT_CODE``.
  * ``hang``: the training thread stops before its next step's collectives for
    ``duration_s`` seconds (0 = until the process is killed), like a rank whose GPU
    kernel or data loader hung: its peers block inside that collective waiting for it.
    The reporter thread keeps running, so the flight recorder shows exactly that.
  * ``slow``: a straggler. Every step from the armed one on sleeps ``delay_s`` extra
    (``DEFAULT_SLOW_DELAY_S`` when 0) before its compute, for ``duration_s`` seconds
    counted from the first slowed step (0 = the rest of the attempt).
  * ``nan``: the rank's loss at the armed step becomes NaN, once (``poison_loss``).
  * ``ckpt-corrupt`` (rank 0, handed a step by the controller): flips bytes in the
    newest valid checkpoint at the top of that step, then tells ``on_checkpoint_damaged``
    (step, path, reason), which the trainer wires to its reporter: the store marks that
    checkpoint invalid at once, not only when a later restore skips it.
  * ``sdc``: silent data corruption of one value of the rank's state, in the training
    step (the trainer asks ``sdc_due(step, target)`` at each firing point): ``target``
    weight (one parameter element right after ``optimizer.step``), optimizer (one
    element of exp_avg or exp_avg_sq, then), grad (one gradient element after the
    gradient sync and clipping, before ``optimizer.step``) or activation (one element of
    a Linear/MoE output in the forward). ``bit`` set: XOR that bit of the value's bits;
    else ``value_error``: ``x *= 1 + value_error`` (``x = value_error`` when x is 0). The
    element is chosen from (rank, at_step), so a ``persistent`` fault hits the same
    element at every step from ``at_step`` on (a defective unit; a flipped bit stays
    stuck at the value its first flip gave it), re-executed steps of a triage included;
    a one-shot fault fires once.
Other kinds (node-down, partition, ...) are the agent's or the controller's; a rank
logs and ignores them. ``after_s`` is the controller's delay and is ignored here.
A ``stop`` command only sets ``stop_requested``; the training loop decides, together
with the other ranks, where to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Return code a parent (``subprocess``, ``multiprocessing``) sees for a rank killed by an
#: injected ``crash``: killed by SIGKILL, as a real hardware-style death would be.
FAULT_EXIT_CODE = -signal.SIGKILL

#: Extra seconds a ``slow`` rank sleeps per step when the order leaves ``delay_s`` at 0.
DEFAULT_SLOW_DELAY_S = 0.3

#: Fault kinds a rank acts on itself.
WORKER_KINDS = frozenset(k for k in FaultKind if k.worker_timed)


#: Where an ``sdc`` fault strikes (``FaultSpec.target``; "" means weight).
SDC_TARGETS = ("weight", "grad", "optimizer", "activation")


@dataclass(frozen=True)
class SdcFault:
    """An armed ``sdc`` fault."""

    target: str
    at_step: int
    bit: int | None
    value_error: float
    persistent: bool

    def describe(self) -> str:
        what = f"bit {self.bit} flipped" if self.bit is not None else f"relative error {self.value_error:g}"
        return f"{self.target} {what}{', persistent' if self.persistent else ''}"

    def pick(self, rank: int, n: int) -> int:
        """A deterministic index in ``range(n)`` for this (rank, at_step)."""
        h = ((rank + 1) * 0x9E3779B1 + self.at_step * 0x85EBCA77 + 0x2545F491) & 0xFFFFFFFF
        h = (h ^ (h >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF
        return (h ^ (h >> 12)) % n if n > 0 else 0


@dataclass
class _Slowdown:
    at_step: int
    delay_s: float
    duration_s: float         # 0 = rest of the attempt
    started: float | None = None  # clock() at the first slowed step


class FaultHooks:
    """Arms and fires injected faults for one rank.

    ``clock`` (seconds) and ``sleep`` are injectable for tests; by default a slow step
    sleeps in an event wait that ``release`` cuts short.
    """

    def __init__(self, rank: int, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] | None = None, checkpoint_dir: str = "") -> None:
        """``checkpoint_dir``: where ``ckpt-corrupt`` finds the newest checkpoint."""
        self.rank = rank
        self.checkpoint_dir = checkpoint_dir
        self._corrupt_at_step: int | None = None
        self.stop_requested = False
        self._clock = clock
        self._released = threading.Event()  # release(): end hangs and slowdowns now
        self._sleep = sleep if sleep is not None else self._released.wait
        self._lock = threading.Lock()  # on_command (reporter thread) vs the training thread
        self._crash_at_step: int | None = None
        self._hang_at_step: int | None = None
        self._hang_s = 0.0
        self._slow: _Slowdown | None = None
        self._nan_at_step: int | None = None
        self._sdc: list[SdcFault] = []
        self._sdc_fired: set[SdcFault] = set()
        self._stuck: dict[SdcFault, int] = {}
        #: Called with (step, checkpoint path, reason) after ckpt-corrupt damaged a
        #: checkpoint; set once the reporter exists (it is built after these hooks).
        self.on_checkpoint_damaged: Callable[[int, str, str], object] | None = None

    @property
    def armed_crash_step(self) -> int | None:
        """The step at whose start this rank will crash, or None."""
        with self._lock:
            return self._crash_at_step

    @property
    def armed_nan_step(self) -> int | None:
        """The step whose loss this rank will poison, or None."""
        with self._lock:
            return self._nan_at_step

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
        try:
            fault_kind = FaultKind.from_wire(fault.kind)
        except ValueError:
            log.warning("rank %d: ignoring command %s with unknown fault kind %d", self.rank, cmd.command_id,
                        fault.kind)
            return
        at_step = max(fault.at_step, 0)
        duration_s = max(fault.duration_s, 0.0)
        if fault_kind is FaultKind.CRASH:
            if at_step == 0:
                self._crash(f"command {cmd.command_id}, immediate")
            with self._lock:
                # Several crash orders: the earliest step wins.
                if self._crash_at_step is None or at_step < self._crash_at_step:
                    self._crash_at_step = at_step
        elif fault_kind is FaultKind.HANG:
            with self._lock:
                self._hang_at_step, self._hang_s = at_step, duration_s
        elif fault_kind is FaultKind.SLOW:
            delay_s = fault.delay_s if fault.delay_s > 0 else DEFAULT_SLOW_DELAY_S
            with self._lock:
                self._slow = _Slowdown(at_step, delay_s, duration_s)
        elif fault_kind is FaultKind.NAN:
            with self._lock:
                if self._nan_at_step is None or at_step < self._nan_at_step:
                    self._nan_at_step = at_step
        elif fault_kind is FaultKind.SDC:
            target = fault.target or "weight"
            if target not in SDC_TARGETS:
                log.warning("rank %d: ignoring sdc fault with target %r (command %s)", self.rank, target,
                            cmd.command_id)
                return
            with self._lock:
                self._sdc.append(SdcFault(target, at_step, fault.bit if fault.HasField("bit") else None,
                                          fault.value_error, fault.persistent))
        elif fault_kind is FaultKind.CKPT_CORRUPT and self.checkpoint_dir:
            # the controller hands a step-timed corruption to rank 0: exactly at that step
            with self._lock:
                self._corrupt_at_step = at_step
        else:
            log.warning("rank %d: ignoring fault kind %r, not a rank's to act on (command %s)",
                        self.rank, str(fault_kind), cmd.command_id)
            return
        log.info("rank %d: %s armed for step %d (command %s)", self.rank, str(fault_kind), at_step, cmd.command_id)

    def before_step(self, step: int) -> None:
        """Fire any fault armed for ``step`` (called by the training loop before each step)."""
        with self._lock:
            crash_at, hang_at, hang_s = self._crash_at_step, self._hang_at_step, self._hang_s
            if hang_at is not None and step >= hang_at:
                self._hang_at_step = None
            corrupt_at = self._corrupt_at_step
            if corrupt_at is not None and step >= corrupt_at:
                self._corrupt_at_step = None
        if corrupt_at is not None and step >= corrupt_at:
            self._corrupt_checkpoint(step)
        if crash_at is not None and step >= crash_at:
            self._crash(f"armed for step {crash_at}, now at step {step}")
        if hang_at is not None and step >= hang_at:
            self._hang(step, hang_s)
        delay_s = self._slow_delay(step)
        if delay_s > 0:
            self._sleep(delay_s)

    def _corrupt_checkpoint(self, step: int) -> None:
        from fleet.workers import checkpoint

        try:
            damaged = checkpoint.corrupt_newest(self.checkpoint_dir)
        except FileNotFoundError as exc:
            log.warning("rank %d: ckpt-corrupt at step %d: %s", self.rank, step, exc)
            return
        print(f"fleet: rank {self.rank} injected checkpoint corruption at step {step}: {damaged}",
              file=sys.stderr, flush=True)
        damaged_step = checkpoint.step_of(damaged.parent)
        if damaged_step is not None and self.on_checkpoint_damaged is not None:
            self.on_checkpoint_damaged(damaged_step, str(damaged.parent),
                                       f"ckpt-corrupt fault: rank {self.rank} flipped bytes in {damaged.name} "
                                       f"at the top of step {step}")

    def poison_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times NaN the first time it is called at or after the armed ``nan`` step,
        else ``loss`` itself (called on every micro-batch's loss)."""
        with self._lock:
            at = self._nan_at_step
            if at is None or step < at:
                return loss
            self._nan_at_step = None
        print(f"fleet: rank {self.rank} injected NaN loss at step {step}", file=sys.stderr, flush=True)
        return loss * float("nan")

    def sdc_due(self, step: int, target: str) -> SdcFault | None:
        """The ``sdc`` fault to fire at ``step`` on ``target``, or None. A one-shot fault
        is returned once (at the first step >= its ``at_step``), a persistent one at every
        step from then on."""
        with self._lock:
            for f in self._sdc:
                if f.target != target or step < f.at_step:
                    continue
                if not f.persistent:
                    self._sdc.remove(f)
                return f
        return None

    def inject_sdc(self, fault: SdcFault, step: int, tensors: list[torch.Tensor]) -> None:
        """Corrupt one element of one of ``tensors`` in place, as ``fault`` says; the same
        element for the same fault on this rank every time (autograd does not see it)."""
        candidates = [t for t in tensors if t is not None and t.numel() > 0]
        if not candidates:
            return
        t = candidates[fault.pick(self.rank, len(candidates))]
        index = fault.pick(self.rank + 7919, t.numel())
        first = fault not in self._sdc_fired
        # a persistent flip is a stuck bit: it keeps the value the first flip gave it (a
        # flip at every step would toggle an accumulated weight back)
        stuck = self._stuck.get(fault) if fault.persistent else None
        before, after = corrupt_element(t, index, fault.bit, fault.value_error, stuck=stuck)
        if fault.persistent and fault.bit is not None and stuck is None:
            self._stuck[fault] = bit_of(t, index, fault.bit)
        self._sdc_fired.add(fault)
        if first or not fault.persistent:
            print(f"fleet: rank {self.rank} injected sdc ({fault.describe()}) at step {step}: element {index} of a "
                  f"{tuple(t.shape)} {fault.target} tensor, {before!r} -> {after!r}"
                  + (" (and at every step from now on)" if fault.persistent else ""),
                  file=sys.stderr, flush=True)

    def sdc_forward_hook(self, fault: SdcFault, step: int) -> Callable:
        """A forward hook that corrupts one element of the module's output (a copy)."""
        def hook(module: object, inputs: object, output: torch.Tensor) -> torch.Tensor:
            out = output.clone()
            self.inject_sdc(fault, step, [out.detach()])
            return out
        return hook

    def _slow_delay(self, step: int) -> float:
        """Seconds this step must sleep for an armed slowdown (0: none, or it is over)."""
        with self._lock:
            slow = self._slow
            if slow is None or step < slow.at_step:
                return 0.0
            now = self._clock()
            if slow.started is None:
                slow.started = now
                first = True
            else:
                first = False
                if slow.duration_s > 0 and now - slow.started >= slow.duration_s:
                    self._slow = None
                    log.info("rank %d: slowdown over at step %d", self.rank, step)
                    return 0.0
        if first:
            print(f"fleet: rank {self.rank} injected slowdown from step {step}: +{slow.delay_s:g} s per step "
                  f"({f'for {slow.duration_s:g} s' if slow.duration_s > 0 else 'for the rest of the attempt'})",
                  file=sys.stderr, flush=True)
        return slow.delay_s

    def _hang(self, step: int, duration_s: float) -> None:
        print(f"fleet: rank {self.rank} injected hang at step {step} "
              f"({f'{duration_s:g} s' if duration_s > 0 else 'until killed'})", file=sys.stderr, flush=True)
        deadline = time.monotonic() + duration_s if duration_s > 0 else None
        # Event.wait in bounded slices: the thread stays interruptible and never spins
        while deadline is None or time.monotonic() < deadline:
            remaining = 60.0 if deadline is None else min(60.0, deadline - time.monotonic())
            if remaining <= 0 or self._released.wait(remaining):
                break
        log.info("rank %d: hang at step %d over", self.rank, step)

    def release(self) -> None:
        """End an ongoing injected hang or slowdown, and any later one (tests, and a clean shutdown)."""
        self._released.set()

    def _crash(self, why: str) -> None:
        # Straight to stderr, flushed: logging handlers may buffer, and nothing runs after this.
        print(f"fleet: rank {self.rank} injected crash ({why}); sending itself SIGKILL",
              file=sys.stderr, flush=True)
        # SIGKILL, not sys.exit or os._exit: a real crash runs no finally blocks, atexit
        # handlers or flushes, and the parent sees a death by signal.
        os.kill(os.getpid(), signal.SIGKILL)
        # Not reached: a signal a process sends itself is delivered before kill() returns.
        os._exit(128 + signal.SIGKILL)


def _words(t: torch.Tensor) -> torch.Tensor:
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().view(-1).view(ints)


def bit_of(t: torch.Tensor, index: int, bit: int) -> int:
    """Bit ``bit`` (modulo the element's width) of element ``index`` of ``t`` (flat)."""
    size = 8 * t.element_size()
    return (int(_words(t)[index].item()) >> (bit % size)) & 1


def corrupt_element(t: torch.Tensor, index: int, bit: int | None, value_error: float, *,
                    stuck: int | None = None) -> tuple[float, float]:
    """Flip ``bit`` of element ``index`` of ``t`` (flat, in place; ``stuck``: set it to that
    instead), or scale it by ``1 + value_error`` (set it to ``value_error`` when it is
    0); returns (before, after)."""
    import torch

    with torch.no_grad():
        flat = t.detach().view(-1)
        before = float(flat[index].item())
        if bit is not None:
            size = t.element_size()
            words = _words(t)
            b = bit % (8 * size)
            value = int(words[index].item()) & ((1 << 8 * size) - 1)
            value = value ^ (1 << b) if stuck is None else (value & ~(1 << b)) | (stuck << b)
            if value >= 1 << (8 * size - 1):  # back to the signed range of the integer view
                value -= 1 << (8 * size)
            words[index] = value
        else:
            flat[index] = before * (1 + value_error) if before != 0 else value_error
        return before, float(flat[index].item())
