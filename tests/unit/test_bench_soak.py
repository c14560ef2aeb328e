"""bench/soak.py's "recovered" rule (pure): a fault counts as recovered when a step past the
last one before it ends inside its window, made by an attempt that did not fail of it."""

from __future__ import annotations

from types import SimpleNamespace

from bench.soak import failed_until, progress_after


def _attempt(number: int, state: str, started: float, ended: float | None) -> SimpleNamespace:
    return SimpleNamespace(number=number, state=SimpleNamespace(value=state), started_at=started, ended_at=ended)


def test_an_attempt_failed_by_the_next_fault_still_recovered_the_one_before() -> None:
    # attempt 1 trains on through fault A at t=100 (an agent restart: nothing ends), then
    # fault B at t=160 crashes it (ended 161); attempt 2 takes over
    spans = [(1, s, 90.0 + s, 91.0 + s) for s in range(1, 70)] + [(2, 70, 163.0, 164.0)]
    lasted = failed_until([_attempt(1, "FAILED", 0.0, 161.0), _attempt(2, "RUNNING", 162.0, None)])
    assert progress_after(spans, lasted, 100.0, 160.0) == 1.0     # step 10 ended at 101
    # B itself: attempt 1's steps after t=160 (none here) do not count; attempt 2's do
    assert progress_after(spans, lasted, 160.0, 220.0) == 4.0


def test_steps_of_an_attempt_the_fault_failed_do_not_count() -> None:
    # a hang at t=100 lets a step in flight end (101), then the attempt is failed at 105
    # and no later attempt steps inside the window
    spans = [(1, s, 90.0 + s, 91.0 + s) for s in range(1, 11)]
    lasted = failed_until([_attempt(1, "FAILED", 0.0, 105.0)])
    assert progress_after(spans, lasted, 100.0, 160.0) is None


def test_a_failed_attempt_without_an_end_time_lasted_until_its_start() -> None:
    lasted = failed_until([_attempt(3, "FAILED", 50.0, None), _attempt(4, "SUCCEEDED", 60.0, 90.0)])
    assert lasted[3] == 50.0
    assert lasted[4] == float("inf")
