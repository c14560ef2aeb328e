"""The watchdog over a real store (SQLite file and PostgreSQL), fed the rows of real
protobuf events as agent batches deliver them (``ingest.prepare``), observed first and
then committed, as the AgentServicer does. No mocks: time is real, so each scenario
plays its steps at a real pace and waits on the incident callback with a bounded timeout.
"""

from __future__ import annotations

import itertools
import re
import threading
import time

import grpc
import pytest

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.config import DetectConfig
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.detectors import Incident
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.store import Store
from fleet.controlplane.store.ingest import prepare
from fleet.controlplane import watchdog as watchdog_module
from fleet.controlplane.watchdog import MIN_COLLECTIVE_GAPS_PER_RANK, VERDICT_STABLE_S, WARMUP_GAPS_PER_RANK, Watchdog
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.fronts import unpack
from tests.component.conftest import TOKEN, StoreJobControl

pytestmark = pytest.mark.timeout(120)

NODES = ["node-0", "node-0", "node-1", "node-1"]
WORLD = range(len(NODES))
CFG = DetectConfig(interval_s=0.05, hang_floor_s=1.0, unconfirmed_hang_s=10.0, straggler_lag_s=0.5,
                   straggler_steps=10, loss_spike_factor=5.0, loss_window=20)
MS = 1_000_000


# -- events, as workers send them -------------------------------------------------------------

def step_ev(job: str, rank: int, step: int, loss: float = 2.0, attempt: int = 1,
            step_time_s: float = 0.1) -> events_pb2.Event:
    return events_pb2.Event(step=events_pb2.StepEvent(
        job_id=job, attempt=attempt, rank=rank, step=step, loss=loss, step_time_s=step_time_s,
        tokens_per_s=1000.0, end_ns=time.time_ns()))


def coll_ev(job: str, rank: int, seq: int, step: int, enter_ns: int, state: str = "completed",
            attempt: int = 1) -> events_pb2.Event:
    c = events_pb2.CollectiveEvent(
        job_id=job, attempt=attempt, rank=rank, group="0", group_size=len(NODES), seq=seq,
        op="all_gather", enter_ns=enter_ns, exit_ns=time.time_ns() if state == "completed" else 0,
        state=state, step=step)
    c.input_sizes.add().dims.extend([64])
    c.input_dtypes.append("float32")
    c.output_sizes.add().dims.extend([len(NODES) * 64])
    c.output_dtypes.append("float32")
    return events_pb2.Event(collective=c)


def group_ev(job: str, rank: int, attempt: int = 1) -> events_pb2.Event:
    return events_pb2.Event(group=events_pb2.ProcessGroupInfo(
        job_id=job, attempt=attempt, rank=rank, group="0", desc="default_pg", ranks=list(WORLD)))


class Feed:
    """Delivers events as node agents do: one batch per node, observed by the watchdog and
    committed to the store (the AgentServicer's order)."""

    _epochs = itertools.count(1)

    def __init__(self, store: Store, watchdog: Watchdog) -> None:
        self.store = store
        self.watchdog = watchdog
        self.epoch = next(self._epochs)  # a fresh (agent, epoch, seq) key space per feed
        self.seq = 0

    def send(self, events: list[events_pb2.Event]) -> None:
        """``events`` of any ranks: split by node, one batch each."""
        by_node: dict[str, list[events_pb2.Event]] = {}
        for ev in events:
            kind = ev.WhichOneof("kind")
            if kind == "fronts":  # a block of rows: one rank's here
                rank = unpack(ev.fronts)[0].rank
            else:
                rank = getattr(ev, kind).rank
                if not isinstance(rank, int):  # a block of collectives: one rank's here
                    rank = rank[0]
            by_node.setdefault(NODES[rank], []).append(ev)
        for node, evs in by_node.items():
            rows = prepare(evs)
            self.watchdog.observe(node, rows)
            self.seq += 1
            self.store.record_batches([(f"agent-{node}", self.epoch, self.seq, rows)])


