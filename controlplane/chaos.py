"""Chaos: the fault kinds, the rules an order must follow, and the schedule that fires them.

A ``FaultOrder`` says what to break (``kind``), where (a rank, or a node) and when (at a
training step, or some seconds after the order). ``fleet inject-fault`` and the
``chaos:`` section of cluster.yaml both produce orders and check them with the same
rules (``check_order``). Who carries a fault out depends on its kind:

  * ``RANK_KINDS`` go to ranks through their node agent (workers/faults.py acts on them);
  * ``AGENT_KINDS`` go to a node's agent, which acts on itself;
  * ``CONTROLLER_KINDS`` are carried out by the controller (``corrupt_checkpoint`` here).

``Scheduler`` holds orders until they are due and then hands each, once, to the
controller's ``fire`` callback on its own named daemon thread. An order for a rank with
``at_step`` is due at once: the worker arms it and fires at that step itself. Any
order with ``after_s`` is due that many seconds after it was submitted; agent and
controller orders with ``at_step`` are due once the job's step reaches it.

No Ray and no gRPC here: ``fire`` is ``chaos_fire.ChaosFirer.fire``, which the
controller wires to its agents and workers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fleet.controlplane.errors import ConfigError, NotFoundError, StateError
from fleet.proto.kinds import Aim, Carrier, FaultKind
from fleet.workers.faults import DEFAULT_SLOW_DELAY_S

log = logging.getLogger(__name__)

#: Every fault kind, in the order help texts list them (the contract's ``FaultKind``).
FAULT_KINDS: tuple[str, ...] = tuple(k.value for k in FaultKind)
RANK_KINDS = frozenset(k for k in FaultKind if k.carrier is Carrier.RANK)
AGENT_KINDS = frozenset(k for k in FaultKind if k.carrier is Carrier.AGENT)
CONTROLLER_KINDS = frozenset(k for k in FaultKind if k.carrier is Carrier.CONTROLLER)
#: Kinds a worker times itself when given ``at_step`` (exactly at that step): the rank
#: kinds, and ``ckpt-corrupt``, which rank 0 carries out at the top of that step.
WORKER_TIMED = frozenset(k for k in FaultKind if k.worker_timed)

#: Kinds that aim at a node (given directly, or as the node of a given rank).
NODE_KINDS = frozenset(k for k in FaultKind if k.aim is Aim.NODE)
#: Kinds that aim at the whole job: neither a rank nor a node.
JOB_KINDS = frozenset(k for k in FaultKind if k.aim is Aim.JOB)
#: Kinds for which ``duration_s`` means something.
DURATION_KINDS = frozenset(k for k in FaultKind if k.has_duration)

#: One line per kind, for --help, errors and the README.
KIND_HELP: Mapping[str, str] = {
    "crash": "the rank's process kills itself with SIGKILL (no cleanup), like a segfault",
    "hang": "the rank stops before its next step's collectives for --duration s (0 = until killed); "
            "its peers block in that collective",
    "slow": f"straggler: every step of the rank sleeps --delay s extra (0 = {DEFAULT_SLOW_DELAY_S:g} s) "
            "for --duration s (0 = the rest of the attempt)",
    "nan": "the rank's loss becomes NaN once, at the step",
    "node-down": "the controller takes the whole node away (its ranks and its agent die), "
                 "for --duration s (0 = for the rest of the attempt)",
    "agent-down": "the node's agent stops for --duration s (0 = until restarted); its ranks keep training",
    "partition": "the node's agent loses its connection to the controller for --duration s "
                 "(0 = for the rest of the attempt)",
    "ckpt-corrupt": "bytes are flipped in the newest valid checkpoint (by rank 0 at the top of --at-step, "
                    "else by the controller); a restart must fall "
                    "back to an older one",
    "controller-crash": "the controller process dies (SIGKILL) and must be restarted",
    "sdc": "silent data corruption: the rank flips --bit B of one element of its --target (weight, grad, "
           "optimizer or activation), or multiplies it by 1 + --value-error, once (--persistent: on every "
           "step from then on); the job needs a copy of that state to compare (ddp, or hsdp on 2+ nodes)",
    "sdc-gemm": "the node's matrix products come out wrong in one element (a defective core) until its "
                "agent restarts; its known-answer GEMM test must catch it",
}

#: What an ``sdc`` fault can corrupt (``FaultOrder.target``; "" = weight).
SDC_TARGETS = ("weight", "grad", "optimizer", "activation")
#: The bits of a float32 value an ``sdc`` flip may name (0 = lowest mantissa bit, 31 = sign).
SDC_BITS = range(32)

#: How ``fleet inject-fault`` names each field of a ``FaultOrder``.
FLAGS: Mapping[str, str] = {
    "kind": "--kind", "rank": "--rank", "node": "--node", "at_step": "--at-step",
    "after_s": "--after", "duration_s": "--duration", "delay_s": "--delay",
    "target": "--target", "bit": "--bit", "value_error": "--value-error", "persistent": "--persistent",
}
#: How cluster.yaml's ``chaos.faults`` items name them.
FIELDS: Mapping[str, str] = {name: name for name in FLAGS}


@dataclass(frozen=True)
class FaultOrder:
    """One fault to inject. ``rank`` -1 means "by node"; ``node`` "" means "by rank"."""

    kind: str
    rank: int = -1
    node: str = ""
    at_step: int = 0        # the first step >= this one (0 = at once)
    after_s: float = 0.0    # or: seconds after the order (0 = at once)
    duration_s: float = 0.0  # hang, slow, agent-down, partition, node-down: how long (0 = indefinitely)
    delay_s: float = 0.0    # slow: extra seconds per step (0 = the worker's default)
    target: str = ""        # sdc: weight | grad | optimizer | activation ("" = weight)
    bit: int | None = None  # sdc: flip this bit of one float32 element ...
    value_error: float = 0.0  # ... or multiply it by 1 + value_error
    persistent: bool = False  # sdc: on every step from at_step on, not once

    def describe(self) -> str:
        """One line for logs and the store, e.g. ``crash on rank 2 at step 30``."""
        if self.rank >= 0:
            target = f" on rank {self.rank}"
        elif self.node:
            target = f" on {self.node}"
        else:
            target = ""
        when = f" at step {self.at_step}" if self.at_step else f" after {self.after_s:g} s" if self.after_s else ""
        how = ""
        if self.kind == FaultKind.SDC:
            what = f"bit {self.bit}" if self.bit is not None else f"relative error {self.value_error:g}"
            how = f" ({what} in a {self.target or 'weight'}{', persistent' if self.persistent else ''})"
        return f"{self.kind}{how}{target}{when}"


def check_kind(kind: str, names: Mapping[str, str] = FIELDS) -> str | None:
    """Why ``kind`` is not a fault kind, or None."""
    if kind in FAULT_KINDS:
        return None
    return f"{names['kind']}: unknown fault kind {kind!r} (choose from {', '.join(FAULT_KINDS)})"


def kind_of_wire(number: int) -> str:
    """The fault kind of a ``FaultSpec.kind`` number; ConfigError naming ``kind`` when it
    is unspecified or unknown."""
    try:
        return FaultKind.from_wire(number).value
    except ValueError:
        raise ConfigError(f"kind: unknown fault kind number {number} "
                          f"(choose from {', '.join(FAULT_KINDS)})") from None


def check_order(order: FaultOrder, names: Mapping[str, str] = FIELDS) -> str | None:
    """The first rule ``order`` breaks, as one line naming the fields by ``names``
    (``FLAGS`` or ``FIELDS``); None when it is valid."""
    problem = check_kind(order.kind, names)
    if problem:
        return problem
    n, kind = names, order.kind
    has_rank, has_node = order.rank >= 0, bool(order.node)
    if order.rank < -1:
        return f"{n['rank']}: must be >= 0 (got {order.rank})"
    if order.at_step < 0:
        return f"{n['at_step']}: must be >= 0 (got {order.at_step})"
    for field in ("after_s", "duration_s", "delay_s"):
        value = getattr(order, field)
        if not (math.isfinite(value) and value >= 0):
            return f"{n[field]}: must be a finite number >= 0 (got {value:g})"
    if kind in JOB_KINDS:
        if has_rank or has_node:
            return f"{n['rank']} / {n['node']}: {kind} acts on the whole job; give neither"
    elif has_rank and has_node:
        return f"{n['rank']} / {n['node']}: give one of them, not both"
    elif not (has_rank or has_node):
        if kind in NODE_KINDS:
            return f"{n['node']}: {kind} needs a node (or {n['rank']}: that rank's node)"
        return f"{n['rank']} / {n['node']}: {kind} needs a rank or a node (every rank on it)"
    if order.at_step > 0 and order.after_s > 0:
        return f"{n['at_step']} / {n['after_s']}: give one of them, not both"
    if order.duration_s > 0 and kind not in DURATION_KINDS:
        return f"{n['duration_s']}: {kind} has no duration (only {', '.join(sorted(DURATION_KINDS))})"
    if order.delay_s > 0 and kind != FaultKind.SLOW:
        return f"{n['delay_s']}: only slow has a per-step delay"
    return _check_sdc(order, names)


def _check_sdc(order: FaultOrder, n: Mapping[str, str]) -> str | None:
    """The rules of an sdc order's own fields (and that no other kind has them)."""
    if order.kind != FaultKind.SDC:
        for name, unset in (("target", ""), ("bit", None), ("value_error", 0.0), ("persistent", False)):
            if getattr(order, name) != unset:
                return f"{n[name]}: only sdc takes it (not {order.kind})"
        return None
    if order.target not in ("", *SDC_TARGETS):
        return f"{n['target']}: must be one of {', '.join(SDC_TARGETS)} (got {order.target!r})"
    if order.bit is not None and order.value_error != 0:
        return f"{n['bit']} / {n['value_error']}: give one of them, not both"
    if order.bit is None and order.value_error == 0:
        return f"{n['bit']} / {n['value_error']}: sdc needs one (a bit to flip, or a relative error)"
    if order.bit is not None and order.bit not in SDC_BITS:
        return f"{n['bit']}: must be a float32 bit, 0 (lowest mantissa bit) to 31 (sign) (got {order.bit})"
    if not math.isfinite(order.value_error):
        return f"{n['value_error']}: must be a finite number (got {order.value_error:g})"
    if order.value_error != 0 and not 1e-9 <= abs(order.value_error) <= 1e6:
        return f"{n['value_error']}: must be between 1e-9 and 1e6 in size (got {order.value_error:g})"
    return None


