"""The watchdog's slow_comm detector over a real store, fed real prepared batches as agents
deliver them: a late rank and a group below its link are each reported once, with the
rank and node the judge names; the next attempt is judged afresh."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from fleet.controlplane.collective_perf import JUDGE_EVERY_S
from fleet.controlplane.config import DetectConfig
from fleet.controlplane.detectors import Incident
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import prepare
from fleet.controlplane.watchdog import Watchdog
from fleet.proto import events_pb2
from fleet.proto.kinds import IncidentKind, Timing

pytestmark = pytest.mark.timeout(60)

NODES = ["node-0", "node-1"]
MS = 1_000_000
CFG = DetectConfig(interval_s=0.05, slow_comm={"window": 4})


@dataclass(frozen=True)
class Path:
    bandwidth_bps: float
    link: str
    scope: str
    racks: tuple[str, ...]


class OneRack:
    """A stand-in topology: every node in rack r1 behind a 100 GB/s link."""

    def rack_of(self, node: str) -> str | None:
        return "r1"

    def path(self, nodes: Iterable[str]) -> Path | None:
        return Path(100e9, "the node link (800 Gbit/s)", "rack", ("r1",))


class Incidents:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.got: list[Incident] = []

    def __call__(self, incident: Incident) -> None:
        with self.cond:
            self.got.append(incident)
            self.cond.notify_all()

    def wait(self, n: int, timeout_s: float) -> list[Incident]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.got) >= n, timeout_s)
            return list(self.got)


def coll(job: str, attempt: int, rank: int, seq: int, enter_ns: int) -> events_pb2.Event:
    """A completed all_reduce of 1 MiB measured by fleet's wrapper in 1 ms."""
    c = events_pb2.CollectiveEvent(
        job_id=job, attempt=attempt, rank=rank, group="0", group_size=len(NODES), seq=seq, op="allreduce",
        enter_ns=enter_ns, exit_ns=enter_ns + MS, state="completed", step=seq, input_dtypes=["float32"],
        output_dtypes=["float32"], duration_ns=MS, timing=Timing.WRAPPER.wire)
    c.input_sizes.add().dims.extend([262144])
    c.output_sizes.add().dims.extend([262144])
    return events_pb2.Event(collective=c)


def feed(store: Store, wd: Watchdog, job: str, attempt: int, seqs: range, seq0: int) -> None:
    """Rank 1 enters each collective 100 ms after rank 0; one batch per node, observed
    then committed (the AgentServicer's order)."""
    for seq in seqs:
        for rank, node in enumerate(NODES):
            batch = prepare([coll(job, attempt, rank, seq, (10 + seq) * 1_000 * MS + rank * 100 * MS)])
            wd.observe(node, batch)
            store.record_batches([(f"agent-{node}", attempt, seq0 + 2 * seq + rank, batch)])


def test_a_late_rank_and_a_slow_group_are_reported_once_per_attempt(store: Store) -> None:
    job = store.create_job("slow-comm", total_steps=100, config_json="{}")
    store.set_job_state(job, JobState.PLACING, "placing")
    assert store.create_attempt(job) == 1
    incidents = Incidents()
    with Watchdog(store, job, CFG, incidents, topology=OneRack()) as wd:
        wd.watch(1, NODES)
        feed(store, wd, job, 1, range(4), 0)
        got = incidents.wait(2, timeout_s=20)
        assert [(i.kind, i.rank, i.node) for i in got] == [
            (IncidentKind.SLOW_COMM, 1, "node-1"), (IncidentKind.SLOW_COMM, -1, "")]
        # every collective skewed by exactly skew_s (0.1 s): MIN_SKEWED of them in the window of 4
        assert ("rank 1 (node-1) entered last in 4 of the 4 collectives of the last 4 whose arrival skew was >= "
                "detect.slow_comm.skew_s 0.1 s (median 0.10 s): a late rank") in got[0].evidence
        # exactly min_bytes (1 MiB) in 1 ms x 2(n-1)/n = 1.0 GB/s of a 100 GB/s link
        assert "median busbw 1.0 GB/s = 0.01 of the node link (800 Gbit/s)" in got[1].evidence
        feed(store, wd, job, 1, range(4, 8), 0)            # the same again: judged, already reported
        assert incidents.wait(3, timeout_s=JUDGE_EVERY_S + 5 * CFG.interval_s) == got
        wd.pause()
        assert store.create_attempt(job) == 2
        wd.watch(2, NODES)                                  # a new attempt: judged afresh
        feed(store, wd, job, 2, range(4), 100)
        assert len(incidents.wait(4, timeout_s=20)) == 4
