"""controlplane/chaos.py and its two front ends: the fault kinds, the rules an order must
follow, the Scheduler's timing (injected clock and step, no sleeping), corrupt_checkpoint
on a real checkpoint, the `chaos:` section of cluster.yaml and `fleet inject-fault`."""

from __future__ import annotations

import threading

import pytest

from fleet.proto import events_pb2
from fleet.proto.kinds import FaultKind
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from fleet.controlplane import chaos
from fleet.controlplane.chaos import (
    AGENT_KINDS,
    CONTROLLER_KINDS,
    FAULT_KINDS,
    RANK_KINDS,
    FaultOrder,
    Scheduler,
    check_order,
    corrupt_checkpoint,
    validate_order,
)
from fleet.controlplane.cli.main import main
from fleet.controlplane.config import ChaosConfig, ChaosFault, ClusterConfig, load_cluster_config, parse_cluster_yaml
from fleet.controlplane.errors import ConfigError, NotFoundError, StateError
from tests.unit.test_config import FUZZ, REPO, SRC, _VALUES
from fleet.workers import checkpoint

pytestmark = pytest.mark.timeout(60)


# -- the kinds -----------------------------------------------------------------------------


def test_every_kind_has_exactly_one_executor_and_a_help_line():
    assert len(FAULT_KINDS) == len(set(FAULT_KINDS)) == 11
    assert RANK_KINDS | AGENT_KINDS | CONTROLLER_KINDS == set(FAULT_KINDS)
    assert not (RANK_KINDS & AGENT_KINDS or RANK_KINDS & CONTROLLER_KINDS or AGENT_KINDS & CONTROLLER_KINDS)
    assert tuple(chaos.KIND_HELP) == FAULT_KINDS
    assert set(chaos.FLAGS) == set(chaos.FIELDS) == {f for f in FaultOrder.__dataclass_fields__}


def test_describe():
    assert FaultOrder("crash", rank=2, at_step=30).describe() == "crash on rank 2 at step 30"
    assert FaultOrder("agent-down", node="node-1", after_s=30).describe() == "agent-down on node-1 after 30 s"
    assert FaultOrder("controller-crash").describe() == "controller-crash"


# -- validate_order --------------------------------------------------------------------------

VALID = [
    FaultOrder("crash", rank=0),
    FaultOrder("crash", node="node-1", at_step=40),
    FaultOrder("hang", rank=3, at_step=5, duration_s=20),
    FaultOrder("slow", rank=1, after_s=10, duration_s=30, delay_s=0.5),
    FaultOrder("nan", rank=0, at_step=100),
    FaultOrder("node-down", node="node-1", duration_s=60),
    FaultOrder("node-down", rank=2),                   # rank 2's node
    FaultOrder("agent-down", node="node-0", after_s=30),
    FaultOrder("partition", rank=0, duration_s=5),
    FaultOrder("ckpt-corrupt", at_step=120),
    FaultOrder("controller-crash", after_s=60),
]


@pytest.mark.parametrize("order", VALID, ids=lambda o: o.describe())
def test_valid_orders(order):
    validate_order(order)
    assert check_order(order) is None


