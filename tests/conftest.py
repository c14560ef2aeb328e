"""Fixtures shared by every tier: nothing a test starts may outlive it.

``no_leaks`` (autouse) fails a test that leaves behind a child process or a ``fleet-``
thread, after a bounded wait for them to end; leaked children are then killed by PID so
later tests start clean.
"""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

LEAK_WAIT_S = 15.0


def _fleet_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fleet-") and t.is_alive()}


def _children() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


@pytest.fixture(autouse=True)
def no_leaks():
    threads_before = _fleet_threads()
    children_before = _children()
    yield
    deadline = time.monotonic() + LEAK_WAIT_S
    while time.monotonic() < deadline:
        threads = _fleet_threads() - threads_before
        children = {
            pid for pid in _children() - children_before
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        }
        if not threads and not children:
            return
        time.sleep(0.1)
    for pid in children:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not threads, f"threads leaked: {sorted(t.name for t in threads)}"
    assert not children, f"child processes leaked: {sorted(children)}"
