"""The controller: runs one job through its lifecycle until it succeeds, fails or stops.

Order of life: create the job row -> start the gRPC server (token, controller.json) ->
start or attach Ray -> one agent per node -> attempts: place the worker group, run,
watch; on a failure attribute it (detectors), decide (policy), tear the attempt down and
place a new one that restores the newest valid checkpoint. Every state change is a row
in the store. Teardown (workers, agents, Ray, server) runs on every exit path,
KeyboardInterrupt included.

The controller is also the ``JobControl`` behind ControlService (inject fault, stop).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fleet.controlplane import auth, chaos
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer
from fleet.controlplane.config import ClusterConfig
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.detectors import Incident, attribute_failures, attribute_with_trace, decide_restart
from fleet.controlplane.errors import FleetError, NotFoundError, StateError, UnavailableError
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.lifecycle import AttemptState, JobState, NodeActor
from fleet.controlplane.placement import choose_nodes
from fleet.controlplane.policy import decide_quarantine
from fleet.controlplane.recovery import (
    PendingRecovery,
    caused,
    end_leftovers,
    finish_recovery,
    note_processes,
    processes_file,
)
from fleet.controlplane.replay import diagnose_attempt
from fleet.controlplane.store import NODE_QUARANTINED, Store
from fleet.controlplane.watchdog import Watchdog
from fleet.proto import control_pb2, events_pb2
from fleet.proto.kinds import FaultKind

log = logging.getLogger(__name__)

#: How long to keep collecting rank failures after the first one, so that the rank
#: whose process died is seen next to the ranks that only lost their peer.
FAILURE_SETTLE_S = 1.0
POLL_INTERVAL_S = 0.05
#: How long the ranks of a failed attempt get to leave their collectives by themselves
#: (they fail fast once a peer is gone) before they are killed.
TEARDOWN_GRACE_S = 3.0
#: A disconnected agent whose process is gone is declared lost after this long (a live
#: agent reconnects by itself well within it).
AGENT_RECONNECT_GRACE_S = 1.0
#: Incidents that end the attempt (the rest are recorded and acted on while it runs).
ATTEMPT_ENDING = frozenset({"crash", "error", "hang", "desync", "nan", "node_loss"})


@dataclass
class Progress:
    """What `fleet up` shows while the job runs."""

    job_id: str
    state: str
    attempt: int
    step: int
    total_steps: int
    restarts: int
    message: str = ""


@dataclass
class RunResult:
    job_id: str
    state: JobState
    attempts: int
    final_step: int
    reason: str
    timings_s: dict[str, float] = field(default_factory=dict)


class Controller:
    """Runs one job. Construct, then call ``run()`` once."""

    def __init__(
        self,
        config: ClusterConfig,
        store: Store,
        *,
        config_json: str = "{}",
        on_progress: Callable[[Progress], None] | None = None,
        resume_job: str = "",
    ) -> None:
        """``resume_job``: take over this job, whose controller died (``fleet up --resume``),
        instead of creating one."""
        self._resume_job = resume_job
        self.config = config
        self.store = store
        self._config_json = config_json
        self._on_progress = on_progress or (lambda p: None)
        self._state_dir = Path(config.state_dir).resolve()
        self._token = auth.new_token()
        self._registry = AgentRegistry()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_reason = ""
        self._attempt = 0
        self._placement: list[str] = []          # node name of each rank, current attempt
        self._restarts = 0
        self._fruitless = 0                      # failed attempts in a row without a step
        self._group = None                       # the running WorkerGroup, for teardown
        self._pool = None                        # WorkerPool: processes across attempts
        self._agents = None                      # AgentSet
        self._incidents: queue.Queue[Incident] = queue.Queue()  # from the watchdog thread
        self._watchdog: Watchdog | None = None
        self._scheduler: chaos.Scheduler | None = None
        self._ckpt_dir = ""
        self._current_step = 0
        self._lost_agents: set[str] = set()      # nodes whose agent is declared lost
        self._restart_due: dict[str, float] = {}  # lost agents to start again at (monotonic)
        self._node_back_at: dict[str, float] = {}  # node-down: node unusable until (monotonic)
        self._agent_back_at: dict[str, float] = {}  # agent-down with a duration: down until
        self._armed: list[chaos.FaultOrder] = []  # step-timed orders handed to workers
        self.job_id = ""
        self.address = ""
        self.timings_s: dict[str, float] = {}

    # -- JobControl (called from gRPC threads) ---------------------------------------

    def list_jobs(self) -> list[control_pb2.JobSummary]:
        return [_summary(j) for j in self.store.list_jobs()]

    def job_status(self, job_id: str) -> control_pb2.JobStatus:
        job = self.store.get_job(job_id or self.job_id)
        status = control_pb2.JobStatus(job=_summary(job))
        if job.id == self.job_id:
            with self._lock:
                status.current_attempt = self._attempt
                status.nodes.extend(sorted(set(self._placement)))
                placement = list(self._placement)
            attempts = self.store.get_attempts(job.id)
            if attempts:
                status.attempt_state = attempts[-1].state.value
            last = {s.rank: s.step for s in self.store.steps(job.id, attempt=self._attempt)} if self._attempt else {}
            pids = {r.rank: r.pid for r in self.store.ranks(job.id, self._attempt)} if self._attempt else {}
            for rank, node in enumerate(placement):
                status.ranks.add(rank=rank, node=node, pid=pids.get(rank, 0), last_step=last.get(rank, 0))
        return status

    def inject_fault(
        self, job_id: str, rank: int, node: str, fault: events_pb2.FaultSpec
    ) -> control_pb2.InjectFaultReply:
        """Check a fault order and hand it to the chaos scheduler (which fires it now or
        when due: ``_fire``)."""
        self._require_this_job(job_id)
        order = chaos.FaultOrder(kind=chaos.kind_of_wire(fault.kind), rank=rank, node=node, at_step=fault.at_step,
                                 after_s=fault.after_s, duration_s=fault.duration_s, delay_s=fault.delay_s)
        chaos.validate_order(order)
        with self._lock:
            attempt, placement = self._attempt, list(self._placement)
        if not placement or self._scheduler is None:
            raise StateError(f"job {self.job_id} has no running worker group yet")
        node, ranks = self._target(order, placement)
        self._scheduler.submit(order)
        command_id = uuid.uuid4().hex[:12]
        self.store.record_action(self.job_id, attempt, "inject_fault", order.describe())
        log.info("fault %s accepted (ranks %s on %s)", order.describe(), ranks, node)
        return control_pb2.InjectFaultReply(command_id=command_id, attempt=attempt, ranks=ranks, node=node)

    @staticmethod
    def _target(order: chaos.FaultOrder, placement: list[str]) -> tuple[str, list[int]]:
        """The node and ranks an order hits in the current placement."""
        if order.kind in chaos.JOB_KINDS:
            return "", []
        if order.rank >= 0:
            if order.rank >= len(placement):
                raise NotFoundError(f"rank {order.rank} does not exist (world size {len(placement)})")
            node = placement[order.rank]
            ranks = [order.rank] if order.kind in chaos.RANK_KINDS else \
                [r for r, n in enumerate(placement) if n == node]
            return node, ranks
        ranks = [r for r, n in enumerate(placement) if n == order.node]
        if not ranks:
            raise NotFoundError(f"node {order.node!r} runs no rank of this job")
        return order.node, ranks

    def _fire(self, order: chaos.FaultOrder) -> None:
        """Carry out a due fault order (chaos scheduler thread)."""
        with self._lock:
            attempt, placement, group = self._attempt, list(self._placement), self._group
        node, ranks = self._target(order, placement)
        spec = events_pb2.FaultSpec(kind=FaultKind(order.kind).wire, at_step=order.at_step, duration_s=order.duration_s,
                                    delay_s=order.delay_s)
        log.warning("chaos: firing %s", order.describe())
        if order.kind in chaos.WORKER_TIMED and order.at_step > 0:
            with self._lock:  # armed in the workers: a restart before the step must re-arm it
                self._armed.append(order)
        if order.kind in chaos.RANK_KINDS:
            rank = order.rank if order.rank >= 0 else -1
            self._registry.send(node, events_pb2.Command(
                command_id=uuid.uuid4().hex[:12], job_id=self.job_id, attempt=attempt, rank=rank, fault=spec))
        elif order.kind in chaos.AGENT_KINDS:
            if order.kind == "agent-down" and order.duration_s > 0:
                self._agent_back_at[node] = time.monotonic() + order.duration_s
            self._registry.send(node, events_pb2.Command(
                command_id=uuid.uuid4().hex[:12], job_id=self.job_id, attempt=attempt, rank=-1, fault=spec))
        elif order.kind == "node-down":
            # the node goes away: its agent and every worker process on it die at once
            if order.duration_s > 0:
                self._node_back_at[node] = time.monotonic() + order.duration_s
            if self._agents is not None:
                self._agents.kill(node)
            if group is not None:
                group.kill_ranks([r for r in ranks if r in group.running()])
            if self._pool is not None:
                self._pool.discard_node(node)
        elif order.kind == "ckpt-corrupt" and order.at_step > 0:
            # rank 0 corrupts at exactly that step (this thread only sees steps late)
            self._registry.send(placement[0], events_pb2.Command(
                command_id=uuid.uuid4().hex[:12], job_id=self.job_id, attempt=attempt, rank=0, fault=spec))
        elif order.kind == "ckpt-corrupt":
            damaged = chaos.corrupt_checkpoint(self._ckpt_dir)
            log.warning("chaos: corrupted %s", damaged)
        elif order.kind == "controller-crash":
            print(f"fleet: injected controller crash (job {self.job_id}); sending SIGKILL to pid {os.getpid()}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def stop_job(self, job_id: str, reason: str) -> str:
        self._require_this_job(job_id)
        self._stop_reason = reason or "stopped by operator"
        self._stop.set()
        return "STOPPING"

    def _require_this_job(self, job_id: str) -> None:
        if job_id and job_id != self.job_id:
            raise NotFoundError(f"this controller runs job {self.job_id}, not {job_id}")

    # -- the job ----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Run the job to an end state; always tears down what it started."""
        from fleet.controlplane.orchestrator import AgentSet, RayRuntime  # Ray only loads here

        cfg = self.config
        t_start = time.monotonic()
        recovery = None
        if self._resume_job:
            recovery = self._take_over(self._resume_job)
        else:
            self.job_id = self.store.create_job(cfg.name, cfg.job.steps, self._config_json)
        runtime = RayRuntime(cfg.ray)
        agents = self._agents = AgentSet()
        self._ckpt_dir = str((Path(cfg.job.checkpoint_dir) / self.job_id).resolve())
        self._watchdog = Watchdog(self.store, self.job_id, cfg.detect, self._incidents.put)
        self._scheduler = chaos.Scheduler(self._fire, lambda: self._current_step)
        server: ControllerServer | None = None
        result: RunResult | None = None
        try:
            # Ray first: it forks its daemons, which must not happen under live gRPC threads.
            self._progress("starting Ray")
            t = time.monotonic()
            runtime.start()
            nodes = runtime.nodes()
            note_processes(self._state_dir)
            self.timings_s["ray_start_s"] = time.monotonic() - t

            t = time.monotonic()
            server = ControllerServer(
                AgentServicer(self.store, self._registry, self._token, controller_id=f"ctl-{os.getpid()}",
                              observer=self._watchdog.observe),
                ControlServicer(self, self._token),
                host=cfg.controller.host,
                port=cfg.controller.port,
                max_message_bytes=cfg.controller.max_message_bytes,
                tls=cfg.controller.tls.server_files(),
            ).start()
            self.address = server.address
            if cfg.controller.metrics_port:
                port = server.agent_servicer.metrics.serve(cfg.controller.host, cfg.controller.metrics_port)
                self._progress(f"metrics on http://{cfg.controller.host}:{port}/metrics")
            tls = cfg.controller.tls
            auth.write_controller_info(self._state_dir, auth.ControllerInfo(
                self.address, self._token, self.job_id, os.getpid(),
                ca_cert=str(tls.ca_cert or ""), client_cert=str(tls.client_cert or ""),
                client_key=str(tls.client_key or ""),
            ))
            self.timings_s["controller_start_s"] = time.monotonic() - t
            if len(nodes) < cfg.job.nodes:
                raise UnavailableError(
                    f"job.nodes is {cfg.job.nodes} but the Ray cluster has {len(nodes)} alive node(s)"
                )
            # Every alive node gets an agent; each attempt is placed on healthy ones only.
            for n in nodes:
                self.store.upsert_node(n.name, n.ray_node_id, n.address, f'{{"CPU": {n.cpus}}}')

            self._progress("starting agents")
            t = time.monotonic()
            agents.start(nodes, self.address, self._token, cfg.agent, cfg.controller, cfg.agent_spill_dir())
            missing = self._registry.wait_for({n.name for n in nodes}, cfg.controller.agent_start_timeout_s)
            if missing:
                raise UnavailableError(f"no agent connected from node(s) {sorted(missing)}")
            self.timings_s["agents_start_s"] = time.monotonic() - t

            self._watchdog.start()
            self._scheduler.start()
            result = self._attempts(nodes, agents, recovery)
        except KeyboardInterrupt:
            self._finish(JobState.STOPPED, "interrupted (Ctrl-C)")
            raise
        except FleetError as exc:
            self._finish(JobState.FAILED, str(exc))
            raise
        except Exception as exc:
            self._finish(JobState.FAILED, f"controller error: {exc}")
            raise
        finally:
            self._progress("tearing down")
            t = time.monotonic()
            self._teardown(agents, runtime, server)
            self.timings_s["teardown_s"] = time.monotonic() - t
            self.timings_s["total_s"] = time.monotonic() - t_start
        return result

    def _attempts(self, nodes: list, agents, recovery: PendingRecovery | None) -> RunResult:  # noqa: ANN001
        from fleet.controlplane.orchestrator import WorkerGroup, WorkerPool

        cfg = self.config
        pool = self._pool = WorkerPool(cfg.job.spare_workers_per_node)
        first = recovery is None  # a resumed job has had its first attempt
        while True:
            t_place = time.monotonic()
            self.store.set_job_state(self.job_id, JobState.PLACING, "placing worker group")
            chosen = self._healthy_nodes(nodes)
            if chosen is None:
                return self._finish(JobState.STOPPED, self._stop_reason)
            self._restore_agents(chosen, agents)
            placement = [n for n in chosen for _ in range(cfg.job.ranks_per_node)]
            attempt = self.store.create_attempt(self.job_id)
            actors, reused = pool.acquire(placement)
            group = self._group = WorkerGroup(placement, actors)
            try:
                pids = group.pids(timeout_s=120)
                port = group.rendezvous_port(self._master_addr(placement), timeout_s=30)
            except Exception as exc:
                group.kill()
                raise UnavailableError(f"worker group could not be placed: {exc}") from None
            with self._lock:
                self._attempt = attempt
                self._placement = [n.name for n in placement]
            for rank, (node, pid) in enumerate(zip(placement, pids, strict=True)):
                self.store.record_rank(self.job_id, attempt, rank, node.name, pid)
            specs = self._specs(attempt, placement, port, self._ckpt_dir, agents.local_addresses)
            assert self._watchdog is not None
            self._watchdog.watch(attempt, [n.name for n in placement])
            group.run(specs)
            t_run = time.time()
            pool.fill_spares(chosen)  # replacements warm up while this attempt starts
            self.store.set_attempt_state(self.job_id, attempt, AttemptState.RUNNING, "worker group running")
            self.store.set_job_state(self.job_id, JobState.RUNNING, f"attempt {attempt} running")
            if first:
                self.timings_s["placement_s"] = time.monotonic() - t_place
                first = False
                for order in cfg.chaos.orders():
                    self._scheduler.submit(order)
            if recovery is not None:
                recovery.attempt, recovery.t_run, recovery.reused = attempt, t_run, reused
                recovery.place_s += time.monotonic() - t_place
                self._rearm(recovery.last_step)

            outcome = self._watch(group, attempt, recovery)
            recovery = None
            if outcome is None:  # every rank finished
                agents.flush(timeout_s=15)
                final = self.store.last_step(self.job_id, attempt)
                self.store.set_attempt_final_step(self.job_id, attempt, final)
                self.store.set_attempt_state(self.job_id, attempt, AttemptState.SUCCEEDED, "all ranks finished")
                return self._finish(JobState.SUCCEEDED, f"completed {final} steps")
            if outcome == "stop":
                group.kill()
                agents.flush(timeout_s=5)
                self.store.set_attempt_state(self.job_id, attempt, AttemptState.STOPPED, self._stop_reason)
                return self._finish(JobState.STOPPED, self._stop_reason)

            recovery, decision = self._end_attempt(group, attempt, outcome, agents)
            if not decision.restart:
                return self._finish(JobState.FAILED, decision.reason)
            self._restarts += 1
            self.store.record_action(self.job_id, attempt, "restart", decision.reason)
            self.store.set_job_state(self.job_id, JobState.RESTARTING, decision.reason)
            self._progress(decision.reason)
            # after an attempt that made progress: at once; after attempts that failed before
            # their first step: restart_backoff_s, doubling each time
            backoff = 0.0 if self._fruitless == 0 else \
                min(60.0, cfg.job.restart_backoff_s * 2 ** (self._fruitless - 1))
            t = time.monotonic()
            if backoff and self._stop.wait(backoff):
                return self._finish(JobState.STOPPED, self._stop_reason)
            recovery.place_s = time.monotonic() - t

    def _rearm(self, completed: int) -> None:
        """Hand the new attempt's workers the step-timed faults the failed attempt armed
        but never reached (its workers took them along); drop the ones it fired: a fault
        fires at the top of its step, so the failed attempt, which completed step
        ``completed``, fired everything up to ``completed + 1``."""
        with self._lock:
            due, self._armed = [o for o in self._armed if o.at_step > completed + 1], []
        for order in due:
            try:
                self._fire(order)
            except FleetError as exc:
                log.warning("chaos: could not re-arm %s: %s", order.describe(), exc)

    def _end_attempt(self, group, attempt: int, incident: Incident, agents):  # noqa: ANN001
        """Tear down a failed attempt and record why; returns (recovery so far, decision).

        Only what must die is killed: the culprit of a hang (a rank stuck in gloo never
        returns) and whatever is still running after the grace. Ranks whose ``run`` ended
        go back to the pool with their in-memory snapshots."""
        t_detect, t0 = time.time(), time.monotonic()
        assert self._watchdog is not None and self._pool is not None
        self._watchdog.pause()
        while not self._incidents.empty():  # fired before the pause: about this attempt, now moot
            self._incidents.get_nowait()
        if incident.rank >= 0 and incident.rank in group.running() and incident.kind in ("hang", "desync", "straggler"):
            group.kill_ranks([incident.rank])
        if incident.kind == "node_loss" and incident.node:
            group.kill_ranks([r for r in group.running() if group.placement[r].name == incident.node])
        group.wind_down(TEARDOWN_GRACE_S)
        if incident.kind == "error":  # let the traces name the culprit: they must be in the store
            agents.flush(timeout_s=5)
            incident = self._attribute_by_trace(incident, attempt)
        incident = self._node_lost(incident, group)
        teardown_s = time.monotonic() - t0
        incident_id = self.store.record_incident(
            self.job_id, attempt, incident.kind, incident.detector, incident.evidence,
            rank=incident.rank, node=incident.node, detected_at=t_detect,
        )
        self._maybe_quarantine(incident.node, attempt)
        self._pool.release(group.survivors())
        with self._lock:  # the fault that caused this incident fired: never re-arm it
            self._armed = [o for o in self._armed if not caused(o, incident)]
            undecided = bool(self._armed)
        if undecided and incident.kind != "error":
            # which armed faults the attempt reached is read from its steps: let the
            # survivors' last reports reach the store first
            agents.flush(timeout_s=2)
        span = self.store.step_span(self.job_id, attempt)
        last_step = span[1] if span else 0
        failed_at = span[2] / 1e9 if span else t_detect
        self.store.set_attempt_final_step(self.job_id, attempt, last_step)
        self.store.set_attempt_state(self.job_id, attempt, AttemptState.FAILED, incident.evidence)
        # failures in a row without a single step back off; one after progress does not
        self._fruitless = 0 if span is not None else self._fruitless + 1
        decision = decide_restart(self._restarts, self.config.job.max_restarts, incident)
        recovery = PendingRecovery(incident_id, attempt, failed_at, last_step,
                             detect_s=max(0.0, t_detect - failed_at), teardown_s=teardown_s)
        return recovery, decision

    def _node_lost(self, incident: Incident, group) -> Incident:  # noqa: ANN001
        """A crash that took every rank of a node together with its agent is a node loss."""
        if incident.kind != "crash" or not incident.node:
            return incident
        on_node = [r for r, n in enumerate(group.placement) if n.name == incident.node]
        agent_gone = incident.node not in self._registry.connected_nodes()
        if agent_gone and on_node and all(r in group.died or r in group.killed for r in on_node):
            return Incident("node_loss", "node_loss", incident.rank, incident.node,
                            f"{incident.node} lost: its agent and all its ranks {on_node} are gone; "
                            + incident.evidence)
        return incident

    def _restore_agents(self, chosen: list, agents) -> None:  # noqa: ANN001
        """Start a new agent on every chosen node whose agent is gone."""
        connected = self._registry.connected_nodes()
        for node in chosen:
            if node.name in connected:
                continue
            if node.name not in self._lost_agents and self._attempt:  # lost between attempts
                self.store.record_incident(self.job_id, self._attempt, "agent_loss", "heartbeat",
                                           f"agent on {node.name} is gone (found before placing the next "
                                           "attempt)", rank=-1, node=node.name)
            self._progress(f"restarting the agent on {node.name}")
            agents.restart(node.name)
            missing = self._registry.wait_for({node.name}, self.config.controller.agent_start_timeout_s)
            if missing:
                raise UnavailableError(f"the agent on {node.name} did not reconnect after a restart")
            self._lost_agents.discard(node.name)
            self._restart_due.pop(node.name, None)
            self.store.record_action(self.job_id, self._attempt, "restart_agent", f"agent on {node.name} restarted")

    # -- controller crash: take over a job whose controller died ---------------------------

    def _take_over(self, job_id: str) -> PendingRecovery:
        """Adopt ``job_id`` after its controller died: end what the dead controller left
        running, fail its attempt with a controller-crash incident and count a restart;
        the next attempt restores the newest valid checkpoint on disk."""
        job = self.store.get_job(job_id)
        if job.state.terminal:
            raise StateError(f"job {job_id} is {job.state.value}; there is nothing to resume")
        try:
            info = auth.read_controller_info(self._state_dir)
        except FleetError:
            info = None
        if info is not None and info.job_id == job_id and info.pid != os.getpid() and psutil.pid_exists(info.pid):
            raise StateError(f"job {job_id} is still run by controller pid {info.pid}; stop it first "
                             "(fleet stop) or let it finish")
        dead_pid = info.pid if info is not None and info.job_id == job_id else 0
        ended = end_leftovers(self._state_dir, dead_pid) if dead_pid else 0
        self.job_id = job_id
        self._restarts = sum(1 for a in self.store.actions(job_id) if a.kind == "restart")
        attempts = self.store.get_attempts(job_id)
        last = attempts[-1].number if attempts else 0
        evidence = (f"the controller of job {job_id} (pid {dead_pid or '?'}) died; "
                    f"taken over by pid {os.getpid()}, {ended} leftover process(es) ended")
        incident_id = self.store.record_incident(job_id, last, "controller_crash", "resume", evidence,
                                                 rank=-1, node="")
        span = self.store.step_span(job_id, last) if last else None
        now = time.time()
        if last and not attempts[-1].state.terminal:
            self.store.set_attempt_final_step(job_id, last, span[1] if span else 0)
            self.store.set_attempt_state(job_id, last, AttemptState.FAILED, evidence)
        if job.state in (JobState.RUNNING, JobState.PLACING):
            self.store.set_job_state(job_id, JobState.RESTARTING, evidence)
        self._restarts += 1
        self.store.record_action(job_id, last, "restart", f"resumed: {evidence}")
        log.warning("%s", evidence)
        failed_at = span[2] / 1e9 if span else now
        return PendingRecovery(incident_id, last, failed_at, span[1] if span else 0,
                         detect_s=max(0.0, now - failed_at), teardown_s=0.0)

    def _maybe_quarantine(self, node: str | None, attempt: int) -> bool:
        """Quarantine ``node`` when the policy says its incidents point at the hardware."""
        if not node:
            return False
        policy, now = self.config.policy, time.time()
        history = self.store.incidents_on_node(node, now - policy.quarantine_window_s)
        decision = decide_quarantine(now, node, history, policy)
        if decision.quarantine:
            self.store.quarantine_node(node, decision.reason, actor=NodeActor.POLICY, job_id=self.job_id)
            self.store.record_action(self.job_id, attempt, "quarantine", decision.reason)
            self._progress(f"quarantined {node}: {decision.reason}")
            if self._pool is not None:
                self._pool.discard_node(node)
        return decision.quarantine

    def _healthy_nodes(self, nodes: list) -> list | None:  # noqa: ANN001 (orchestrator NodeInfo)
        """The nodes of the next attempt: never a quarantined one. Waits (bounded by
        ``job.capacity_wait_s``, showing why) while too few are healthy; None if stopped."""
        wait_s = self.config.job.capacity_wait_s
        deadline = time.monotonic() + wait_s
        shown = ""
        while True:
            quarantined = {n.name: n.quarantine_reason for n in self.store.list_nodes()
                           if n.state == NODE_QUARANTINED}
            now = time.monotonic()
            down = {n: f"node-down fault, back in {t - now:.0f} s" for n, t in self._node_back_at.items() if t > now}
            job = self.config.job
            decision = choose_nodes([n.name for n in nodes], quarantined, job.nodes, down,
                                    minimum=job.min_nodes if 0 < job.min_nodes < job.nodes else None)
            if decision.nodes:
                by_name = {n.name: n for n in nodes}
                if decision.reason:  # shrunk: fewer data-parallel ranks this attempt
                    self.store.record_action(self.job_id, self._attempt, "shrink", decision.reason)
                    self._progress(decision.reason)
                return [by_name[name] for name in decision.nodes]
            if time.monotonic() >= deadline:
                raise UnavailableError(f"{decision.reason}; waited {wait_s:.0f} s (job.capacity_wait_s)")
            if decision.reason != shown:
                shown = decision.reason
                self.store.set_job_reason(self.job_id, f"waiting: {decision.reason}")
                self._progress(f"waiting for healthy nodes: {decision.reason} (fleet release NODE)")
            if self._stop.wait(1.0):
                return None

    def _attribute_by_trace(self, incident: Incident, attempt: int) -> Incident:
        """Let the attempt's collective traces name the culprit when no process died."""
        if incident.kind != "error":
            return incident
        try:
            _, diagnosis = diagnose_attempt(self.store, self.job_id, attempt)
        except Exception:  # noqa: BLE001 - attribution must not take the controller down
            log.exception("desync diagnosis of attempt %d failed", attempt)
            return incident
        with self._lock:
            nodes = list(self._placement)
        refined = attribute_with_trace(incident, diagnosis.verdict, diagnosis.culprit_ranks,
                                       diagnosis.summary, nodes)
        if refined is not incident:
            log.warning("attempt %d: the flight recorder blames rank %d: %s", attempt, refined.rank,
                        diagnosis.summary)
        return refined

    def _watch(self, group, attempt: int, recovery: PendingRecovery | None) -> Incident | str | None:  # noqa: ANN001
        """Block until the attempt ends: None = success, "stop", or the Incident that
        ends it. Meanwhile: act on incidents that do not end it (agent loss, straggler,
        loss spike), finish timing a recovery once its first step lands, show progress."""
        next_tick = next_note = 0.0
        while True:
            failures = group.poll(POLL_INTERVAL_S)
            if failures:
                settle = time.monotonic() + FAILURE_SETTLE_S
                while not group.finished and time.monotonic() < settle:
                    failures += group.poll(0.05)
                incident = attribute_failures(failures, [n.name for n in group.placement])
                log.warning("attempt %d failed: %s", attempt, incident.evidence)
                return incident
            if group.finished:
                return None
            if self._stop.is_set():
                return "stop"
            try:
                incident = self._incidents.get_nowait()
            except queue.Empty:
                incident = None
            if incident is not None:
                if incident.kind in ATTEMPT_ENDING:
                    log.warning("attempt %d: %s", attempt, incident.evidence)
                    return incident
                ended = self._side_incident(incident, attempt, group)
                if ended is not None:
                    return ended
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + 0.5
                self._check_agents(attempt)
                if now >= next_note:  # the process tree changes only when processes start
                    next_note = now + 5.0
                    note_processes(self._state_dir)
                span = self.store.step_span(self.job_id, attempt)
                self._current_step = span[1] if span else self._current_step
                if recovery is not None and span is not None:
                    self._record_recovery(recovery, span)
                    recovery = None
                self._progress("training")

    def _side_incident(self, incident: Incident, attempt: int, group) -> Incident | None:  # noqa: ANN001
        """Record an incident that does not end the attempt by itself; returns an
        incident that ends it after all (its node was quarantined), else None."""
        self.store.record_incident(self.job_id, attempt, incident.kind, incident.detector, incident.evidence,
                                   rank=incident.rank, node=incident.node)
        log.warning("attempt %d: %s", attempt, incident.evidence)
        self._progress(f"{incident.kind} on {incident.node or '?'}: {incident.evidence}")
        if self._maybe_quarantine(incident.node, attempt) and incident.node in {n.name for n in group.placement}:
            return Incident(incident.kind, incident.detector, incident.rank, incident.node,
                            f"{incident.node} quarantined; moving off it. {incident.evidence}")
        return None

    def _check_agents(self, attempt: int) -> None:
        """Agent loss: a silent connected agent (heartbeats missed) or a disconnected one
        whose process is gone. A gone agent is started again (at once, or when an
        agent-down or node-down fault's duration is over); its ranks keep training and
        keep their events meanwhile. A silent live one is waited for (a partition)."""
        if self._agents is None:
            return
        timeout = self.config.controller.heartbeat_timeout_s
        now = time.monotonic()
        for node in list(self._agents.actors):
            session = self._registry.session(node)
            silent = now - session.last_heard if session is not None else 0.0
            connected = session is not None and session.connected
            if node in self._lost_agents:
                if connected and silent < timeout:
                    self._lost_agents.discard(node)  # heard again (a partition ended)
                    log.info("agent on %s is back", node)
                elif node in self._restart_due and now >= self._restart_due[node]:
                    self._restart_agent(node, attempt)
                continue
            if connected and silent < timeout:
                continue
            if not connected and silent < AGENT_RECONNECT_GRACE_S:
                continue
            alive = self._agents.alive(node)
            if connected or alive:
                if silent < timeout:
                    continue
                what = f"agent on {node} silent for {silent:.1f} s (heartbeat timeout {timeout:g} s); " \
                       "its process is alive: partitioned from the controller"
            else:
                what = f"agent on {node} is gone (stream closed {silent:.1f} s ago, process dead)"
            self._lost_agents.add(node)
            self.store.record_incident(self.job_id, attempt, "agent_loss", "heartbeat", what, rank=-1, node=node)
            log.warning("%s", what)
            if not alive:
                self._restart_due[node] = max(now, self._node_back_at.get(node, 0.0),
                                              self._agent_back_at.pop(node, 0.0))
                if now >= self._restart_due[node]:
                    self._restart_agent(node, attempt)

    def _restart_agent(self, node: str, attempt: int) -> None:
        assert self._agents is not None
        try:
            self._agents.restart(node)
        except FleetError as exc:
            log.error("%s", exc)
            return
        self._restart_due.pop(node, None)
        self._lost_agents.discard(node)
        self.store.record_action(self.job_id, attempt, "restart_agent", f"agent on {node} restarted")
        log.warning("agent on %s restarted", node)

    def _record_recovery(self, r: PendingRecovery, span: tuple[int, int, int]) -> None:
        """The new attempt made its first step: store the recovery's phases."""
        rec = finish_recovery(self.job_id, r, span, self.store.worker_status(self.job_id, r.attempt))
        self.store.record_recovery(rec)
        log.info("recovered in %.2f s (detect %.2f, teardown %.2f, place %.2f, pg %.2f, restore %.2f, "
                 "first step %.2f); restored step %d from %s, %d step(s) lost, %d process(es) reused",
                 rec.total_s, rec.detect_s, rec.teardown_s, rec.place_s, rec.pg_init_s, rec.restore_s,
                 rec.first_step_s, rec.restored_step, rec.restored_from, rec.steps_lost, rec.reused_workers)

    def _specs(self, attempt, placement, port, ckpt_dir, local_addresses):  # noqa: ANN001
        from fleet.controlplane import launch

        return launch.worker_specs(
            self.config, job_id=self.job_id, attempt=attempt, placement=placement, port=port,
            checkpoint_dir=ckpt_dir, local_addresses=local_addresses,
            master_addr=self._master_addr(placement))

    def _master_addr(self, placement) -> str:  # noqa: ANN001
        """Rendezvous host: rank 0's node (always loopback for the local cluster)."""
        return "127.0.0.1" if self.config.ray.address is None else placement[0].address

    def _finish(self, state: JobState, reason: str) -> RunResult:
        job = self.store.get_job(self.job_id) if self.job_id else None
        if job is not None and not job.state.terminal:
            attempts = self.store.get_attempts(self.job_id)
            if attempts and not attempts[-1].state.terminal:
                end = AttemptState.STOPPED if state is JobState.STOPPED else AttemptState.FAILED
                self.store.set_attempt_state(self.job_id, attempts[-1].number, end, reason)
            self.store.set_job_state(self.job_id, state, reason)
            job = self.store.get_job(self.job_id)
        self._progress(reason)
        return RunResult(
            job_id=self.job_id,
            state=job.state if job else state,
            attempts=job.attempts if job else 0,
            final_step=job.steps_completed if job else 0,
            reason=reason,
            timings_s=self.timings_s,
        )

    def _teardown(self, agents, runtime, server: ControllerServer | None) -> None:  # noqa: ANN001
        group, self._group = self._group, None
        pool, self._pool = self._pool, None
        for what, fn in (
            ("chaos scheduler", self._scheduler.close if self._scheduler is not None else (lambda: None)),
            ("watchdog", self._watchdog.close if self._watchdog is not None else (lambda: None)),
            ("workers", group.kill if group is not None else (lambda: None)),
            ("spare workers", pool.close if pool is not None else (lambda: None)),
            ("agents", agents.close),
            ("ray", runtime.shutdown),
            ("grpc server", server.close if server is not None else (lambda: None)),
            ("process list", lambda: processes_file(self._state_dir, os.getpid()).unlink(missing_ok=True)),
        ):
            try:
                fn()
            except Exception as exc:  # teardown goes on: every later part must still stop
                log.warning("teardown of %s failed: %s", what, exc)
        auth.remove_controller_info(self._state_dir, os.getpid())

    def _progress(self, message: str) -> None:
        if not self.job_id:
            return
        try:
            job = self.store.get_job(self.job_id)
            step = self.store.last_step(self.job_id, self._attempt) if self._attempt else 0
        except FleetError:
            return
        self._on_progress(
            Progress(self.job_id, job.state.value, self._attempt, step, job.total_steps, self._restarts, message)
        )


def _summary(job) -> control_pb2.JobSummary:  # noqa: ANN001 (store JobRecord)
    return control_pb2.JobSummary(
        job_id=job.id,
        name=job.name,
        state=job.state.value,
        attempts=job.attempts,
        steps_completed=job.steps_completed,
        total_steps=job.total_steps,
        created_at=job.created_at,
    )
