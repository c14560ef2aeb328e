"""workers/faults.py: crash injection exits the process with FAULT_EXIT_CODE; stop sets a flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleet_proto import events_pb2
from tests.unit.test_workers_support import REPO_ROOT
from workers.faults import FAULT_EXIT_CODE, FaultHooks

pytestmark = pytest.mark.timeout(60)


def _crash(at_step: int) -> events_pb2.Command:
    return events_pb2.Command(command_id="c", rank=0, fault=events_pb2.FaultSpec(kind="crash", at_step=at_step))


def _immediate() -> None:
    FaultHooks(0).on_command(_crash(0))


def _armed() -> None:
    hooks = FaultHooks(0)
    hooks.on_command(_crash(3))
    hooks.before_step(1)
    hooks.before_step(2)
    print("survived step 2", flush=True)
    hooks.before_step(3)


def _exit_code(target) -> int:
    """Run ``target`` in a fresh interpreter; its exit status."""
    code = f"from tests.unit.test_workers_faults import {target.__name__} as t; t()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=30)
    assert "injected crash" in proc.stderr
    return proc.returncode


def test_immediate_crash_exits_with_fault_code():
    assert _exit_code(_immediate) == FAULT_EXIT_CODE


def test_armed_crash_fires_at_its_step():
    assert _exit_code(_armed) == FAULT_EXIT_CODE


def test_arming_keeps_the_earliest_step_and_does_not_fire_early():
    hooks = FaultHooks(0)
    hooks.on_command(_crash(9))
    hooks.on_command(_crash(5))
    hooks.on_command(_crash(7))
    assert hooks.armed_crash_step == 5
    hooks.before_step(4)  # returns: not yet


def test_stop_and_unknown_kinds():
    hooks = FaultHooks(1)
    hooks.on_command(events_pb2.Command(command_id="x", fault=events_pb2.FaultSpec(kind="bitflip")))
    hooks.on_command(events_pb2.Command(command_id="y"))
    assert hooks.armed_crash_step is None and not hooks.stop_requested
    hooks.on_command(events_pb2.Command(command_id="s", stop=True))
    assert hooks.stop_requested


def _hang(at_step: int, duration_s: float) -> events_pb2.Command:
    return events_pb2.Command(command_id="h", rank=0,
                              fault=events_pb2.FaultSpec(kind="hang", at_step=at_step, duration_s=duration_s))


def test_hang_blocks_the_step_for_its_duration_then_returns():
    import time

    hooks = FaultHooks(0)
    hooks.on_command(_hang(3, 0.3))
    t0 = time.monotonic()
    hooks.before_step(2)
    assert time.monotonic() - t0 < 0.2  # not armed for step 2
    hooks.before_step(3)
    assert time.monotonic() - t0 >= 0.3
    t1 = time.monotonic()
    hooks.before_step(4)  # fires once
    assert time.monotonic() - t1 < 0.2


def test_endless_hang_ends_on_release():
    import threading

    hooks = FaultHooks(0)
    hooks.on_command(_hang(0, 0))
    done = threading.Event()
    t = threading.Thread(target=lambda: (hooks.before_step(1), done.set()), name="fleet-test-hang")
    t.start()
    assert not done.wait(0.3)  # still hanging
    hooks.release()
    assert done.wait(10)
    t.join(10)
