"""Measured durations for collectives on backends that record none (gloo).

PyTorch's flight recorder notes when a gloo op retires but not when it finished, so an
entry's exit is only when a poll first saw it done: no duration. This module times the
ops where Python issues them. ``install(sink)`` wraps the public collectives of
``torch.distributed`` (the module attributes: ``dist.all_reduce``,
``dist.all_gather_into_tensor``, ...), which is how user scripts, FSDP2
(``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor``), expert-parallel
``all_to_all_single`` (also through ``torch.distributed.nn.functional``) and fleet's
own recorder reach them, and reports one window per call:

  * a blocking call (``async_op=False``): from the call to its return, ``Timing.WRAPPER``
    -- the thread waited all of it, so all of it is exposed;
  * ``async_op=True``: from the call to the completion of its ``Work``'s future (a
    callback on the backend's thread), ``Timing.ASYNC`` -- the thread was free meanwhile.
    Reported twice: opened at the call (``exit_ns`` 0), closed by the callback.

``NativeFlightTail`` attaches each window to the native entry it contains (same group,
``enter <= time_created_ns <= exit``). What no wrapper sees -- DDP's C++ reducer,
functional collectives under ``torch.compile`` -- stays "not measured".

Only process groups whose backend is gloo are timed: NCCL returns from a "blocking"
call once the kernel is queued, so the call's return says nothing; NCCL's own device
timing (``TORCH_NCCL_ENABLE_TIMING=1``) is the source there.

Invariants: installing twice is a no-op (one wrapper per function; the sink is
replaced); ``uninstall`` restores the original functions; a wrapper never changes what
the call returns or raises, and a failing sink or future is swallowed (timing is
telemetry, never a reason for a training step to fail). Code that bound a collective
before ``install`` (``from torch.distributed import all_reduce``) keeps the untimed one.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from fleet.proto.kinds import Timing

log = logging.getLogger(__name__)

#: (group name, enter_ns, exit_ns (0: an async op opened, not done yet), Timing wire number)
Sink = Callable[[str, int, int, int], None]

#: The collectives timed, by their ``torch.distributed`` names.
TIMED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
         "all_gather_single", "reduce_scatter_single")

_WRAPPER, _ASYNC = Timing.WRAPPER.wire, Timing.ASYNC.wire
_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_sink: Sink | None = None
_timed_groups: dict[int, str | None] = {}  # id(group) -> its name when timed, None when not


def install(sink: Sink) -> None:
    """Time the collectives from now on, reporting each window to ``sink`` (which must be
    cheap and thread-safe: async completions arrive on the backend's threads)."""
    global _sink
    with _lock:
        _sink = sink
        for name in TIMED:
            fn = getattr(dist, name, None)
            if fn is None or name in _originals:
                continue
            _originals[name] = fn
            wrapped = _wrap(name, fn)
            setattr(dist, name, wrapped)
            if getattr(c10d, name, None) is fn:
                setattr(c10d, name, wrapped)


def uninstall() -> None:
    """Put the original functions back and drop the sink."""
    global _sink
    with _lock:
        for name, fn in _originals.items():
            setattr(dist, name, fn)
            if hasattr(c10d, name):
                setattr(c10d, name, fn)
        _originals.clear()
        _timed_groups.clear()
        _sink = None


def installed() -> bool:
    return bool(_originals)


def _group_name(group: Any) -> str | None:
    """The name windows are filed under, or None when ``group``'s backend is not timed."""
    pg = group if group is not None else c10d._get_default_group()
    key = id(pg)
    name = _timed_groups.get(key, "")
    if name == "":
        try:
            name = pg.group_name if "gloo" in str(dist.get_backend(pg)).lower() else None
        except Exception:  # noqa: BLE001 - a group being torn down: leave it untimed
            name = None
        if len(_timed_groups) < 4096:
            _timed_groups[key] = name
    return name


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    params = inspect.signature(fn).parameters
    names = list(params)
    group_at = names.index("group") if "group" in names else None
    async_at = names.index("async_op") if "async_op" in names else None

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        sink = _sink
        if sink is None:
            return fn(*args, **kwargs)
        try:
            group = kwargs.get("group") if group_at is None or len(args) <= group_at else args[group_at]
            if "group" in kwargs:
                group = kwargs["group"]
            is_async = bool(kwargs.get("async_op", args[async_at] if async_at is not None and
                                       len(args) > async_at else False))
            gname = _group_name(group) if dist.is_initialized() else None
        except Exception:  # noqa: BLE001 - an odd call: let torch judge it, untimed
            gname = None
        if gname is None:
            return fn(*args, **kwargs)
        enter_ns = time.time_ns()
        result = fn(*args, **kwargs)
        if not is_async or result is None:
            _report(sink, gname, enter_ns, time.time_ns(), _WRAPPER)
            return result
        try:
            future = result.get_future()
        except Exception:  # noqa: BLE001 - a Work without a future: not measured
            return result
        # opened now, closed by the callback: an entry the tail reads in between waits for it
        _report(sink, gname, enter_ns, 0, _ASYNC)
        future.add_done_callback(lambda _f: _report(sink, gname, enter_ns, time.time_ns(), _ASYNC))
        return result

    return timed


def _report(sink: Sink, group: str, enter_ns: int, exit_ns: int, timing: int) -> None:
    try:
        sink(group, enter_ns, exit_ns, timing)
    except Exception:  # noqa: BLE001 - timing must never fail a collective
        log.debug("collective timing sink failed", exc_info=True)