@pytest.mark.parametrize(
    ("order", "message"),
    [
        (FaultOrder("meteor", rank=0),
         "--kind: unknown fault kind 'meteor' (choose from crash, hang, slow, nan, node-down, agent-down, "
         "partition, ckpt-corrupt, controller-crash, sdc, sdc-gemm)"),
        (FaultOrder("crash"), "--rank / --node: crash needs a rank or a node (every rank on it)"),
        (FaultOrder("nan", rank=1, node="node-0"), "--rank / --node: give one of them, not both"),
        (FaultOrder("agent-down"), "--node: agent-down needs a node (or --rank: that rank's node)"),
        (FaultOrder("node-down"), "--node: node-down needs a node (or --rank: that rank's node)"),
        (FaultOrder("partition", rank=0, node="node-0"), "--rank / --node: give one of them, not both"),
        (FaultOrder("ckpt-corrupt", node="node-0"),
         "--rank / --node: ckpt-corrupt acts on the whole job; give neither"),
        (FaultOrder("controller-crash", rank=0),
         "--rank / --node: controller-crash acts on the whole job; give neither"),
        (FaultOrder("crash", rank=-2), "--rank: must be >= 0 (got -2)"),
        (FaultOrder("crash", rank=0, at_step=-1), "--at-step: must be >= 0 (got -1)"),
        (FaultOrder("crash", rank=0, after_s=-1), "--after: must be a finite number >= 0 (got -1)"),
        (FaultOrder("hang", rank=0, duration_s=float("nan")), "--duration: must be a finite number >= 0 (got nan)"),
        (FaultOrder("slow", rank=0, delay_s=float("inf")), "--delay: must be a finite number >= 0 (got inf)"),
        (FaultOrder("hang", rank=0, at_step=3, after_s=2), "--at-step / --after: give one of them, not both"),
        (FaultOrder("crash", rank=0, duration_s=5), "--duration: crash has no duration"),
        (FaultOrder("hang", rank=0, delay_s=1), "--delay: only slow has a per-step delay"),
    ],
)
def test_invalid_orders_name_the_flag(order, message):
    with pytest.raises(ConfigError) as info:
        validate_order(order)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_the_same_rules_name_config_fields():
    assert check_order(FaultOrder("hang", rank=0, at_step=3, after_s=2)) == (
        "at_step / after_s: give one of them, not both")


# -- Scheduler: run_due with an injected clock and step ----------------------------------------


