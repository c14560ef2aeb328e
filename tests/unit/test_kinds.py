"""fleet.proto.kinds agrees with the .proto enums it mirrors, value for value."""

from __future__ import annotations

import pytest

from fleet.proto import events_pb2
from fleet.proto.kinds import Carrier, FaultKind, IncidentKind

pytestmark = pytest.mark.timeout(30)


def _proto_names(enum_type, prefix: str) -> set[str]:  # noqa: ANN001 (protobuf EnumTypeWrapper)
    return {name.removeprefix(prefix) for name in enum_type.keys() if not name.endswith("_UNSPECIFIED")}


def test_fault_kinds_match_the_proto_enum() -> None:
    assert {k.name for k in FaultKind} == _proto_names(events_pb2.FaultKind, "FAULT_KIND_")
    for kind in FaultKind:
        assert kind.value == kind.name.lower().replace("_", "-")
        assert FaultKind.from_wire(kind.wire) is kind


def test_incident_kinds_match_the_proto_enum() -> None:
    assert {k.name for k in IncidentKind} == _proto_names(events_pb2.IncidentKind, "INCIDENT_KIND_")
    for kind in IncidentKind:
        assert kind.value == kind.name.lower()
        assert events_pb2.IncidentKind.Name(kind.wire) == "INCIDENT_KIND_" + kind.name


def test_unspecified_or_unknown_fault_numbers_are_refused() -> None:
    with pytest.raises(ValueError):
        FaultKind.from_wire(0)
    with pytest.raises(ValueError):
        FaultKind.from_wire(999)


def test_properties() -> None:
    assert FaultKind.CRASH.carrier is Carrier.RANK and FaultKind.CRASH.worker_timed
    assert FaultKind.CKPT_CORRUPT.worker_timed and FaultKind.CKPT_CORRUPT.carrier is Carrier.CONTROLLER
    assert not FaultKind.PARTITION.worker_timed and FaultKind.PARTITION.has_duration
    assert {k for k in IncidentKind if k.counts_for_quarantine} == {IncidentKind.CRASH, IncidentKind.HANG}
    assert all(k.hardware_like for k in IncidentKind if k.counts_for_quarantine)
    assert not IncidentKind.STRAGGLER.ends_attempt and IncidentKind.NODE_LOSS.ends_attempt
