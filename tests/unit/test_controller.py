"""The real Controller over an in-memory runtime (standing for Ray), real node agents
in this process over real gRPC, and a real SQLite store file.

The in-memory ``Workers`` play a script per attempt: every rank reports its steps to
its node's agent (the real ``NodeAgent`` local service, as a worker does) and finishes,
or one rank dies after some steps and its peers fail once they notice.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml

from fleet.agent.node_agent import NodeAgent
from fleet.agent.settings import AgentSettings
from fleet.controlplane.config import ClusterConfig, ControllerConfig, RayConfig
from fleet.controlplane.controller import Controller, Progress, RunResult
from fleet.controlplane.errors import NotFoundError, StateError
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.runtime import NodeInfo, Process, RankFailure, Runtime
from fleet.controlplane.store import Store
from fleet.proto import agent_pb2, agent_pb2_grpc, events_pb2
from fleet.proto.kinds import FaultKind, IncidentKind
from fleet.workers.spec import WorkerSpec

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


@dataclass(frozen=True)
class Outcome:
    """What one attempt does: every rank runs ``steps`` steps; then ``die`` (a rank) dies,
    or (``hold``) the ranks keep running until killed, or they finish."""

    steps: int
    die: int = -1
    hold: bool = False


@dataclass
class Script:
    outcomes: list[Outcome]
    attempts: list[list[WorkerSpec]] = field(default_factory=list)


class InMemoryCluster:
    def __init__(self, config: RayConfig) -> None:
        self._n = config.nodes
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo(f"node-{i}", f"ray-{i}", "127.0.0.1", 4.0) for i in range(self._n)]

    def shutdown(self) -> None:
        self.stopped = True


class InProcessAgents:
    """Real NodeAgents in this process, one per node."""

    def __init__(self) -> None:
        self.actors: dict[str, NodeAgent] = {}
        self.local_addresses: dict[str, str] = {}
        self._kwargs: dict[str, object] = {}

    def _agent(self, node: str, port: int) -> NodeAgent:
        agent = NodeAgent(node_name=node, local_port=port, die=lambda: None, **self._kwargs)  # type: ignore[arg-type]
        self.local_addresses[node] = agent.start(connect_timeout_s=10)
        self.actors[node] = agent
        return agent

    def start(self, nodes: list[NodeInfo], controller_address: str, token: str, settings: AgentSettings,
              controller: ControllerConfig, bind_host: str = "127.0.0.1") -> None:
        self._kwargs = dict(controller_address=controller_address, token=token, settings=settings,
                            tls=controller.tls.client_files(), bind_host=bind_host)
        for n in nodes:
            self._agent(n.name, 0)

    def alive(self, node: str, timeout_s: float = 2.0) -> bool:
        return node in self.actors

    def kill(self, node: str) -> None:
        agent = self.actors.pop(node, None)
        if agent is not None:
            agent.close()

    def restart(self, node: str) -> str:
        self.kill(node)
        self._agent(node, int(self.local_addresses[node].rsplit(":", 1)[1]))
        return self.local_addresses[node]

    def flush(self, timeout_s: float = 10.0) -> bool:
        return all(a.flush(timeout_s) for a in self.actors.values())

    def close(self, timeout_s: float = 15.0) -> None:
        for node in list(self.actors):
            self.kill(node)


class InMemoryPool:
    def __init__(self, spares_per_node: int, warm: object = None) -> None:
        self._pids = itertools.count(10_000)
        self.closed = False

    def fill_spares(self, nodes: list[NodeInfo]) -> None:
        pass

    def warm_up(self, nodes: list[NodeInfo], per_node: int) -> None:
        pass

    def acquire(self, placement: list[NodeInfo]) -> tuple[list[Process], int]:
        return [next(self._pids) for _ in placement], 0

    def release(self, survivors: dict[int, tuple[str, Process]]) -> None:
        pass

    def discard_node(self, node: str) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class ScriptedWorkers:
    """One attempt's ranks, playing the script's next outcome."""

    def __init__(self, script: Script, placement: list[NodeInfo], actors: list[Process]) -> None:
        self.placement = placement
        self._actors = actors
        self._script = script
        self._outcome = script.outcomes[len(script.attempts)]
        self.results: dict[int, str] = {}
        self.died: set[int] = set()
        self.killed: set[int] = set()
        self._pending: list[RankFailure] = []

    @property
    def finished(self) -> bool:
        return len(self.results) == len(self.placement)

    def pids(self, timeout_s: float) -> list[int]:
        return list(self._actors)

    def rendezvous_port(self, host: str, timeout_s: float) -> int:
        return 29_500

    def run(self, specs: list[WorkerSpec]) -> None:
        self._script.attempts.append(specs)
        for spec in specs:
            _report_steps(spec, self._outcome.steps)
        for spec in specs:
            if self._outcome.hold:
                continue
            if self._outcome.die < 0:
                self.results[spec.rank] = "ok"
            elif spec.rank == self._outcome.die:
                self.results[spec.rank] = "died"
                self.died.add(spec.rank)
                self._pending.append(RankFailure(spec.rank, spec.node_name, True, "process died (SIGKILL)"))

    def poll(self, timeout_s: float) -> list[RankFailure]:
        failures, self._pending = self._pending, []
        if not failures and not self.finished:
            time.sleep(timeout_s)
        return failures

    def running(self) -> list[int]:
        return [r for r in range(len(self.placement)) if r not in self.results]

    def returned(self) -> dict[int, dict]:
        return {r: res for r, res in self.results.items() if isinstance(res, dict) and "error" not in res}

    def kill_ranks(self, ranks: list[int]) -> None:
        for r in ranks:
            self.killed.add(r)
            self.results.setdefault(r, "killed")

    def wind_down(self, grace_s: float) -> list[RankFailure]:
        """The peers of a dead rank fail in their next collective."""
        out = [RankFailure(r, self.placement[r].name, False, "peer closed the connection") for r in self.running()]
        for f in out:
            self.results[f.rank] = "raised"
        return out

    def survivors(self) -> dict[int, tuple[str, Process]]:
        return {r: (self.placement[r].name, self._actors[r]) for r in self.results
                if r not in self.died and r not in self.killed}

    def kill(self) -> None:
        self.kill_ranks(list(range(len(self.placement))))


def _report_steps(spec: WorkerSpec, steps: int) -> None:
    """What a worker's reporter sends its node agent: one StepEvent per step."""
    now = time.time_ns()
    events = [events_pb2.Event(step=events_pb2.StepEvent(
        job_id=spec.job_id, attempt=spec.attempt, rank=spec.rank, step=s, loss=2.0, step_time_s=0.01,
        end_ns=now - (steps - s) * 10_000_000)) for s in range(1, steps + 1)]
    with grpc.insecure_channel(spec.agent_address) as channel:
        agent_pb2_grpc.NodeAgentStub(channel).Report(
            agent_pb2.WorkerReport(job_id=spec.job_id, attempt=spec.attempt, rank=spec.rank, events=events),
            timeout=10)


