"""workers/faults.py: every fault kind a rank acts on (crash by SIGKILL, hang, slow, nan),
arming at a step, kinds that are not a rank's, and the stop flag."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
from tests.unit.test_workers_support import REPO_ROOT
from fleet.workers.faults import DEFAULT_SLOW_DELAY_S, FAULT_EXIT_CODE, WORKER_KINDS, FaultHooks

pytestmark = pytest.mark.timeout(60)


#: A ``FaultSpec.kind`` number the contract does not define (what a newer controller may send).
UNKNOWN_WIRE_KIND = 99


def _fault(kind: str, at_step: int = 0, **fields: float) -> events_pb2.Command:
    wire = FaultKind(kind).wire if kind in {k.value for k in FaultKind} else UNKNOWN_WIRE_KIND
    return events_pb2.Command(command_id=kind[0], rank=0,
                              fault=events_pb2.FaultSpec(kind=wire, at_step=at_step, **fields))


def _crash(at_step: int) -> events_pb2.Command:
    return _fault("crash", at_step)


# -- crash: a death by SIGKILL, in a fresh interpreter --------------------------------------


def _no_cleanup_marks() -> None:
    """What a process that exits normally would print on the way out."""
    import atexit

    atexit.register(lambda: print("atexit ran", flush=True))


def _immediate() -> None:
    _no_cleanup_marks()
    try:
        FaultHooks(0).on_command(_crash(0))
    finally:
        print("finally ran", flush=True)


def _armed() -> None:
    _no_cleanup_marks()
    hooks = FaultHooks(0)
    hooks.on_command(_crash(3))
    hooks.before_step(1)
    hooks.before_step(2)
    print("survived step 2", flush=True)
    try:
        hooks.before_step(3)
    finally:
        print("finally ran", flush=True)


def _run(target) -> subprocess.CompletedProcess:
    """Run ``target`` in a fresh interpreter."""
    code = f"from tests.unit.test_workers_faults import {target.__name__} as t; t()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=30)
    assert "injected crash" in proc.stderr
    return proc


def test_fault_exit_code_is_death_by_sigkill():
    assert FAULT_EXIT_CODE == -signal.SIGKILL == -9


def test_immediate_crash_dies_by_sigkill_without_cleanup():
    proc = _run(_immediate)
    assert proc.returncode == FAULT_EXIT_CODE
    assert "finally ran" not in proc.stdout and "atexit ran" not in proc.stdout


def test_armed_crash_fires_at_its_step():
    proc = _run(_armed)
    assert proc.returncode == FAULT_EXIT_CODE
    assert "survived step 2" in proc.stdout
    assert "finally ran" not in proc.stdout and "atexit ran" not in proc.stdout


def test_arming_keeps_the_earliest_step_and_does_not_fire_early():
    hooks = FaultHooks(0)
    hooks.on_command(_crash(9))
    hooks.on_command(_crash(5))
    hooks.on_command(_crash(7))
    assert hooks.armed_crash_step == 5
    hooks.before_step(4)  # returns: not yet


@pytest.mark.parametrize("kind", ["bitflip", "node-down", "agent-down", "partition", "controller-crash"])
def test_kinds_that_are_not_a_ranks_are_ignored(kind):
    assert kind not in WORKER_KINDS
    hooks = FaultHooks(1, sleep=lambda s: pytest.fail("slept"))
    hooks.on_command(_fault(kind, duration_s=5))
    hooks.before_step(1)
    loss = torch.tensor(2.0)
    assert hooks.poison_loss(1, loss) is loss
    assert hooks.armed_crash_step is None and hooks.armed_nan_step is None and not hooks.stop_requested


def test_stop_and_commands_without_a_kind():
    hooks = FaultHooks(1)
    hooks.on_command(events_pb2.Command(command_id="y"))
    assert hooks.armed_crash_step is None and not hooks.stop_requested
    hooks.on_command(events_pb2.Command(command_id="s", stop=True))
    assert hooks.stop_requested


def test_after_s_is_the_controllers_and_ignored_here():
    hooks = FaultHooks(0)
    hooks.on_command(_fault("crash", 4, after_s=30))
    assert hooks.armed_crash_step == 4


# -- hang ----------------------------------------------------------------------------------


def test_hang_blocks_the_step_for_its_duration_then_returns():
    hooks = FaultHooks(0)
    hooks.on_command(_fault("hang", 3, duration_s=0.3))
    t0 = time.monotonic()
    hooks.before_step(2)
    assert time.monotonic() - t0 < 0.2  # not armed for step 2
    hooks.before_step(3)
    assert time.monotonic() - t0 >= 0.3
    t1 = time.monotonic()
    hooks.before_step(4)  # fires once
    assert time.monotonic() - t1 < 0.2


def test_endless_hang_ends_on_release():
    hooks = FaultHooks(0)
    hooks.on_command(_fault("hang", 0))
    done = threading.Event()
    t = threading.Thread(target=lambda: (hooks.before_step(1), done.set()), name="fleet-test-hang")
    t.start()
    assert not done.wait(0.3)  # still hanging
    hooks.release()
    assert done.wait(10)
    t.join(10)


# -- slow: a fake clock and a recording sleep ---------------------------------------------------


class _Time:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[tuple[int, float]] = []
        self.step = 0

    def sleep(self, seconds: float) -> None:
        self.sleeps.append((self.step, seconds))

    def hooks(self) -> FaultHooks:
        return FaultHooks(0, clock=lambda: self.now, sleep=self.sleep)

    def run(self, hooks: FaultHooks, step: int, now: float) -> None:
        self.step, self.now = step, now
        hooks.before_step(step)


def test_slow_sleeps_every_step_from_the_armed_one_for_its_duration():
    t = _Time()
    hooks = t.hooks()
    hooks.on_command(_fault("slow", 3, delay_s=0.5, duration_s=10))
    for step, now in [(1, 0.0), (2, 1.0), (3, 100.0), (4, 105.0), (5, 109.9), (6, 110.0), (7, 500.0)]:
        t.run(hooks, step, now)
    # the duration counts from the first slowed step (t=100), not from the order
    assert t.sleeps == [(3, 0.5), (4, 0.5), (5, 0.5)]


def test_slow_without_duration_lasts_the_attempt_and_defaults_its_delay():
    t = _Time()
    hooks = t.hooks()
    hooks.on_command(_fault("slow", 0))
    for step in range(1, 6):
        t.run(hooks, step, now=step * 1e6)
    assert t.sleeps == [(s, DEFAULT_SLOW_DELAY_S) for s in range(1, 6)]
    assert DEFAULT_SLOW_DELAY_S == 0.3


def test_a_new_slow_order_replaces_the_armed_one():
    t = _Time()
    hooks = t.hooks()
    hooks.on_command(_fault("slow", 2, delay_s=1.0))
    t.run(hooks, 2, 0.0)
    hooks.on_command(_fault("slow", 4, delay_s=0.1, duration_s=1))
    for step, now in [(3, 1.0), (4, 2.0), (5, 2.5), (6, 3.0)]:
        t.run(hooks, step, now)
    assert t.sleeps == [(2, 1.0), (4, 0.1), (5, 0.1)]


def test_real_slow_step_takes_its_delay_and_release_ends_it():
    hooks = FaultHooks(0)
    hooks.on_command(_fault("slow", 1, delay_s=0.2))
    t0 = time.monotonic()
    hooks.before_step(1)
    assert 0.2 <= time.monotonic() - t0 < 5
    hooks.release()
    t1 = time.monotonic()
    hooks.before_step(2)
    assert time.monotonic() - t1 < 0.1


# -- nan -----------------------------------------------------------------------------------------


def test_nan_poisons_one_loss_at_the_armed_step():
    hooks = FaultHooks(0)
    hooks.on_command(_fault("nan", 3))
    assert hooks.armed_nan_step == 3
    loss = torch.tensor(1.5, requires_grad=True)
    assert hooks.poison_loss(2, loss) is loss
    poisoned = hooks.poison_loss(3, loss)
    assert math.isnan(poisoned.item())
    poisoned.backward()  # the NaN reaches the gradients, as a real one would
    assert math.isnan(loss.grad.item())
    assert hooks.poison_loss(3, loss) is loss  # once: the next micro-batch is clean
    assert hooks.poison_loss(4, loss) is loss
    assert hooks.armed_nan_step is None


def test_nan_at_step_zero_poisons_the_next_loss_and_late_steps_still_fire():
    hooks = FaultHooks(0)
    hooks.on_command(_fault("nan", 0))
    assert math.isnan(hooks.poison_loss(17, torch.tensor(1.0)).item())
    hooks.on_command(_fault("nan", 5))
    # the loop skipped step 5 (restored past it): the first step >= 5 gets it
    assert math.isnan(hooks.poison_loss(8, torch.tensor(1.0)).item())


# -- ckpt-corrupt: rank 0 tells the store at once ---------------------------------------------


def test_rank_0s_corruption_reaches_the_store_as_an_invalid_checkpoint_at_once(tmp_path):
    """The order comes through a real reporter from a real agent server; rank 0 corrupts
    the newest checkpoint at the armed step and reports it invalid, wired as
    workers/train.py wires it; the batch the agent got lands in a real SQLite store,
    which says invalid without any restore."""
    from tests.unit.test_chaos import _save_two_checkpoints
    from tests.unit.test_workers_parallel import in_pg
    from tests.unit.test_workers_support import AgentServer, run_ranks
    from fleet.controlplane.store import Store
    from fleet.workers import checkpoint
    from fleet.workers.reporter import Reporter
    from fleet.workers.spec import WorkerSpec
    from fleet.workers.train import _Emitter

    ckpt = tmp_path / "ckpt"
    run_ranks(in_pg, 1, (_save_two_checkpoints, str(ckpt)), timeout_s=50)
    agent = AgentServer()
    try:
        with Store(f"sqlite:///{tmp_path}/fleet.db") as store:
            job_id = store.create_job("t", 20, "{}")
            attempt = store.create_attempt(job_id)
            spec = WorkerSpec(job_id=job_id, attempt=attempt, rank=0, world_size=1, node_name="n0",
                              master_addr="127.0.0.1", master_port=0, agent_address=agent.address,
                              checkpoint_dir=str(ckpt), report_interval_s=0.02)
            hooks = FaultHooks(0, checkpoint_dir=spec.checkpoint_dir)
            armed = threading.Event()

            def on_command(cmd: events_pb2.Command) -> None:
                hooks.on_command(cmd)
                armed.set()

            with Reporter(spec, on_command) as reporter:
                emit = _Emitter(spec, reporter)
                hooks.on_checkpoint_damaged = emit.checkpoint_invalid
                for step in (5, 10):  # what rank 0 reported when it saved them
                    emit.checkpoint(step, str(checkpoint.step_path(ckpt, step)), "sha", 0.1)
                agent.send(0, _fault("ckpt-corrupt", at_step=12))
                assert armed.wait(20), "the order never reached the hooks"
                hooks.before_step(11)
                assert checkpoint.latest_valid(ckpt)[0] == 10
                hooks.before_step(12)
                assert checkpoint.latest_valid(ckpt)[0] == 5
                agent.wait_for(lambda a: any(c.invalid for c in a.of_kind("checkpoint")))
            [bad] = [c for c in agent.of_kind("checkpoint") if c.invalid]
            assert (bad.job_id, bad.attempt, bad.rank, bad.step, bad.path) == \
                (job_id, attempt, 0, 10, str(checkpoint.step_path(ckpt, 10)))
            assert store.record_batch("agent-n0", 1, 1, [e for _, e in agent.events])
            assert [(c.step, c.valid) for c in store.checkpoints(job_id)] == [(5, True), (10, False)]
            [action] = [a for a in store.actions(job_id) if a.kind == "ckpt_invalid"]
            assert action.cause.startswith("checkpoint of step 10 invalid: ckpt-corrupt fault: rank 0 flipped "
                                           "bytes in ")
            assert action.cause.endswith("at the top of step 12")
    finally:
        agent.stop()
