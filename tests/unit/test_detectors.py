"""Failure attribution and the restart decision: pure functions, literal inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from fleet.controlplane.detectors import Incident, RestartDecision, attribute_failures, decide_restart
from fleet.proto.kinds import IncidentKind

pytestmark = pytest.mark.timeout(30)

PEER_CLOSED = "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500"


@dataclass(frozen=True)
class Failure:
    rank: int
    node: str
    actor_died: bool
    error: str
    nonfinite_step: int = 0
    nonfinite_ranks: tuple[int, ...] = ()


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
    from fleet.controlplane.detectors import attribute_with_trace

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


# -- non-finite loss --------------------------------------------------------------------------

NAN_MSG = "NonFiniteLossError: non-finite loss at step 42 on rank(s) [2, 3]"


def _nan(rank: int, node: str, step: int, ranks: tuple[int, ...], error: str = NAN_MSG) -> Failure:
    """A rank that raised NonFiniteLossError, as the orchestrator reports it: fields, not text."""
    return Failure(rank, node, False, error, nonfinite_step=step, nonfinite_ranks=ranks)


def test_nonfinite_loss_names_the_first_listed_rank_and_its_node() -> None:
    failures = [_nan(r, f"node-{r // 2}", 42, (2, 3)) for r in range(4)]
    nodes = ["node-a", "node-a", "node-b", "node-b"]
    inc = attribute_failures(failures, nodes=nodes)
    assert inc == Incident(
        kind="nan", detector="nan", rank=2, node="node-b",
        evidence="non-finite loss at step 42 on rank(s) [2, 3] (raised by rank(s) [0, 1, 2, 3])",
    )


def test_nonfinite_loss_outranks_a_death_and_works_without_nodes() -> None:
    failures = [
        Failure(0, "node-0", False, PEER_CLOSED),
        Failure(3, "node-1", True, "actor died"),
        _nan(1, "node-0", 7, (1,)),
    ]
    inc = attribute_failures(failures)  # nodes not given: the failure's own node
    assert inc is not None
    assert (inc.kind, inc.detector, inc.rank, inc.node) == ("nan", "nan", 1, "node-0")
    # a listed rank outside `nodes` and absent from the failures has no node
    inc = attribute_failures([_nan(0, "node-0", 1, (9,))], nodes=["node-0"])
    assert inc is not None and (inc.rank, inc.node) == (9, "")
    # no rank's own loss was flagged (only the global mean overflowed): the reporter is named
    inc = attribute_failures([Failure(0, "node-0", False, PEER_CLOSED), _nan(2, "node-1", 5, ())])
    assert inc is not None and (inc.kind, inc.rank, inc.node) == ("nan", 2, "node-1")
    assert inc.evidence == "non-finite loss at step 5 on rank(s) [2] (raised by rank(s) [2])"


def test_nan_in_the_text_without_the_fields_stays_an_error() -> None:
    inc = attribute_failures([Failure(0, "node-0", False, "ValueError: loss is nan")], nodes=["n0"])
    assert inc is not None and inc.kind == "error"
    # the text alone is not parsed: only the structured fields make a nan incident
    inc = attribute_failures([Failure(0, "node-0", False, NAN_MSG)], nodes=["n0"])
    assert inc is not None and inc.kind == "error"


# -- hangs ------------------------------------------------------------------------------------

def test_hang_threshold_is_a_multiple_of_the_median_with_a_floor() -> None:
    from fleet.controlplane.detectors import hang_threshold_s

    assert hang_threshold_s([0.5, 0.6, 0.4, 9.0], 3.0, 1.0) == pytest.approx(1.65)  # median 0.55
    assert hang_threshold_s([0.1, 0.1, 0.2], 3.0, 1.0) == 1.0                        # the floor
    assert hang_threshold_s([], 3.0, 1.0) == 1.0
    assert hang_threshold_s([float("nan"), 2.0], 3.0, 1.0) == 6.0


NODES4 = ["node-0", "node-0", "node-1", "node-1"]
#: rank -> (last step, seconds since its last progress): rank 1 stopped first
PROGRESS = {0: (10, 2.1), 1: (10, 3.4), 2: (10, 2.0), 3: (10, 2.2)}
HANG_SUMMARY = "hang: culprit rank 1. rank 1 never entered collective 57 (all_gather)"


def test_normal_skew_is_not_a_hang() -> None:
    from fleet.controlplane.detectors import decide_hang

    # below the threshold nothing counts, not even a hang verdict
    assert decide_hang(0.9, 1.0, 10.0, "hang", [1], HANG_SUMMARY, PROGRESS, NODES4) is None
    # past it, a diagnosis that sees only waits in flight ("ok") waits for more
    assert decide_hang(2.0, 1.0, 10.0, "ok", [], "ok", PROGRESS, NODES4) is None
    assert decide_hang(2.0, 1.0, 10.0, None, [], "", PROGRESS, NODES4) is None
    # a straggler verdict is no hang either
    assert decide_hang(2.0, 1.0, 10.0, "straggler", [3], "straggler", PROGRESS, NODES4) is None


def test_confirmed_hang_names_the_rank_the_others_wait_for() -> None:
    from fleet.controlplane.detectors import decide_hang

    inc = decide_hang(2.0, 1.5, 10.0, "hang", [1], HANG_SUMMARY, PROGRESS, NODES4)
    assert inc == Incident(
        "hang", "hang", 1, "node-0",
        "no rank finished a step for 2.0 s (hang threshold 1.5 s); flight recorder: " + HANG_SUMMARY)
    desync = decide_hang(2.0, 1.5, 10.0, "mismatch", [3], "mismatch: culprit rank 3.", PROGRESS, NODES4)
    assert desync is not None and (desync.kind, desync.rank, desync.node) == ("desync", 3, "node-1")


def test_unconfirmed_hang_blames_the_oldest_progress_after_the_grace() -> None:
    from fleet.controlplane.detectors import decide_hang

    assert decide_hang(11.0, 1.5, 10.0, "ok", [], "ok", PROGRESS, NODES4) is None  # 11.0 <= 1.5 + 10
    inc = decide_hang(11.6, 1.5, 10.0, "ok", [], "ok", PROGRESS, NODES4)
    assert inc == Incident(
        "hang", "hang", 1, "node-0",
        "unconfirmed: no rank finished a step for 11.6 s (hang threshold 1.5 s) and the flight recorder "
        "named no culprit (ok); rank 1 progressed last, 3.4 s ago (step 10), the longest ago")
    # nobody stands out: no rank is named
    tie = {0: (3, 5.0), 1: (3, 5.0)}
    inc = decide_hang(20.0, 1.5, 10.0, None, [], "", tie, NODES4)
    assert inc is not None and (inc.rank, inc.node) == (-1, "")
    assert inc.evidence.endswith("(no diagnosis); no rank stands out")
    inc = decide_hang(20.0, 1.5, 10.0, None, [], "", {}, NODES4)
    assert inc is not None and inc.rank == -1


def test_a_rank_that_never_progressed_is_the_oldest() -> None:
    from fleet.controlplane.detectors import decide_hang, oldest_rank

    progress = {0: (4, 2.0), 1: (0, math.inf), 2: (4, 2.5)}
    assert oldest_rank(progress) == 1
    assert oldest_rank({0: (0, math.inf), 1: (0, math.inf)}) is None
    inc = decide_hang(30.0, 1.0, 10.0, "ok", [], "ok", progress, ["a", "b", "c"])
    assert inc is not None and (inc.rank, inc.node) == (1, "b")
    assert "rank 1 never progressed" in inc.evidence


def test_startup_timeout() -> None:
    from fleet.controlplane.detectors import startup_hang

    assert startup_hang(299.0, 300.0, "hang", [2], "hang: culprit rank 2.", NODES4) is None
    inc = startup_hang(301.0, 300.0, "hang", [2], "hang: culprit rank 2.", NODES4)
    assert inc == Incident("hang", "hang", 2, "node-1",
                           "no step finished 301 s after the attempt started (startup timeout 300 s); "
                           "flight recorder: hang: culprit rank 2.")
    inc = startup_hang(301.0, 300.0, "empty", [], "no collectives recorded", NODES4)
    assert inc == Incident("hang", "hang", -1, "",
                           "unconfirmed: no step finished 301 s after the attempt started (startup timeout "
                           "300 s); the flight recorder named no culprit (empty)")


def test_collective_hang_threshold_is_a_multiple_of_the_largest_gap_with_a_floor() -> None:
    from fleet.controlplane.detectors import collective_hang_threshold_s

    # a DDP step: many bucket all-reduces milliseconds apart, then one long compute gap
    ddp = [0.004] * 40 + [0.8] + [0.004] * 40
    assert collective_hang_threshold_s(ddp, 3.0, 1.0) == pytest.approx(2.4)  # not the median's floor
    assert collective_hang_threshold_s([0.1, 0.2, 0.3], 3.0, 1.0) == 1.0     # the floor
    assert collective_hang_threshold_s([], 3.0, 1.0) == 1.0
    assert collective_hang_threshold_s(iter([float("nan"), float("inf"), -1.0, 2.0]), 3.0, 1.0) == 6.0


def test_a_collective_stall_says_where_its_threshold_came_from() -> None:
    from fleet.controlplane.detectors import collective_stall_reason, decide_hang

    why = collective_stall_reason(4.1, 3.0, 1.0, 3.0)
    assert why == ("no collective entered or completed for 4.1 s, threshold 3.0 s from the job's collective "
                   "cadence (largest recent gap 1.0 s x hang_factor 3)")
    assert collective_stall_reason(1.4, 1.0, 0.1, 3.0) == (
        "no collective entered or completed for 1.4 s, threshold 1.0 s from hang_floor_s (the job's collective "
        "cadence gives 0.3 s: largest recent gap 0.1 s x hang_factor 3)")
    inc = decide_hang(4.1, 3.0, 10.0, "hang", [1], HANG_SUMMARY, PROGRESS, NODES4, why)
    assert inc == Incident("hang", "hang", 1, "node-0", f"{why}; flight recorder: {HANG_SUMMARY}")
    inc = decide_hang(13.5, 3.0, 10.0, "ok", [], "ok", PROGRESS, NODES4, why)
    assert inc is not None and inc.evidence.startswith(f"unconfirmed: {why} and the flight recorder named no")


def test_a_reported_nonfinite_loss_is_a_nan_incident_of_its_rank() -> None:
    from fleet.controlplane.detectors import nan_step_incident

    assert nan_step_incident(5, 2, 1.25, NODES4) is None
    assert nan_step_incident(5, 2, float("nan"), NODES4) == Incident(
        "nan", "nan", 2, "node-1", "rank 2 on node-1 reported a non-finite loss (nan) at step 5")
    inc = nan_step_incident(7, 9, float("-inf"), NODES4)  # a rank beyond the known nodes
    assert inc is not None and (inc.kind, inc.rank, inc.node) == (IncidentKind.NAN, 9, "")
    assert inc.evidence == "rank 9 on no node reported a non-finite loss (-inf) at step 7"


# -- stragglers -------------------------------------------------------------------------------

S = 1_000_000_000  # ns per second


def test_collective_laggard_is_late_against_the_median_of_the_others() -> None:
    from fleet.controlplane.detectors import collective_laggard

    assert collective_laggard({0: 10 * S, 1: 10 * S + S // 10, 2: 11 * S, 3: 10 * S + S // 5}) == (2, 0.9)
    assert collective_laggard({0: 5 * S, 1: 5 * S}) == (0, 0.0)  # a tie names the lowest rank
    assert collective_laggard({0: 5 * S}) is None


def test_step_laggard_takes_the_latest_arrival_over_the_limit() -> None:
    from fleet.controlplane.detectors import step_laggard

    step = [
        {0: 0, 1: S // 10, 2: 2 * S // 10, 3: 0},      # normal skew: rank 2, 0.15 s
        {0: 3 * S, 1: 3 * S, 2: 3 * S, 3: 3 * S + 7 * S // 10},  # rank 3, 0.7 s
    ]
    assert step_laggard(step, 0.5) == (3, 0.7)
    assert step_laggard(step[:1], 0.5) is None
    assert step_laggard([], 0.5) is None


def test_straggler_needs_the_same_rank_in_consecutive_steps() -> None:
    from fleet.controlplane.detectors import detect_straggler

    late = [(s, 3, 0.6 if s % 2 else 0.9) for s in range(10, 20)]
    inc = detect_straggler(late, 10, NODES4)
    assert inc == Incident(
        "straggler", "straggler", 3, "node-1",
        "rank 3 entered collectives last in each of 10 consecutive steps (10-19), a median 0.75 s after "
        "the other members")
    assert detect_straggler(late[1:], 10, NODES4) is None                      # 9 steps only
    one_off = late[:5] + [None] + late[6:] + [(20, 3, 0.7)]                      # a step on time breaks it
    assert detect_straggler(one_off, 10, NODES4) is None
    other = late[:9] + [(19, 1, 0.8)]                                            # another rank in between
    assert detect_straggler(other, 10, NODES4) is None
    gap = late[:9] + [(25, 3, 0.8)]                                              # not consecutive steps
    assert detect_straggler(gap, 10, NODES4) is None


def test_a_one_off_slow_step_is_not_a_straggler() -> None:
    from fleet.controlplane.detectors import detect_straggler

    history = [None] * 9 + [(9, 2, 5.0)]
    assert detect_straggler(history, 10, NODES4) is None
    assert detect_straggler([(9, 2, 5.0)], 1, NODES4) is not None  # unless one step is the rule


# -- losses -----------------------------------------------------------------------------------

def test_loss_spike_against_the_median_of_the_window() -> None:
    from fleet.controlplane.detectors import loss_spike, loss_spike_incident

    recent = [3.0, 2.9, 2.8, 2.7, 2.6]
    assert loss_spike(recent, 14.1, 5.0, 5)        # > 5 x 2.8
    assert not loss_spike(recent, 13.9, 5.0, 5)
    assert not loss_spike(recent, 100.0, 0.0, 5)  # off
    inc = loss_spike_incident(77, 14.1, recent, 5.0, 5)
    assert inc == Incident("loss_spike", "loss", -1, "",
                           "loss 14.1 at step 77 is 5.0x the median 2.8 of the previous 5 steps (limit 5x)")
    assert loss_spike_incident(77, 3.0, recent, 5.0, 5) is None


def test_fewer_than_window_finite_losses_never_spike() -> None:
    from fleet.controlplane.detectors import loss_spike

    assert not loss_spike([1.0, 1.0, 1.0, 1.0], 1000.0, 5.0, 5)
    nan, inf = float("nan"), float("inf")
    assert not loss_spike([1.0, nan, 1.0, inf, 1.0, 1.0], 1000.0, 5.0, 5)  # 4 finite ones
    assert loss_spike([1.0, nan, 1.0, inf, 1.0, 1.0, 1.0], 1000.0, 5.0, 5)
    assert not loss_spike([1.0] * 5, nan, 5.0, 5)  # the nan detector's case, not a spike
    assert not loss_spike([0.0] * 5, 1.0, 5.0, 5)  # a zero median says nothing
    # only the last `window` finite losses count
    assert loss_spike([100.0] * 10 + [1.0] * 5, 6.0, 5.0, 5)


# -- agents -----------------------------------------------------------------------------------

def test_agents_lost_past_the_timeout() -> None:
    from fleet.controlplane.detectors import agent_loss_incident, agents_lost

    assert agents_lost({"node-1": 10.5, "node-0": 0.3, "node-2": 10.0, "node-3": 99.0}, 10.0) == ["node-1", "node-3"]
    assert agents_lost({}, 10.0) == []
    inc = agent_loss_incident("node-1", 10.5, 10.0, NODES4)
    assert inc == Incident("agent_loss", "agent", 2, "node-1",
                           "the agent of node-1 was not heard from for 10.5 s (timeout 10 s); rank(s) [2, 3] "
                           "run there")
    spare = agent_loss_incident("node-9", 12.0, 10.0, NODES4)
    assert (spare.rank, spare.node) == (-1, "node-9")


def test_nonfinite_loss_inside_a_ray_task_error() -> None:
    # Ray's task error: a traceback as text, and the NonFiniteLossError's fields, which
    # the orchestrator copies into the failure (test_failures.py covers that hop)
    error = ("ray.exceptions.RayTaskError(NonFiniteLossError): ray::RankActor.run() (pid=41, ip=127.0.0.1)\n"
             "  File \"workers/trainer.py\", line 287, in step\n"
             "fleet.workers.failures.NonFiniteLossError: non-finite loss at step 12 on rank(s) [3]")
    inc = attribute_failures([_nan(0, "node-0", 12, (3,), error)], nodes=NODES4)
    assert inc is not None and (inc.kind, inc.rank, inc.node) == ("nan", 3, "node-1")
    assert inc.evidence == "non-finite loss at step 12 on rank(s) [3] (raised by rank(s) [0])"


def test_detect_config_defaults_and_ordering() -> None:
    from fleet.controlplane.config import DetectConfig, parse_cluster_yaml
    from fleet.controlplane.errors import ConfigError

    d = parse_cluster_yaml("{}").detect
    assert (d.interval_s, d.hang_factor, d.hang_floor_s, d.unconfirmed_hang_s, d.startup_timeout_s) == (
        0.2, 3.0, 1.0, 10.0, 300.0)
    assert (d.straggler_lag_s, d.straggler_steps, d.loss_spike_factor, d.loss_window) == (0.2, 10, 5.0, 20)
    assert DetectConfig(loss_spike_factor=0).loss_spike_factor == 0  # off
    with pytest.raises(ConfigError, match=r"detect: interval_s must be < hang_floor_s"):
        parse_cluster_yaml("detect: {interval_s: 2.0, hang_floor_s: 1.0}")
    with pytest.raises(ConfigError, match=r"detect.straggler_steps"):
        parse_cluster_yaml("detect: {straggler_steps: 0}")


# -- kinds ------------------------------------------------------------------------------------

def test_an_incident_kind_is_an_incident_kind_enum_and_an_unknown_one_is_refused() -> None:
    inc = Incident("node_loss", "node_loss", 1, "node-1", "gone")
    assert inc.kind is IncidentKind.NODE_LOSS and f"{inc.kind}" == "node_loss"
    with pytest.raises(ValueError, match="gpu_fell_off"):
        Incident("gpu_fell_off", "d", 0, "node-0", "")


def test_every_detector_builds_enum_kinds() -> None:
    died = attribute_failures([Failure(0, "node-0", True, "killed")], ["node-0"])
    raised = attribute_failures([Failure(0, "node-0", False, "boom")], ["node-0"])
    nan = attribute_failures([_nan(0, "node-0", 1, (0,))], ["node-0"])
    assert [(type(i.kind), i.kind) for i in (died, raised, nan)] == [
        (IncidentKind, IncidentKind.CRASH), (IncidentKind, IncidentKind.ERROR), (IncidentKind, IncidentKind.NAN)]
