"""Chaos firing: carrying a due fault order out, and re-arming step-timed ones.

``ChaosFirer.fire`` is what ``chaos.Scheduler`` calls when an order is due: rank and
agent kinds become a ``Command`` sent to the node's agent; node-down takes the node
away (its agent and its ranks die at once); ckpt-corrupt is sent to rank 0 (given a
step) or done here; controller-crash kills this process. A checkpoint damaged here is
marked invalid in the store at once (rank 0 reports its own as an invalid
``CheckpointEvent``): the manifest on disk is the truth, the store's flag follows it.
A step-timed order handed to workers is *armed* in them: when the attempt fails before
that step, ``rearm`` hands it to the next attempt's workers, and ``forget_caused``
drops the one that caused the failure (it fired).

``spec_of`` and ``order_of`` translate between an order and the wire's ``FaultSpec`` (an
sdc fault's target, bit, relative error and persistence included), in one place for the
client, the control server and the ranks.

It reaches the rest of the controller only through the narrow Protocols below. No Ray
and no gRPC here (protobuf messages only).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from fleet.controlplane import chaos
from fleet.controlplane.detectors import Incident
from fleet.controlplane.errors import FleetError, NotFoundError
from fleet.controlplane.recovery import caused
from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind

log = logging.getLogger(__name__)


class Position(Protocol):
    """Where the job is: its id and the current attempt's placement."""

    @property
    def job_id(self) -> str: ...

    def position(self) -> tuple[int, list[str]]:
        """(current attempt, node name of each rank); (0, []) before the first."""


class CommandSink(Protocol):
    """Delivers a command to a node's agent (``agent_server.AgentRegistry``)."""

    def send(self, node_name: str, command: events_pb2.Command) -> None: ...


class Breaker(Protocol):
    """Takes a node away (node-down): its agent and the given ranks' processes."""

    def kill_node(self, node: str, ranks: list[int]) -> None: ...


class DownTimes(Protocol):
    """Keeps the end of a fault's duration (``agent_supervisor.AgentSupervisor``)."""

    def agent_down_until(self, node: str, until: float) -> None: ...

    def node_down_until(self, node: str, until: float) -> None: ...


class CheckpointBook(Protocol):
    """Keeps checkpoint validity in step with the disk (``store.Store``)."""

    def invalidate_checkpoint(self, job_id: str, step: int, reason: str = "",
                              attempt: int | None = None) -> None: ...


def spec_of(order: chaos.FaultOrder) -> events_pb2.FaultSpec:
    """The wire form of ``order`` (what ranks and agents act on); ``bit`` only when set."""
    spec = events_pb2.FaultSpec(kind=FaultKind(order.kind).wire, at_step=order.at_step,
                                duration_s=order.duration_s, after_s=order.after_s, delay_s=order.delay_s,
                                target=order.target, value_error=order.value_error, persistent=order.persistent)
    if order.bit is not None:
        spec.bit = order.bit
    return spec


def order_of(spec: events_pb2.FaultSpec, rank: int = -1, node: str = "") -> chaos.FaultOrder:
    """The order a ``FaultSpec`` aimed at ``rank`` / ``node`` describes (not validated);
    ``ConfigError`` naming ``kind`` for an unknown kind number."""
    return chaos.FaultOrder(
        kind=chaos.kind_of_wire(spec.kind), rank=rank, node=node, at_step=spec.at_step, after_s=spec.after_s,
        duration_s=spec.duration_s, delay_s=spec.delay_s, target=spec.target,
        bit=spec.bit if spec.HasField("bit") else None, value_error=spec.value_error, persistent=spec.persistent)


def target(order: chaos.FaultOrder, placement: list[str]) -> tuple[str, list[int]]:
    """The node and ranks ``order`` hits in ``placement`` (node of each rank);
    ``NotFoundError`` when its rank or node is not in it."""
    if order.kind in chaos.JOB_KINDS:
        return "", []
    if order.rank >= 0:
        if order.rank >= len(placement):
            raise NotFoundError(f"rank {order.rank} does not exist (world size {len(placement)})")
        node = placement[order.rank]
        ranks = [order.rank] if order.kind in chaos.RANK_KINDS else \
            [r for r, n in enumerate(placement) if n == node]
        return node, ranks
    ranks = [r for r, n in enumerate(placement) if n == order.node]
    if not ranks:
        raise NotFoundError(f"node {order.node!r} runs no rank of this job")
    return order.node, ranks


