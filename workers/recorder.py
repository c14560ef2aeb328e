"""The flight recorder: every collective this rank issues, as it enters and as it leaves.

``FlightRecorder`` wraps the ``torch.distributed`` collectives the training loop itself
issues. With a ``NativeFlightTail`` attached (the default in training; see
workers/native_fr.py) PyTorch's native recorder is the source of truth for *every*
collective, FSDP's and DCP's included, and these calls are timed like every other
``torch.distributed`` call (``workers.collective_timing``). Without one (a torch build without the native recorder), each wrapped call
emits two ``CollectiveEvent``s through ``sink``: ``state="started"`` at entry (with
``exit_ns = 0``) and ``"completed"`` or ``"failed"`` at exit, both carrying the same
sequence number. Emitting at entry is the point: when a collective hangs, the agent
already knows which ranks entered it and which never did.

Invariants:
  * Sequence numbers are per process group (keyed by the group's ``group_name``; the
    default group is ``"0"``), start at 1 and are consecutive. A failed call still
    consumes its number, because the other ranks' numbering advanced too.
  * Only the calling thread issues collectives; the recorder is not thread-safe and
    need not be (one training loop per process). ``sink`` must be non-blocking and
    thread-safe (``Reporter.emit`` is).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from fleet.proto import events_pb2
from fleet.workers.native_fr import NativeFlightTail

Sink = Callable[[events_pb2.Event], None]

# Renamed in recent torch; prefer the new name so no deprecation warning fires per step.
# Looked up at each call: ``workers.collective_timing`` replaces the module's functions.
_ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER_SINGLE = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FlightRecorder:
    """Records the collectives of one rank of one attempt of a job.

    ``step`` is the training step stamped on each event; set it with ``set_step`` (or
    assign ``recorder.step``) at the top of each step.
    """

    def __init__(self, job_id: str, attempt: int, rank: int, sink: Sink,
                 tail: NativeFlightTail | None = None) -> None:
        self.tail = tail
        self.job_id = job_id
        self.attempt = attempt
        self.rank = rank
        self.sink = sink
        self.step = 0
        self._seq: dict[str, int] = {}
        # Group name and size never change for a live group; look them up once.
        self._group_info: dict[int, tuple[str, int]] = {}

    def set_step(self, step: int) -> None:
        """Stamp subsequent collectives with training step ``step``."""
        self.step = step
        if self.tail is not None:
            self.tail.step_started(step)

    def last_seq(self, group: dist.ProcessGroup | None = None) -> int:
        """The sequence number of the latest collective issued on ``group`` (0 if none)."""
        return self._seq.get(self._info(group)[0], 0)

    # ---- wrapped collectives ---------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None) -> None:
        """In-place ``dist.all_reduce`` of ``tensor``, recorded."""
        self._run("all_reduce", group, (tensor,), (tensor,),
                  lambda: dist.all_reduce(tensor, op=op, group=group))

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
        """In-place ``dist.broadcast`` of ``tensor`` from global rank ``src``, recorded."""
        self._run("broadcast", group, (tensor,), (tensor,),
                  lambda: dist.broadcast(tensor, src=src, group=group))

    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        """``dist.barrier``, recorded (no tensors)."""
        self._run("barrier", group, (), (), lambda: dist.barrier(group=group))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor,
                               group: dist.ProcessGroup | None = None) -> None:
        """Gather ``input`` from every rank into ``output`` (``group_size`` times larger), recorded."""
        self._run("all_gather_into_tensor", group, (input,), (output,),
                  lambda: getattr(dist, _ALL_GATHER_SINGLE)(output, input, group=group))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor,
                              op: ReduceOp.RedOpType = ReduceOp.SUM,
                              group: dist.ProcessGroup | None = None) -> None:
        """Reduce ``input`` across ranks and keep this rank's shard in ``output``, recorded."""
        self._run("reduce_scatter_tensor", group, (input,), (output,),
                  lambda: getattr(dist, _REDUCE_SCATTER_SINGLE)(output, input, op=op, group=group))

    def all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor,
                   group: dist.ProcessGroup | None = None) -> None:
        """List form of all-gather: ``outputs[i]`` receives rank ``i``'s ``input``, recorded."""
        self._run("all_gather", group, (input,), tuple(outputs),
                  lambda: dist.all_gather(outputs, input, group=group))

    # ---- internals -----------------------------------------------------------------

    def _info(self, group: dist.ProcessGroup | None) -> tuple[str, int]:
        pg = group if group is not None else dist.group.WORLD
        key = id(pg)
        info = self._group_info.get(key)
        if info is None:
            info = (pg.group_name, dist.get_world_size(pg))
            self._group_info[key] = info
        return info

    def _run(self, op: str, group: dist.ProcessGroup | None, inputs: Sequence[torch.Tensor],
             outputs: Sequence[torch.Tensor], call: Callable[[], object]) -> None:
        name, size = self._info(group)
        if self.tail is not None:  # the native entry is the record; collective_timing times the call
            call()
            return
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq
        event = events_pb2.Event()
        ce = event.collective
        ce.job_id = self.job_id
        ce.attempt = self.attempt
        ce.rank = self.rank
        ce.group = name
        ce.group_size = size
        ce.seq = seq
        ce.op = op
        ce.step = self.step
        for t in inputs:
            ce.input_sizes.add().dims.extend(t.shape)
            ce.input_dtypes.append(_dtype_name(t.dtype))
        for t in outputs:
            ce.output_sizes.add().dims.extend(t.shape)
            ce.output_dtypes.append(_dtype_name(t.dtype))
        ce.state = "started"
        ce.enter_ns = time.time_ns()
        # The sink may keep the message, so the exit record is a copy, not a mutation.
        self.sink(event)
        try:
            call()
        except BaseException:
            self.sink(self._finished(event, "failed", time.time_ns()))
            raise
        self.sink(self._finished(event, "completed", time.time_ns()))

    @staticmethod
    def _finished(started: events_pb2.Event, state: str, exit_ns: int) -> events_pb2.Event:
        done = events_pb2.Event()
        done.CopyFrom(started)
        done.collective.exit_ns = exit_ns
        done.collective.state = state
        return done
