"""agent/spool.py's write-ahead log read back after a death at any byte: the field scanner
never raises on what a torn write or a damaged disk leaves, and adopting a log gives
exactly the reports whose marks made it to disk, each once. Real files in tmp_path."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.agent.spool import Spool, fields
from fleet.agent.uplink import _length_delimited
from fleet.proto import agent_pb2, events_pb2
from fleet.proto.contract import EVENT_BATCH_EVENTS_TAG, EVENT_BATCH_MARKS_TAG


def _event(step: int) -> bytes:
    e = events_pb2.Event(step=events_pb2.StepEvent(job_id="j", attempt=1, rank=0, step=step))
    return _length_delimited(EVENT_BATCH_EVENTS_TAG, e.SerializeToString())


def _mark(report_id: int) -> bytes:
    return _length_delimited(EVENT_BATCH_MARKS_TAG,
                             agent_pb2.ReportMark(reporter="w", report_id=report_id).SerializeToString())


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_the_field_scanner_never_raises_and_tiles_a_prefix(data: bytes) -> None:
    end = 0
    for key, start, stop in fields(data):
        assert start == end and stop <= len(data) and data[start:].startswith(key)
        end = stop


@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=8), cut=st.floats(0, 1))
@settings(max_examples=60, deadline=None)
def test_a_log_torn_anywhere_yields_exactly_its_complete_reports(tmp_path_factory, sizes: list[int],
                                                                 cut: float) -> None:
    root = tmp_path_factory.mktemp("spill")
    log, step, ends = b"", 0, []   # ends: (byte offset after report i's mark, its last step)
    for i, n in enumerate(sizes, start=1):
        for _ in range(n):
            step += 1
            log += _event(step)
        log += _mark(i)
        ends.append((len(log), step, i))
    torn = log[:int(len(log) * cut)]
    dead = root / "agent-n" / "1"
    dead.mkdir(parents=True)
    (dead / f"pending.{1:020d}.log").write_bytes(torn)
    spool = Spool(root, "agent-n", 2)
    try:
        (pred,) = spool.take_stale()
        complete = [(s, i) for end, s, i in ends if end <= len(torn)]
        last_step, last_report = complete[-1] if complete else (0, 0)
        assert pred.reports == ({"w": last_report} if last_report else {})
        steps = [e.step.step for b in pred.batches
                 for e in agent_pb2.EventBatch.FromString(b.path.read_bytes()).events]
        assert steps == list(range(1, last_step + 1))
        assert all((b.epoch, b.seq) == (1, 1) for b in pred.batches)
    finally:
        spool.close()
    assert not dead.exists() and not (root / "agent-n" / "2").exists()


def test_damaged_batch_files_and_logs_are_adopted_without_raising(tmp_path: Path) -> None:
    dead = tmp_path / "agent-n" / "1"
    dead.mkdir(parents=True)
    (dead / f"{3:020d}.2.batch").write_bytes(EVENT_BATCH_MARKS_TAG + b"\x05\xff\xff\xff\xff\xff")
    (dead / f"pending.{4:020d}.log").write_bytes(b"\x00garbage")
    (dead / "not-ours.txt").write_bytes(b"x")
    spool = Spool(tmp_path, "agent-n", 2)
    try:
        (pred,) = spool.take_stale()
        # the batch goes up as it is (the controller rejects what it cannot read); the
        # log's garbage holds no complete report
        assert [(b.seq, b.n_events) for b in pred.batches] == [(3, 2)] and pred.reports == {}
    finally:
        spool.close()
