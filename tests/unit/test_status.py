"""`fleet status`'s builder on literal records (no store), its wire and JSON forms, and how a
program's ranks took a stop (``stopping.program_outcome``)."""

from __future__ import annotations

import json

import pytest

from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.runtime import RankFailure
from fleet.controlplane.status import LiveFacts, StatusRecords, build_status, from_proto, to_dict, to_proto
from fleet.controlplane.stopping import program_outcome
from fleet.controlplane.store import (
    AttemptRecord,
    CheckpointRecord,
    IncidentRecord,
    JobRecord,
    NodeRecord,
    RankRecord,
)
from fleet.proto.kinds import IncidentKind

pytestmark = pytest.mark.timeout(30)

NOW = 2000.0


def _job(state: JobState = JobState.RUNNING, ended_at: float | None = None) -> JobRecord:
    return JobRecord(id="j-1", name="demo", state=state, total_steps=300, steps_completed=140, attempts=2,
                     created_at=1000.0, ended_at=ended_at, reason="attempt 2 running", config_json="{}")


def _agg(step: int, ranks: int, loss: float, tokens: float) -> dict:
    return {"step": step, "ranks": ranks, "loss": loss, "tokens_per_s": tokens, "step_time_s_mean": 0.1,
            "step_time_s_max": 0.1, "slowest_rank": 0}


def _records(**over: object) -> StatusRecords:
    base = dict(
        job=_job(),
        attempts=[AttemptRecord("j-1", 1, AttemptState.FAILED, 1001.0, 1500.0, 0, 120, "crash"),
                  AttemptRecord("j-1", 2, AttemptState.RUNNING, 1510.0, None, 100, None, "")],
        # step 141 has only 3 of 4 ranks so far: the figures come from step 140
        newest_steps=[_agg(140, 4, 2.5, 4000.0), _agg(141, 3, 9.9, 3000.0)],
        ranks=[RankRecord("j-1", 2, r, f"node-{1 + r // 2}", 100 + r) for r in range(4)],
        last_incident=IncidentRecord(7, "j-1", 1, IncidentKind.CRASH, 1, "node-0", "exit",
                                     "rank 1 on node-0 was killed\nby signal 9 (SIGKILL)", 1499.0),
        restarts=1,
        checkpoint=CheckpointRecord("j-1", 2, 140, "/c/140", "x", 0.2, True, 1900.0),
        nodes=[NodeRecord("node-0", "r0", "h0", "{}", "quarantined", "2 crashes in 1 h", 1500.0, 1999.0),
               NodeRecord("node-1", "r1", "h1", "{}", "healthy", "", None, 1999.5, health="ok"),
               NodeRecord("node-2", "r2", "h2", "{}", "healthy", "", None, 1999.5),
               NodeRecord("node-10", "r9", "h9", "{}", "healthy", "", None, 500.0)],  # seen before the job
        job_nodes=frozenset({"node-0", "node-1", "node-2"}),
        events_lost={"node-1": 12},
        ettr=0.8125,
    )
    base.update(over)
    return StatusRecords(**base)  # type: ignore[arg-type]


def test_the_job_figures_come_from_the_newest_step_every_rank_reported() -> None:
    s = build_status(_records(), NOW)
    j = s.job
    assert (j.job_id, j.state, j.attempt, j.attempt_state) == ("j-1", "RUNNING", 2, "RUNNING")
    assert (j.step, j.total_steps, j.world_size) == (141, 300, 4)
    assert (j.loss, j.tokens_per_s) == (2.5, 4000.0)
    assert (j.ettr, j.restarts, j.checkpoint_step, j.stopping) == (0.8125, 1, 140, "")
    i = j.last_incident
    assert i is not None
    assert (i.kind, i.rank, i.node, i.detected_at, i.observed) == ("crash", 1, "node-0", 1499.0, False)
    assert i.evidence == "rank 1 on node-0 was killed by signal 9 (SIGKILL)"  # one line
    assert not s.live