class Incidents:
    """The on_incident callback: records (wall ns, incident) and lets a test wait."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.got: list[tuple[int, Incident]] = []

    def __call__(self, incident: Incident) -> None:
        with self.cond:
            self.got.append((time.time_ns(), incident))
            self.cond.notify_all()

    def wait(self, n: int, timeout_s: float) -> list[Incident]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.got) >= n, timeout_s)
            return [i for _, i in self.got]

    def kinds(self) -> list[str]:
        with self.cond:
            return [i.kind for _, i in self.got]


@pytest.fixture
def job(store: Store) -> str:
    job_id = store.create_job("watchdog-test", total_steps=10_000, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING, "placing")
    assert store.create_attempt(job_id) == 1
    for rank, node in enumerate(NODES):
        store.record_rank(job_id, 1, rank, node, 1000 + rank)
    return job_id


def _watchdog(store: Store, job: str, incidents: Incidents, cfg: DetectConfig = CFG, **kw) -> Watchdog:
    return Watchdog(store, job, cfg, incidents, **kw)


def _healthy_steps(feed: Feed, job: str, steps: range, pace_s: float = 0.1) -> int:
    """Play ``steps`` of a healthy 4-rank run (one all_gather per step, seq = step);
    return the last step's end (wall ns)."""
    end = 0
    for step in steps:
        t = time.time_ns()
        feed.send([coll_ev(job, r, step, step, t + r * MS) for r in WORLD])
        time.sleep(pace_s)
        feed.send([step_ev(job, r, step, loss=3.0 - step / 100) for r in WORLD])
        end = time.time_ns()
    return end


# -- (a) hang ---------------------------------------------------------------------------------

def _rank_1_hangs_at_step_7(store: Store, job: str, wd: Watchdog) -> int:
    """Six healthy steps, then ranks 0, 2 and 3 enter all_gather 7 and wait while rank 1
    hangs before it; returns the end of step 6 (wall ns)."""
    wd.watch(1, NODES)
    feed = Feed(store, wd)
    feed.send([group_ev(job, r) for r in WORLD])
    last_end = _healthy_steps(feed, job, range(1, 7))
    t = time.time_ns()
    feed.send([coll_ev(job, r, 7, 7, t, state="started") for r in (0, 2, 3)])
    return last_end


def test_hang_names_the_rank_that_never_entered_the_collective(store: Store, job: str) -> None:
    incidents = Incidents()
    with _watchdog(store, job, incidents) as wd:
        last_end = _rank_1_hangs_at_step_7(store, job, wd)
        threshold = CFG.hang_floor_s  # 3 x a ~0.1 s median is below the floor
        got = incidents.wait(1, timeout_s=threshold + 5.0)
        assert len(got) == 1, "no hang detected"
        fired_ns, inc = incidents.got[0]
        assert (inc.kind, inc.detector, inc.rank, inc.node) == ("hang", "hang", 1, "node-0")
        assert "flight recorder: hang: culprit rank 1" in inc.evidence
        assert "rank 1 never entered collective 7" in inc.evidence
        took = (fired_ns - last_end) / 1e9
        assert threshold < took <= threshold + 1.0, f"fired {took:.2f} s after the last step"
        # the same hang is reported once
        assert incidents.wait(2, timeout_s=0.5) == [inc]


