"""workers/collective_timing.py: torch.distributed's collectives timed where they are called."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fleet.proto.kinds import Timing
from fleet.workers import collective_timing
from tests.unit.test_workers_support import run_ranks

pytestmark = pytest.mark.timeout(60)


def _timed_alone(rank: int, world_size: int, port: int) -> dict:
    windows: list[tuple] = []
    original = dist.all_reduce
    collective_timing.install(lambda *w: windows.append(w))
    collective_timing.install(lambda *w: windows.append(w))  # again: the sink is replaced, nothing wrapped twice
    wrapped = dist.all_reduce
    with pytest.raises((ValueError, RuntimeError)):
        dist.all_reduce(torch.ones(2))  # no process group yet: torch raises, untimed
    out: dict = {"wrapped_once": wrapped.__wrapped__ is original, "before_init": list(windows)}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, 0, None)  # group given by position
        collective_timing.install(lambda *w: 1 / 0)  # a failing sink never fails the call
        dist.all_reduce(t)
        out["value"] = t.tolist()
    finally:
        dist.destroy_process_group()
    out["windows"] = windows
    collective_timing.uninstall()
    out["restored"] = dist.all_reduce is original and not collective_timing.installed()
    return out


def test_blocking_and_async_calls_report_their_windows_and_nothing_breaks_a_call():
    out = run_ranks(_timed_alone, 1)[0]
    assert out["wrapped_once"] and out["restored"]
    assert out["before_init"] == [] and out["value"] == [1.0, 1.0, 1.0]
    windows = out["windows"]
    wrapper, opened, closed, bcast = windows
    assert [(g, t) for g, _, _, t in windows] == [("0", Timing.WRAPPER.wire), ("0", Timing.ASYNC.wire),
                                                  ("0", Timing.ASYNC.wire), ("0", Timing.WRAPPER.wire)]
    assert opened[2] == 0 and opened[1] == closed[1]  # the async op: opened at the call, closed when done
    for _, enter, exit_, _ in (wrapper, closed, bcast):
        assert 0 < enter <= exit_