def in_memory_runtime(script: Script) -> Runtime:
    return Runtime(cluster=InMemoryCluster, agents=InProcessAgents, pool=InMemoryPool,
                   workers=lambda placement, actors: ScriptedWorkers(script, placement, actors))


def cluster_config(tmp: Path, **job: object) -> ClusterConfig:
    """examples/local.yaml, two nodes of one rank, every path inside ``tmp``."""
    raw = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    raw["state_dir"] = str(tmp / ".fleet")
    raw["store"]["url"] = f"sqlite:///{tmp}/.fleet/fleet.db"
    raw["controller"].update(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0)
    raw["job"].update(steps=STEPS, checkpoint_dir=str(tmp / "ckpt"), ranks_per_node=1, ep_size=1,
                      restart_backoff_s=0.0, **job)
    raw["policy"]["quarantine_after_incidents"] = 0
    return ClusterConfig.model_validate(raw)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    (tmp_path / ".fleet").mkdir()
    with Store(f"sqlite:///{tmp_path}/.fleet/fleet.db") as s:
        yield s


def run_job(tmp: Path, store: Store, outcomes: list[Outcome], **job: object) -> tuple[RunResult, Script,
                                                                                      list[Progress]]:
    script = Script(outcomes)
    shown: list[Progress] = []
    ctl = Controller(cluster_config(tmp, **job), store, on_progress=shown.append, runtime=in_memory_runtime(script))
    return ctl.run(), script, shown