def test_the_verdicts_clock_starts_before_the_threshold(store: Store, job: str, monkeypatch) -> None:
    """The flight recorder's verdict must hold VERDICT_STABLE_S; it starts holding
    VERDICT_STABLE_S before the threshold, so the hang fires at the threshold, not that
    much after it. Stretched (threshold 4 s, stability 2 s) to part the two clearly."""
    stable_s = 2.0
    monkeypatch.setattr(watchdog_module, "VERDICT_STABLE_S", stable_s)
    cfg = CFG.model_copy(update={"hang_floor_s": 4.0})
    incidents = Incidents()
    with _watchdog(store, job, incidents, cfg) as wd:
        last_end = _rank_1_hangs_at_step_7(store, job, wd)
        (inc,) = incidents.wait(1, timeout_s=cfg.hang_floor_s + stable_s + 5.0)
        fired_ns, _ = incidents.got[0]
        assert (inc.kind, inc.rank) == ("hang", 1) and "culprit rank 1" in inc.evidence
        took = (fired_ns - last_end) / 1e9
        assert cfg.hang_floor_s < took < cfg.hang_floor_s + stable_s / 2, f"fired {took:.2f} s after the last step"


def test_a_paused_watchdog_fires_nothing_and_watch_rearms(store: Store, job: str) -> None:
    incidents = Incidents()
    cfg = CFG.model_copy(update={"startup_timeout_s": 0.3})
    with _watchdog(store, job, incidents, cfg) as wd:
        wd.watch(1, NODES)
        wd.pause()
        assert incidents.wait(1, timeout_s=0.8) == []  # the startup timeout passed while paused
        wd.watch(1, NODES)
        (inc,) = incidents.wait(1, timeout_s=5.0)
        assert (inc.kind, inc.rank, inc.node) == ("hang", -1, "")
        assert "startup timeout 0.3 s" in inc.evidence and inc.evidence.startswith("unconfirmed")


def test_startup_hang_is_blamed_on_the_rank_the_flight_recorder_names(store: Store, job: str) -> None:
    incidents = Incidents()
    cfg = CFG.model_copy(update={"startup_timeout_s": 1.5})
    with _watchdog(store, job, incidents, cfg) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        t = time.time_ns()
        feed.send([coll_ev(job, r, 1, 0, t, state="started") for r in (0, 1, 3)])
        (inc,) = incidents.wait(1, timeout_s=10.0)
        assert (inc.kind, inc.rank, inc.node) == ("hang", 2, "node-1")
        assert "startup timeout 1.5 s" in inc.evidence and "culprit rank 2" in inc.evidence


# -- (a') hang of a job without steps: judged from its collectives alone -------------------------

def _threshold_of(inc: Incident) -> float:
    found = re.search(r"threshold ([0-9.]+) s from the job's collective cadence", inc.evidence)
    assert found, inc.evidence
    return float(found.group(1))


