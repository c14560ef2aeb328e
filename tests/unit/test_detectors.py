"""Failure attribution and the restart decision: pure functions, literal inputs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from controlplane.detectors import Incident, RestartDecision, attribute_failures, decide_restart

pytestmark = pytest.mark.timeout(30)

PEER_CLOSED = "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500"


@dataclass(frozen=True)
class Failure:
    rank: int
    node: str
    actor_died: bool
    error: str


def test_no_failures_is_no_incident() -> None:
    assert attribute_failures([]) is None
    assert attribute_failures(()) is None


def test_dead_process_is_blamed_over_ranks_that_raised() -> None:
    failures = [
        Failure(0, "node-0", False, PEER_CLOSED),
        Failure(1, "node-0", False, PEER_CLOSED),
        Failure(3, "node-1", True, "actor died: exit code -9"),
        Failure(2, "node-1", False, PEER_CLOSED),
    ]
    inc = attribute_failures(failures)
    assert inc == Incident(
        kind="crash", detector="crash", rank=3, node="node-1",
        evidence="rank 3 on node-1: actor died: exit code -9; then ranks [0, 1, 2] failed",
    )


def test_lowest_dead_rank_is_blamed_and_the_others_are_evidence() -> None:
    failures = [
        Failure(3, "node-1", True, "exit -9"),
        Failure(0, "node-0", False, PEER_CLOSED),
        Failure(2, "node-1", True, "exit -9"),
    ]
    inc = attribute_failures(failures)
    assert inc is not None
    assert (inc.kind, inc.rank, inc.node) == ("crash", 2, "node-1")
    assert inc.evidence.startswith("rank 2 on node-1: exit -9")
    assert "[3, 0]" in inc.evidence


def test_single_death_has_no_victim_list() -> None:
    inc = attribute_failures([Failure(1, "node-0", True, "segfault")])
    assert inc is not None
    assert inc.rank == 1
    assert inc.evidence == "rank 1 on node-0: segfault"
    assert "then ranks" not in inc.evidence


def test_all_exceptions_give_an_error_on_the_lowest_rank() -> None:
    failures = [
        Failure(2, "node-1", False, "ValueError: loss is nan"),
        Failure(1, "node-0", False, "ValueError: loss is nan"),
    ]
    inc = attribute_failures(failures)
    assert inc is not None
    assert inc.kind == "error"
    assert (inc.rank, inc.node) == (1, "node-0")
    assert inc.evidence == "rank 1 raised: ValueError: loss is nan"


def test_attribution_does_not_depend_on_order() -> None:
    failures = [Failure(r, f"node-{r // 2}", r in (1, 3), f"e{r}") for r in range(4)]
    a = attribute_failures(failures)
    b = attribute_failures(list(reversed(failures)))
    assert a is not None and b is not None
    assert (a.kind, a.rank, a.node) == (b.kind, b.rank, b.node) == ("crash", 1, "node-0")


def _incident(kind: str = "crash", rank: int = 3, node: str = "node-1") -> Incident:
    return Incident(kind, "crash", rank, node, "evidence")


def test_restart_while_budget_lasts() -> None:
    inc = _incident()
    for done in range(3):
        d = decide_restart(done, 3, inc)
        assert d == RestartDecision(True, f"crash of rank 3 on node-1: restart {done + 1} of 3")


def test_give_up_when_budget_is_spent() -> None:
    d = decide_restart(3, 3, _incident(kind="error", rank=0, node="node-0"))
    assert d.restart is False
    assert "rank 0" in d.reason
    assert "node-0" in d.reason
    assert "error" in d.reason
    assert "giving up" in d.reason


def test_zero_budget_never_restarts() -> None:
    d = decide_restart(0, 0, _incident())
    assert d.restart is False
    assert "rank 3 on node-1" in d.reason


def test_over_budget_still_gives_up() -> None:
    assert decide_restart(5, 3, _incident()).restart is False


def test_trace_verdict_names_the_culprit_when_nobody_died() -> None:
    from controlplane.detectors import attribute_with_trace

    raised = Incident("error", "crash", 0, "node-0", "rank 0 raised: timed out")
    nodes = ["node-0", "node-0", "node-1", "node-1"]
    hang = attribute_with_trace(raised, "hang", [3], "hang: culprit rank 3.", nodes)
    assert (hang.kind, hang.detector, hang.rank, hang.node) == ("hang", "flight-recorder", 3, "node-1")
    assert "culprit rank 3" in hang.evidence and "timed out" in hang.evidence
    desync = attribute_with_trace(raised, "mismatch", [1], "mismatch", nodes)
    assert (desync.kind, desync.rank) == ("desync", 1)
    # an ok verdict, or a process death, keeps the original attribution
    assert attribute_with_trace(raised, "ok", [], "ok", nodes) is raised
    died = Incident("crash", "crash", 2, "node-1", "rank 2 died")
    assert attribute_with_trace(died, "hang", [0], "hang", nodes) is died