def incident_kinds(store: Store, job_id: str) -> list[str]:
    return [i.kind for i in store.incidents(job_id)]


def test_a_job_that_succeeds(tmp_path: Path, store: Store) -> None:
    result, script, shown = run_job(tmp_path, store, [Outcome(STEPS)])
    assert result.state is JobState.SUCCEEDED
    assert (result.attempts, result.final_step, result.reason) == (1, STEPS, f"completed {STEPS} steps")
    [specs] = script.attempts
    assert [(s.rank, s.world_size, s.node_name, s.master_port) for s in specs] == \
        [(0, 2, "node-0", 29_500), (1, 2, "node-1", 29_500)]
    assert specs[0].checkpoint_dir == str((tmp_path / "ckpt" / result.job_id).resolve())
    [attempt] = store.get_attempts(result.job_id)
    assert attempt.state is AttemptState.SUCCEEDED
    assert incident_kinds(store, result.job_id) == []
    assert [(r.rank, r.node) for r in store.ranks(result.job_id, 1)] == [(0, "node-0"), (1, "node-1")]
    assert shown and shown[-1].state == JobState.SUCCEEDED.value
    assert {"ray_start_s", "controller_start_s", "agents_start_s", "placement_s", "teardown_s"} <= set(
        result.timings_s)
    # torn down: no controller.json, no process list
    assert not list((tmp_path / ".fleet").glob("controller*.json"))
    assert not (tmp_path / ".fleet" / f"processes-{os.getpid()}.json").exists()


def test_a_rank_failure_restarts_and_then_succeeds(tmp_path: Path, store: Store) -> None:
    result, script, _ = run_job(tmp_path, store, [Outcome(3, die=1), Outcome(STEPS)], max_restarts=2)
    assert result.state is JobState.SUCCEEDED
    assert (result.attempts, result.final_step) == (2, STEPS)
    assert [specs[0].attempt for specs in script.attempts] == [1, 2]
    first, second = store.get_attempts(result.job_id)
    assert (first.state, second.state) == (AttemptState.FAILED, AttemptState.SUCCEEDED)
    [incident] = store.incidents(result.job_id)
    assert (incident.kind, incident.rank, incident.node, incident.attempt) == (IncidentKind.CRASH, 1, "node-1", 1)
    assert "rank 1 on node-1: process died" in incident.evidence
    assert [a.kind for a in store.actions(result.job_id)].count("restart") == 1


def test_max_restarts_exhausted_fails_the_job(tmp_path: Path, store: Store) -> None:
    result, script, _ = run_job(tmp_path, store, [Outcome(2, die=0), Outcome(2, die=1)], max_restarts=1)
    assert result.state is JobState.FAILED
    assert result.attempts == 2 and len(script.attempts) == 2
    assert [a.state for a in store.get_attempts(result.job_id)] == [AttemptState.FAILED, AttemptState.FAILED]
    assert incident_kinds(store, result.job_id) == [IncidentKind.CRASH, IncidentKind.CRASH]
    assert store.get_job(result.job_id).state is JobState.FAILED
    assert [a.kind for a in store.actions(result.job_id)].count("restart") == 1


