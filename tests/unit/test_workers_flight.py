"""workers/flight.py (the library call for plain torchrun scripts) and the native tail it
shares with fleet's workers (workers/native_fr.py), on real gloo process groups."""

from __future__ import annotations

import logging
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fleet.proto import events_pb2
from fleet.proto.kinds import Timing
from tests.unit.test_workers_support import AgentServer, run_ranks
from fleet.workers.flight import FlightRecorderError, record_collectives
from fleet.workers.native_fr import NativeFlightTail
from fleet.workers.rendezvous import loopback_store

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def agent():
    server = AgentServer()
    yield server
    server.stop()


def _init(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=loopback_store(rank, world_size, port), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))


# ---- record_collectives in a real 2-rank group ------------------------------------------

def _script(rank: int, world_size: int, port: int, agent_address: str, dump_dir: str) -> dict:
    """What a user's torchrun script does, with torchrun's environment."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), TORCHELASTIC_RESTART_COUNT="2")
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    with record_collectives(job_id="job-f", agent_address=agent_address, dump_dir=dump_dir,
                            poll_interval_s=0.1, report_interval_s=0.05) as rec:
        ring = os.environ["TORCH_FR_BUFFER_SIZE"]
        _init(rank, world_size, port)
        sub = dist.new_group([0, 1])
        rec.step(1)
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.broadcast(t, src=1, group=sub)
        rec.step(2)
        out = torch.empty(8)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
            out, torch.full((4,), float(rank)))
        dist.barrier(group=sub)
    dist.destroy_process_group()  # after close: group membership is read from the live groups
    return {"ring": ring, "counters": rec.counters(), "streaming": rec.streaming}


def test_record_collectives_streams_every_collective_and_writes_dumps(agent, tmp_path):
    results = run_ranks(_script, 2, (agent.address, str(tmp_path)))
    for rank in (0, 1):
        assert results[rank]["ring"] == "256" and results[rank]["streaming"]
        assert results[rank]["counters"]["fr_lost"] == 0
        events = [e for r, e in agent.events if r == rank]
        kinds = [e.WhichOneof("kind") for e in events]
        groups = {e.group.group: e.group for e in events if e.WhichOneof("kind") == "group"}
        assert groups["0"].desc == "default_pg" and list(groups["0"].ranks) == [0, 1]
        assert len(groups) == 2 and all(list(g.ranks) == [0, 1] for g in groups.values())
        assert all((g.job_id, g.attempt, g.rank) == ("job-f", 2, rank) for g in groups.values())
        # a group's membership arrives before its first collective
        for name in groups:
            first_info = next(i for i, e in enumerate(events) if kinds[i] == "group" and e.group.group == name)
            first_coll = next(i for i, e in enumerate(events)
                              if kinds[i] == "collective" and e.collective.group == name)
            assert first_info < first_coll
        done = [e.collective for e in events if kinds[events.index(e)] == "collective"
                and e.collective.state == "completed"]
        assert all((c.job_id, c.attempt, c.rank) == ("job-f", 2, rank) for c in done)
        world = [c for c in done if c.group == "0"]
        sub = [c for c in done if c.group != "0"]
        assert [(c.seq, c.op, c.step) for c in world] == [(1, "all_reduce", 1), (2, "all_gather", 2)]
        assert [(c.seq, c.op, c.step) for c in sub] == [(1, "broadcast", 1), (2, "barrier", 2)]
        assert all(c.group_size == 2 and c.exit_ns >= c.enter_ns > 0 for c in done)
        assert [list(s.dims) for s in world[1].input_sizes] == [[4]] and list(world[1].input_dtypes) == ["float32"]

        dump = tmp_path / f"fr_dump_{rank}"
        doc = pickle.loads(dump.read_bytes())
        assert doc["version"].startswith("2.")
        assert [e["profiling_name"] for e in doc["entries"]][-4:] == [
            "gloo:all_reduce", "gloo:broadcast", "gloo:all_gather", "gloo:barrier"]
        assert all("frames" in e for e in doc["entries"])  # stack traces, for post-mortems
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fr_dump_0", "fr_dump_1"]


def _dump_only(rank: int, world_size: int, port: int, dump_dir: str) -> str:
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    os.environ.pop("FLEET_AGENT_ADDRESS", None)
    rec = record_collectives(dump_dir=dump_dir)
    assert not rec.streaming
    _init(rank, world_size, port)
    dist.all_reduce(torch.ones(2))
    path = rec.dump()
    rec.close()
    dist.destroy_process_group()
    return os.environ["TORCH_FR_BUFFER_SIZE"] + " " + path.name


def test_dump_only_keeps_a_large_ring(tmp_path):
    assert run_ranks(_dump_only, 1, (str(tmp_path),)) == {0: "2000 fr_dump_0"}


def _recorder_off(rank: int, world_size: int, port: int) -> list[str]:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    errors = []
    with pytest.raises(FlightRecorderError) as before:
        record_collectives(agent_address="")
    errors.append(str(before.value))
    _init(rank, world_size, port)
    try:
        with pytest.raises(FlightRecorderError) as after:
            record_collectives(agent_address="")
        errors.append(str(after.value))
    finally:
        dist.destroy_process_group()
    return errors


def test_refuses_clearly_when_the_recorder_is_off():
    before, after = run_ranks(_recorder_off, 1)[0]
    assert "flight recorder is off" in before and "TORCH_FR_BUFFER_SIZE=0" in before
    assert "process group already exists with the flight recorder off" in after


# ---- the native tail itself ---------------------------------------------------------------

def _init_alone() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _tail_rank(rank: int, world_size: int, port: int) -> dict:
    os.environ["TORCH_FR_BUFFER_SIZE"] = "16"
    # an earlier process group in this process: its entries are not this tail's
    _init_alone()
    for _ in range(3):
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()

    events: list[events_pb2.Event] = []
    tail = NativeFlightTail("job", 3, rank, events.append, ring_entries=16, poll_interval_s=30.0)
    _init_alone()
    t = torch.ones(2)

    def issue(n: int) -> None:
        for _ in range(n):
            dist.all_reduce(t)
        time.sleep(0.05)  # gloo retires a finished op from its own thread

    issue(5)
    out = {"first": tail.poll()}              # first poll always reads
    out["unchanged"] = tail.poll()            # probe says nothing changed
    issue(3)
    out["not_due"] = tail.poll()              # changed, but the interval is not up
    issue(6)
    out["half_full"] = tail.poll()            # 9 of 16 unread: read early
    issue(40)
    logging.getLogger("fleet.workers.native_fr").setLevel(logging.WARNING)
    out["overflow"] = tail.poll(force=True)   # 40 new in a ring of 16: 24 lost
    out["counters"] = tail.counters()
    out["events"] = [e.SerializeToString() for e in events]
    dist.destroy_process_group()
    return out


def test_tail_reads_only_when_due_and_counts_overwritten_entries():
    out = run_ranks(_tail_rank, 1)[0]
    assert (out["first"], out["unchanged"], out["not_due"], out["half_full"], out["overflow"]) == (6, 0, 0, 9, 16)
    c = out["counters"]
    assert (c["fr_lost"], c["fr_collectives"], c["fr_dumps"], c["fr_skipped_polls"]) == (24, 30, 3, 2)
    events = [events_pb2.Event.FromString(b) for b in out["events"]]
    assert events[0].WhichOneof("kind") == "group" and events[0].group.group == "0"
    assert list(events[0].group.ranks) == [0] and events[0].group.desc == "default_pg"
    seqs = [e.collective.seq for e in events[1:]]
    assert seqs == list(range(1, 15)) + list(range(39, 55))  # 15..38 were overwritten
    # every one issued through torch.distributed's functions: timed (workers.collective_timing)
    assert all(e.collective.state == "completed" and not e.collective.exit_estimated
               and e.collective.timing == Timing.WRAPPER.wire and e.collective.duration_ns > 0 for e in events[1:])
    assert all((e.collective.job_id, e.collective.attempt) == ("job", 3) for e in events[1:])
