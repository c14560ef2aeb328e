"""The watchdog on a large job's telemetry: collective fronts instead of collectives.

Real store (SQLite and PostgreSQL), real protobuf events through ``ingest.prepare``, the
same feed as tests/component/test_watchdog.py. The fronts name a suspect; the watchdog
asks the suspect groups' agents for their raw entries (``TracePull`` through ``send``);
the test answers as an agent would (the entries as CollectiveColumns in a batch) and
the flight recorder's diagnosis of them names the culprit. Unanswered, the watchdog
decides on the fronts alone once ``PULL_WAIT_S`` has passed.
"""

from __future__ import annotations

import threading
import time

import pytest

from fleet.controlplane.detectors import Incident
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import prepare
from fleet.controlplane import fronts_pull
from fleet.controlplane.fronts_pull import PULL_WAIT_S
from fleet.controlplane.watchdog import Watchdog
from fleet.proto import columns, events_pb2
from fleet.proto.fronts import FrontRow, pack, signature
from fleet.proto.kinds import IncidentKind
from tests.component.test_watchdog import CFG, NODES, WORLD, Feed, Incidents, group_ev, step_ev

pytestmark = pytest.mark.timeout(120)

SIZES, DTYPES = "[[64]]", '["float32"]'
SIG = signature("all_reduce", SIZES, DTYPES, SIZES, DTYPES)
ODD = signature("broadcast", SIZES, DTYPES, SIZES, DTYPES)


@pytest.fixture
def job(store: Store) -> str:
    job_id = store.create_job("fronts-test", total_steps=10_000, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING, "placing")
    assert store.create_attempt(job_id) == 1
    for rank, node in enumerate(NODES):
        store.record_rank(job_id, 1, rank, node, 1000 + rank)
    return job_id


def front_ev(job: str, rank: int, entered: int, completed: int, enter_ns: int, sig: int = SIG,
             op: str = "all_reduce") -> events_pb2.Event:
    return events_pb2.Event(fronts=pack([FrontRow(job, 1, rank, "0", len(NODES), entered, completed, enter_ns,
                                                  enter_ns if completed == entered else 0, op, sig, entered, 1)]))


