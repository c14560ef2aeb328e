"""How long an agent waits before reconnecting to the controller: capped exponential
backoff with full jitter.

A controller restart breaks every agent's stream at the same instant. Without jitter,
2,048 agents would retry in lock-step waves (all at 0.1 s, all at 0.3 s, ...), each wave
a burst of TLS handshakes and Hellos on a controller that is just coming up. With full
jitter, retry ``n`` waits a uniform draw from ``[0, min(max_s, first_s * 2**n))``: once
the ceiling reaches ``max_s`` the agents' arrivals are spread evenly over a window of
``max_s`` seconds, and every agent is back within about ``max_s`` of the controller's
return. Full jitter rather than "decorrelated" jitter because it is stateless (a
function of the attempt number and one uniform draw, so tests and the scale benchmark's
synthetic agents compute the same delays), and because it spreads the load most evenly
of the common schemes (AWS Architecture Blog, "Exponential Backoff And Jitter"); a draw
near 0 costs only one early retry while the ceiling still doubles.

Pure: no clock, no sleeping; randomness comes from the ``rng`` passed in.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

#: The first ceiling, seconds (the uplink's historic first delay).
FIRST_S = 0.1


def _check(first_s: float, max_s: float) -> None:
    if not first_s > 0:
        raise ValueError(f"first_s: must be > 0 (got {first_s})")
    if not max_s >= first_s:
        raise ValueError(f"max_s: must be >= first_s={first_s} (got {max_s})")


def ceiling(attempt: int, first_s: float = FIRST_S, max_s: float = 2.0) -> float:
    """The largest delay of retry ``attempt`` (0-based), seconds: ``min(max_s, first_s * 2**attempt)``."""
    _check(first_s, max_s)
    if attempt < 0:
        raise ValueError(f"attempt: must be >= 0 (got {attempt})")
    # 2**attempt overflows nothing in Python, but stop doubling once past the cap
    return max_s if attempt >= 64 else min(max_s, first_s * (1 << attempt))


def delay(attempt: int, u: float, first_s: float = FIRST_S, max_s: float = 2.0) -> float:
    """The delay of retry ``attempt`` for a uniform draw ``u`` in [0, 1), seconds."""
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u: must be in [0, 1) (got {u})")
    return u * ceiling(attempt, first_s, max_s)


def reconnect_delays(first_s: float = FIRST_S, max_s: float = 2.0,
                     rng: random.Random | None = None) -> Iterator[float]:
    """The delays before retries 0, 1, 2, ... (endless), seconds. Start a new iterator
    when a connection succeeds. ``rng``: None draws from a fresh ``random.Random()``
    (seeded from the OS, so agents in different processes do not draw alike)."""
    _check(first_s, max_s)  # here, not on the first next(): bad bounds fail at once
    return _delays(first_s, max_s, rng if rng is not None else random.Random())


def _delays(first_s: float, max_s: float, rng: random.Random) -> Iterator[float]:
    for attempt in itertools.count():
        yield delay(attempt, rng.random(), first_s, max_s)
