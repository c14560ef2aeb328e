"""Fronts in the store: the ingest writer keeps the newest front per (job, attempt, rank,
group) of committed batches and writes them every ``fronts_flush_s`` and at close; a
stored front never moves back. Real SQLite file and PostgreSQL."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from fleet.controlplane.metrics import ControllerMetrics
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import InvalidBatch, prepare
from fleet.controlplane.store.writer import IngestWriter, Item
from fleet.proto import agent_pb2, events_pb2
from fleet.proto.fronts import PACKED_COLUMNS, FrontRow, newest, pack, unpack

pytestmark = pytest.mark.timeout(60)


@dataclass
class Stream:
    """The writer's view of one agent stream: where acks go."""

    agent_id: str = "agent-n0"
    node_name: str = "n0"
    failed: bool = False
    acks: list[int] = field(default_factory=list)

    def ack(self, msg: agent_pb2.ControllerMessage) -> None:
        self.acks.append(msg.ack.seq)

    def fail(self, reason: str) -> None:
        self.failed = True


def row(rank: int, entered: int, completed: int, group: str = "dp0") -> FrontRow:
    return FrontRow("job-1", 1, rank, group, 4, entered, completed, entered * 10, completed * 10,
                    "all_reduce", 7, entered, 1)


def fronts_ev(rows: list[FrontRow]) -> events_pb2.Event:
    return events_pb2.Event(fronts=pack(rows))


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_writer_keeps_the_newest_front_and_flushes_it(store: Store) -> None:
    stream = Stream()
    with IngestWriter(store, ControllerMetrics(), fronts_flush_s=0.2) as writer:
        batches = [[row(r, 5, 5) for r in range(4)],
                   [row(0, 6, 5), row(1, 6, 6)],
                   [row(0, 4, 4)]]                     # late and older: changes nothing
        for seq, rows in enumerate(batches, 1):
            assert writer.put(Item(stream, 1, seq, prepare([fronts_ev(rows)]), len(rows)))
        assert _wait(lambda: len(stream.acks) == 3, 10)
        assert _wait(lambda: store.count_fronts("job-1", 1) == 4, 10)
        assert _wait(lambda: [(f.rank, f.entered_seq, f.completed_seq) for f in store.fronts("job-1", 1)]
                     == [(0, 6, 5), (1, 6, 6), (2, 5, 5), (3, 5, 5)], 10)
        assert writer.put(Item(stream, 1, 4, prepare([fronts_ev([row(2, 9, 9)])]), 1))
    # close() flushed what was still kept
    assert [f.entered_seq for f in store.fronts("job-1", 1, ranks=[2])] == [9]
    assert [f.rank for f in store.fronts("job-1", 1, offset=1, limit=2)] == [1, 2]


def test_record_fronts_never_moves_a_front_back(store: Store) -> None:
    store.record_fronts([row(0, 8, 7), row(1, 3, 3)])
    store.record_fronts([row(0, 8, 6), row(0, 7, 7), row(1, 3, 3)._replace(step=99)])
    got = {f.rank: (f.entered_seq, f.completed_seq, f.step) for f in store.fronts("job-1", 1)}
    assert got == {0: (8, 7, 8), 1: (3, 3, 99)}  # as far on: the newer write wins


@pytest.mark.parametrize("bad, field_name", [
    (lambda b: b.entered_seq.append(3), "fronts.entered_seq"),
    (lambda b: b.group.__setitem__(0, 9), "fronts.group"),
    (lambda b: b.completed_seq.__setitem__(0, 99), "completed_seq above entered_seq"),
])
def test_a_malformed_fronts_block_is_refused_naming_the_field(bad, field_name: str) -> None:
    block = pack([row(0, 5, 5)], packed=False)
    bad(block)
    with pytest.raises(InvalidBatch, match=field_name):
        prepare([events_pb2.Event(fronts=block)])


def _repacked(block: events_pb2.CollectiveFronts, column: str, value: int) -> None:
    m = np.frombuffer(block.packed, dtype="<i8").reshape(len(PACKED_COLUMNS), -1).copy()
    m[PACKED_COLUMNS.index(column), 0] = value
    block.packed = m.astype("<i8").tobytes()


@pytest.mark.parametrize("bad, field_name", [
    (lambda b: setattr(b, "packed", b.packed[:-3]), "fronts.packed: .* not a whole number"),
    (lambda b: b.rank.append(1), "both packed and repeated"),
    (lambda b: _repacked(b, "group", 7), "fronts.group: index 7 outside strings"),
    (lambda b: _repacked(b, "op", -1), "fronts.op: index -1 outside strings"),
    (lambda b: _repacked(b, "rank", -2), "fronts.rank: a value outside"),
    (lambda b: _repacked(b, "completed_seq", 99), "completed_seq above entered_seq"),
    (lambda b: _repacked(b, "entered_seq", -1), "a negative seq"),
])
def test_a_malformed_packed_block_is_refused_naming_the_field(bad, field_name: str) -> None:
    block = pack([row(0, 5, 5), row(1, 6, 6)])
    assert block.packed and not block.rank
    bad(block)
    with pytest.raises(InvalidBatch, match=field_name):
        prepare([events_pb2.Event(fronts=block)])


def test_packed_and_repeated_blocks_read_the_same() -> None:
    rows = [row(0, 5, 5), row(1, 6, 5), row(2, 9, 9)._replace(group="tp", op="all_gather")]
    assert unpack(pack(rows)) == unpack(pack(rows, packed=False)) == rows
    assert newest([pack(rows[:2]), pack(rows[2:], packed=False)]) == rows


def test_a_slow_fronts_flush_puts_the_next_one_off_but_never_past_the_bound(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # a flush that took t seconds is followed by the next FRONTS_FLUSH_COST * t later (7.5 s
    # here), but never later than FRONTS_FLUSH_MAX_S: fronts not yet written are lost if
    # the controller dies, and an attempt that ended is never sent again
    from fleet.controlplane.store import writer as writer_module

    monkeypatch.setattr(writer_module, "FRONTS_FLUSH_MAX_S", 1.0)
    record = store.record_fronts

    def slow(rows: list[FrontRow]) -> None:  # a loaded store: every write takes 0.3 s
        time.sleep(0.3)
        record(rows)

    monkeypatch.setattr(store, "record_fronts", slow)
    stream = Stream()
    with IngestWriter(store, ControllerMetrics(), fronts_flush_s=0.1) as writer:
        assert writer.put(Item(stream, 1, 1, prepare([fronts_ev([row(r, 5, 5) for r in range(4)])]), 4))
        assert _wait(lambda: store.count_fronts("job-1", 1) == 4, 10)
        assert writer.put(Item(stream, 1, 2, prepare([fronts_ev([row(0, 9, 9)])]), 1))
        assert _wait(lambda: [f.entered_seq for f in store.fronts("job-1", 1, ranks=[0])] == [9], 5)
