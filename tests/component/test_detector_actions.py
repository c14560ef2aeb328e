"""detect.<kind>.action through the real Controller's attempt loop (the in-memory runtime of
tests/unit/test_controller.py: real node agents over gRPC, the real watchdog, a real
SQLite store): an observed hang is stored with what it would have done, `fleet report`
shows it, and the attempt is neither restarted nor its node quarantined; a hang whose
action is quarantine takes its node out at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from fleet.controlplane.cli.main import main
from fleet.controlplane.config import ClusterConfig
from fleet.controlplane.controller import Controller
from fleet.controlplane.lifecycle import JobState
from fleet.controlplane.report import load_report
from fleet.controlplane.runtime import Runtime
from fleet.controlplane.store import NODE_QUARANTINED, Store
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.kinds import IncidentKind
from tests.unit.test_controller import (
    InMemoryCluster,
    InMemoryPool,
    InProcessAgents,
    Outcome,
    Script,
    ScriptedWorkers,
    cluster_config,
)

pytestmark = pytest.mark.timeout(120)

#: detection well inside the test's patience: 1 s threshold, then 1 s without a culprit
FAST_HANG = {"hang_floor_s": 1.0, "unconfirmed_hang_s": 1.0}


class HeldWorkers(ScriptedWorkers):
    """Ranks that stop reporting steps after the outcome's steps and finish once
    ``release`` is set (an observed hang lets the attempt run on: it must end by itself).
    ``behind``: on a held attempt, this rank's last step ended 0.5 s before the others'
    (it is the one that stopped first, whom an unconfirmed hang blames)."""

    release = threading.Event()
    behind: int | None = None

    def run(self, specs) -> None:  # noqa: ANN001
        if self.behind is None or not self._outcome.hold:
            super().run(specs)
            return
        self._script.attempts.append(specs)
        now = time.time_ns()
        for spec in specs:
            last = now - (500_000_000 if spec.rank == self.behind else 0)
            events = [events_pb2.Event(step=events_pb2.StepEvent(
                job_id=spec.job_id, attempt=spec.attempt, rank=spec.rank, step=s, loss=2.0, step_time_s=0.01,
                end_ns=last - (self._outcome.steps - s) * 10_000_000)) for s in range(1, self._outcome.steps + 1)]
            with grpc.insecure_channel(spec.agent_address) as channel:
                agent_pb2_grpc.NodeAgentStub(channel).Report(agent_pb2.WorkerReport(
                    job_id=spec.job_id, attempt=spec.attempt, rank=spec.rank, events=events), timeout=10)

    def poll(self, timeout_s: float):  # noqa: ANN201
        if self.release.is_set() and not self.finished:
            for r in self.running():
                self.results[r] = "ok"
        return super().poll(timeout_s)


def _config(tmp: Path, detect: dict, ray_nodes: int = 2) -> ClusterConfig:
    cfg = cluster_config(tmp, max_restarts=3, nodes=2)
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw.setdefault("ray", {})["nodes"] = ray_nodes
    raw.setdefault("detect", {}).update(FAST_HANG, **detect)
    return ClusterConfig.model_validate(raw)


def _run(cfg: ClusterConfig, store: Store, outcomes: list[Outcome], until,  # noqa: ANN001
         behind: int | None = None) -> tuple:
    """Run the job; once ``until(store, job_id)`` holds (or 60 s passed), the held ranks finish."""
    script = Script(outcomes)
    HeldWorkers.release, HeldWorkers.behind = threading.Event(), behind
    runtime = Runtime(cluster=InMemoryCluster, agents=InProcessAgents, pool=InMemoryPool,
                      workers=lambda placement, actors: HeldWorkers(script, placement, actors))

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not HeldWorkers.release.is_set():
            jobs = store.list_jobs()
            if jobs and until(store, jobs[0].id):
                break
            time.sleep(0.1)
        HeldWorkers.release.set()

    watcher = threading.Thread(target=watch, name="test-release-held-ranks", daemon=True)
    watcher.start()
    try:
        result = Controller(cfg, store, runtime=runtime).run()
    finally:
        HeldWorkers.release.set()
        watcher.join(5)
    return result, script


def _observed(store: Store, job_id: str) -> bool:
    return any(i.observed for i in store.incidents(job_id))


@pytest.fixture
def store(tmp_path: Path):  # noqa: ANN201
    (tmp_path / ".fleet").mkdir()
    with Store(f"sqlite:///{tmp_path}/.fleet/fleet.db") as s:
        yield s


def test_an_observed_hang_is_stored_and_reported_and_nothing_is_restarted(
        tmp_path: Path, store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, {"hang": {"action": "observe"}})
    result, script = _run(cfg, store, [Outcome(3, hold=True)], _observed)
    assert result.state is JobState.SUCCEEDED, result.reason
    assert len(script.attempts) == 1  # the attempt ran on, and was never restarted
    [incident] = store.incidents(result.job_id)
    assert (incident.kind, incident.detector, incident.attempt) == (IncidentKind.HANG, "hang", 1)
    assert incident.observed == "would restart the attempt (restart 1 of 3)"
    assert "no rank finished a step" in incident.evidence
    assert [a.kind for a in store.actions(result.job_id)] == []
    assert all(n.state != NODE_QUARANTINED for n in store.list_nodes())

    out = load_report(store, result.job_id, time.time())
    assert out["restarts"] == 0 and out["attempts"] == 1
    [shown] = out["incidents"]
    assert (shown["kind"], shown["observed"], shown["would"], shown["ended_attempt"]) == (
        "hang", True, "would restart the attempt (restart 1 of 3)", False)
    capsys.readouterr()
    assert main(["report", result.job_id, "--store", cfg.store.url]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "hang (observed)" in text
    assert (f"observed attempt 1, hang of rank {incident.rank} on {incident.node or 'no node'}: "
            "would restart the attempt (restart 1 of 3)") in text


def test_a_hang_whose_action_is_quarantine_takes_its_node_out_at_once(tmp_path: Path, store: Store) -> None:
    # the policy alone would never quarantine (quarantine_after_incidents: 0); rank 1 is
    # the one that stopped, so the unconfirmed hang names it and its node
    cfg = _config(tmp_path, {"hang": {"action": "quarantine"}}, ray_nodes=3)
    result, script = _run(cfg, store, [Outcome(3, hold=True), Outcome(6)],
                          lambda s, job: len(s.get_attempts(job)) > 1, behind=1)
    assert result.state is JobState.SUCCEEDED, result.reason
    first = store.incidents(result.job_id)[0]
    assert (first.kind, first.rank, first.node, first.observed) == (IncidentKind.HANG, 1, "node-1", "")
    node = next(n for n in store.list_nodes() if n.name == "node-1")
    assert node.state == NODE_QUARANTINED
    assert "detect.hang.action: quarantine" in node.quarantine_reason
    assert [a.kind for a in store.actions(result.job_id)][:2] == ["quarantine", "restart"]
    assert [{s.node_name for s in a} for a in script.attempts] == [{"node-0", "node-1"}, {"node-0", "node-2"}]