class _World:
    """A fake clock and job step, and a record of what was fired."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.step = 0
        self.fired: list[FaultOrder] = []
        self.fired_event = threading.Event()

    def fire(self, order: FaultOrder) -> None:
        self.fired.append(order)
        self.fired_event.set()

    def scheduler(self, **kw) -> Scheduler:
        return Scheduler(self.fire, lambda: self.step, clock=lambda: self.now, **kw)


def test_rank_kinds_with_a_step_fire_at_once_for_the_worker_to_arm():
    w = _World()
    with w.scheduler() as s:
        s.submit(FaultOrder("crash", rank=1, at_step=400))
        s.submit(FaultOrder("slow", node="node-0", at_step=9))
        assert [o.kind for o in s.run_due()] == ["crash", "slow"]
        assert s.pending() == [] and w.fired[0].at_step == 400


def test_after_s_fires_that_many_seconds_after_submit_whatever_the_kind():
    w = _World()
    with w.scheduler() as s:
        hang = FaultOrder("hang", rank=0, after_s=30)
        down = FaultOrder("agent-down", node="node-1", after_s=10, duration_s=5)
        s.submit(hang)
        w.now += 5
        s.submit(down)                    # due at 1015; hang at 1030
        w.now = 1014.9
        assert s.run_due() == [] and s.pending() == [hang, down]
        w.now = 1015.0
        assert s.run_due() == [down]
        w.now = 1029.99
        assert s.run_due() == []
        w.now = 1030.0
        assert s.run_due() == [hang]
        assert w.fired == [down, hang]


def test_controller_and_agent_kinds_with_a_step_wait_for_the_job_to_reach_it():
    w = _World()
    with w.scheduler() as s:
        corrupt = FaultOrder("ckpt-corrupt", at_step=120)    # rank 0 times it: handed over at once
        partition = FaultOrder("partition", node="node-0", at_step=50, duration_s=3)
        down = FaultOrder("node-down", node="node-1", at_step=120)
        now = FaultOrder("controller-crash")
        for order in (corrupt, partition, down, now):
            s.submit(order)
        assert s.run_due() == [corrupt, now]
        w.step = 49
        assert s.run_due() == []
        w.step = 60                       # steps can jump (polled): >= fires
        assert s.run_due() == [partition]
        w.now += 1e9                      # time alone does not fire a step order
        assert s.run_due() == []
        w.step = 120
        assert s.run_due() == [down]
        assert s.pending() == []


def test_a_failing_fire_or_step_reader_is_logged_and_the_rest_still_fire(caplog):
    w = _World()
    boom = FaultOrder("crash", rank=9)

    def fire(order: FaultOrder) -> None:
        if order == boom:
            raise RuntimeError("no such rank")
        w.fire(order)

    steps = iter([RuntimeError("store down"), 7])

    def current_step() -> int:
        value = next(steps)
        if isinstance(value, Exception):
            raise value
        return value

    s = Scheduler(fire, current_step, clock=lambda: w.now)
    ok = FaultOrder("hang", rank=0)
    later = FaultOrder("node-down", node="node-1", at_step=5)
    for order in (boom, ok, later):
        s.submit(order)
    assert s.run_due() == [boom, ok]     # both were due; boom's failure is logged, then dropped
    assert w.fired == [ok]
    assert "firing crash on rank 9 failed" in caplog.text
    assert "store down" in caplog.text and s.pending() == [later]
    assert s.run_due() == [later]        # the step reader works again
    s.close()


def test_submit_validates_is_bounded_and_refuses_after_close():
    w = _World()
    s = w.scheduler(max_pending=2)
    with pytest.raises(ConfigError, match="--kind"):
        s.submit(FaultOrder("meteor", rank=0))
    s.submit(FaultOrder("ckpt-corrupt", at_step=5))
    s.submit(FaultOrder("ckpt-corrupt", at_step=6))
    with pytest.raises(StateError, match="already waiting"):
        s.submit(FaultOrder("ckpt-corrupt", at_step=7))
    s.close()
    assert s.pending() == []              # dropped, never fired
    assert w.fired == []
    with pytest.raises(StateError, match="closed"):
        s.submit(FaultOrder("crash", rank=0))
    with pytest.raises(StateError, match="closed"):
        s.start()
    s.close()                             # idempotent


# -- Scheduler: its thread (bounded waits on events, never a bare sleep) ------------------------


def test_the_thread_fires_due_orders_and_stops_on_close():
    w = _World()
    with w.scheduler(poll_interval_s=0.01) as s:
        s.start()
        s.start()  # once
        threads = [t for t in threading.enumerate() if t.name == "fleet-chaos-scheduler"]
        assert len(threads) == 1 and threads[0].daemon
        s.submit(FaultOrder("crash", rank=0, at_step=3))
        assert w.fired_event.wait(10) and w.fired[-1].kind == "crash"
        w.fired_event.clear()
        s.submit(FaultOrder("ckpt-corrupt", at_step=20))
        s.submit(FaultOrder("agent-down", node="node-0", after_s=60))
        w.step = 20
        assert w.fired_event.wait(10) and w.fired[-1].kind == "ckpt-corrupt"
        w.fired_event.clear()
        w.now += 60
        assert w.fired_event.wait(10) and w.fired[-1].kind == "agent-down"
    assert not threads[0].is_alive()


def test_the_thread_survives_a_failing_fire():
    w = _World()
    calls = []

    def fire(order: FaultOrder) -> None:
        calls.append(order)
        if len(calls) == 1:
            raise RuntimeError("agent gone")
        w.fire(order)

    with Scheduler(fire, lambda: 0, poll_interval_s=0.01) as s:
        s.start()
        s.submit(FaultOrder("crash", rank=0))
        s.submit(FaultOrder("hang", rank=1))
        assert w.fired_event.wait(10)
        assert [o.kind for o in calls] == ["crash", "hang"]


# -- corrupt_checkpoint on a real checkpoint -------------------------------------------------------


def _save_two_checkpoints(rank: int, world_size: int, ckpt_dir: str) -> None:
    """Inside a one-rank gloo group: commit checkpoints of steps 5 and 10."""
    from tests.unit.test_workers_parallel import StandInMoE
    from fleet.workers.recorder import FlightRecorder

    rec = FlightRecorder("job", 0, rank, lambda event: None)
    model = StandInMoE(vocab=64, n_layers=1, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    for step in (5, 10):
        checkpoint.save(ckpt_dir, step, model, opt, rec, keep=0)


def test_corrupt_checkpoint_damages_the_newest_valid_one(tmp_path):
    from tests.unit.test_workers_parallel import in_pg
    from tests.unit.test_workers_support import run_ranks

    run_ranks(in_pg, 1, (_save_two_checkpoints, str(tmp_path)), timeout_s=50)
    assert checkpoint.latest_valid(tmp_path) == (10, str(tmp_path / "step_00000010"))
    newest = tmp_path / "step_00000010"
    sizes = {p.name: p.stat().st_size for p in newest.iterdir()}
    data_files = [n for n in sizes if n.endswith(".distcp")]
    assert data_files

    damaged = corrupt_checkpoint(tmp_path)

    assert damaged.parent == newest and damaged.name == max(data_files, key=sizes.get)
    assert {p.name: p.stat().st_size for p in newest.iterdir()} == sizes      # in place, same size
    assert not checkpoint.verify(newest) and checkpoint.verify(newest, checksums=False)
    assert checkpoint.latest_valid(tmp_path) == (5, str(tmp_path / "step_00000005"))

    corrupt_checkpoint(tmp_path)                                              # then the older one
    assert checkpoint.latest_valid(tmp_path) is None
    with pytest.raises(NotFoundError, match="no valid checkpoint"):
        corrupt_checkpoint(tmp_path)


def test_rank_0_corrupts_the_newest_checkpoint_at_exactly_the_armed_step(tmp_path):
    from tests.unit.test_workers_parallel import in_pg
    from tests.unit.test_workers_support import run_ranks
    from fleet.workers.faults import FaultHooks

    run_ranks(in_pg, 1, (_save_two_checkpoints, str(tmp_path)), timeout_s=50)
    hooks = FaultHooks(0, checkpoint_dir=str(tmp_path))
    hooks.on_command(events_pb2.Command(command_id="c", fault=events_pb2.FaultSpec(kind=FaultKind("ckpt-corrupt").wire, at_step=12)))
    hooks.before_step(11)
    assert checkpoint.latest_valid(tmp_path)[0] == 10
    hooks.before_step(12)
    assert checkpoint.latest_valid(tmp_path)[0] == 5
    hooks.before_step(13)  # once only
    assert checkpoint.latest_valid(tmp_path)[0] == 5
    # a rank without a checkpoint folder ignores the order
    other = FaultHooks(1)
    other.on_command(events_pb2.Command(command_id="d", fault=events_pb2.FaultSpec(kind=FaultKind("ckpt-corrupt").wire, at_step=1)))
    other.before_step(1)
    assert checkpoint.latest_valid(tmp_path)[0] == 5


def test_corrupt_checkpoint_without_checkpoints(tmp_path):
    with pytest.raises(NotFoundError, match=f"no valid checkpoint under {tmp_path}"):
        corrupt_checkpoint(tmp_path / "absent")


# -- the chaos: section of cluster.yaml ----------------------------------------------------------


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_cluster_yaml(text, SRC)
    return str(info.value)


def test_no_chaos_by_default():
    assert parse_cluster_yaml("", SRC).chaos.orders() == []


def test_chaos_faults_become_orders_in_file_order():
    cfg = parse_cluster_yaml(
        "chaos:\n  faults:\n"
        "    - {kind: crash, rank: 1, at_step: 40}\n"
        "    - {kind: agent-down, node: node-1, after_s: 30, duration_s: 0}\n"
        "    - {kind: slow, rank: 0, at_step: 10, duration_s: 20, delay_s: 0.5}\n"
        "    - {kind: ckpt-corrupt, at_step: 100}\n", SRC)
    assert cfg.chaos.orders() == [
        FaultOrder("crash", rank=1, at_step=40),
        FaultOrder("agent-down", node="node-1", after_s=30),
        FaultOrder("slow", rank=0, at_step=10, duration_s=20, delay_s=0.5),
        FaultOrder("ckpt-corrupt", at_step=100),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("chaos:\n  faults:\n    - kind: crash\n      rank: 0\n    - kind: meteor\n      rank: 1\n",
         f"{SRC}:5: chaos.faults.1.kind: unknown fault kind 'meteor' (choose from crash, hang, slow, nan, "
         "node-down, agent-down, partition, ckpt-corrupt, controller-crash, sdc, sdc-gemm)"),
        ("chaos:\n  faults:\n    - rank: 0\n", f"{SRC}:3: chaos.faults.0.kind: Field required"),
        ("chaos:\n  faults:\n    - kind: crash\n      rank: -1\n",
         f"{SRC}:4: chaos.faults.0.rank: Input should be greater than or equal to 0"),
        ("chaos:\n  faults:\n    - kind: hang\n      rank: 0\n      after_s: -3\n",
         f"{SRC}:5: chaos.faults.0.after_s: Input should be greater than or equal to 0"),
        ("chaos:\n  faults:\n    - kind: crash\n      rank: 0\n      color: red\n",
         f"{SRC}:5: chaos.faults.0.color: unknown key"),
        ("chaos:\n  faults:\n    - kind: crash\n",
         f"{SRC}:3: chaos.faults.0: rank / node: crash needs a rank or a node"),
        ("chaos:\n  faults:\n    - {kind: crash, rank: 1, node: node-0}\n",
         f"{SRC}:3: chaos.faults.0: rank / node: give one of them, not both"),
        ("chaos:\n  faults:\n    - {kind: hang, rank: 1, at_step: 3, after_s: 5}\n",
         f"{SRC}:3: chaos.faults.0: at_step / after_s: give one of them, not both"),
        ("chaos:\n  faults:\n    - {kind: ckpt-corrupt, node: node-0}\n",
         f"{SRC}:3: chaos.faults.0: rank / node: ckpt-corrupt acts on the whole job"),
        ("chaos:\n  faults:\n    - {kind: crash, rank: 0, delay_s: 1}\n",
         f"{SRC}:3: chaos.faults.0: delay_s: only slow has a per-step delay"),
        ("chaos:\n  faults: {kind: crash}\n", f"{SRC}:2: chaos.faults: Input should be a valid list"),
        ("chaos:\n  fault: []\n", f"{SRC}:2: chaos.fault: unknown key"),
    ],
)
def test_chaos_errors_name_the_item_field_and_line(text, expected):
    assert _error(text).startswith(expected)


def test_examples_chaos_yaml_is_the_local_example_plus_a_chaos_section():
    local = load_cluster_config(REPO / "examples" / "local.yaml")
    cfg = load_cluster_config(REPO / "examples" / "chaos.yaml")
    assert cfg.model_dump(exclude={"chaos"}) == local.model_dump(exclude={"chaos"})
    kinds = {o.kind for o in cfg.chaos.orders()}
    assert {"crash", "slow", "ckpt-corrupt", "agent-down"} <= kinds
    # every rank it names exists in the job
    assert all(o.rank < cfg.job.world_size for o in cfg.chaos.orders())


_FAULT_ITEM = st.one_of(
    st.fixed_dictionaries({}, optional={
        "kind": st.one_of(st.sampled_from(FAULT_KINDS), _VALUES),
        "rank": st.one_of(st.integers(-2, 8), _VALUES),
        "node": st.one_of(st.sampled_from(["node-0", "node-1", ""]), _VALUES),
        "at_step": st.one_of(st.integers(-1, 500), _VALUES),
        "after_s": _VALUES, "duration_s": _VALUES, "delay_s": _VALUES, "bogus": _VALUES,
    }),
    _VALUES,
)


@FUZZ
@given(st.one_of(st.fixed_dictionaries({}, optional={"faults": st.lists(_FAULT_ITEM, max_size=4),
                                                    "bogus": _VALUES}), _VALUES))
def test_fuzz_chaos_section_only_raises_config_error(section):
    text = yaml.safe_dump({"chaos": section}, sort_keys=False)
    try:
        cfg = parse_cluster_yaml(text, SRC)
    except ConfigError as exc:
        msg = str(exc)
        assert msg.startswith(f"{SRC}:") and "\n" not in msg, msg
        assert "chaos" in msg, msg
    else:
        assert isinstance(cfg, ClusterConfig)
        for order in cfg.chaos.orders():
            validate_order(order)  # what the file accepts, the CLI accepts too


def test_chaos_models_are_frozen_and_documented():
    for model in (ChaosConfig, ChaosFault):
        assert model.__doc__
        assert all(f.description for f in model.model_fields.values())
    cfg = parse_cluster_yaml("chaos:\n  faults:\n    - {kind: crash, rank: 0}\n", SRC)
    with pytest.raises(Exception):
        cfg.chaos.faults[0].rank = 1  # type: ignore[misc]


# -- fleet inject-fault ---------------------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(["inject-fault", "--job", "j", *argv])
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    return code, "\n".join(lines)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kind", "meteor", "--rank", "0"], "error: --kind: unknown fault kind 'meteor'"),
        (["--kind", "agent-down"], "error: --node: agent-down needs a node"),
        (["--kind", "ckpt-corrupt", "--rank", "0"], "error: --rank / --node: ckpt-corrupt acts on the whole job"),
        (["--kind", "hang", "--rank", "0", "--at-step", "3", "--after", "5"],
         "error: --at-step / --after: give one of them, not both"),
        (["--kind", "hang", "--rank", "0", "--delay", "1"], "error: --delay: only slow"),
        (["--kind", "slow", "--rank", "0", "--after", "-1"], "error: --after: must be a finite number >= 0"),
        (["--kind", "slow", "--rank", "0", "--duration", "inf"], "error: --duration: must be a finite number"),
        (["--kind", "crash", "--rank", "-1"], "error: --rank: must be >= 0 (got -1)"),
        (["--kind", "sdc", "--rank", "1", "--bit", "32"], "error: --bit: must be a float32 bit, 0"),
        (["--kind", "sdc", "--rank", "1", "--bit", "-1"], "error: --bit: must be a float32 bit"),
        (["--kind", "sdc", "--rank", "1", "--bit", "3", "--target", "bias"],
         "error: --target: must be one of weight, grad, optimizer, activation (got 'bias')"),
        (["--kind", "sdc", "--rank", "1"], "error: --bit / --value-error: sdc needs one"),
        (["--kind", "sdc", "--rank", "1", "--bit", "3", "--value-error", "1e-3"],
         "error: --bit / --value-error: give one of them, not both"),
        (["--kind", "sdc", "--rank", "1", "--value-error", "nan"], "error: --value-error: must be a finite number"),
        (["--kind", "sdc", "--rank", "1", "--value-error", "1e7"], "error: --value-error: must be between 1e-9"),
        (["--kind", "crash", "--rank", "1", "--persistent"], "error: --persistent: only sdc takes it (not crash)"),
        (["--kind", "sdc-gemm", "--node", "node-0", "--bit", "3"], "error: --bit: only sdc takes it (not sdc-gemm)"),
        (["--kind", "sdc-gemm"], "error: --node: sdc-gemm needs a node"),
    ],
)
def test_cli_refuses_bad_flags_before_connecting(capsys, tmp_path, argv, needle):
    # tmp_path holds no controller.json: a flag error must come first
    code, text = _cli(capsys, *argv, "--state-dir", str(tmp_path))
    assert code == ConfigError.exit_code == 2
    lines = text.split("\n")  # the error, and its hint: one line each
    assert len(lines) == 2 and lines[0].startswith(needle) and lines[1].startswith("hint: "), text


def test_cli_help_describes_every_kind(capsys):
    code, text = _cli(capsys, "--help")
    assert code == 0
    flat = " ".join(text.split())
    for kind in FAULT_KINDS:
        assert f"{kind}:" in flat, kind
    for flag in ("--after", "--delay", "--duration", "--at-step"):
        assert flag in flat


class _FakeClient:
    calls: list[tuple[tuple, dict]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def inject_fault(self, *args, **kwargs):
        from fleet.proto import control_pb2

        self.calls.append((args, kwargs))
        ranks = [kwargs["rank"]] if kwargs["rank"] >= 0 else []
        node = kwargs["node"] or ("node-0" if ranks else "")
        return control_pb2.InjectFaultReply(command_id="c1", attempt=2, ranks=ranks, node=node)


_NO_SDC = {"target": "", "bit": None, "value_error": 0.0, "persistent": False}


@pytest.mark.parametrize(
    ("argv", "kwargs", "printed"),
    [
        (["--kind", "slow", "--rank", "1", "--after", "30", "--duration", "20", "--delay", "0.5"],
         {"rank": 1, "node": "", "at_step": 0, "duration_s": 20.0, "after_s": 30.0, "delay_s": 0.5, **_NO_SDC},
         "injected slow into rank(s) [1] on node-0 (attempt 2, in 30 s); command c1"),
        (["--kind", "ckpt-corrupt", "--at-step", "120"],
         {"rank": -1, "node": "", "at_step": 120, "duration_s": 0.0, "after_s": 0.0, "delay_s": 0.0, **_NO_SDC},
         "injected ckpt-corrupt into job j (attempt 2, at step 120); command c1"),
        (["--kind", "partition", "--node", "node-1", "--duration", "5"],
         {"rank": -1, "node": "node-1", "at_step": 0, "duration_s": 5.0, "after_s": 0.0, "delay_s": 0.0,
          **_NO_SDC},
         "injected partition into node-1 (attempt 2, now); command c1"),
        (["--kind", "sdc", "--rank", "1", "--bit", "30", "--target", "optimizer", "--persistent",
          "--at-step", "25"],
         {"rank": 1, "node": "", "at_step": 25, "duration_s": 0.0, "after_s": 0.0, "delay_s": 0.0,
          "target": "optimizer", "bit": 30, "value_error": 0.0, "persistent": True},
         "injected sdc (bit 30 in a optimizer, persistent) into rank(s) [1] on node-0 (attempt 2, at step 25); "
         "command c1"),
        (["--kind", "sdc", "--rank", "0", "--value-error", "1e-3"],
         {"rank": 0, "node": "", "at_step": 0, "duration_s": 0.0, "after_s": 0.0, "delay_s": 0.0,
          "target": "", "bit": None, "value_error": 1e-3, "persistent": False},
         "injected sdc (relative error 0.001 in a weight) into rank(s) [0] on node-0 (attempt 2, now); command c1"),
        (["--kind", "sdc-gemm", "--node", "node-1"],
         {"rank": -1, "node": "node-1", "at_step": 0, "duration_s": 0.0, "after_s": 0.0, "delay_s": 0.0, **_NO_SDC},
         "injected sdc-gemm into node-1 (attempt 2, now); command c1"),
    ],
)
def test_cli_passes_every_field_to_the_client(capsys, monkeypatch, argv, kwargs, printed):
    from fleet.controlplane.client import ControlClient

    _FakeClient.calls = []
    monkeypatch.setattr(ControlClient, "from_state_dir", classmethod(lambda cls, *a: _FakeClient()))
    code, text = _cli(capsys, *argv)
    assert code == 0, text
    ((args, got),) = _FakeClient.calls
    assert args == ("j", argv[1]) and got == kwargs
    assert text == printed


def test_client_puts_after_and_delay_in_the_fault_spec(monkeypatch):
    from fleet.controlplane.client import ControlClient

    sent = []
    client = ControlClient("127.0.0.1:1", "token")
    monkeypatch.setattr(client, "_call", lambda method, request: sent.append(request))
    try:
        client.inject_fault("j", "slow", rank=1, after_s=30, delay_s=0.5, duration_s=20)
        client.inject_fault("j", "crash", rank=0, at_step=5)   # the old call still works
        client.inject_fault("j", "sdc", rank=1, target="grad", bit=0, persistent=True)
        client.inject_fault("j", "sdc", rank=1, value_error=-0.5)
    finally:
        client.close()
    slow, crash, flip, scale = (r.fault for r in sent)
    assert (slow.kind, slow.after_s, slow.delay_s, slow.duration_s) == (FaultKind.SLOW.wire, 30.0, 0.5, 20.0)
    assert (crash.kind, crash.at_step, crash.after_s, crash.delay_s) == (FaultKind.CRASH.wire, 5, 0.0, 0.0)
    assert not crash.HasField("bit")
    # bit 0 is a bit: it must travel as set, not as the unset default
    assert (flip.kind, flip.target, flip.HasField("bit"), flip.bit, flip.persistent) == \
        (FaultKind.SDC.wire, "grad", True, 0, True)
    assert (scale.HasField("bit"), scale.value_error, scale.persistent) == (False, -0.5, False)