def test_a_job_without_steps_hangs_from_its_collective_cadence(store: Store, job: str) -> None:
    incidents = Incidents()
    with _watchdog(store, job, incidents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        # no step API: every collective is "step 0"; one all_gather every 0.4 s
        rounds = MIN_COLLECTIVE_GAPS_PER_RANK + WARMUP_GAPS_PER_RANK + 2
        for seq in range(1, rounds + 1):
            t = time.time_ns()
            feed.send([coll_ev(job, r, seq, 0, t + r * MS) for r in WORLD])
            time.sleep(0.4)
        # ranks 0, 1 and 3 enter the next all_gather and wait; rank 2 never does
        entered = time.time_ns()
        feed.send([coll_ev(job, r, rounds + 1, 0, entered, state="started") for r in (0, 1, 3)])
        (inc,) = incidents.wait(1, timeout_s=10.0)
        fired_ns, _ = incidents.got[0]
        assert (inc.kind, inc.detector, inc.rank, inc.node) == ("hang", "hang", 2, "node-1")
        assert "flight recorder: hang: culprit rank 2" in inc.evidence
        assert f"rank 2 never entered collective {rounds + 1}" in inc.evidence
        assert re.search(r"^no collective entered or completed for [0-9.]+ s, threshold [0-9.]+ s from the job's "
                         r"collective cadence \(largest recent gap 0\.[4-9] s x hang_factor 3\)", inc.evidence)
        threshold = _threshold_of(inc)  # as shown: to 0.1 s
        assert CFG.hang_floor_s < threshold < 3 * 0.7  # 3 x the 0.4 s gap (and sleep's overshoot)
        took = (fired_ns - entered) / 1e9
        # VERDICT_STABLE_S, telemetry lag and two check intervals on top of the threshold
        assert threshold - 0.05 < took <= threshold + VERDICT_STABLE_S + 1.0, f"fired {took:.2f} s after the stall"
        assert incidents.wait(2, timeout_s=0.5) == [inc]


def test_a_job_without_steps_keeps_its_cadence_of_bursts_and_long_compute_gaps(store: Store, job: str) -> None:
    incidents = Incidents()
    # A low floor and a short grace: a threshold learned from the short gaps (the floor)
    # would call the first compute gap an unconfirmed hang; a start-up timeout shorter
    # than the run shows that the collectives took over from it.
    cfg = CFG.model_copy(update={"hang_floor_s": 0.3, "unconfirmed_hang_s": 0.5, "startup_timeout_s": 2.5})
    compute_s, burst = 1.0, 5
    with _watchdog(store, job, incidents, cfg) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        seq = 0
        for _ in range(5):
            for _ in range(burst):  # a DDP step's bucket all-reduces, 10 ms apart
                seq += 1
                t = time.time_ns()
                feed.send([coll_ev(job, r, seq, 0, t + r * MS) for r in WORLD])
                time.sleep(0.01)
            last = time.time_ns()
            time.sleep(compute_s)  # forward and backward: no collective at all
        assert incidents.kinds() == []
        # every rank stops at once: nobody waits on anybody, so only the grace makes it a hang
        (inc,) = incidents.wait(1, timeout_s=3 * (compute_s + 0.2) + cfg.unconfirmed_hang_s + 3.0)
        fired_ns, _ = incidents.got[0]
        assert inc.kind == "hang" and inc.evidence.startswith("unconfirmed: no collective entered or completed")
        assert re.search(r"from the job's collective cadence \(largest recent gap 1\.[0-2] s x hang_factor 3\)",
                         inc.evidence), inc.evidence
        threshold = _threshold_of(inc)  # as shown: to 0.1 s
        assert threshold >= 3 * compute_s
        assert (fired_ns - last) / 1e9 > threshold - 0.05 + cfg.unconfirmed_hang_s


# -- (a'') nan from reported steps --------------------------------------------------------------

class Both:
    """Two watchdogs observing the same batches."""

    def __init__(self, *watchdogs: Watchdog) -> None:
        self.watchdogs = watchdogs

    def observe(self, node: str, rows) -> None:  # noqa: ANN001
        for wd in self.watchdogs:
            wd.observe(node, rows)


def test_a_nonfinite_step_loss_is_a_nan_incident_only_when_asked(store: Store, job: str) -> None:
    on, off = Incidents(), Incidents()
    with _watchdog(store, job, on, nan_from_steps=True) as wd_on, _watchdog(store, job, off) as wd_off:
        for wd in (wd_on, wd_off):
            wd.watch(1, NODES)
        feed = Feed(store, Both(wd_on, wd_off))  # type: ignore[arg-type]
        for step in range(1, 5):
            feed.send([step_ev(job, r, step) for r in WORLD])
        # rank 3 (node-1) reports a non-finite loss first, then every rank does (infinities:
        # SQLite stores a NaN as NULL, which the steps table refuses)
        feed.send([step_ev(job, r, 5, loss=float("inf") if r == 3 else 2.0) for r in WORLD])
        feed.send([step_ev(job, r, 6, loss=float("-inf")) for r in WORLD])
        (inc,) = on.wait(1, timeout_s=5.0)
        assert inc == Incident("nan", "nan", 3, "node-1", "rank 3 on node-1 reported a non-finite loss (inf) at step 5")
        assert on.wait(2, timeout_s=0.5) == [inc]  # once per attempt
        assert off.wait(1, timeout_s=0.2) == []    # the built-in trainer's path: it raises itself


# -- (b) healthy ------------------------------------------------------------------------------

def test_a_healthy_run_raises_nothing(store: Store) -> None:
    job_id = store.create_job("healthy", total_steps=30, config_json="{}")
    store.set_job_state(job_id, JobState.PLACING, "placing")
    attempt = store.create_attempt(job_id)
    incidents = Incidents()
    with _watchdog(store, job_id, incidents) as wd:
        wd.watch(attempt, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job_id, r) for r in WORLD])
        for step in range(1, 31):
            t = time.time_ns()
            late = step % 4                       # normal skew: a different rank each step ...
            lag_ms = 400 if step == 12 else 30    # ... once by 0.4 s (a one-off slow rank)
            # the early ranks' starts ship a report before the late rank's: a race a
            # diagnosis must not mistake for a hang
            feed.send([coll_ev(job_id, r, step, step, t, state="started") for r in WORLD if r != late])
            time.sleep(lag_ms / 1000)
            feed.send([coll_ev(job_id, late, step, step, t + lag_ms * MS, state="started")])
            time.sleep(0.6 if step == 20 else 0.05)  # one slow step for everyone, 5x the median
            feed.send([coll_ev(job_id, r, step, step, t + (lag_ms * MS if r == late else 0)) for r in WORLD]
                      + [step_ev(job_id, r, step, loss=3.0 - step / 50) for r in WORLD])
        # the last step is done: ranks finishing (checkpoint, teardown) are no hang
        assert incidents.wait(1, timeout_s=CFG.hang_floor_s + 1.5) == []


