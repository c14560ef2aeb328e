"""The pure parts of the controller's metrics: arrival-lag matching, expert shares, the
badput mapping, which incident ended an attempt and what was done about it, the bulk
histogram (against prometheus-client's own), the observer fan-out, and the config and
controller.json fields metrics add."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram

from fleet.controlplane import auth
from fleet.controlplane.agent_server import fan_out
from fleet.controlplane.collective_metrics import ArrivalMatcher, arrival_lags, expert_shares
from fleet.controlplane.config import parse_cluster_yaml
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.job_metrics import LOST_CATEGORIES, ending_incident, incident_action, lost_by_category
from fleet.controlplane.metrics import BulkHistogram
from fleet.controlplane.store import IncidentRecord
from fleet.controlplane.store.ingest import PreparedBatch
from fleet.proto.kinds import IncidentKind

pytestmark = pytest.mark.timeout(60)


def _incident(id_: int, kind: str, *, attempt: int = 1, at: float = 1000.0, observed: str = "",
              node: str | None = "node-1") -> IncidentRecord:
    return IncidentRecord(id=id_, job_id="j", attempt=attempt, kind=IncidentKind(kind), rank=2, node=node,
                          detector="t", evidence="e", detected_at=at, observed=observed)


# -- arrival lag ------------------------------------------------------------------------------

def test_arrival_lags_are_behind_the_first_member() -> None:
    assert arrival_lags({0: 5_000_000_000, 1: 5_250_000_000, 2: 5_000_000_000, 3: 6_000_000_000}) == {
        0: 0.0, 1: 0.25, 2: 0.0, 3: 1.0}
    assert arrival_lags({}) == {}


def test_matcher_completes_a_collective_once_every_member_entered() -> None:
    m = ArrivalMatcher(window=2)
    m.add("0", 1, 3, 0, 1_000_000_000)
    m.add("0", 1, 3, 1, 1_100_000_000)
    assert m.mean_lags() == {} and m.matched == 0          # rank 2 not in yet
    m.add("0", 1, 3, 1, 1_900_000_000)                     # rank 1's completion row: its enter stays
    m.add("0", 1, 3, 2, 1_500_000_000)
    assert m.matched == 1
    assert m.mean_lags() == pytest.approx({0: 0.0, 1: 0.1, 2: 0.5})
    m.add("0", 1, 3, 0, 1_000_000_000)                     # a completion after the match: no new match
    assert m.matched == 1
    for seq, lags in ((2, (0.0, 0.3, 0.1)), (3, (0.2, 0.0, 0.1))):
        for rank, lag in enumerate(lags):
            m.add("0", seq, 3, rank, 10_000_000_000 * seq + int(lag * 1e9))
    # a window of 2: the last two matches only
    assert m.mean_lags() == pytest.approx({0: 0.1, 1: 0.15, 2: 0.1})


def test_matcher_takes_a_collective_s_members_at_once() -> None:
    one_by_one, at_once = ArrivalMatcher(), ArrivalMatcher()
    for rank, t in ((2, 7_000_000_000), (0, 5_000_000_000), (1, 5_500_000_000)):
        one_by_one.add("dp", 16, 3, rank, t)
    at_once.add_members("dp", 16, 3, (2, 0), (7_000_000_000, 5_000_000_000))
    at_once.add_members("dp", 16, 3, (1, 0), (5_500_000_000, 9_000_000_000))  # rank 0 again: its first stays
    assert at_once.matched == one_by_one.matched == 1
    assert at_once.mean_lags() == one_by_one.mean_lags() == {0: 0.0, 1: 0.5, 2: 2.0}


def test_matcher_leaves_out_p2p_and_single_member_groups_and_bounds_open_matches() -> None:
    m = ArrivalMatcher(max_open=2)
    m.add("0:p2p", 1, 2, 0, 1)
    m.add("0:p2p", 1, 2, 1, 5)
    m.add("solo", 1, 1, 0, 1)
    assert m.matched == 0 and m.mean_lags() == {}
    m.add("0", 1, 2, 0, 0)     # never completed: rank 1 died
    m.add("0", 2, 2, 0, 0)
    m.add("0", 3, 2, 0, 0)     # evicts (0, 1)
    m.add("0", 1, 2, 1, 9)     # opens (0, 1) again with rank 1 alone: evicts (0, 2)
    assert m.matched == 0
    m.add("0", 3, 2, 1, 2_000_000_000)
    assert m.matched == 1 and m.mean_lags() == pytest.approx({0: 0.0, 1: 2.0})


# -- MoE ----------------------------------------------------------------------------------------

def test_expert_shares() -> None:
    assert expert_shares([10, 30, 60, 0]) == [0.1, 0.3, 0.6, 0.0]
    assert expert_shares([0, 0]) == [0.0, 0.0]
    assert expert_shares([]) == []


# -- goodput ------------------------------------------------------------------------------------

def test_lost_time_categories_are_badput_names() -> None:
    lost = {"startup_s": 3.5, "detection_s": 1.25, "restart_s": 12.0, "recomputed_s": 4.0,
            "checkpointing_s": 0.5, "other_s": 2.0}
    assert lost_by_category(lost) == {
        "program_startup": 3.5, "disruption_detection": 1.25, "infrastructure_recovery_from_disruption": 12.0,
        "wasted_progress_from_disruption": 4.0, "unproductive_checkpoint_save_time": 0.5, "other": 2.0}
    assert set(LOST_CATEGORIES) == set(lost)  # every category fleet report has


# -- incidents ----------------------------------------------------------------------------------

def test_ending_incident_follows_fleet_report() -> None:
    straggler, crash, spike = _incident(1, "straggler"), _incident(2, "crash"), _incident(3, "loss_spike")
    assert ending_incident([straggler, crash, spike]) is crash          # the last kind that ends one
    assert ending_incident([straggler, spike]) is straggler              # else the first
    assert ending_incident([straggler, crash], timed=[1]) is straggler   # a restart timed for it wins
    assert ending_incident([_incident(4, "hang", observed="would restart")]) is None
    assert ending_incident([]) is None


def test_incident_action() -> None:
    crash = _incident(1, "crash", at=1000.0)
    common = dict(quarantined_at=None, attempt_over=False, ended_it=False, restarted=False)
    assert incident_action(_incident(2, "hang", observed="would restart"), **common, age_s=0) == "observe"
    assert incident_action(crash, **{**common, "quarantined_at": 1000.5}, age_s=1) == "quarantine"
    # a quarantine of the node long before this incident is not its action
    assert incident_action(crash, **{**common, "quarantined_at": 900.0}, age_s=1) is None
    assert incident_action(crash, **common, age_s=1) is None                    # not known yet
    over = {**common, "attempt_over": True}
    assert incident_action(crash, **{**over, "ended_it": True, "restarted": True}, age_s=2) == "restart"
    assert incident_action(crash, **{**over, "ended_it": True}, age_s=2) == "none"      # the job gave up
    assert incident_action(crash, **{**over, "restarted": True}, age_s=2) == "none"     # another ended it
    assert incident_action(crash, **common, age_s=60) == "none"
    straggler = _incident(3, "straggler")
    assert incident_action(straggler, **common, age_s=4.9) is None
    assert incident_action(straggler, **common, age_s=5) == "none"


# -- the bulk histogram ---------------------------------------------------------------------------

def test_bulk_histogram_exports_what_prometheus_client_would() -> None:
    buckets = (0.001, 0.01, 0.1, 1.0)
    values = [0.0005, 0.001, 0.002, 0.01, 0.5, 1.0, 7.0, 0.1]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = BulkHistogram("x_seconds", "x", ["op"], buckets, ours)
    bulk.observe_many(("a",), values[:3])
    bulk.observe_many(("a",), values[3:])
    bulk.observe_many(("b",), [])
    h = Histogram("x_seconds", "x", ["op"], buckets=buckets, registry=theirs)
    for v in values:
        h.labels("a").observe(v)

    def samples(registry: CollectorRegistry) -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples
                if not s.name.endswith("_created")}

    assert samples(ours) == samples(theirs)
    assert ours.get_sample_value("x_seconds_bucket", {"op": "a", "le": "0.001"}) == 2
    assert ours.get_sample_value("x_seconds_count", {"op": "a"}) == 8
    assert ours.get_sample_value("x_seconds_count", {"op": "b"}) is None   # nothing observed: no series


# -- wiring ---------------------------------------------------------------------------------------

def test_fan_out_shows_every_batch_to_every_observer_even_after_one_fails() -> None:
    seen: list[str] = []

    def broken(node: str, batch: PreparedBatch) -> None:
        seen.append("broken")
        raise RuntimeError("observer bug")

    assert fan_out(None, None) is None
    only = lambda node, batch: seen.append("only")  # noqa: E731
    assert fan_out(None, only) is only
    both = fan_out(broken, lambda node, batch: seen.append(node))
    with pytest.raises(RuntimeError, match="observer bug"):
        both("node-3", PreparedBatch())
    assert seen == ["broken", "node-3"]


def test_metrics_config_defaults_and_errors() -> None:
    cfg = parse_cluster_yaml("{}\n", "x.yaml").controller
    assert (cfg.metrics, cfg.metrics_port, cfg.metrics_refresh_interval_s) == (True, 0, 1.0)
    cfg = parse_cluster_yaml("controller:\n  metrics: false\n  metrics_refresh_interval_s: 0.25\n", "x.yaml")
    assert (cfg.controller.metrics, cfg.controller.metrics_refresh_interval_s) == (False, 0.25)
    for bad in ("0", "-1", "nope"):
        with pytest.raises(ConfigError) as info:
            parse_cluster_yaml(f"controller:\n  metrics_refresh_interval_s: {bad}\n", "x.yaml")
        assert str(info.value).startswith("x.yaml:2: controller.metrics_refresh_interval_s: "), str(info.value)
        assert "\n" not in str(info.value)


def test_controller_json_without_metrics_port_still_reads(tmp_path: Path) -> None:
    (tmp_path / "controller.json").write_text(json.dumps(
        {"address": "127.0.0.1:5", "token": "t", "job_id": "j-1", "pid": 7}))
    assert auth.read_controller_info(tmp_path).metrics_port == 0
    auth.write_controller_info(tmp_path, auth.ControllerInfo("127.0.0.1:5", "t", "j-1", 7, metrics_port=9400))
    assert json.loads((tmp_path / "controller.json").read_text())["metrics_port"] == 9400
    assert auth.read_controller_info(tmp_path).metrics_port == 9400