class Agents:
    """``send``: keeps the commands; ``pulls()`` waits for TracePulls."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.commands: list[tuple[str, events_pb2.Command]] = []

    def __call__(self, node: str, command: events_pb2.Command) -> None:
        with self.cond:
            self.commands.append((node, command))
            self.cond.notify_all()

    def pulls(self, n: int, timeout_s: float) -> list[tuple[str, events_pb2.Command]]:
        with self.cond:
            self.cond.wait_for(lambda: sum(c.HasField("pull") for _, c in self.commands) >= n, timeout_s)
            return [(node, c) for node, c in self.commands if c.HasField("pull")]


def raw(job: str, rank: int, seq: int, enter_ns: int, done: bool, op: str = "all_reduce") -> events_pb2.Event:
    c = events_pb2.CollectiveEvent(job_id=job, attempt=1, rank=rank, group="0", group_size=len(NODES), seq=seq,
                                   op=op, enter_ns=enter_ns, exit_ns=enter_ns + 1000 if done else 0,
                                   state="completed" if done else "started", step=seq)
    c.input_sizes.add().dims.extend([64])
    c.output_sizes.add().dims.extend([64])
    c.input_dtypes.append("float32")
    c.output_dtypes.append("float32")
    return events_pb2.Event(collectives=columns.pack([c.__class__.FromString(c.SerializeToString())]))


def _healthy(feed: Feed, job: str, steps: range) -> dict[int, int]:
    """Healthy steps: every rank enters and completes seq = step; returns enter ns by seq."""
    entered = {}
    for step in steps:
        t = entered[step] = time.time_ns()
        feed.send([front_ev(job, r, step, step, t) for r in WORLD])
        time.sleep(0.1)
        feed.send([step_ev(job, r, step) for r in WORLD])
    return entered


def _rank_2_stops(feed: Feed, job: str) -> None:
    """Groups declared, four healthy steps, then every rank but 2 enters seq 5."""
    feed.send([group_ev(job, r) for r in WORLD])
    _healthy(feed, job, range(1, 5))
    feed.send([front_ev(job, r, 5, 4, time.time_ns()) for r in (0, 1, 3)])


def test_fronts_name_a_suspect_and_the_pulled_entries_confirm_it(store: Store, job: str) -> None:
    incidents, agents = Incidents(), Agents()
    with Watchdog(store, job, CFG, incidents, send=agents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        entered = _healthy(feed, job, range(1, 7))
        t7 = time.time_ns()
        feed.send([front_ev(job, r, 7, 6, t7) for r in (0, 2, 3)])  # rank 1 never enters seq 7
        pulls = agents.pulls(2, timeout_s=15)
        assert {node for node, _ in pulls} == {"node-0", "node-1"}
        for node, cmd in pulls:
            assert list(cmd.pull.groups) == ["0"] and cmd.pull.job_id == job and cmd.pull.attempt == 1
            assert sorted(cmd.pull.ranks) == [r for r in WORLD if NODES[r] == node]
        assert incidents.kinds() == []  # it waits for the entries before it decides
        # the agents answer with their rings: seqs 1..6 done everywhere, seq 7 open on 0, 2, 3
        feed.send([raw(job, r, s, entered[s], True) for r in WORLD for s in range(1, 7)]
                  + [raw(job, r, 7, t7, False) for r in (0, 2, 3)])
        got = incidents.wait(1, timeout_s=15)
    assert [(i.kind, i.rank, i.node) for i in got] == [(IncidentKind.HANG, 1, "node-0")]
    assert "collective fronts" not in got[0].evidence  # the flight recorder's own verdict
    assert "rank 1" in got[0].evidence


def test_pulled_entries_confirm_before_the_store_has_them(store: Store, job: str) -> None:
    # at 16,384 ranks the store's writer is seconds behind: the answers are judged as they
    # are observed, not once committed (here they never are)
    incidents, agents = Incidents(), Agents()
    with Watchdog(store, job, CFG, incidents, send=agents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        entered = _healthy(feed, job, range(1, 7))
        t7 = time.time_ns()
        feed.send([front_ev(job, r, 7, 6, t7) for r in (0, 1, 2)])  # rank 3 never enters seq 7
        pulls = agents.pulls(2, timeout_s=15)
        answered = time.monotonic()
        for node, _ in pulls:
            wd.observe(node, prepare([raw(job, r, s, entered[s], True) for r in WORLD if NODES[r] == node
                                      for s in range(1, 7)]
                                     + [raw(job, r, 7, t7, False) for r in (0, 1, 2) if NODES[r] == node]))
        got = incidents.wait(1, timeout_s=15)
    assert [(i.kind, i.rank, i.node) for i in got] == [(IncidentKind.HANG, 3, "node-1")]
    assert "collective fronts" not in got[0].evidence  # the flight recorder's verdict, not the fallback
    assert time.monotonic() - answered < PULL_WAIT_S
    assert not store.recent_collectives(job, 1, 8)  # nothing of it was ever stored


def test_pulled_entries_are_not_judged_as_live_collectives(store: Store, job: str) -> None:
    # a pull's answers are rings of old entries from hundreds of agents, arriving as a hang
    # is being confirmed: they feed its diagnosis and nothing else (a large job's
    # stragglers, cadence and lag are judged on its steps and fronts)
    incidents, agents = Incidents(), Agents()
    with Watchdog(store, job, CFG, incidents, send=agents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        _healthy(feed, job, range(1, 4))
        # entries in which rank 3 entered every op 0.6 s after the others (a straggler by
        # CFG, were they live: see test_watchdog's straggler test), seconds old
        t = time.time_ns() - 30 * 10**9
        feed.send([raw(job, r, s, t + s * 10**9 + (600_000_000 if r == 3 else 0), True)
                   for s in range(1, 15) for r in WORLD])
        _healthy(feed, job, range(4, 6))
        assert incidents.wait(1, timeout_s=1.0) == []


def test_unanswered_pull_decides_on_the_fronts(store: Store, job: str) -> None:
    incidents, agents = Incidents(), Agents()
    with Watchdog(store, job, CFG, incidents, send=agents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        _rank_2_stops(feed, job)
        assert agents.pulls(2, timeout_s=15)
        asked = time.monotonic()
        got = incidents.wait(1, timeout_s=15)
    assert time.monotonic() - asked >= PULL_WAIT_S - 0.5
    assert [(i.kind, i.rank, i.node) for i in got] == [(IncidentKind.HANG, 2, "node-1")]
    assert "collective fronts" in got[0].evidence and "never entered all_reduce seq 5" in got[0].evidence


def test_a_suspicion_over_more_nodes_than_a_pull_may_ask_is_left_to_the_fronts(
        store: Store, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # agents reconnecting after a controller restart once had the fronts blame 8,192 ranks
    # over every node of a 16,384-rank job; pulling all their rings buried the ingest
    monkeypatch.setattr(fronts_pull, "PULL_MAX_NODES", 1)   # the suspect group spans 2 nodes here
    incidents, agents = Incidents(), Agents()
    with Watchdog(store, job, CFG, incidents, send=agents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        _rank_2_stops(feed, job)
        got = incidents.wait(1, timeout_s=15)
    assert agents.pulls(1, timeout_s=0.1) == []
    assert [(i.kind, i.rank, i.node) for i in got] == [(IncidentKind.HANG, 2, "node-1")]
    assert "collective fronts" in got[0].evidence


def test_a_rank_entering_another_op_is_a_desync(store: Store, job: str) -> None:
    incidents = Incidents()
    with Watchdog(store, job, CFG, incidents) as wd:  # no send: the fronts decide
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        _healthy(feed, job, range(1, 5))
        t = time.time_ns()
        feed.send([front_ev(job, r, 5, 4, t) for r in (0, 1, 2)]
                  + [front_ev(job, 3, 5, 4, t, sig=ODD, op="broadcast")])
        got = incidents.wait(1, timeout_s=20)
    assert [(i.kind, i.rank, i.node) for i in got] == [(IncidentKind.DESYNC, 3, "node-1")]
    assert "rank 3 entered broadcast" in got[0].evidence
