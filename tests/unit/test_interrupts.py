"""``DeferredInterrupt``: a Ctrl-C is raised where the guarded code asks, a second at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from fleet.controlplane.interrupts import DeferredInterrupt


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)   # the handler runs at the next bytecode boundary of the main thread


def test_the_first_ctrl_c_waits_for_check_and_the_handler_is_restored() -> None:
    before = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(KeyboardInterrupt), DeferredInterrupt() as ctrl_c:
        _ctrl_c()
        reached.append("after the signal")   # not interrupted here
        assert ctrl_c.asked
        ctrl_c.check()
        reached.append("after check")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_ctrl_c_is_raised_at_once() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt), DeferredInterrupt():
        _ctrl_c()
        reached.append(1)
        _ctrl_c()
        reached.append(2)
    assert reached == [1]


def test_a_ctrl_c_noted_as_the_block_ends_is_raised_when_it_ends() -> None:
    with pytest.raises(KeyboardInterrupt), DeferredInterrupt():
        _ctrl_c()


def test_pause_ends_soon_after_a_ctrl_c() -> None:
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt), DeferredInterrupt() as ctrl_c:
        timer.start()
        ctrl_c.pause(30)
    assert time.monotonic() - t < 5


def test_a_block_without_ctrl_c_ends_quietly_and_other_threads_change_nothing() -> None:
    with DeferredInterrupt() as ctrl_c:
        ctrl_c.pause(0.05)
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def other() -> None:
        with DeferredInterrupt() as d:
            seen.append(signal.getsignal(signal.SIGINT) is before and not d.asked)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [True]