def test_operators_see_the_running_job_inject_a_fault_and_stop_it(tmp_path: Path, store: Store) -> None:
    script = Script([Outcome(2, hold=True)])
    # the scripted ranks never read the stop command: they are killed after job.stop_timeout_s
    ctl = Controller(cluster_config(tmp_path, stop_timeout_s=0.5), store, runtime=in_memory_runtime(script))
    seen: dict[str, object] = {}

    def operator() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (ctl.job_id and ctl.control.job_status("").ranks):
            time.sleep(0.05)
        seen["status"] = ctl.control.job_status(ctl.job_id)
        seen["jobs"] = [j.job_id for j in ctl.control.list_jobs()]
        crash = events_pb2.FaultSpec(kind=FaultKind.CRASH.wire, at_step=50)
        seen["fault"] = ctl.control.inject_fault("", 1, "", crash)
        try:
            ctl.control.stop_job("j-other", "no")
        except NotFoundError as exc:
            seen["other"] = str(exc)
        seen["stop"] = ctl.control.stop_job(ctl.job_id, "enough")
        seen["again"] = ctl.control.stop_job(ctl.job_id, "twice")  # the first request's words stay

    thread = threading.Thread(target=operator, name="test-operator")
    thread.start()
    try:
        result = ctl.run()
    finally:
        thread.join(30)
    assert result.state is JobState.STOPPED
    assert result.reason == ("stopped by operator: enough; rank(s) [0, 1] did not stop within 0.5 s "
                             "(job.stop_timeout_s) and were killed after step 2; no valid checkpoint"), result.reason
    status = seen["status"]
    assert (status.job.job_id, status.current_attempt, list(status.nodes)) == (result.job_id, 1, ["node-0", "node-1"])
    assert [(r.rank, r.node, r.pid) for r in status.ranks] == [(0, "node-0", 10_000), (1, "node-1", 10_001)]
    assert seen["jobs"] == [result.job_id]
    fault = seen["fault"]
    assert (fault.attempt, list(fault.ranks), fault.node) == (1, [1], "node-1")
    assert seen["other"] == f"this controller runs job {result.job_id}, not j-other"
    assert (seen["stop"].state, seen["stop"].attempt, seen["stop"].stop_timeout_s) == ("STOPPING", 1, 0.5)
    assert seen["again"].state == "STOPPING"
    assert [a.cause for a in store.actions(result.job_id) if a.kind == "stop"] == ["stopped by operator: enough"]
    with pytest.raises(StateError, match=f"job {result.job_id} has already ended: STOPPED"):
        ctl.control.stop_job(result.job_id, "late")
    [attempt] = store.get_attempts(result.job_id)
    assert attempt.state is AttemptState.STOPPED
    assert [a.cause for a in store.actions(result.job_id) if a.kind == "inject_fault"] == ["crash on rank 1 at step 50"]


def test_a_fault_before_the_first_attempt_is_refused(tmp_path: Path, store: Store) -> None:
    ctl = Controller(cluster_config(tmp_path), store, runtime=in_memory_runtime(Script([])))
    with pytest.raises(StateError, match="has no running worker group yet"):
        ctl.control.inject_fault("", 0, "", events_pb2.FaultSpec(kind=FaultKind.CRASH.wire))


def test_the_controller_imports_no_ray() -> None:
    import subprocess
    import sys

    code = "import sys, fleet.controlplane.controller; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_the_ray_runtime_has_what_the_protocols_ask() -> None:
    from fleet.controlplane import orchestrator, runtime

    for impl, proto in ((orchestrator.RayRuntime, runtime.Cluster), (orchestrator.AgentSet, runtime.Agents),
                        (orchestrator.WorkerPool, runtime.Pool), (orchestrator.WorkerGroup, runtime.Workers)):
        wanted = {n for n in vars(proto) if not n.startswith("_")}
        missing = {n for n in wanted if not hasattr(impl, n)} - _instance_attributes(impl)
        assert not missing, f"{impl.__name__} lacks {sorted(missing)} of {proto.__name__}"


def _instance_attributes(cls: type) -> set[str]:
    """Names a class sets on ``self`` in ``__init__`` (dict attributes are not on the class)."""
    import inspect
    import re

    return set(re.findall(r"self\.(\w+)\s*(?::[^=]+)?=", inspect.getsource(cls.__init__)))
