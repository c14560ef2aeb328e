"""workers/train.py end to end: 2 real gloo ranks reporting to a real NodeAgent gRPC
server; checkpoint/restore gives bit-identical losses; crash injection; consistent stop."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
from tests.unit.test_workers_support import AgentServer, run_ranks
from fleet.workers import checkpoint, train
from fleet.workers.faults import FAULT_EXIT_CODE
from fleet.workers.spec import TrainArgs, WorkerSpec

pytestmark = pytest.mark.timeout(90)

Status = events_pb2.WorkerStatus


def _spec(rank: int, world_size: int, port: int, agent_address: str, ckpt_dir: str,
          steps: int, attempt: int = 0, pg_timeout_s: float = 30.0) -> WorkerSpec:
    return WorkerSpec(
        job_id="job-t", attempt=attempt, rank=rank, world_size=world_size, node_name="node0",
        master_addr="127.0.0.1", master_port=port, agent_address=agent_address,
        checkpoint_dir=ckpt_dir, train=TrainArgs(steps=steps, checkpoint_interval=5, keep_checkpoints=3),
        pg_timeout_s=pg_timeout_s, report_interval_s=0.02, env={"GLOO_SOCKET_IFNAME": "lo"})


def _run(rank, world_size, port, agent_address, ckpt_dir, steps, attempt=0):
    return train.run(_spec(rank, world_size, port, agent_address, ckpt_dir, steps, attempt))


def _run_expecting_failure(rank, world_size, port, agent_address, ckpt_dir, steps):
    try:
        train.run(_spec(rank, world_size, port, agent_address, ckpt_dir, steps, pg_timeout_s=15.0))
    except Exception as exc:  # the surviving rank must fail, not hang
        return type(exc).__name__
    return "no error"


@pytest.fixture
def agent():
    server = AgentServer()
    yield server
    server.stop()


def _losses(agent: AgentServer, rank: int, attempt: int) -> dict[int, float]:
    return {s.step: s.loss for s in agent.of_kind("step", rank) if s.attempt == attempt}


def test_train_restore_is_bit_identical(agent, tmp_path):
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    keys = ("rank", "final_step", "restored_step", "stopped")
    results = run_ranks(_run, 2, (agent.address, full, 20, 0))
    assert {r: {k: v[k] for k in keys} for r, v in results.items()} == {
        r: {"rank": r, "final_step": 20, "restored_step": 0, "stopped": False} for r in (0, 1)}
    assert all(v["train_s"] > 0 and v["pg_init_s"] > 0 for v in results.values())
    assert run_ranks(_run, 2, (agent.address, split, 10, 1))[0]["final_step"] == 10
    resumed = run_ranks(_run, 2, (agent.address, split, 20, 2))
    assert {r: (v["restored_step"], v["final_step"]) for r, v in resumed.items()} == {0: (10, 20), 1: (10, 20)}

    for rank in (0, 1):
        full_losses = _losses(agent, rank, 0)
        assert sorted(full_losses) == list(range(1, 21))
        resumed_losses = _losses(agent, rank, 2)
        assert sorted(resumed_losses) == list(range(11, 21))
        assert all(resumed_losses[s] == full_losses[s] for s in range(11, 21))  # bit for bit
        assert _losses(agent, rank, 1) == {s: full_losses[s] for s in range(1, 11)}
        # Learning happens, and every rank reports the same global mean loss.
        assert full_losses[20] < full_losses[1] - 0.5
        assert full_losses == _losses(agent, 1 - rank, 0)

        statuses = [(s.state, s.restored_step, s.phase) for s in agent.of_kind("status", rank) if s.attempt == 2]
        # steps 15 and 20 save a checkpoint, then the final commit: each in phase checkpointing
        checkpointing = [(Status.TRAINING, 0, "checkpointing"), (Status.TRAINING, 0, "")]
        assert statuses == [(Status.STARTING, 0, ""), (Status.PG_READY, 0, ""), (Status.RESTORED, 10, ""),
                            (Status.TRAINING, 0, ""), *checkpointing * 3, (Status.FINISHED, 0, "")]
        collectives = [c for c in agent.of_kind("collective", rank) if c.attempt == 0 and c.state == "completed"]
        # Every group's sequence numbers are consecutive from 1 (the native recorder sees
        # FSDP's and the checkpointer's groups as well as the default one).
        by_group: dict[str, list[int]] = {}
        for c in collectives:
            by_group.setdefault(c.group, []).append(c.seq)
        assert "0" in by_group and len(by_group) >= 2
        for group, seqs in by_group.items():
            assert sorted(seqs) == list(range(1, len(seqs) + 1)), f"group {group} has gaps"
        ops = {c.op for c in collectives}
        assert {"broadcast", "all_reduce", "all_gather"} <= ops  # restore choice, step stats, FSDP
        assert {c.step for c in collectives} >= set(range(1, 21))

    ckpts = agent.of_kind("checkpoint")
    assert all(c.rank == 0 and len(c.manifest_sha256) == 64 and c.save_s > 0 for c in ckpts)
    assert [(c.attempt, c.step) for c in ckpts] == [(0, 5), (0, 10), (0, 15), (0, 20), (1, 5), (1, 10),
                                                    (2, 15), (2, 20)]
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == [
        "step_00000010", "step_00000015", "step_00000020"]
    assert checkpoint.latest_valid(split) == (20, str(tmp_path / "split" / "step_00000020"))


def test_injected_crash_kills_one_rank_and_fails_the_other(agent, tmp_path):
    agent.send(1, events_pb2.Command(command_id="f1", rank=1,
                                     fault=events_pb2.FaultSpec(kind=FaultKind("crash").wire, at_step=4)))
    out = run_ranks(_run_expecting_failure, 2, (agent.address, str(tmp_path), 50),
                    expect_exit={1: FAULT_EXIT_CODE})
    assert out[0] != "no error"
    agent.wait_for(lambda a: any(s.state == Status.FAILED for s in a.of_kind("status", 0)))
    # Like a real crash, the dying rank ships nothing after its last report.
    assert max(s.step for s in agent.of_kind("step", 1)) <= 3
    assert max(s.step for s in agent.of_kind("step", 0)) == 3
    # Rank 0 is seen entering a step-4 collective of the default group that rank 1 never
    # joined: the evidence a desync verdict is built from. (gloo does not tell whether a
    # retired op failed, so its state is not asserted.)
    def last_seq(rank: int) -> events_pb2.CollectiveEvent:
        return max((c for c in agent.of_kind("collective", rank) if c.group == "0"), key=lambda c: c.seq)
    agent.wait_for(lambda a: any(c.step == 4 for c in a.of_kind("collective", 0)))
    assert last_seq(0).step == 4
    assert last_seq(1).seq < last_seq(0).seq


def test_stop_command_stops_all_ranks_after_the_same_step(agent, tmp_path):
    agent.send(0, events_pb2.Command(command_id="s1", rank=0, stop=True))
    out = run_ranks(_run, 2, (agent.address, str(tmp_path), 500))
    assert out[0]["stopped"] and out[1]["stopped"]
    assert out[0]["final_step"] == out[1]["final_step"] < 500
    assert checkpoint.latest_valid(tmp_path)[0] == out[0]["final_step"]


def test_cli_help_runs():
    proc = subprocess.run([sys.executable, "-m", "fleet.workers.train", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--checkpoint-dir" in proc.stdout


def test_spec_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29411")
    spec = train.spec_from_torchrun(["--steps", "7", "--checkpoint-dir", "/tmp/x"])
    assert (spec.rank, spec.world_size, spec.master_port, spec.train.steps, spec.agent_address) == (
        3, 4, 29411, 7, "")
    assert dataclasses.replace(spec, rank=0).checkpoint_dir == "/tmp/x"


def test_torchrun_flags_are_derived_from_the_recipe_fields():
    defaults = train.spec_from_torchrun(["--checkpoint-dir", "/tmp/x"])
    assert defaults.train == TrainArgs()
    spec = train.spec_from_torchrun([
        "--checkpoint-dir", "/tmp/x", "--sync-checkpoint", "--activation-checkpointing", "--seed", "5",
        "--lr-schedule", "constant", "--memory-snapshots", "off", "--batch-size", "2", "--lr", "0.01",
        "--data-parallel", "ddp", "--fp8", "rowwise"])
    assert spec.train == TrainArgs(async_checkpoint=False, activation_checkpointing=True, seed=5,
                                   lr_schedule="constant", memory_snapshots="off", batch_size=2, lr=0.01,
                                   data_parallel="ddp")
    assert spec.model.fp8 == "rowwise"


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--lr-schedule", "step"], ["--seq-len", "x"]])
def test_torchrun_flags_are_validated_like_the_fields(argv, capsys):
    with pytest.raises(SystemExit):
        train.spec_from_torchrun(["--checkpoint-dir", "/tmp/x", *argv])
    assert "error" in capsys.readouterr().err
