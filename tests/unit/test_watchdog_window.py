"""The watchdog's sliding-window maximum of collective gaps, against a brute force."""

from __future__ import annotations

import random

import pytest

from fleet.controlplane.watchdog import _RecentMax

pytestmark = pytest.mark.timeout(30)


def test_the_recent_max_is_the_max_of_the_last_size_values() -> None:
    rng = random.Random(13)
    for size in (1, 2, 5, 64):
        window, pushed = _RecentMax(size), []
        assert (window.known(), window.values()) == (0, [])
        for _ in range(500):
            value = rng.choice([rng.random(), 0.5, 1.0])  # ties too
            window.push(value)
            pushed.append(value)
            assert window.known() == min(len(pushed), size)
            assert max(window.values()) == window.values()[0] == max(pushed[-size:])
