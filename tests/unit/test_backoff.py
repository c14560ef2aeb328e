"""The agents' reconnect delays (agent/backoff.py): bounds, cap, spread. Pure, no sleeping."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from fleet.agent.backoff import ceiling, delay, reconnect_delays


def test_the_ceiling_doubles_from_first_s_up_to_the_cap() -> None:
    assert [ceiling(n, 0.1, 2.0) for n in range(7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert ceiling(10_000, 0.1, 2.0) == 2.0


def test_a_delay_is_the_draw_times_the_ceiling() -> None:
    assert delay(0, 0.0) == 0.0
    assert delay(3, 0.5, 0.1, 2.0) == pytest.approx(0.4)
    assert delay(9, 0.999, 0.1, 2.0) < 2.0


def test_every_delay_lies_in_zero_to_its_ceiling() -> None:
    delays = list(itertools.islice(reconnect_delays(0.1, 2.0, random.Random(7)), 200))
    for n, d in enumerate(delays):
        assert 0.0 <= d < ceiling(n, 0.1, 2.0), (n, d)
    assert max(delays) < 2.0


def test_capped_delays_spread_evenly_over_the_whole_window() -> None:
    """2,048 agents past the ramp: their next retries cover [0, max_s) evenly, not in a wave."""
    draws = [list(itertools.islice(reconnect_delays(0.1, 2.0, random.Random(seed)), 10))[-1]
             for seed in range(2048)]
    assert statistics.mean(draws) == pytest.approx(1.0, abs=0.06)
    counts = [0] * 10
    for d in draws:
        counts[int(d / 0.2)] += 1
    # each 0.2 s slot gets about a tenth (205): a lock-step wave would put them all in one
    assert min(counts) > 150 and max(counts) < 260, counts


def test_two_agents_with_different_generators_do_not_draw_alike() -> None:
    a = list(itertools.islice(reconnect_delays(0.1, 2.0, random.Random(1)), 8))
    b = list(itertools.islice(reconnect_delays(0.1, 2.0, random.Random(2)), 8))
    assert a != b
    # without an rng each iterator seeds itself from the OS
    assert list(itertools.islice(reconnect_delays(), 8)) != list(itertools.islice(reconnect_delays(), 8))


@pytest.mark.parametrize(("kw", "field"), [
    (dict(first_s=0.0), "first_s"), (dict(first_s=-1.0), "first_s"),
    (dict(first_s=1.0, max_s=0.5), "max_s"), (dict(first_s=float("nan")), "first_s"),
])
def test_bad_bounds_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        reconnect_delays(**kw)  # at the call, not at the first delay


def test_bad_attempt_or_draw_names_the_argument() -> None:
    with pytest.raises(ValueError, match="^attempt:"):
        ceiling(-1)
    with pytest.raises(ValueError, match="^u:"):
        delay(0, 1.0)
