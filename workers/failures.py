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


class SdcError(RuntimeError):
    """Silent data corruption that repeats: every rank raises it after the same triage.

    ``step``: the first step whose fingerprints disagreed; ``rank``: the suspect (its
    copy disagreed with the majority, and again when the step was re-executed);
    ``verdict``: "persistent" (or "ambiguous": two copies disagree, both reproduce, and no
    majority decides); ``rollback_step``: the newest step whose state was verified
    (the next attempt restores at most this step); ``evidence``: the triage in one line.
    """

    def __init__(self, step: int, rank: int, verdict: str, rollback_step: int, evidence: str) -> None:
        self.step, self.rank, self.verdict = int(step), int(rank), str(verdict)
        self.rollback_step, self.evidence = int(rollback_step), str(evidence)
        super().__init__(f"{self.verdict} silent data corruption at step {self.step} on rank {self.rank}: "
                         f"{self.evidence}; roll back to step {self.rollback_step}")

    def __reduce__(self) -> tuple[type[SdcError], tuple[int, int, str, int, str]]:
        return type(self), (self.step, self.rank, self.verdict, self.rollback_step, self.evidence)


def status_fields(exc: BaseException) -> dict[str, object]:
    """The ``WorkerStatus`` fields a FAILED report of ``exc`` carries beyond its text
    (none for a failure without structure)."""
    if isinstance(exc, NonFiniteLossError):
        return {"nonfinite_step": exc.step, "nonfinite_ranks": exc.ranks}
    return {}


class RankExitError(RuntimeError):
    """A user program's process on one rank ended badly (``workers/launcher.py``).

    ``exit_code``: its exit status, negative when a signal killed it (-9: SIGKILL);
    ``traceback``: what it left (torch's ``@record`` error file, the launcher's capture of
    an uncaught exception, or the tail of its output); ``exited_at``: Unix seconds when
    its launcher saw it end; ``reached_pg``: whether it had created its process group.
    """

    def __init__(self, rank: int, exit_code: int, traceback: str, exited_at: float, reached_pg: bool) -> None:
        self.rank = int(rank)
        self.exit_code = int(exit_code)
        self.traceback = traceback
        self.exited_at = float(exited_at)
        self.reached_pg = bool(reached_pg)
        super().__init__(f"rank {self.rank} {describe_exit(self.exit_code)}"
                         + ("" if self.reached_pg else " before creating its process group"))

    def __reduce__(self) -> tuple[type[RankExitError], tuple[int, int, str, float, bool]]:
        return type(self), (self.rank, self.exit_code, self.traceback, self.exited_at, self.reached_pg)


def signal_name(exit_code: int) -> str | None:
    """The name of the signal a negative exit code stands for (``SIGKILL`` for -9); None
    for other codes or an unknown signal."""
    import signal

    try:
        return signal.Signals(-exit_code).name if exit_code < 0 else None
    except ValueError:
        return None


def describe_exit(exit_code: int) -> str:
    """``exited with code 1`` or ``was killed by signal 9 (SIGKILL)``."""
    if exit_code >= 0:
        return f"exited with code {exit_code}"
    return f"was killed by signal {-exit_code} ({signal_name(exit_code) or 'unknown signal'})"