class ChaosFirer:
    """Carries due fault orders out for one job; keeps the orders armed in workers.

    ``fire`` runs on the chaos scheduler's thread, ``rearm``/``forget_caused`` on the
    controller's: the armed list is guarded by a lock. ``checkpoint_dir`` is the job's
    checkpoint folder (ckpt-corrupt without a step); ``corrupt`` damages it and returns
    the damaged file; ``checkpoints`` is told which checkpoint that made invalid."""

    def __init__(self, job: Position, commands: CommandSink, breaker: Breaker, down: DownTimes,
                 checkpoints: CheckpointBook, checkpoint_dir: str,
                 corrupt: Callable[[str], Path] = chaos.corrupt_checkpoint,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._job = job
        self._commands = commands
        self._breaker = breaker
        self._down = down
        self._checkpoint_dir = checkpoint_dir
        self._corrupt = corrupt
        self._checkpoints = checkpoints
        self._clock = clock
        self._lock = threading.Lock()
        self._armed: list[chaos.FaultOrder] = []

    def target(self, order: chaos.FaultOrder) -> tuple[str, list[int]]:
        """The node and ranks ``order`` hits in the current placement."""
        return target(order, self._job.position()[1])

    def armed(self) -> list[chaos.FaultOrder]:
        """Step-timed orders the workers of the current attempt carry, oldest first."""
        with self._lock:
            return list(self._armed)

    def fire(self, order: chaos.FaultOrder) -> None:
        """Carry out a due fault order."""
        attempt, placement = self._job.position()
        node, ranks = target(order, placement)
        kind = FaultKind(order.kind)
        spec = spec_of(order)
        spec.after_s = 0.0  # due now: the delay was the scheduler's
        log.warning("chaos: firing %s", order.describe())
        if kind.worker_timed and order.at_step > 0:
            with self._lock:  # armed in the workers: a restart before the step must re-arm it
                self._armed.append(order)
        if kind in chaos.RANK_KINDS:
            self._send(node, attempt, order.rank if order.rank >= 0 else -1, spec)
        elif kind in chaos.AGENT_KINDS:
            if kind is FaultKind.AGENT_DOWN and order.duration_s > 0:
                self._down.agent_down_until(node, self._clock() + order.duration_s)
            self._send(node, attempt, -1, spec)
        elif kind is FaultKind.NODE_DOWN:
            if order.duration_s > 0:
                self._down.node_down_until(node, self._clock() + order.duration_s)
            self._breaker.kill_node(node, ranks)
        elif kind is FaultKind.CKPT_CORRUPT and order.at_step > 0:
            # rank 0 corrupts at exactly that step (this thread only sees steps late)
            self._send(placement[0], attempt, 0, spec)
        elif kind is FaultKind.CKPT_CORRUPT:
            self._corrupt_here(attempt)
        elif kind is FaultKind.CONTROLLER_CRASH:
            print(f"fleet: injected controller crash (job {self._job.job_id}); sending SIGKILL to pid "
                  f"{os.getpid()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def _corrupt_here(self, attempt: int) -> None:
        """Damage the newest valid checkpoint and mark it invalid in the store (a
        ``ckpt_invalid`` action of ``attempt``)."""
        from fleet.workers.checkpoint import step_of  # torch: loaded by the corruption anyway

        damaged = self._corrupt(self._checkpoint_dir)
        log.warning("chaos: corrupted %s", damaged)
        step = step_of(damaged.parent)
        if step is None:
            log.warning("chaos: %s is not in a step directory; the store is left as it is", damaged)
            return
        try:
            self._checkpoints.invalidate_checkpoint(
                self._job.job_id, step, f"ckpt-corrupt fault: the controller flipped bytes in {damaged.name}",
                attempt=attempt or None)
        except NotFoundError:
            # its save is still on its way to the store; the restore that skips it marks it
            log.warning("chaos: checkpoint of step %d is not in the store yet", step)

    def _send(self, node: str, attempt: int, rank: int, spec: events_pb2.FaultSpec) -> None:
        self._commands.send(node, events_pb2.Command(
            command_id=uuid.uuid4().hex[:12], job_id=self._job.job_id, attempt=attempt, rank=rank, fault=spec))

    def forget_caused(self, incident: Incident) -> bool:
        """Drop the armed order that caused ``incident`` (it fired: never re-arm it);
        returns whether any armed order is left."""
        with self._lock:
            self._armed = [o for o in self._armed if not caused(o, incident)]
            return bool(self._armed)

    def rearm(self, completed: int) -> None:
        """Hand the new attempt's workers the step-timed faults the failed attempt armed
        but never reached (its workers took them along); drop the ones it fired: a fault
        fires at the top of its step, so the failed attempt, which completed step
        ``completed``, fired everything up to ``completed + 1``."""
        with self._lock:
            due, self._armed = [o for o in self._armed if o.at_step > completed + 1], []
        for order in due:
            try:
                self.fire(order)
            except FleetError as exc:
                log.warning("chaos: could not re-arm %s: %s", order.describe(), exc)
