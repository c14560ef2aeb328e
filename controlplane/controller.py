"""The controller: runs one job through its lifecycle until it succeeds, fails or stops.

Order of life: create the job row (or take over a job whose controller died, or resume a
stopped one: ``recovery.take_over``) -> start or attach the cluster (Ray) -> start the gRPC server and
the metrics (token, controller.json, the Prometheus target file) -> one agent per node ->
the attempts (``attempts``: place, run, watch, attribute, decide, restart). Every state change is a row in the
store. Teardown (chaos, watchdog, workers, agents, Ray, metrics, server) runs on every exit
path, KeyboardInterrupt included.

What it is made of: ``job_control`` (the live state and the ``JobControl`` behind
ControlService), ``agent_supervisor`` (agent loss and restarts), ``chaos_fire`` (carrying
fault orders out), ``attempts`` (the attempt loop) and ``runtime`` (the Ray-free
Protocols of the cluster, agents and workers; Ray's by default, imported lazily).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleet.controlplane import auth
from fleet.controlplane.addresses import join_host_port
from fleet.controlplane.agent_server import AgentRegistry, AgentServicer, fan_out
from fleet.controlplane.agent_supervisor import AgentSupervisor
from fleet.controlplane.attempts import AttemptRunner
from fleet.controlplane.collective_metrics import CollectiveMetrics
from fleet.controlplane.config import ClusterConfig
from fleet.controlplane.control_server import ControlServicer
from fleet.controlplane.detectors import Incident
from fleet.controlplane.errors import FleetError, UnavailableError
from fleet.controlplane.grpc_server import ControllerServer
from fleet.controlplane.ingest_shards import IngestShards
from fleet.controlplane.job_control import JobService, LiveJob
from fleet.controlplane.job_metrics import JobMetrics, MetricsRefresher
from fleet.controlplane.lifecycle import AttemptState, JobState
from fleet.controlplane.metrics import ControllerMetrics
from fleet.controlplane.node_checks import NodeChecks
from fleet.controlplane.recovery import note_processes, processes_file, take_over
from fleet.controlplane.runtime import Agents, Cluster, NodeInfo, Runtime, ray_runtime
from fleet.controlplane.store import Store
from fleet.controlplane.supervision import SupervisionConfig
from fleet.controlplane.topology import Topology
from fleet.controlplane.watchdog import Watchdog

log = logging.getLogger(__name__)


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
        runtime: Runtime | None = None,
        on_output: Callable[[str], None] | None = None,
    ) -> None:
        """``resume_job``: take this job up again instead of creating one (``fleet up
        --resume``): one whose controller died, or one an operator stopped; this config
        (the file given, not the stored one) runs it on. ``runtime``: how the cluster, agents and workers are
        built (None: Ray's, ``runtime.ray_runtime``). ``on_output(line)``: where a user
        program's rank-prefixed output goes when ``job.entrypoint.tee`` is set."""
        self._on_output = on_output
        self._resume_job = resume_job
        self.config = config
        self.store = store
        self._config_json = config_json
        self._on_progress = on_progress or (lambda p: None)
        self._runtime = runtime
        self._state_dir = Path(config.state_dir).resolve()
        self._token = auth.new_token()
        self._registry = AgentRegistry()
        #: known-answer GEMM tests through the agents: pre-flight, release gate (node_checks.py)
        self._node_checks = NodeChecks(self.store, self._registry)
        self._job = LiveJob()
        self._control = JobService(store, self._job, self._registry, stop_timeout_s=config.job.stop_timeout_s)
        self._incidents: queue.Queue[Incident] = queue.Queue()  # from the watchdog thread
        self.address = ""
        #: where agents dial: ``address``, or the ingest processes' shared port
        self.agent_address = ""
        self._shards: IngestShards | None = None
        self.metrics_port = 0  # the /metrics endpoint's port once serving; 0 = none
        self._metrics: ControllerMetrics | None = None
        self._feed: CollectiveMetrics | None = None  # the collective metrics, once served
        self._refresher: MetricsRefresher | None = None
        self._last_message = ""
        self.timings_s: dict[str, float] = {}

    @property
    def job_id(self) -> str:
        return self._job.job_id

    @property
    def control(self) -> JobService:
        """The ``JobControl`` ControlService calls (list, status, inject fault, stop)."""
        return self._control

    def run(self) -> RunResult:
        """Run the job to an end state; always tears down what it started."""
        cfg = self.config
        t_start = time.monotonic()
        recovery, resumed_at = None, None
        if self._resume_job:
            # the ranks restore from <job.checkpoint_dir>/<job>: the folder the job has used from its start
            takeover = take_over(self.store, self._state_dir, self._resume_job,
                                 checkpoint_dir=(Path(cfg.job.checkpoint_dir) / self._resume_job).resolve(),
                                 steps=cfg.job.steps if cfg.job.user_program is None else 0)
            self._job.job_id, self._job.restarts = self._resume_job, takeover.restarts
            recovery, resumed_at = takeover.recovery, takeover.resumed_at
        else:
            self._job.job_id = self.store.create_job(
                cfg.name, cfg.job.steps if cfg.job.user_program is None else 0, self._config_json)
        runtime = self._runtime or ray_runtime()  # Ray only loads here
        cluster = runtime.cluster(cfg.ray)
        agents = runtime.agents()
        # a program's ranks do not raise on a NaN loss as the built-in trainer's do: the
        # loss they report through fleet.step is judged instead
        watchdog = Watchdog(self.store, self.job_id, cfg.detect, self._incidents.put,
                            nan_from_steps=cfg.job.user_program is not None, send=self._registry.send,
                            on_watch=self._placed)
        supervisor = AgentSupervisor(self.store, self.job_id, self._registry, agents,
                                     SupervisionConfig(cfg.controller.heartbeat_timeout_s))
        runner = AttemptRunner(
            cfg, self.store, self._job, runtime=runtime, agents=agents, registry=self._registry,
            supervisor=supervisor, watchdog=watchdog, incidents=self._incidents,
            checkpoint_dir=str((Path(cfg.job.checkpoint_dir) / self.job_id).resolve()),
            progress=self._progress, timings_s=self.timings_s, environ=os.environ, on_output=self._on_output,
            checks=self._node_checks)
        self._control.take_faults(runner.scheduler.submit)
        server: ControllerServer | None = None
        result: RunResult | None = None
        try:
            # Ray first: it forks its daemons, which must not happen under live gRPC threads.
            self._progress("starting Ray")
            t = time.monotonic()
            cluster.start()
            nodes = cluster.nodes()
            note_processes(self._state_dir)
            self.timings_s["ray_start_s"] = time.monotonic() - t

            t = time.monotonic()
            server = self._serve(watchdog)
            self.timings_s["controller_start_s"] = time.monotonic() - t
            if len(nodes) < cfg.job.nodes:
                raise UnavailableError(
                    f"job.nodes is {cfg.job.nodes} but the Ray cluster has {len(nodes)} alive node(s)"
                )
            self._start_agents(nodes, agents)
            watchdog.start()
            runner.scheduler.start()
            result = self._finish(*runner.run(nodes, recovery, resumed_at=resumed_at))
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
            self._teardown(runner, watchdog, agents, cluster, server)
            self.timings_s["teardown_s"] = time.monotonic() - t
            self.timings_s["total_s"] = time.monotonic() - t_start
        return result

    def _placed(self, attempt: int, nodes_by_rank: list[str], topology: Topology | None) -> None:
        """An attempt is placed: the collective metrics rate its groups against the same links."""
        if self._feed is not None:
            self._feed.set_nodes(attempt, nodes_by_rank, topology)

    def _serve(self, watchdog: Watchdog) -> ControllerServer:
        """Start the gRPC server and the metrics (their refresher, their endpoint), and
        publish how to reach them (controller.json, the Prometheus target file)."""
        cfg = self.config
        feed = None
        if cfg.controller.metrics:
            self._metrics = ControllerMetrics()
            feed = self._feed = CollectiveMetrics(self._metrics.registry, self.job_id)
        observer = fan_out(watchdog.observe, feed and feed.observe)
        server = ControllerServer(
            AgentServicer(self.store, self._registry, self._token, controller_id=f"ctl-{os.getpid()}",
                          metrics=self._metrics, observer=observer, on_node_check=self._node_checks.observe),
            ControlServicer(self._control, self._token, node_checks=self._node_checks),
            host=cfg.controller.host,
            port=cfg.controller.port,
            max_message_bytes=cfg.controller.max_message_bytes,
            tls=cfg.controller.tls.server_files(),
        ).start()
        self.address = self.agent_address = server.address
        try:
            if processes := cfg.ingest_processes():
                self._progress(f"starting {processes} ingest processes")
                self._shards = IngestShards(
                    processes, store_url=cfg.store.url, host=cfg.controller.host,
                    port=cfg.controller.ingest_port, token=self._token, controller_id=f"ctl-{os.getpid()}",
                    registry=self._registry, observer=observer, on_node_check=self._node_checks.observe,
                    metrics=self._metrics, max_message_bytes=cfg.controller.max_message_bytes,
                    tls=cfg.controller.tls.server_files())
                self.agent_address = self._shards.address
            if self._metrics is not None:
                self._serve_metrics(self._metrics, feed)
            tls = cfg.controller.tls
            auth.write_controller_info(self._state_dir, auth.ControllerInfo(
                self.address, self._token, self.job_id, os.getpid(),
                ca_cert=str(tls.ca_cert or ""), client_cert=str(tls.client_cert or ""),
                client_key=str(tls.client_key or ""), metrics_port=self.metrics_port,
            ))
        except BaseException:
            if self._shards is not None:
                self._shards.close()
            server.close()  # the caller's teardown never got it
            raise
        return server

    def _serve_metrics(self, metrics: ControllerMetrics, feed: CollectiveMetrics | None) -> None:
        """The metrics refresher and the /metrics endpoint (``metrics.close`` stops both and
        removes the target file)."""
        cfg = self.config.controller
        metrics.watch_agents(self._registry.silent_for)
        refresher = MetricsRefresher(metrics, JobMetrics(metrics.registry, self.store, self.job_id), feed,
                                     cfg.metrics_refresh_interval_s).start()
        metrics.on_close(refresher.close)
        self._refresher = refresher
        try:
            self.metrics_port = metrics.serve(cfg.host, cfg.metrics_port)
        except OSError as exc:
            raise UnavailableError(f"controller.metrics_port: cannot serve metrics on {cfg.host}:"
                                   f"{cfg.metrics_port}: {exc.strerror or exc}") from None
        targets = metrics.publish_targets(self._state_dir, cfg.host, self.metrics_port, self.job_id)
        self._progress(f"metrics on http://{join_host_port(cfg.host, self.metrics_port)}/metrics "
                       f"(Prometheus file_sd: {targets})")

    def _start_agents(self, nodes: list[NodeInfo], agents: Agents) -> None:
        """Every alive node gets a node row and an agent; each attempt is placed on
        healthy ones only."""
        cfg = self.config
        for n in nodes:
            self.store.upsert_node(n.name, n.ray_node_id, n.address, f'{{"CPU": {n.cpus}}}')
        self._progress("starting agents")
        t = time.monotonic()
        agents.start(nodes, self.agent_address, self._token, cfg.agent_settings(), cfg.controller, bind_host=cfg.agent.host)
        missing = self._registry.wait_for({n.name for n in nodes}, cfg.controller.agent_start_timeout_s)
        if missing:
            raise UnavailableError(f"no agent connected from node(s) {sorted(missing)}")
        self.timings_s["agents_start_s"] = time.monotonic() - t

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

    def _teardown(self, runner: AttemptRunner, watchdog: Watchdog, agents: Agents, cluster: Cluster,
                  server: ControllerServer | None) -> None:
        for what, fn in (
            ("chaos scheduler", runner.scheduler.close),
            ("watchdog", watchdog.close),
            ("output tee", runner.stop_tee),
            ("workers", runner.kill_workers),
            ("spare workers", runner.close_pool),
            ("agents", agents.close),
            ("ray", cluster.shutdown),
            ("metrics", self._metrics.close if self._metrics is not None else (lambda: None)),
            ("ingest processes", self._shards.close if self._shards is not None else (lambda: None)),
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
        if message != self._last_message:
            # what the job does changed (an incident, an attempt's end, a restart, a
            # quarantine; not the periodic "training"): its metrics follow at once, so an
            # incident reaches Prometheus with the next scrape, not a refresh later
            self._last_message = message
            if self._refresher is not None:
                self._refresher.wake()
        try:
            job = self.store.get_job(self.job_id)
            attempt = self._job.attempt
            step = self.store.last_step(self.job_id, attempt) if attempt else 0
        except FleetError:
            return
        self._on_progress(
            Progress(self.job_id, job.state.value, attempt, step, job.total_steps, self._job.restarts, message)
        )
