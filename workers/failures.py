"""Why a rank's run failed, as fields the controller acts on instead of text it parses.

A rank raises these; they reach the controller structurally on both paths a failure
takes: the rank's FAILED ``WorkerStatus`` carries ``status_fields(exc)`` (events.proto),
and Ray hands the exception object itself (pickled, attributes intact) to the
orchestrator, which copies them into its ``RankFailure`` for the detectors.

Imports neither torch nor the controller: the controller unpickles these, and a plain
torchrun script may raise or catch them.
"""

from __future__ import annotations

from collections.abc import Sequence


class NonFiniteLossError(RuntimeError):
    """Some rank's loss was NaN or infinite: every rank raises it after the same step.

    ``step`` is that step (>= 1); ``ranks`` the ranks whose own loss was not finite,
    empty when only the global mean overflowed.
    """

    def __init__(self, step: int, ranks: Sequence[int]) -> None:
        self.step = int(step)
        self.ranks = [int(r) for r in ranks]
        super().__init__(f"non-finite loss at step {self.step} on rank(s) {self.ranks}")

    def __reduce__(self) -> tuple[type[NonFiniteLossError], tuple[int, list[int]]]:
        # pickled by Ray on the way to the controller: rebuild from the fields, since
        # BaseException's default would call __init__ with the message alone
        return type(self), (self.step, self.ranks)


def status_fields(exc: BaseException) -> dict[str, object]:
    """The ``WorkerStatus`` fields a FAILED report of ``exc`` carries beyond its text
    (none for a failure without structure)."""
    if isinstance(exc, NonFiniteLossError):
        return {"nonfinite_step": exc.step, "nonfinite_ranks": exc.ranks}
    return {}