# -- (c) straggler ----------------------------------------------------------------------------

def test_a_rank_late_to_every_step_is_a_straggler_once(store: Store, job: str) -> None:
    incidents = Incidents()
    with _watchdog(store, job, incidents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        for step in range(1, 15):
            t = time.time_ns() - 700 * MS
            # rank 3 enters 0.6 s after the others, every step
            feed.send([coll_ev(job, r, step, step, t + (600 * MS if r == 3 else r * MS)) for r in WORLD]
                      + [step_ev(job, r, step) for r in WORLD])
            time.sleep(0.02)
        (inc,) = incidents.wait(1, timeout_s=5.0)
        assert (inc.kind, inc.detector, inc.rank, inc.node) == ("straggler", "straggler", 3, "node-1")
        assert "in each of 10 consecutive steps (1-10)" in inc.evidence
        assert "a median 0.60 s after" in inc.evidence
        assert incidents.wait(2, timeout_s=0.3) == [inc]  # once per (attempt, rank)


# -- (d) loss spike ---------------------------------------------------------------------------

def test_a_loss_spike_is_reported_once(store: Store, job: str) -> None:
    incidents = Incidents()
    with _watchdog(store, job, incidents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        for step in range(1, 26):
            loss = float("inf") if step == 10 else 3.0 - step / 50  # not finite: not in the median
            feed.send([step_ev(job, r, step, loss=loss) for r in WORLD])
        # other attempts' and jobs' spikes are none of this watch's business
        feed.send([step_ev(job, r, 26, loss=500.0, attempt=2) for r in WORLD])
        other = store.create_job("other", total_steps=100, config_json="{}")
        feed.send([step_ev(other, r, 26, loss=500.0) for r in WORLD])
        assert incidents.wait(1, timeout_s=0.3) == []
        feed.send([step_ev(job, r, 26, loss=40.0) for r in WORLD])
        feed.send([step_ev(job, r, 27, loss=45.0) for r in WORLD])
        (inc,) = incidents.wait(1, timeout_s=5.0)
        assert (inc.kind, inc.detector, inc.rank, inc.node) == ("loss_spike", "loss", -1, "")
        assert inc.evidence.startswith("loss 40 at step 26 is ")
        assert incidents.wait(2, timeout_s=0.3) == [inc]


# -- (e) agent loss ---------------------------------------------------------------------------

class Silence:
    """A ``silent_for``: seconds since each connected agent was heard; counts its calls."""

    def __init__(self, silent: dict[str, float]) -> None:
        self.silent = dict(silent)
        self.calls = 0
        self.cond = threading.Condition()

    def __call__(self) -> dict[str, float]:
        with self.cond:
            self.calls += 1
            self.cond.notify_all()
            return dict(self.silent)

    def set(self, **silent: float) -> None:
        with self.cond:
            self.silent = {k.replace("_", "-"): v for k, v in silent.items()}

    def checked(self, times: int = 2) -> None:
        """Wait until the watchdog has asked ``times`` more times."""
        with self.cond:
            target = self.calls + times
            assert self.cond.wait_for(lambda: self.calls >= target, 5.0)


def test_a_silent_agent_is_lost_once_until_heard_again(store: Store, job: str) -> None:
    incidents = Incidents()
    silence = Silence({"node-0": 0.1, "node-1": 0.1, "node-9": 500.0})  # node-9 runs no rank
    with _watchdog(store, job, incidents, silent_for=silence, agent_timeout_s=1.0) as wd:
        wd.watch(1, NODES)
        silence.checked()
        assert incidents.kinds() == []
        silence.set(node_0=0.1, node_1=1.5, node_9=500.0)
        (inc,) = incidents.wait(1, timeout_s=5.0)
        assert inc == Incident("agent_loss", "agent", 2, "node-1",
                               "the agent of node-1 was not heard from for 1.5 s (timeout 1 s); "
                               "rank(s) [2, 3] run there")
        silence.checked()
        assert len(incidents.wait(2, timeout_s=0.1)) == 1  # still silent: no second incident
        silence.set(node_0=0.1, node_1=0.1, node_9=500.0)   # heard again: re-armed
        silence.checked()
        silence.set(node_0=0.1, node_1=2.0, node_9=500.0)
        got = incidents.wait(2, timeout_s=5.0)
        assert [(i.kind, i.node) for i in got] == [("agent_loss", "node-1")] * 2
        # an agent that disconnects drops out of silent_for: silent from its last report on
        silence.set(node_1=0.1, node_9=500.0)
        got = incidents.wait(3, timeout_s=5.0)
        assert (got[2].kind, got[2].rank, got[2].node) == ("agent_loss", 0, "node-0")


def test_an_agent_not_back_after_a_restart_is_lost_only_once_the_others_stop_arriving(store: Store, job: str) -> None:
    """A controller that just started has heard no agent: those welcomed back in turn keep
    the ones still in line from being lost, and one that never comes is lost a timeout
    after the last arrival."""
    incidents = Incidents()
    silence = Silence({})   # no agent back yet
    timeout_s = 3.0
    with _watchdog(store, job, incidents, silent_for=silence, agent_timeout_s=timeout_s) as wd:
        wd.watch(1, NODES)
        watched = time.monotonic()
        while time.monotonic() - watched < timeout_s / 2:
            silence.checked()
        silence.set(node_0=0.0)   # node-0 is welcomed back, node-1 is still in line
        silence.checked()
        arrived = time.monotonic()
        assert arrived - watched < timeout_s - 0.5, "the test thread was too slow to show the arrival in time"
        # past the timeout since the watch began (counted from there, node-1 would be lost),
        # short of it since node-0 arrived
        while time.monotonic() - watched < timeout_s + 0.3:
            silence.checked()
        assert time.monotonic() - arrived < timeout_s - 0.1
        assert incidents.kinds() == [], "an agent still in line after a restart was called lost"
        (inc,) = incidents.wait(1, timeout_s=5.0)   # node-1 never comes
        lost_at = time.monotonic()
    assert (inc.kind, inc.node) == ("agent_loss", "node-1")
    assert lost_at - arrived >= timeout_s - 0.1, "lost before a timeout had passed since the last arrival"


# -- through the real agent stream ------------------------------------------------------------

def _server(store: Store, registry: AgentRegistry, observer) -> ControllerServer:  # noqa: ANN001
    return ControllerServer(
        AgentServicer(store, registry, TOKEN, controller_id="ctl-test", observer=observer),
        ControlServicer(StoreJobControl(store), TOKEN), port=0).start()


def test_the_agent_stream_feeds_the_watchdog_and_a_dead_agent_is_lost(store: Store, job: str) -> None:
    registry, incidents = AgentRegistry(), Incidents()
    wd = Watchdog(store, job, CFG, incidents, lambda: registry.silent_for(time.monotonic()), agent_timeout_s=1.0)
    server = _server(store, registry, wd.observe)
    agent = NodeAgent(node_name="node-0", controller_address=server.address, token=TOKEN,
                      settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2))
    try:
        with wd:
            wd.watch(1, ["node-0"] * 2)
            agent.start(connect_timeout_s=10)
            with grpc.insecure_channel(agent.local_address) as channel:
                stub = agent_pb2_grpc.NodeAgentStub(channel)
                for rank in (0, 1):
                    losses = [3.0 - s / 50 for s in range(1, 26)] + [60.0]
                    stub.Report(agent_pb2.WorkerReport(job_id=job, attempt=1, rank=rank, events=[
                        step_ev(job, rank, s, loss=loss, attempt=1) for s, loss in enumerate(losses, 1)]),
                        timeout=5)
            (spike,) = incidents.wait(1, timeout_s=10.0)
            assert (spike.kind, spike.evidence[:18]) == ("loss_spike", "loss 60 at step 26")
            agent.close()  # the agent dies: its stream ends and it is never heard again
            got = incidents.wait(2, timeout_s=10.0)
            assert [(i.kind, i.rank, i.node) for i in got][1:] == [("agent_loss", 0, "node-0")]
    finally:
        agent.close()
        server.close()
    assert len(store.steps(job)) == 52  # the observer took nothing from ingest


def test_a_failing_observer_does_not_break_ingest(store: Store, job: str) -> None:
    def broken(node: str, rows) -> None:  # noqa: ANN001
        raise RuntimeError("observer bug")

    server = _server(store, AgentRegistry(), broken)
    agent = NodeAgent(node_name="node-0", controller_address=server.address, token=TOKEN,
                      settings=AgentSettings(batch_interval_s=0.05, heartbeat_interval_s=0.2))
    try:
        agent.start(connect_timeout_s=10)
        with grpc.insecure_channel(agent.local_address) as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            for first in (1, 11):
                stub.Report(agent_pb2.WorkerReport(job_id=job, attempt=1, rank=0, events=[
                    step_ev(job, 0, s) for s in range(first, first + 10)]), timeout=5)
        assert agent.flush(10)
        assert [s.step for s in store.steps(job)] == list(range(1, 21))
    finally:
        agent.close()
        server.close()


# -- the bounded live diagnosis ----------------------------------------------------------------

def test_recent_collectives_are_a_bounded_window_with_the_laggards_last_entry(store: Store, job: str) -> None:
    from fleet.controlplane.diagnosis import diagnose, diagnose_attempt, recent_traces

    feed = Feed(store, Watchdog(store, job, CFG, Incidents()))  # never started: observes nothing
    feed.send([group_ev(job, r) for r in WORLD])
    t = time.time_ns() - 60 * 1_000_000_000
    # ranks 0, 2, 3 reach collective 200; rank 1 stopped after 100 and the others wait in 200
    feed.send([coll_ev(job, r, seq, seq // 10, t + seq * MS, state="completed" if seq < 200 else "started")
               for r in (0, 2, 3) for seq in range(1, 201)]
              + [coll_ev(job, 1, seq, seq // 10, t + seq * MS) for seq in range(1, 101)])
    rows = store.recent_collectives(job, 1, per_group=64)
    assert {(r.rank, min(c.seq for c in rows if c.rank == r.rank), max(c.seq for c in rows if c.rank == r.rank))
            for r in rows} == {(0, 137, 200), (1, 100, 100), (2, 137, 200), (3, 137, 200)}
    assert [(r.rank, r.group, r.seq) for r in rows] == sorted((r.rank, r.group, r.seq) for r in rows)
    assert len(rows) == 3 * 64 + 1
    # the verdict is the full diagnosis's
    _, full = diagnose_attempt(store, job, 1)
    live = diagnose(recent_traces(store, job, 1, per_group=64))
    assert (live.verdict, live.culprit_ranks) == (full.verdict, full.culprit_ranks) == ("hang", [1])
    assert "rank 1 never entered collective 101" in live.summary
    assert store.recent_collectives(job, 2, per_group=64) == []


# -- (f) silent data corruption: triage verdicts the ranks went on after -----------------------

def sdc_ev(job: str, rank: int, step: int, kind: str, value: str, ok: bool = True, detail: str = "",
           attempt: int = 1) -> events_pb2.Event:
    return events_pb2.Event(sdc=events_pb2.SdcCheckEvent(
        job_id=job, attempt=attempt, rank=rank, node="", step=step, kind=kind, value=value, expected="d0",
        ok=ok, detail=detail, time_ns=time.time_ns()))


def _verdict(verdict: str, suspect: int, first: int, rollback: int) -> str:
    import json

    return json.dumps({"first_bad_step": first, "suspects": [suspect], "state": "weights", "replays": 1,
                       "rollback_step": rollback, "triage": [f"step {first + 9}: rank {suspect} differs from the "
                                                             "majority", "replay 1: it agrees now"],
                       "evidence": "did not repeat"})


def test_a_transient_sdc_verdict_is_one_side_incident(store: Store, job: str) -> None:
    from fleet.controlplane.watchdog import SDC_SETTLE_S

    incidents = Incidents()
    with _watchdog(store, job, incidents) as wd:
        wd.watch(1, NODES)
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        _healthy_steps(feed, job, range(1, 3), pace_s=0.05)
        feed.send([sdc_ev(job, r, 10, "fingerprint", "d0" if r != 2 else "d1", ok=r != 2) for r in WORLD])
        feed.send([sdc_ev(job, 2, 10, "verdict", "transient", ok=False, detail=_verdict("transient", 2, 1, 0)),
                   sdc_ev(job, 0, 10, "verdict", "clean", detail=_verdict("clean", 0, 1, 0)),
                   # a persistent one ends the attempt through SdcError; another attempt's is not watched
                   sdc_ev(job, 3, 10, "verdict", "persistent", ok=False, detail=_verdict("persistent", 3, 1, 0)),
                   sdc_ev(job, 1, 10, "verdict", "transient", ok=False, detail=_verdict("transient", 1, 1, 0),
                          attempt=2)])
        (inc,) = incidents.wait(1, timeout_s=SDC_SETTLE_S + 5.0)
        assert (inc.kind, inc.detector, inc.rank, inc.node, inc.rollback_step) == (
            "sdc", "sdc_transient", 2, "node-1", 0)
        assert inc.evidence.startswith("transient silent data corruption first seen at step 1")
        assert "suspect rank 2 on node-1" in inc.evidence and "triage: step 10" in inc.evidence
        assert incidents.wait(2, timeout_s=SDC_SETTLE_S + 1.0) == [inc]   # each verdict once
        # a later verdict (read after the first ones) is the next incident
        feed.send([sdc_ev(job, 3, 20, "verdict", "ambiguous", ok=False, detail=_verdict("ambiguous", 3, 12, 10))])
        got = incidents.wait(2, timeout_s=SDC_SETTLE_S + 5.0)
        assert [(i.detector, i.rank, i.rollback_step) for i in got] == [
            ("sdc_transient", 2, 0), ("sdc_ambiguous", 3, 10)]
