"""workers/recorder.py with real 2-rank gloo process groups on 127.0.0.1."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fleet.proto import events_pb2
from fleet.proto.kinds import Timing
from tests.unit.test_workers_support import run_ranks
from fleet.workers.native_fr import NativeFlightTail
from fleet.workers.recorder import FlightRecorder
from fleet.workers.rendezvous import loopback_store

pytestmark = pytest.mark.timeout(60)


def _record_some(rank: int, world_size: int, port: int) -> list[bytes]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    try:
        events: list[events_pb2.Event] = []
        rec = FlightRecorder("job", 2, rank, events.append)
        sub = dist.new_group([0, 1])
        rec.set_step(1)
        rec.barrier()
        t = torch.full((3, 2), float(rank + 1))
        rec.all_reduce(t)
        assert torch.equal(t, torch.full((3, 2), 3.0))
        rec.all_reduce(torch.ones(4, dtype=torch.float64), group=sub)
        rec.step = 2
        b = torch.tensor([rank * 10], dtype=torch.int64)
        rec.broadcast(b, src=1)
        assert b.item() == 10
        out = torch.empty(4, dtype=torch.bfloat16)
        rec.all_gather_into_tensor(out, torch.full((2,), float(rank), dtype=torch.bfloat16), group=sub)
        assert out.tolist() == [0.0, 0.0, 1.0, 1.0]
        rec.barrier(group=sub)
        with pytest.raises((ValueError, RuntimeError)):
            # Wrong output size: fails on every rank before any data moves.
            rec.all_gather_into_tensor(torch.empty(3), torch.ones(2))
        assert rec.last_seq() == 4 and rec.last_seq(sub) == 3
        return [e.SerializeToString() for e in events]
    finally:
        dist.destroy_process_group()


def test_records_every_collective_with_per_group_sequence_numbers():
    raw = run_ranks(_record_some, 2)
    for rank in (0, 1):
        events = [events_pb2.Event.FromString(b).collective for b in raw[rank]]
        assert all(e.rank == rank and e.job_id == "job" and e.attempt == 2 for e in events)
        # started / finished pairs, same seq, entry before exit.
        assert len(events) == 14
        for started, done in zip(events[::2], events[1::2]):
            assert started.state == "started" and started.exit_ns == 0
            assert done.state in ("completed", "failed")
            assert (done.seq, done.group, done.op) == (started.seq, started.group, started.op)
            assert started.enter_ns == done.enter_ns <= done.exit_ns
        done = events[1::2]
        world = [e for e in done if e.group == "0"]
        subs = [e for e in done if e.group != "0"]
        assert [e.seq for e in world] == [1, 2, 3, 4]
        assert [e.op for e in world] == ["barrier", "all_reduce", "broadcast", "all_gather_into_tensor"]
        assert [e.state for e in world] == ["completed"] * 3 + ["failed"]
        assert [e.seq for e in subs] == [1, 2, 3]
        assert [e.op for e in subs] == ["all_reduce", "all_gather_into_tensor", "barrier"]
        assert len({e.group for e in subs}) == 1
        assert all(e.group_size == 2 for e in done)
        assert [e.step for e in done] == [1, 1, 1, 2, 2, 2, 2]
        ar = world[1]
        assert [list(s.dims) for s in ar.input_sizes] == [[3, 2]] and list(ar.input_dtypes) == ["float32"]
        assert [list(s.dims) for s in ar.output_sizes] == [[3, 2]]
        ag = subs[1]
        assert [list(s.dims) for s in ag.input_sizes] == [[2]]
        assert [list(s.dims) for s in ag.output_sizes] == [[4]]
        assert list(ag.output_dtypes) == ["bfloat16"]
        assert list(world[0].input_sizes) == [] and list(world[0].input_dtypes) == []
    # Both ranks name the groups alike, so the controller can match them.
    names = [{e.collective.group for e in map(events_pb2.Event.FromString, raw[r])} for r in (0, 1)]
    assert names[0] == names[1]


def _merged(rank: int, world_size: int, port: int) -> list[bytes]:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
    events: list[events_pb2.Event] = []
    tail = NativeFlightTail("job", 1, rank, events.append, ring_entries=64)
    rec = FlightRecorder("job", 1, rank, events.append, tail=tail)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rec.set_step(7)
        rec.all_reduce(torch.ones(3))                 # the recorder's wrapper: a blocking call
        dist.broadcast(torch.ones(2), src=0)          # a plain torch.distributed call: timed too
        work = dist.all_reduce(torch.ones(5), async_op=True)
        work.wait()                                   # async: issue to the Work's completion
        # the process group's own method, as DDP's C++ reducer reaches it: no Python call to time
        dist.distributed_c10d._get_default_group().broadcast([torch.ones(1)]).wait()
        time.sleep(0.05)
        tail.poll(force=True)
    finally:
        dist.destroy_process_group()
    return [e.SerializeToString() for e in events]


def test_native_entries_take_the_timed_windows():
    events = [events_pb2.Event.FromString(b) for b in run_ranks(_merged, 1)[0]]
    assert [e.WhichOneof("kind") for e in events] == ["group"] + ["collective"] * 4
    wrapped, plain, async_, raw = (e.collective for e in events[1:])
    assert (wrapped.op, wrapped.seq, wrapped.step, wrapped.state) == ("all_reduce", 1, 7, "completed")
    assert [(c.op, c.seq) for c in (plain, async_, raw)] == [("broadcast", 2), ("all_reduce", 3), ("broadcast", 4)]
    for c, timing in ((wrapped, Timing.WRAPPER), (plain, Timing.WRAPPER), (async_, Timing.ASYNC)):
        assert not c.exit_estimated and c.timing == timing.wire, c
        # the window opened before the backend created the entry, and closed at the exit
        assert 0 < c.duration_ns and c.exit_ns - c.duration_ns <= c.enter_ns <= c.exit_ns
    assert raw.exit_estimated and (raw.duration_ns, raw.timing) == (0, 0)
    assert raw.exit_ns >= async_.exit_ns


def test_timed_windows_are_safe_to_add_while_a_read_looks_them_up():
    # the training thread adds a window per collective while the reporter's read looks one
    # up: iterating a deque another thread changes raised "deque mutated during iteration",
    # which failed the read half way (and, before reads resumed where they failed, lost
    # the entry being converted)
    tail = NativeFlightTail("job", 1, 0, lambda e: None, ring_entries=64)
    stop = time.monotonic() + 1.0
    errors: list[BaseException] = []

    def add() -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            tail.timed("0", n, 0)   # ops still running: none is dropped, a lookup scans them all

    adder = threading.Thread(target=add)
    adder.start()
    try:
        while time.monotonic() < stop:
            try:
                tail._window("0", time.monotonic_ns())
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        adder.join()
    assert errors == []


def _failing_read(rank: int, world_size: int, port: int) -> list[bytes]:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
    events: list[events_pb2.Event] = []
    tail = NativeFlightTail("job", 1, rank, events.append, ring_entries=64)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(4):
            dist.all_reduce(torch.ones(3))
        time.sleep(0.05)
        window, calls = tail._window, []

        def flaky(group: str, created_ns: int):  # noqa: ANN202
            calls.append(created_ns)
            if len(calls) == 2:
                raise RuntimeError("deque mutated during iteration")
            return window(group, created_ns)

        tail._window = flaky
        with pytest.raises(RuntimeError):
            tail.poll(force=True)        # fails on the second entry
        tail.poll(force=True)            # the next read goes on from there
    finally:
        dist.destroy_process_group()
    return [e.SerializeToString() for e in events]


def test_a_read_that_fails_half_way_loses_and_repeats_nothing():
    events = [events_pb2.Event.FromString(b) for b in run_ranks(_failing_read, 1)[0]]
    seqs = [e.collective.seq for e in events if e.WhichOneof("kind") == "collective"]
    assert seqs == [1, 2, 3, 4], seqs
