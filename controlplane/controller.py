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
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from controlplane import auth
from controlplane.agent_server import AgentRegistry, AgentServicer
from controlplane.config import ClusterConfig
from controlplane.control_server import ControlServicer
from controlplane.detectors import Incident, attribute_failures, attribute_with_trace, decide_restart
from controlplane.errors import FleetError, NotFoundError, StateError, UnavailableError
from controlplane.grpc_server import ControllerServer
from controlplane.lifecycle import AttemptState, JobState
from controlplane.placement import choose_nodes
from controlplane.policy import decide_quarantine
from controlplane.replay import diagnose_attempt
from controlplane.store import NODE_QUARANTINED, Store
from fleet_proto import control_pb2, events_pb2

log = logging.getLogger(__name__)

#: How long to keep collecting rank failures after the first one, so that the rank
#: whose process died is seen next to the ranks that only lost their peer.
FAILURE_SETTLE_S = 1.0
POLL_INTERVAL_S = 0.2


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


def worker_env(config: ClusterConfig) -> dict[str, str]:
    """Environment of every worker process: the one place it is derived from config."""
    del config  # nothing configurable yet; flight-recorder and NCCL knobs will land here
    return {
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class Controller:
    """Runs one job. Construct, then call ``run()`` once."""

    def __init__(
        self,
        config: ClusterConfig,
        store: Store,
        *,
        config_json: str = "{}",
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
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
        self._group = None                       # the running WorkerGroup, for teardown
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
        self._require_this_job(job_id)
        with self._lock:
            attempt, placement = self._attempt, list(self._placement)
        if not placement:
            raise StateError(f"job {self.job_id} has no running worker group yet")
        if rank >= 0:
            if rank >= len(placement):
                raise NotFoundError(f"rank {rank} does not exist (world size {len(placement)})")
            node = placement[rank]
            ranks = [rank]
        else:
            ranks = [r for r, n in enumerate(placement) if n == node]
            if not ranks:
                raise NotFoundError(f"node {node!r} runs no rank of job {self.job_id}")
        command_id = uuid.uuid4().hex[:12]
        cmd = events_pb2.Command(
            command_id=command_id, job_id=self.job_id, attempt=attempt, rank=rank, fault=fault
        )
        self._registry.send(node, cmd)
        self.store.record_action(
            self.job_id, attempt, "inject_fault",
            f"{fault.kind} on rank(s) {ranks} of {node}" + (f" at step {fault.at_step}" if fault.at_step else ""),
        )
        log.info("fault %s sent to %s ranks %s (command %s)", fault.kind, node, ranks, command_id)
        return control_pb2.InjectFaultReply(command_id=command_id, attempt=attempt, ranks=ranks, node=node)

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
        from controlplane.orchestrator import AgentSet, RayRuntime  # Ray only loads here

        cfg = self.config
        t_start = time.monotonic()
        self.job_id = self.store.create_job(cfg.name, cfg.job.steps, self._config_json)
        runtime = RayRuntime(cfg.ray)
        agents = AgentSet()
        server: ControllerServer | None = None
        result: RunResult | None = None
        try:
            # Ray first: it forks its daemons, which must not happen under live gRPC threads.
            self._progress("starting Ray")
            t = time.monotonic()
            runtime.start()
            nodes = runtime.nodes()
            self.timings_s["ray_start_s"] = time.monotonic() - t

            t = time.monotonic()
            server = ControllerServer(
                AgentServicer(self.store, self._registry, self._token, controller_id=f"ctl-{os.getpid()}"),
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

            result = self._attempts(nodes, agents)
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

    def _attempts(self, nodes: list, agents) -> RunResult:  # noqa: ANN001 (orchestrator types)
        from controlplane.orchestrator import WorkerGroup

        cfg = self.config
        ckpt_dir = str((Path(cfg.job.checkpoint_dir) / self.job_id).resolve())
        first = True
        while True:
            self.store.set_job_state(self.job_id, JobState.PLACING, "placing worker group")
            chosen = self._healthy_nodes(nodes)
            if chosen is None:
                return self._finish(JobState.STOPPED, self._stop_reason)
            placement = [n for n in chosen for _ in range(cfg.job.ranks_per_node)]
            attempt = self.store.create_attempt(self.job_id)
            t = time.monotonic()
            group = self._group = WorkerGroup(placement)
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
            specs = self._specs(attempt, placement, port, ckpt_dir, agents.local_addresses)
            group.run(specs)
            self.store.set_attempt_state(self.job_id, attempt, AttemptState.RUNNING, "worker group running")
            self.store.set_job_state(self.job_id, JobState.RUNNING, f"attempt {attempt} running")
            if first:
                self.timings_s["placement_s"] = time.monotonic() - t
                first = False

            outcome = self._watch(group, attempt)
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

            incident: Incident = outcome
            group.kill()
            agents.flush(timeout_s=5)
            incident = self._attribute_by_trace(incident, attempt)
            self.store.record_incident(
                self.job_id, attempt, incident.kind, incident.detector, incident.evidence,
                rank=incident.rank, node=incident.node,
            )
            self._maybe_quarantine(incident.node, attempt)
            self.store.set_attempt_final_step(self.job_id, attempt, self.store.last_step(self.job_id, attempt))
            self.store.set_attempt_state(self.job_id, attempt, AttemptState.FAILED, incident.evidence)
            decision = decide_restart(self._restarts, cfg.job.max_restarts, incident)
            if not decision.restart:
                return self._finish(JobState.FAILED, decision.reason)
            self._restarts += 1
            self.store.record_action(self.job_id, attempt, "restart", decision.reason)
            self.store.set_job_state(self.job_id, JobState.RESTARTING, decision.reason)
            self._progress(decision.reason)
            if self._stop.wait(cfg.job.restart_backoff_s):
                return self._finish(JobState.STOPPED, self._stop_reason)

    def _maybe_quarantine(self, node: str | None, attempt: int) -> None:
        """Quarantine ``node`` when the policy says its incidents point at the hardware."""
        if not node:
            return
        policy, now = self.config.policy, time.time()
        history = self.store.incidents_on_node(node, now - policy.quarantine_window_s)
        decision = decide_quarantine(now, node, history, policy)
        if decision.quarantine:
            self.store.quarantine_node(node, decision.reason)
            self.store.record_action(self.job_id, attempt, "quarantine", decision.reason)
            self._progress(f"quarantined {node}: {decision.reason}")

    def _healthy_nodes(self, nodes: list) -> list | None:  # noqa: ANN001 (orchestrator NodeInfo)
        """The nodes of the next attempt: never a quarantined one. Waits (bounded by
        ``job.capacity_wait_s``, showing why) while too few are healthy; None if stopped."""
        wait_s = self.config.job.capacity_wait_s
        deadline = time.monotonic() + wait_s
        shown = ""
        while True:
            quarantined = {n.name: n.quarantine_reason for n in self.store.list_nodes()
                           if n.state == NODE_QUARANTINED}
            decision = choose_nodes([n.name for n in nodes], quarantined, self.config.job.nodes)
            if decision.nodes:
                by_name = {n.name: n for n in nodes}
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

    def _watch(self, group, attempt: int) -> Incident | str | None:  # noqa: ANN001
        """Block until the attempt ends: None = success, "stop", or the Incident."""
        next_progress = 0.0
        while True:
            failures = group.poll(POLL_INTERVAL_S)
            if failures:
                settle = time.monotonic() + FAILURE_SETTLE_S
                while not group.finished and time.monotonic() < settle:
                    failures += group.poll(0.1)
                incident = attribute_failures(failures)
                log.warning("attempt %d failed: %s", attempt, incident.evidence)
                return incident
            if group.finished:
                return None
            if self._stop.is_set():
                return "stop"
            now = time.monotonic()
            if now >= next_progress:
                next_progress = now + 0.5
                self._progress("training")

    def _specs(self, attempt, placement, port, ckpt_dir, local_addresses):  # noqa: ANN001
        from workers.spec import WorkerSpec

        cfg = self.config
        env = worker_env(cfg)
        return [
            WorkerSpec(
                job_id=self.job_id,
                attempt=attempt,
                rank=rank,
                world_size=len(placement),
                node_name=node.name,
                master_addr=self._master_addr(placement),
                master_port=port,
                agent_address=local_addresses[node.name],
                checkpoint_dir=ckpt_dir,
                model=cfg.job.model.args(),
                train=cfg.job.train_args(),
                pg_timeout_s=cfg.job.pg_timeout_s,
                report_interval_s=cfg.agent.report_interval_s,
                env=env,
                fr_buffer_entries=cfg.job.flight_recorder_entries,
                fr_poll_interval_s=cfg.agent.fr_poll_interval_s,
            )
            for rank, node in enumerate(placement)
        ]

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
        for what, fn in (
            ("workers", group.kill if group is not None else (lambda: None)),
            ("agents", agents.close),
            ("ray", runtime.shutdown),
            ("grpc server", server.close if server is not None else (lambda: None)),
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
