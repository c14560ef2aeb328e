"""The watchdog's hang threshold follows the phase a rank reports (``WorkerStatus.phase``),
over a real store, fed real protobuf events as agent batches deliver them."""

from __future__ import annotations

import time

import pytest

from fleet.controlplane.store import Store
from fleet.proto import events_pb2
from tests.component.test_watchdog import CFG, WORLD, Feed, Incidents, _healthy_steps, _watchdog, coll_ev, \
    group_ev, job  # noqa: F401 -- job: the fixture

pytestmark = pytest.mark.timeout(120)

CHECKPOINT_TIMEOUT_S = 3.0


def phase_ev(job_id: str, rank: int, phase: str) -> events_pb2.Event:
    return events_pb2.Event(status=events_pb2.WorkerStatus(
        job_id=job_id, attempt=1, rank=rank, state=events_pb2.WorkerStatus.TRAINING, time_ns=time.time_ns(),
        phase=phase))


def test_a_rank_in_a_long_checkpoint_is_hung_only_after_the_phase_timeout(store: Store, job: str) -> None:  # noqa: F811
    incidents = Incidents()
    cfg = CFG.model_copy(update={"phase_timeouts_s": {"checkpointing": CHECKPOINT_TIMEOUT_S}})
    with _watchdog(store, job, incidents, cfg) as wd:
        wd.watch(1, [f"node-{r // 2}" for r in WORLD])
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        last_end = _healthy_steps(feed, job, range(1, 7))
        # rank 1 starts a synchronous checkpoint; the others wait for it in all_gather 7
        feed.send([phase_ev(job, 1, "checkpointing")])
        feed.send([coll_ev(job, r, 7, 7, time.time_ns(), state="started") for r in (0, 2, 3)])
        # the step threshold (hang_floor_s, 1 s) passes twice over: no hang inside the phase
        assert incidents.wait(1, timeout_s=CHECKPOINT_TIMEOUT_S - 1.0) == []
        got = incidents.wait(1, timeout_s=5.0)
        assert len(got) == 1, "no hang detected after the phase timeout"
        fired_ns, inc = incidents.got[0]
        assert (inc.kind, inc.rank) == ("hang", 1)
        assert "rank 1 is in phase 'checkpointing' (detect.phase_timeouts_s.checkpointing: 3 s)" in inc.evidence
        assert (fired_ns - last_end) / 1e9 > CHECKPOINT_TIMEOUT_S


def test_leaving_the_phase_restores_the_step_threshold(store: Store, job: str) -> None:  # noqa: F811
    incidents = Incidents()
    cfg = CFG.model_copy(update={"phase_timeouts_s": {"checkpointing": 30.0}})
    with _watchdog(store, job, incidents, cfg) as wd:
        wd.watch(1, [f"node-{r // 2}" for r in WORLD])
        feed = Feed(store, wd)
        feed.send([group_ev(job, r) for r in WORLD])
        feed.send([phase_ev(job, 1, "checkpointing")])
        _healthy_steps(feed, job, range(1, 7))
        feed.send([phase_ev(job, 1, "")])
        feed.send([coll_ev(job, r, 7, 7, time.time_ns(), state="started") for r in (0, 2, 3)])
        got = incidents.wait(1, timeout_s=CFG.hang_floor_s + 5.0)
        assert [(i.kind, i.rank) for i in got] == [("hang", 1)]
        assert "phase" not in got[0].evidence
