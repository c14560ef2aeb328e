"""The controller's side of silent data corruption, as pure decisions: which layouts have
copies, a verdict row parsed, a rank's SdcError attributed, the side incident of a
transient verdict, quarantine (persistent at once, transient on recurrence), the restart
that rolls back, what the worker specs carry, cluster.yaml rules and the wire form of an
sdc order."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from fleet.controlplane.chaos import FaultOrder
from fleet.controlplane.chaos_fire import ChaosFirer, order_of, spec_of
from fleet.controlplane.config import PolicyConfig, parse_cluster_yaml
from fleet.controlplane.detectors import Incident, attribute_failures, decide_restart, sdc_verdict_incident
from fleet.controlplane.errors import ConfigError
from fleet.controlplane.launch import worker_specs
from fleet.controlplane.policy import decide_quarantine
from fleet.controlplane.runtime import RankFailure
from fleet.controlplane.sdc import SdcFailure, SdcVerdict, copies_problem, sdc_section
from fleet.proto.kinds import FaultKind, IncidentKind
from fleet.workers.failures import SdcError

pytestmark = pytest.mark.timeout(60)

NODES = ["node-0", "node-0", "node-1", "node-1"]


@dataclass
class Row:
    """A verdict (or other SDC check) row as the store returns it."""

    id: int = 1
    attempt: int = 1
    rank: int | None = 2
    step: int = 31
    value: str = "transient"
    expected: str = "abc"
    detail: str = ""
    kind: str = "verdict"
    ok: bool = False


def _detail(**over: object) -> str:
    base = {"first_bad_step": 31, "suspects": [2], "state": "weights", "replays": 1, "rollback_step": 30,
            "triage": ["step 40: rank 2's weights differ from ranks [0, 1, 3]", "replay 1 of steps 31..40: rank 2 "
                       "now agrees"], "evidence": "bit flip did not repeat"}
    return json.dumps({**base, **over})


# -- layouts ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("layout", "needle"), [
    (("ddp", 4, 2), None),
    (("ddp", 2, 1), None),
    (("hsdp", 4, 2), None),
    (("hsdp", 4, 1), "hsdp on 1 node"),
    (("fsdp", 4, 2), "fsdp shards"),
    (("ddp", 1, 1), "1-rank world"),
])
def test_copies_problem_says_why_a_layout_has_no_copy(layout, needle) -> None:
    problem = copies_problem(*layout)
    assert problem is None if needle is None else needle in problem
    assert "job.entrypoint" in copies_problem("ddp", 4, 2, program=True)


# -- verdict rows -----------------------------------------------------------------------------

def test_a_verdict_row_is_parsed_from_its_detail() -> None:
    v = SdcVerdict.from_row(Row(detail=_detail()))
    assert (v.step, v.suspect, v.verdict, v.state, v.replays, v.rollback_step, v.suspects) == (
        31, 2, "transient", "weights", 1, 30, (2,))
    assert len(v.triage) == 2
    text = v.describe("node-1")
    for part in ("transient silent data corruption first seen at step 31", "suspect rank 2 on node-1",
                 "triage: step 40", "rolled back to step 30 after 1 replay(s)"):
        assert part in text, text


@pytest.mark.parametrize("detail", ["not json", "[1, 2]", "", json.dumps({"replays": "two", "triage": "x",
                                                                          "first_bad_step": True})])
def test_a_malformed_verdict_detail_never_raises(detail) -> None:
    v = SdcVerdict.from_row(Row(rank=None, step=12, detail=detail))
    assert (v.step, v.suspect, v.replays, v.rollback_step, v.triage) == (12, -1, 0, None, ())
    assert "no rank" in v.describe()


# -- attribution ------------------------------------------------------------------------------

def test_an_sdc_error_is_the_cause_and_carries_its_rollback_step() -> None:
    sdc = SdcFailure(step=31, rank=2, verdict="persistent", rollback_step=30,
                     evidence="rank 2's weights differ again after replay 1")
    failures = [RankFailure(r, NODES[r], False, "SdcError: ...", sdc=sdc) for r in range(4)]
    failures.append(RankFailure(1, NODES[1], False, "non-finite loss", nonfinite_step=31, nonfinite_ranks=(1,)))
    incident = attribute_failures(failures, NODES)
    assert (incident.kind, incident.detector, incident.rank, incident.node, incident.rollback_step) == (
        IncidentKind.SDC, "sdc_persistent", 2, "node-1", 30)
    for part in ("persistent silent data corruption first seen at step 31", "suspect rank 2 on node-1",
                 "differ again after replay 1", "roll back to step 30"):
        assert part in incident.evidence, incident.evidence
    # without one, nothing changes
    assert attribute_failures(failures[4:], NODES).kind is IncidentKind.NAN


def test_the_orchestrator_reads_sdc_error_off_a_ray_task_error() -> None:
    import ray.exceptions

    from fleet.controlplane.orchestrator import _raised, sdc_failure

    err = ray.exceptions.RayTaskError("WorkerActor.run", "Traceback ...", SdcError(31, 2, "persistent", 30, "again"))
    seen = pickle.loads(pickle.dumps(err)).as_instanceof_cause()
    assert sdc_failure(seen) == SdcFailure(31, 2, "persistent", 30, "again")
    assert _raised(0, "node-0", seen).sdc == SdcFailure(31, 2, "persistent", 30, "again")
    assert sdc_failure(RuntimeError("persistent silent data corruption at step 1")) is None


@pytest.mark.parametrize(("verdict", "detector"), [("transient", "sdc_transient"), ("ambiguous", "sdc_ambiguous"),
                                                   ("clean", None), ("persistent", None)])
def test_only_transient_and_ambiguous_verdicts_are_side_incidents(verdict, detector) -> None:
    incident = sdc_verdict_incident(SdcVerdict.from_row(Row(value=verdict, detail=_detail())), NODES)
    if detector is None:
        assert incident is None
        return
    assert (incident.kind, incident.detector, incident.rank, incident.node, incident.rollback_step) == (
        IncidentKind.SDC, detector, 2, "node-1", 30)
    assert not incident.kind.ends_attempt
    assert incident.evidence.startswith(f"{verdict} silent data corruption first seen at step 31")


def test_the_restart_after_sdc_says_where_it_rolls_back_to() -> None:
    sdc = Incident(IncidentKind.SDC, "sdc_persistent", 2, "node-1", "...", rollback_step=30)
    assert decide_restart(0, 3, sdc).reason == (
        "sdc of rank 2 on node-1: restart 1 of 3, rolling back to step 30 (verified before the corruption)")
    crash = Incident(IncidentKind.CRASH, "crash", 1, "node-0", "died")
    assert "rolling back" not in decide_restart(0, 3, crash).reason


# -- quarantine -------------------------------------------------------------------------------

@dataclass
class Inc:
    kind: str
    detector: str
    node: str | None
    detected_at: float
    job_id: str = "j-1"
    attempt: int = 1
    rank: int | None = 2


def test_a_persistent_sdc_quarantines_at_once() -> None:
    d = decide_quarantine(1000.0, "node-1", [Inc("sdc", "sdc_persistent", "node-1", 990.0)], PolicyConfig())
    assert d.quarantine
    assert d.reason.startswith("persistent silent data corruption on node-1: rank 2 (j-1 attempt 1)")


def test_one_transient_sdc_does_not_quarantine_a_second_does() -> None:
    one = [Inc("sdc", "sdc_transient", "node-1", 900.0)]
    d = decide_quarantine(1000.0, "node-1", one, PolicyConfig())
    assert not d.quarantine
    assert "1 transient silent data corruption on node-1 (quarantined if it recurs: 2 within 3600 s)" in d.reason
    two = [*one, Inc("sdc", "sdc_ambiguous", "node-1", 950.0, attempt=2)]
    d = decide_quarantine(1000.0, "node-1", two, PolicyConfig())
    assert d.quarantine
    assert d.reason.startswith("silent data corruption recurred on node-1: 2 transient incidents within 3600 s")
    # elsewhere, long ago, or with automatic quarantine off: no
    assert not decide_quarantine(1000.0, "node-0", two, PolicyConfig()).quarantine
    assert not decide_quarantine(10_000.0, "node-1", two, PolicyConfig()).quarantine
    off = PolicyConfig(quarantine_after_incidents=0)
    assert not decide_quarantine(1000.0, "node-1", [Inc("sdc", "sdc_persistent", "node-1", 990.0)], off).quarantine


def test_sdc_incidents_do_not_count_as_crashes_and_crashes_not_as_sdc() -> None:
    mixed = [Inc("sdc", "sdc_transient", "node-1", 900.0), Inc("crash", "crash", "node-1", 950.0)]
    assert not decide_quarantine(1000.0, "node-1", mixed, PolicyConfig()).quarantine


# -- worker specs -----------------------------------------------------------------------------

def _specs(yaml_text: str, nodes: list[str], **kwargs: object):
    cfg = parse_cluster_yaml(yaml_text)
    placement = [SimpleNamespace(name=n) for n in nodes]
    return worker_specs(cfg, job_id="j", attempt=1, placement=placement, port=1, checkpoint_dir="/c",
                        local_addresses={n: "127.0.0.1:1" for n in nodes}, master_addr="127.0.0.1", **kwargs)


def test_worker_specs_check_only_where_there_are_copies() -> None:
    ddp = _specs("job: {data_parallel: ddp}\nsdc: {check_interval: 5, trigger_factor: 8}\n", NODES,
                 restore_at_most=30)
    assert {(s.sdc_check_interval, s.sdc_trigger_factor, s.restore_at_most) for s in ddp} == {(5, 8.0, 30)}
    fsdp = _specs("sdc: {trigger_factor: 8}\n", NODES)
    assert {(s.sdc_check_interval, s.sdc_trigger_factor, s.restore_at_most) for s in fsdp} == {(0, 8.0, 0)}
    # hsdp shrunk onto one node (min_nodes) has no replica left: checks off, triggers on
    hsdp = _specs("job: {data_parallel: hsdp, min_nodes: 1}\n", NODES[:2])
    assert {s.sdc_check_interval for s in hsdp} == {0}
    assert {s.sdc_check_interval for s in _specs("job: {data_parallel: hsdp}\n", NODES)} == {10}


# -- cluster.yaml -----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "needle"), [
    ("sdc: {check_interval: 5}\n", "c.yaml: sdc.check_interval: 5 asks for fingerprint checks, but data_parallel "
                                   "fsdp shards"),
    ("sdc: {check_interval: 10}\n", "sdc.check_interval: 10 asks"),   # explicit, even at the default
    ("job: {data_parallel: hsdp, nodes: 1}\nray: {nodes: 1}\nsdc: {check_interval: 5}\n",
     "sdc.check_interval: 5 asks for fingerprint checks, but data_parallel hsdp on 1 node"),
    ("job: {data_parallel: ddp, nodes: 1, ranks_per_node: 1}\nsdc: {check_interval: 5}\n",
     "sdc.check_interval: 5 asks for fingerprint checks, but a 1-rank world"),
    ("chaos:\n  faults:\n    - {kind: crash, rank: 0}\n    - {kind: sdc, rank: 1, bit: 3}\n",
     "c.yaml: chaos.faults.1.kind: sdc needs a copy of the corrupted state to compare, but data_parallel fsdp"),
    ("job: {data_parallel: ddp}\nchaos:\n  faults:\n    - {kind: sdc, rank: 1, bit: 40}\n",
     "c.yaml:4: chaos.faults.0: bit: must be a float32 bit"),
    ("job: {data_parallel: ddp}\nchaos:\n  faults:\n    - {kind: sdc, rank: 1, target: bias, bit: 1}\n",
     "chaos.faults.0: target: must be one of weight, grad, optimizer, activation"),
    ("job: {data_parallel: ddp}\nchaos:\n  faults:\n    - {kind: nan, rank: 1, persistent: true}\n",
     "chaos.faults.0: persistent: only sdc takes it (not nan)"),
])
def test_cluster_yaml_refuses_sdc_that_cannot_be_checked(text, needle) -> None:
    with pytest.raises(ConfigError) as err:
        parse_cluster_yaml(text, "c.yaml")
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cluster_yaml_sdc_that_can_be_checked() -> None:
    assert parse_cluster_yaml("sdc: {check_interval: 0}\n").sdc.check_interval == 0   # off is fine anywhere
    assert parse_cluster_yaml("{}").sdc.check_interval == 10                           # unset: off for lack of copies
    cfg = parse_cluster_yaml("job: {data_parallel: ddp}\nsdc: {check_interval: 2}\nchaos:\n  faults:\n"
                             "    - {kind: sdc, rank: 1, target: optimizer, value_error: 0.001, persistent: true,"
                             " at_step: 7}\n    - {kind: sdc-gemm, node: node-1}\n")
    assert cfg.chaos.orders() == [
        FaultOrder("sdc", rank=1, at_step=7, target="optimizer", value_error=0.001, persistent=True),
        FaultOrder("sdc-gemm", node="node-1")]


# -- the wire form, and firing ----------------------------------------------------------------

def test_sdc_orders_travel_whole() -> None:
    for order in (FaultOrder("sdc", rank=1, at_step=5, target="grad", bit=0, persistent=True),
                  FaultOrder("sdc", rank=2, value_error=-1e-3), FaultOrder("crash", rank=0)):
        spec = spec_of(order)
        assert spec.HasField("bit") == (order.bit is not None)
        assert order_of(spec, order.rank, order.node) == order


def test_a_fired_sdc_fault_reaches_its_rank_with_every_field() -> None:
    sent = []

    class Sink:
        def send(self, node, command):  # noqa: ANN001
            sent.append((node, command))

    job = SimpleNamespace(job_id="j-1", position=lambda: (2, list(NODES)))
    firer = ChaosFirer(job, Sink(), None, None, None, "/ckpt")  # type: ignore[arg-type]
    firer.fire(FaultOrder("sdc", rank=3, at_step=9, target="activation", bit=30, persistent=True))
    firer.fire(FaultOrder("sdc-gemm", node="node-0"))
    (node, cmd), (gemm_node, gemm) = sent
    f = cmd.fault
    assert (node, cmd.rank, cmd.attempt) == ("node-1", 3, 2)
    assert (f.kind, f.at_step, f.target, f.bit, f.persistent) == (FaultKind.SDC.wire, 9, "activation", 30, True)
    assert (gemm_node, gemm.rank, gemm.fault.kind) == ("node-0", -1, FaultKind.SDC_GEMM.wire)
    assert firer.armed() == [FaultOrder("sdc", rank=3, at_step=9, target="activation", bit=30, persistent=True)]


# -- the report's section ---------------------------------------------------------------------

def test_sdc_section_counts_checks_and_matches_incidents_to_verdicts() -> None:
    checks = [Row(id=i, kind="fingerprint", rank=r, step=s, value="d", ok=not (s == 40 and r == 2))
              for i, (s, r) in enumerate(((s, r) for s in (10, 20, 30, 40) for r in range(4)), 1)]
    checks += [Row(id=50, kind="replay", rank=r, step=40, value="d", ok=True) for r in range(4)]
    checks += [Row(id=60, kind="trigger", rank=0, step=45, value="53.1", expected="23")]
    checks += [Row(id=70, detail=_detail()), Row(id=71, value="clean", rank=None, step=45, ok=True,
                                                 detail=_detail(suspects=[], rollback_step=44))]
    incidents = [SimpleNamespace(attempt=1, kind="sdc", rank=2, node="node-1", detector="sdc_transient",
                                 evidence="transient ..."),
                 SimpleNamespace(attempt=1, kind="crash", rank=0, node="node-0", detector="crash", evidence="x"),
                 SimpleNamespace(attempt=2, kind="sdc", rank=1, node="node-0", detector="sdc_persistent",
                                 evidence="persistent at step 80")]
    out = sdc_section(checks, incidents, {1: dict(enumerate(NODES))})
    assert (out["fingerprint_checks"], out["fingerprints"], out["mismatches"], out["triggers"], out["replays"]) == (
        4, 16, 1, 1, 4)
    assert [v["verdict"] for v in out["verdicts"]] == ["transient", "clean"]
    transient, persistent = out["incidents"]
    assert (transient["first_bad_step"], transient["suspect_rank"], transient["suspect_node"],
            transient["rollback_step"], transient["replays"], transient["state"]) == (31, 2, "node-1", 30, 1, "weights")
    assert transient["triage"][0].startswith("step 40")
    # no verdict row for it (e.g. lost): what the incident says is kept
    assert (persistent["first_bad_step"], persistent["suspect_rank"], persistent["verdict"],
            persistent["incident_evidence"]) == (None, 1, "persistent", "persistent at step 80")
