"""When a node is quarantined (pure decision, literal timestamps)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from fleet.controlplane.config import PolicyConfig
from fleet.controlplane.policy import decide_quarantine
from fleet.proto.kinds import IncidentKind


@dataclass
class Inc:
    kind: str
    node: str | None
    detected_at: float
    job_id: str = "j-1"
    attempt: int = 1
    rank: int | None = 0


@dataclass
class Policy:
    quarantine_after_incidents: int = 2
    quarantine_window_s: float = 600.0
    quarantine_kinds: list[str] = field(default_factory=lambda: ["crash", "hang"])


def test_the_second_hardware_incident_in_the_window_quarantines_the_node() -> None:
    one = [Inc("crash", "node-0", 1000.0)]
    assert not decide_quarantine(1100.0, "node-0", one, Policy()).quarantine
    two = [*one, Inc("hang", "node-0", 1500.0, attempt=2, rank=1)]
    d = decide_quarantine(1550.0, "node-0", two, Policy())
    assert d.quarantine
    assert d.reason == ("2 incidents on node-0 within 600 s (policy: 2): crash of rank 0 (j-1 attempt 1); "
                        "hang of rank 1 (j-1 attempt 2)")


def test_old_software_and_other_nodes_incidents_do_not_count() -> None:
    history = [Inc("crash", "node-0", 100.0),        # outside the window
               Inc("error", "node-0", 1500.0),       # follows the code, not the node
               Inc("desync", "node-0", 1510.0),
               Inc("crash", "node-1", 1520.0),       # another node
               Inc("crash", "node-0", 1530.0)]
    d = decide_quarantine(1600.0, "node-0", history, Policy())
    assert not d.quarantine and d.reason == "1 of 2 incidents on node-0 in 600 s"


def test_zero_turns_automatic_quarantine_off() -> None:
    many = [Inc("crash", "node-0", float(t)) for t in range(10)]
    assert not decide_quarantine(10.0, "node-0", many, Policy(quarantine_after_incidents=0)).quarantine
    assert decide_quarantine(10.0, "node-0", many[:1], Policy(quarantine_after_incidents=1)).quarantine


def test_the_default_kinds_are_those_that_count_for_quarantine() -> None:
    kinds = PolicyConfig().quarantine_kinds
    assert kinds == [k for k in IncidentKind if k.counts_for_quarantine] == ["crash", "hang"]
    assert all(type(k) is IncidentKind for k in kinds)
    assert PolicyConfig(quarantine_kinds=["node_loss", "crash"]).quarantine_kinds == [
        IncidentKind.NODE_LOSS, IncidentKind.CRASH]


def test_an_unknown_quarantine_kind_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ValidationError) as info:
        PolicyConfig(quarantine_kinds=["crash", "gpu_fell_off"])
    (error,) = info.value.errors()
    known = sorted(k.value for k in IncidentKind)
    assert error["msg"] == f"Value error, unknown incident kind(s) ['gpu_fell_off']; known: {known}"


def test_a_policy_config_drives_the_decision() -> None:
    history = [Inc("crash", "node-0", 1000.0), Inc("node_loss", "node-0", 1001.0), Inc("hang", "node-0", 1002.0)]
    assert decide_quarantine(1003.0, "node-0", history, PolicyConfig()).reason.startswith("2 incidents on node-0")
    only_loss = PolicyConfig(quarantine_kinds=["node_loss"], quarantine_after_incidents=1)
    assert "node_loss of rank 0" in decide_quarantine(1003.0, "node-0", history, only_loss).reason
