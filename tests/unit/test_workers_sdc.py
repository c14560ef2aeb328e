"""SDC checks of the built-in trainer on real gloo ranks (3 DDP ranks, tiny model): no
false verdicts over 10 fault-free runs (5 steps each); a transient bit flip is detected within the check
interval, triaged as transient on the right rank, and training continues on state
bit-identical to a fault-free run; a persistent one raises SdcError on every rank after
at most 2 replays, and the next attempt restores the verified step below the ceiling
and ends bit-identical to the fault-free run. Events reach a real agent."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
from fleet.workers import checkpoint, train
from fleet.workers.failures import SdcError
from fleet.workers.faults import FaultHooks
from fleet.workers.rendezvous import loopback_store
from fleet.workers.spec import TrainArgs, WorkerSpec
from tests.unit.test_workers_support import AgentServer, run_ranks

pytestmark = pytest.mark.timeout(180)

WORLD = 3


def _spec(rank, world, agent, job, recipe, interval, attempt=0, ceiling=0, ckpt="") -> WorkerSpec:
    return WorkerSpec(
        job_id=job, attempt=attempt, rank=rank, world_size=world, node_name=f"node-{rank}",
        master_addr="127.0.0.1", master_port=0, agent_address=agent, checkpoint_dir=ckpt,
        train=recipe, pg_timeout_s=30.0, report_interval_s=0.02, env={"GLOO_SOCKET_IFNAME": "lo"},
        sdc_check_interval=interval, restore_at_most=ceiling)


def _join(rank, world, port):
    dist.init_process_group("gloo", store=loopback_store(rank, world, port), rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))


def _armed(rank, target_rank, **fault) -> FaultHooks:
    hooks = FaultHooks(rank)
    if rank == target_rank:
        hooks.on_command(events_pb2.Command(command_id="sdc", fault=events_pb2.FaultSpec(
            kind=FaultKind.SDC.wire, **fault)))
    return hooks


def _losses(rank, world, agent, job, recipe, interval, **kw):
    losses = {}
    result = train.run(_spec(rank, world, agent, job, recipe, interval, **{k: kw.pop(k) for k in
                                                                          ("attempt", "ceiling", "ckpt") if k in kw}),
                       on_step=lambda r: losses.update({r.step: r.loss}), **kw)
    return result, losses


# ---- (a) fault-free -------------------------------------------------------------------

def _fault_free(rank, world, port):
    _join(rank, world, port)
    try:
        out = []
        for seed in range(10):
            recipe = TrainArgs(steps=5, checkpoint_interval=0, data_parallel="ddp", seed=seed, warmup_steps=2)
            r = train.run(_spec(rank, world, "", f"ok-{seed}", recipe, interval=1))
            out.append({"sdc": r["sdc"], "final": r["final_step"], "digest": r["sdc_digest"],
                        "check_s": r["sdc_check_s"]})
        return out
    finally:
        dist.destroy_process_group()


def test_ten_fault_free_runs_give_no_mismatch_and_no_verdict():
    out = run_ranks(_fault_free, WORLD, timeout_s=150)
    for rank in range(WORLD):
        assert len(out[rank]) == 10
        for run in out[rank]:
            assert run["final"] == 5
            assert all(v["verdict"] == "clean" for v in run["sdc"]), run["sdc"]
            assert run["check_s"] > 0
    # every copy of every run ends identical; different seeds give different state
    digests = [[run["digest"] for run in out[r]] for r in range(WORLD)]
    assert digests[0] == digests[1] == digests[2] and len(set(digests[0])) == 10


# ---- (b) a transient flip --------------------------------------------------------------

FLIP_AT = 5


def _transient(rank, world, port, agent):
    _join(rank, world, port)
    try:
        recipe = TrainArgs(steps=7, checkpoint_interval=0, data_parallel="ddp", warmup_steps=2)
        ref, ref_losses = _losses(rank, world, agent, "ref", recipe, 3)
        hooks = _armed(rank, 1, at_step=FLIP_AT, target="weight", bit=22)
        got, losses = _losses(rank, world, agent, "flip", recipe, 3, hooks=hooks)
        return {"ref": ref["sdc_digest"], "got": got["sdc_digest"], "sdc": got["sdc"],
                "ref_losses": ref_losses, "losses": losses}
    finally:
        dist.destroy_process_group()


@pytest.fixture
def agent():
    server = AgentServer()
    yield server
    server.stop()


def _sdc_events(agent: AgentServer, job: str) -> list:
    return [e for e in agent.of_kind("sdc") if e.job_id == job]


def test_transient_flip_is_detected_within_the_interval_and_rolled_back_bit_for_bit(agent):
    out = run_ranks(_transient, WORLD, (agent.address,), timeout_s=150)
    for rank in range(WORLD):
        (v,) = out[rank]["sdc"]
        assert v["verdict"] == "transient" and v["suspects"] == [1] and v["mechanism"] == "fingerprint"
        assert v["detected_step"] == 6 and v["detected_step"] - FLIP_AT < 3      # the next check
        assert v["rollback_step"] == 3 and v["replays"] == 1 and v["state"] == "weights"
        assert FLIP_AT <= v["first_bad_step"] <= 6
        # the replay is the rollback: the state and every later loss are the fault-free ones
        assert out[rank]["got"] == out[rank]["ref"]
        for step in range(6, 8):
            assert out[rank]["losses"][step] == out[rank]["ref_losses"][step]
    events = _sdc_events(agent, "flip")
    fps = [e for e in events if e.kind == "fingerprint"]
    assert sorted((e.step, e.rank) for e in fps) == [(s, r) for s in (0, 3, 6) for r in range(WORLD)]
    bad = [e for e in fps if not e.ok]
    assert [(e.rank, e.step, e.node) for e in bad] == [(1, 6, "node-1")] and bad[0].expected
    assert all(e.ok for e in fps if e.rank != 1 or e.step != 6)
    replays = [e for e in events if e.kind == "replay"]
    assert sorted(e.rank for e in replays) == [0, 1, 2] and all("steps 4..6" in e.detail for e in replays)
    assert [e.ok for e in sorted(replays, key=lambda e: e.rank)] == [False, False, False]  # the flip spread
    (verdict,) = [e for e in events if e.kind == "verdict"]
    assert (verdict.rank, verdict.value, verdict.node, verdict.ok) == (1, "transient", "", False)
    detail = json.loads(verdict.detail)
    assert set(detail) == {"first_bad_step", "suspects", "state", "replays", "rollback_step", "triage", "evidence"}
    assert detail["suspects"] == [1] and detail["rollback_step"] == 3 and len(detail["triage"]) >= 3
    assert not _sdc_events(agent, "ref") or all(e.kind == "fingerprint" and e.ok for e in _sdc_events(agent, "ref"))


# ---- (c) a persistent fault ------------------------------------------------------------

def _persistent(rank, world, port, agent, ckpt):
    _join(rank, world, port)
    try:
        recipe = TrainArgs(steps=7, checkpoint_interval=3, data_parallel="ddp", warmup_steps=2)
        ref, _ = _losses(rank, world, agent, "ref", recipe, 2, ckpt=ckpt + "/ref")
        hooks = _armed(rank, 1, at_step=5, target="optimizer", value_error=1e-3, persistent=True)
        try:
            train.run(_spec(rank, world, agent, "bad", recipe, 2, ckpt=ckpt + "/bad"), hooks=hooks)
        except SdcError as exc:
            err = {"step": exc.step, "rank": exc.rank, "verdict": exc.verdict, "rollback": exc.rollback_step,
                   "evidence": exc.evidence}
        else:
            err = None
        # the next attempt (the faulty rank's node would be gone; here the fault is)
        again, _ = _losses(rank, world, agent, "bad", recipe, 2, attempt=1, ceiling=err["rollback"] if err else 0,
                           ckpt=ckpt + "/bad")
        return {"err": err, "ref": ref["sdc_digest"], "restored": again["restored_step"],
                "restored_from": again["restored_from"], "final": again["sdc_digest"]}
    finally:
        dist.destroy_process_group()


def test_persistent_fault_raises_sdc_error_and_the_next_attempt_restores_below_the_ceiling(agent, tmp_path):
    out = run_ranks(_persistent, WORLD, (agent.address, str(tmp_path)), timeout_s=170)
    for rank in range(WORLD):
        err = out[rank]["err"]
        assert err is not None, "no SdcError"
        assert (err["rank"], err["verdict"], err["step"], err["rollback"]) == (1, "persistent", 5, 4)
        # the ceiling: memory snapshot 4 (verified), not the checkpoint of step 6's attempt
        assert out[rank]["restored"] == 4 and out[rank]["restored_from"].startswith("memory")
        assert out[rank]["final"] == out[rank]["ref"]
    # the restore ceiling on disk, and checkpoints carry the fingerprints they were verified with
    step, path = checkpoint.latest_valid(tmp_path / "bad", at_most=4)
    state = {"extra": b""}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    extra = checkpoint._unpack(state["extra"])["sdc"]
    assert step == 3 and extra["step"] == 3 and extra["verified"] and len(set(extra["digests"])) == 1
    assert checkpoint.latest_valid(tmp_path / "bad")[0] == 7
    (verdict,) = [e for e in _sdc_events(agent, "bad") if e.kind == "verdict" and e.attempt == 0]
    assert (verdict.rank, verdict.value, verdict.step) == (1, "persistent", 5)
    assert json.loads(verdict.detail)["replays"] <= 2
    # the verdict came from the lowest rank that is not the suspect, flushed before the raise
    assert [r for r, e in agent.events if e.WhichOneof("kind") == "sdc" and e.sdc.kind == "verdict"
            and e.sdc.job_id == "bad"] == [0]
