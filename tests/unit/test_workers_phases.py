"""Phases a rank reports (workers/phases.py) and the step API's ``fleet.phase``."""

from __future__ import annotations

import pytest

import fleet
from fleet.proto import events_pb2
from fleet.workers.phases import Phases, check_name

pytestmark = pytest.mark.timeout(30)


def test_phases_report_entering_and_leaving_innermost_first() -> None:
    events: list[events_pb2.Event] = []
    phases = Phases("job", 2, 1, events.append)
    with phases.phase("eval"):
        assert phases.current == "eval"
        with phases.phase("checkpointing"):
            assert phases.current == "checkpointing"
    assert phases.current == ""
    got = [(e.status.state, e.status.phase, e.status.phase_s > 0) for e in events]
    training = events_pb2.WorkerStatus.TRAINING
    assert got == [(training, "eval", False), (training, "checkpointing", False), (training, "eval", True),
                   (training, "", True)]
    assert {(e.status.job_id, e.status.attempt, e.status.rank) for e in events} == {("job", 2, 1)}


def test_a_phase_that_raises_is_still_left() -> None:
    events: list[events_pb2.Event] = []
    phases = Phases("job", 1, 0, events.append)
    with pytest.raises(KeyError), phases.phase("eval"):
        raise KeyError("x")
    assert [e.status.phase for e in events] == ["eval", ""]


@pytest.mark.parametrize("name", ["", " eval", "a b", "x" * 65, 3, "-lead"])
def test_bad_phase_names_are_refused(name: object) -> None:
    with pytest.raises(ValueError, match="phase name"):
        check_name(name)
    with pytest.raises(ValueError, match="phase name"), fleet.phase(name):  # type: ignore[arg-type]
        pass


def test_fleet_phase_outside_fleet_is_a_no_op() -> None:
    with fleet.phase("eval"):
        pass
