"""Who failed first among a program's ranks, and when a start-up failure repeats (pure)."""

from __future__ import annotations

from fleet.controlplane.detectors import Incident
from fleet.controlplane.exits import attribute_exits, early_exit, last_line, same_startup_failure
from fleet.controlplane.runtime import RankFailure
from fleet.proto.kinds import IncidentKind

NODES = ["node-0", "node-0", "node-1", "node-1"]
TB = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad batch\n'


def exit_(rank: int, code: int, at: float, tb: str = "", pg: bool = True) -> RankFailure:
    return RankFailure(rank, NODES[rank], False, f"rank {rank} exited", exit_code=code, traceback=tb,
                       exited_at=at, reached_pg=pg)


def test_the_rank_that_ended_first_is_blamed_not_the_lowest_or_the_first_reported() -> None:
    # rank 3 died by SIGKILL first; ranks 0 and 2 failed after it ("connection closed")
    failures = [exit_(0, 1, 100.40, "RuntimeError: Connection closed by peer"), exit_(3, -9, 100.00),
                exit_(2, 1, 100.25, "RuntimeError: Connection closed by peer")]
    inc = attribute_exits(failures, {}, NODES)
    assert (inc.kind, inc.rank, inc.node, inc.exit_code) == (IncidentKind.CRASH, 3, "node-1", -9)
    assert "rank 3 on node-1 was killed by signal 9 (SIGKILL)" in inc.evidence
    assert "then rank 2 exited with code 1 +0.25 s later, rank 0 exited with code 1 +0.40 s later" in inc.evidence


def test_an_exception_is_an_error_with_its_last_line_and_traceback() -> None:
    inc = attribute_exits([exit_(1, 1, 5.0, TB)], {0: True, 2: True}, NODES)
    assert (inc.kind, inc.rank, inc.exit_code, inc.traceback) == (IncidentKind.ERROR, 1, 1, TB)
    assert inc.evidence == ("rank 1 on node-0 exited with code 1: ValueError: bad batch; "
                            "rank(s) [0, 2] had exited with code 0")


def test_simultaneous_exits_blame_the_signal_death() -> None:
    inc = attribute_exits([exit_(0, 1, 7.000, TB), exit_(2, -11, 7.002)], {}, NODES)
    assert (inc.rank, inc.kind) == (2, IncidentKind.CRASH)


def test_a_rank_that_never_created_its_group_says_so() -> None:
    inc = attribute_exits([exit_(2, 1, 1.0, TB, pg=False)], {}, NODES)
    assert "rank 2 on node-1 exited with code 1 before creating its process group: ValueError" in inc.evidence


def test_failures_without_exit_codes_are_left_to_the_built_in_attribution() -> None:
    assert attribute_exits([RankFailure(0, "node-0", True, "process died")], {}, NODES) is None


def test_an_early_exit_before_the_group_is_explained() -> None:
    inc = early_exit({1: False}, [0, 2, 3], NODES)
    assert (inc.kind, inc.rank, inc.node, inc.exit_code) == (IncidentKind.ERROR, 1, "node-0", 0)
    assert "before creating its process group; ranks [0, 2, 3] wait for it in the rendezvous" in inc.evidence
    assert early_exit({1: False}, [], NODES) is None  # everyone is done: nothing waits


def test_a_repeated_start_up_failure_is_recognised_on_any_rank() -> None:
    a = Incident(IncidentKind.ERROR, "exit", 0, "node-0", "x", traceback=TB, exit_code=1)
    b = Incident(IncidentKind.ERROR, "exit", 3, "node-1", "y", traceback="...\nValueError: bad batch", exit_code=1)
    other = Incident(IncidentKind.ERROR, "exit", 0, "node-0", "z", traceback="KeyError: 'x'", exit_code=1)
    assert same_startup_failure(a, b)
    on_rank = [Incident(IncidentKind.ERROR, "exit", r, "n", "e", traceback=f"RuntimeError: no data on rank {r}",
                        exit_code=1) for r in (0, 1)]
    assert same_startup_failure(*on_rank)  # the message names the rank that failed first
    assert not same_startup_failure(a, other)
    assert not same_startup_failure(None, b)
    assert last_line(TB) == "ValueError: bad batch" and last_line("") == ""


def test_the_early_exit_watch_waits_its_grace_then_fires_and_resets() -> None:
    from fleet.controlplane.exits import EARLY_EXIT_GRACE_S, EarlyExitWatch, finished_ranks

    watch = EarlyExitWatch()
    finished = finished_ranks({1: {"exit_code": 0, "reached_pg": False}, 0: {"exit_code": 0, "reached_pg": True}})
    assert finished == {1: False, 0: True}
    assert watch.check(finished, [2, 3], NODES, now=100.0) is None
    assert watch.check(finished, [2, 3], NODES, now=100.0 + EARLY_EXIT_GRACE_S - 0.1) is None
    assert watch.check(finished, [2, 3], NODES, now=100.0 + EARLY_EXIT_GRACE_S).rank == 1
    watch.reset()
    assert watch.check(finished, [2, 3], NODES, now=200.0) is None  # a new attempt: the grace again


def test_a_culprit_that_had_exited_0_says_so() -> None:
    from fleet.controlplane.exits import explain_early_exit

    hang = Incident(IncidentKind.HANG, "hang", 2, "node-1", "rank 2 never entered collective 7.")
    assert explain_early_exit(hang, {0: True}) is hang
    assert explain_early_exit(hang, {2: False}).evidence.endswith(
        "(rank 2's program had exited with code 0 before creating its process group: it left while its peers "
        "still needed it)")