def test_nodes_from_the_store_name_ranks_quarantine_and_lost_events() -> None:
    s = build_status(_records(), NOW)
    # the job's nodes, natural order; node-10 was last seen before the job began
    assert [n.name for n in s.nodes] == ["node-0", "node-1", "node-2"]
    n0, n1, n2 = s.nodes
    assert (n0.state, n0.quarantine_reason, n0.ranks) == ("quarantined", "2 crashes in 1 h", ())
    assert (n1.state, n1.health, n1.ranks, n1.events_lost) == ("healthy", "ok", (0, 1), 12)
    assert (n2.ranks, n2.events_lost, n2.last_seen) == ((2, 3), 0, 1999.5)
    assert not any(n.agent_connected for n in s.nodes) and all(n.silent_s is None for n in s.nodes)


def test_live_facts_take_over_placement_agents_and_the_stop() -> None:
    live = LiveFacts(attempt=2, placement=["node-2", "node-2", "node-10", "node-10"],
                     connected=frozenset({"node-2", "node-10"}), silent_s={"node-2": 0.25, "node-10": 4.0},
                     stopping="checkpointing")
    s = build_status(_records(), NOW, live)
    assert s.live and s.job.stopping == "checkpointing"
    by = {n.name: n for n in s.nodes}
    assert set(by) == {"node-0", "node-1", "node-2", "node-10"}
    assert (by["node-10"].ranks, by["node-10"].agent_connected, by["node-10"].silent_s) == ((2, 3), True, 4.0)
    assert (by["node-1"].ranks, by["node-1"].agent_connected, by["node-1"].silent_s) == ((), False, None)


def test_before_the_first_step_the_step_is_the_restored_one() -> None:
    s = build_status(_records(newest_steps=[], last_incident=None, checkpoint=None, ettr=None), NOW)
    assert (s.job.step, s.job.loss, s.job.tokens_per_s) == (100, None, 0.0)
    assert (s.job.last_incident, s.job.checkpoint_step, s.job.ettr) == (None, None, None)


def test_a_job_before_its_first_attempt() -> None:
    s = build_status(_records(job=_job(JobState.PLACING), attempts=[], newest_steps=[], ranks=[],
                              job_nodes=frozenset()), NOW)
    assert (s.job.attempt, s.job.attempt_state, s.job.step, s.job.world_size) == (0, "", 0, 0)
    # a job still running shows the cluster's nodes registered since it began
    assert [n.name for n in s.nodes] == ["node-0", "node-1", "node-2"]


def test_an_ended_job_shows_only_the_nodes_it_ran_on() -> None:
    s = build_status(_records(job=_job(JobState.STOPPED, ended_at=1990.0), job_nodes=frozenset({"node-1"}),
                              ranks=[RankRecord("j-1", 2, 0, "node-1", 1)]), NOW)
    assert [n.name for n in s.nodes] == ["node-1"]
    assert s.job.ended_at == 1990.0


def test_the_wire_form_round_trips_and_the_json_form_is_plain() -> None:
    live = LiveFacts(attempt=2, placement=["node-1"] * 2 + ["node-2"] * 2, connected=frozenset({"node-1"}),
                     silent_s={"node-1": 0.5}, stopping="tearing down")
    for s in (build_status(_records(), NOW), build_status(_records(), NOW, live),
              build_status(_records(newest_steps=[], last_incident=None, checkpoint=None, ettr=None), NOW)):
        assert from_proto(to_proto(s)) == s
    d = json.loads(json.dumps(to_dict(build_status(_records(), NOW, live))))
    assert d["source"] == "controller" and d["at"] == NOW
    assert d["job"]["last_incident"]["kind"] == "crash" and d["job"]["checkpoint_step"] == 140
    assert d["nodes"][1] == {"name": "node-1", "state": "healthy", "health": "ok", "quarantine_reason": "",
                             "ranks": [0, 1], "events_lost": 12, "last_seen": 1999.5, "agent_connected": True,
                             "silent_s": 0.5}


def test_how_a_programs_ranks_took_sigterm() -> None:
    term = [RankFailure(r, "node-0", False, "exited", exit_code=-15) for r in (0, 1)]
    assert program_outcome(term, 2, [], 60.0, 1.25) == (
        "every rank's program was sent SIGTERM (it keeps its own checkpoint, if it saves one then) and ended "
        "within 1.2 s (2 SIGTERM, 2 exit code 0)")
    assert program_outcome([], 0, [3], 60.0, 60.0).endswith(
        "; rank(s) [3] still ran after 60 s (job.stop_timeout_s) and were killed")