def validate_order(order: FaultOrder, names: Mapping[str, str] = FLAGS) -> None:
    """Raise ``ConfigError`` (one line naming the offending flag) if ``order`` is invalid."""
    problem = check_order(order, names)
    if problem:
        raise ConfigError(problem)


# -- the schedule ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pending:
    order: FaultOrder
    due_at: float | None   # clock() time it is due, or None: due at ``at_step``
    at_step: int


def _due(p: _Pending, now: float, step: int | None) -> bool:
    if p.due_at is not None:
        return now >= p.due_at
    return step is not None and step >= p.at_step


class Scheduler:
    """Fires fault orders when they are due, each once, on a named daemon thread.

    ``fire(order)`` is the controller's delivery; what it raises is logged and the
    order dropped. ``current_step()`` is the job's newest step (polled every
    ``poll_interval_s`` while an order waits for one). ``clock`` gives seconds. At most
    ``max_pending`` orders wait at once. A context manager; ``close`` drops what is
    still pending.
    """

    def __init__(self, fire: Callable[[FaultOrder], None], current_step: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, *, poll_interval_s: float = 0.05,
                 max_pending: int = 1000) -> None:
        self._fire = fire
        self._current_step = current_step
        self._clock = clock
        self._poll_interval_s = poll_interval_s
        self._max_pending = max_pending
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, order: FaultOrder) -> None:
        """Queue ``order`` (validated here too); ``StateError`` when closed or full."""
        validate_order(order)
        if order.after_s > 0:
            entry = _Pending(order, self._clock() + order.after_s, 0)
        elif order.kind in WORKER_TIMED or order.at_step == 0:
            entry = _Pending(order, self._clock(), 0)  # a rank arms at_step itself
        else:
            entry = _Pending(order, None, order.at_step)
        with self._cond:
            if self._closed:
                raise StateError("the chaos scheduler is closed")
            if len(self._pending) >= self._max_pending:
                raise StateError(f"{len(self._pending)} faults are already waiting; no more are taken")
            self._pending.append(entry)
            self._cond.notify_all()
        log.info("chaos: %s scheduled", order.describe())

    def pending(self) -> list[FaultOrder]:
        """Orders not fired yet, oldest first."""
        with self._cond:
            return [p.order for p in self._pending]

    def run_due(self) -> list[FaultOrder]:
        """Fire every order due now, on the calling thread; return them (the thread's one pass)."""
        with self._cond:
            waiting_for_step = any(p.due_at is None for p in self._pending)
        step = self._step() if waiting_for_step else None
        now = self._clock()
        with self._cond:
            due = [p for p in self._pending if _due(p, now, step)]
            self._pending = [p for p in self._pending if not _due(p, now, step)]
        for p in due:
            try:
                self._fire(p.order)
            except Exception:  # noqa: BLE001 -- a failed delivery must not stop the schedule
                log.exception("chaos: firing %s failed", p.order.describe())
            else:
                log.info("chaos: fired %s", p.order.describe())
        return [p.order for p in due]

    def _step(self) -> int | None:
        try:
            return self._current_step()
        except Exception:  # noqa: BLE001 -- no step known yet: try again next poll
            log.exception("chaos: reading the current step failed")
            return None

    def start(self) -> None:
        """Start the thread (once)."""
        with self._cond:
            if self._closed:
                raise StateError("the chaos scheduler is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="fleet-chaos-scheduler", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                # bounded waits: due times come from an injectable clock, steps from polling
                self._cond.wait(self._poll_interval_s if self._pending else 1.0)
                if self._closed:
                    return
            self.run_due()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and drop pending orders; idempotent."""
        with self._cond:
            self._closed = True
            dropped, self._pending = self._pending, []
            self._cond.notify_all()
            thread = self._thread
        for p in dropped:
            log.info("chaos: %s dropped, never fired", p.order.describe())
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("chaos: scheduler thread still running after %.1f s", timeout_s)

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- ckpt-corrupt ---------------------------------------------------------------------------



def corrupt_checkpoint(checkpoint_dir: str | Path) -> Path:
    """Flip bytes in place in the largest data file of the newest valid checkpoint under
    ``checkpoint_dir`` (``workers.checkpoint.corrupt_newest``), so that ``latest_valid``
    skips it; return that file. ``NotFoundError`` when there is no valid checkpoint."""
    from fleet.workers import checkpoint  # torch: only the controller that corrupts pays for it

    try:
        return checkpoint.corrupt_newest(checkpoint_dir)
    except FileNotFoundError as exc:
        raise NotFoundError(str(exc)) from None
