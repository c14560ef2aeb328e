"""The attempts of one job: place a worker group, run it, watch it, end it, restart.

``AttemptRunner.run`` loops until the job ends: choose healthy nodes (never a
quarantined or downed one; wait, bounded, while too few), restore missing agents, place
one process per rank (reusing survivors and spares from the pool), start the ranks and
watch them. While an attempt runs it acts on the incidents that do not end it (agent
loss, straggler, loss spike: record, maybe quarantine) and supervises the agents. A
detector's incident gets the response its kind's ``detect.<kind>.action`` asks for
(``detectors.decide_response``): ``observe`` stores it with what acting would have done
and the attempt runs on; ``quarantine`` takes its node out at once. When
one ends it (a rank failed, a detector fired), the attempt is torn down (only what must
die is killed), the failure attributed, the restart decided (``decide_restart``) and,
after a backoff when attempts in a row made no step, the next attempt placed; it
restores the newest valid checkpoint. After silent data corruption (an SDC incident
with a rollback step V) the next attempts restore no state newer than V, until one of
them has trained past the step the corrupted attempt reached (by then every checkpoint
newer than V is its own). Every state change is a store row.

A stop request (`fleet stop`) ends the job STOPPED, the running attempt's ranks first
saving a checkpoint and leaving by themselves (``stopping.Stopper``); a stop while placing
or backing off ends it at once.

It also takes nodes away for chaos (``kill_node``: node-down) and owns the chaos firer
and scheduler, whose orders are aimed at its current placement.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from fleet.controlplane import chaos, exits, launch, node_checks
from fleet.controlplane.agent_server import AgentRegistry
from fleet.controlplane.agent_supervisor import AgentSupervisor
from fleet.controlplane.chaos_fire import ChaosFirer
from fleet.controlplane.config import ClusterConfig
from fleet.controlplane.detectors import DetectorAction, Incident, RestartDecision, Response, attribute_failures, \
    attribute_with_trace, decide_response, decide_restart
from fleet.controlplane.diagnosis import diagnose_attempt
from fleet.controlplane.errors import UnavailableError
from fleet.controlplane.interrupts import DeferredInterrupt
from fleet.controlplane.job_control import LiveJob
from fleet.controlplane.lifecycle import AttemptState, JobState, NodeActor
from fleet.controlplane.logtee import LogTee
from fleet.controlplane.placement import JobLayout, choose_nodes
from fleet.controlplane.policy import QuarantineDecision, decide_quarantine
from fleet.controlplane.recovery import PendingRecovery, faults_after, finish_recovery, note_processes
from fleet.controlplane.runtime import Agents, NodeInfo, Pool, Runtime, Workers
from fleet.controlplane.sdc import copies_problem
from fleet.controlplane.stopping import Stopper
from fleet.controlplane.store import NODE_QUARANTINED, IncidentRecord, Store
from fleet.controlplane.topology import Topology
from fleet.controlplane.watchdog import Watchdog
from fleet.proto.kinds import IncidentKind
from fleet.workers.spec import Launch

log = logging.getLogger(__name__)

#: How long to keep collecting rank failures after the first one, so that the rank
#: whose process died is seen next to the ranks that only lost their peer.
FAILURE_SETTLE_S = 1.0
#: The same for a user program: each failure carries when its process exited, so the first
#: one is known once the failures in flight have arrived.
PROGRAM_SETTLE_S = 0.25
#: Replacement spares are started once an attempt made progress (its first step stored),
#: or this long after it started: a process starting at once (the Ray worker's own start at
#: full priority, then its imports) slows the ranks' restore and first step.
SPARES_DELAY_S = 20.0
POLL_INTERVAL_S = 0.05
#: How long the pre-flight GEMM tests of an attempt's nodes may take in all (an agent's
#: first test imports torch; on a GPU it initialises CUDA too).
PREFLIGHT_TIMEOUT_S = 60.0
#: How long the ranks of a failed attempt get to leave their collectives by themselves
#: (they fail fast once a peer is gone) before they are killed.
TEARDOWN_GRACE_S = 3.0
#: Incidents whose culprit rank is killed at once: it may be stuck in a collective.
_STUCK_CULPRIT = frozenset({IncidentKind.HANG, IncidentKind.DESYNC, IncidentKind.STRAGGLER})


class AttemptRunner:
    """Runs a job's attempts on the controller's thread (see the module docstring).

    ``job`` is the live state it moves from attempt to attempt; ``incidents`` is where
    the watchdog puts what it detects; ``progress(message)`` shows what happens;
    ``timings_s`` gets ``placement_s`` of the first attempt."""

    def __init__(self, config: ClusterConfig, store: Store, job: LiveJob, *, runtime: Runtime, agents: Agents,
                 registry: AgentRegistry, supervisor: AgentSupervisor, watchdog: Watchdog,
                 incidents: queue.Queue[Incident], checkpoint_dir: str, progress: Callable[[str], None],
                 timings_s: dict[str, float], environ: Mapping[str, str] | None = None,
                 on_output: Callable[[str], None] | None = None,
                 checks: node_checks.NodeChecks | None = None) -> None:
        """``environ``: the ``fleet`` command's environment, which a user program's ranks
        inherit (``job.entrypoint.inherit_env``); ``on_output(line)``: where their output
        lines go, rank-prefixed, with ``job.entrypoint.tee``; ``checks``: runs the
        pre-flight known-answer GEMM test (none: no pre-flight test)."""
        self._node_checks = checks
        self._on_output = on_output
        self._tee: LogTee | None = None
        self.config = config
        self.store = store
        self.job = job
        self._runtime = runtime
        self._agents = agents
        self._registry = registry
        self._supervisor = supervisor
        self._watchdog = watchdog
        self._incidents = incidents
        self._ckpt_dir = checkpoint_dir
        self._progress = progress
        self._timings_s = timings_s
        self._state_dir = Path(config.state_dir).resolve()
        self._group: Workers | None = None  # the running attempt, for teardown and chaos
        self._pool: Pool | None = None      # processes across attempts
        self._fruitless = 0                 # failed attempts in a row without a step
        self._current_step = 0
        self._environ = dict(environ or {})
        self._builtin = config.job.user_program is None
        self._early_exits = exits.EarlyExitWatch()
        self._startup_failure: Incident | None = None  # the last attempt's, if it made no progress
        self._topology: Topology | None = None  # cluster.yaml's, resolved against the nodes in run()
        self._placement_reasons: tuple[str, ...] = ()  # why the last chosen nodes, in their order
        # after SDC: restore no step newer than this (0 = no ceiling) until an attempt passes the other
        self._restore_at_most, self._ceiling_until = 0, 0
        self.firer = ChaosFirer(job, registry, self, supervisor, store, checkpoint_dir)
        self._stopper = Stopper(config.job, store, job, registry=registry, agents=agents, watchdog=watchdog,
                                progress=progress)
        self.scheduler = chaos.Scheduler(self.firer.fire, lambda: self._current_step)

    # -- chaos: node-down -------------------------------------------------------------

    def kill_node(self, node: str, ranks: list[int]) -> None:
        """The node goes away: its agent and every worker process on it die at once."""
        self._agents.kill(node)
        group, pool = self._group, self._pool
        if group is not None:
            group.kill_ranks([r for r in ranks if r in group.running()])
        if pool is not None:
            pool.discard_node(node)

    # -- teardown ------------------------------------------------------------------------

    def kill_workers(self) -> None:
        """Kill the running attempt's ranks (teardown)."""
        group, self._group = self._group, None
        if group is not None:
            group.kill()

    def close_pool(self) -> None:
        """Kill the spare and surviving processes (teardown)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def stop_tee(self) -> None:
        """Print what is left of the attempt's output and stop copying it (teardown too)."""
        tee, self._tee = self._tee, None
        if tee is not None:
            tee.stop()

    def _start_tee(self, program: Launch | None) -> None:
        if program is None or not program.tee or self._on_output is None:
            return
        self._tee = LogTee(Path(program.log_dir), self._on_output).start()

    # -- the attempts --------------------------------------------------------------------

    def run(self, nodes: list[NodeInfo], recovery: PendingRecovery | None, *,
            resumed_at: int | None = None) -> tuple[JobState, str]:
        """Attempts until the job ends; returns its end state and why. ``recovery``: the
        restart a takeover after a controller crash began; ``resumed_at``: the job was
        stopped and is resumed from that step's checkpoint, so only the config's faults
        timed after it are scheduled (``recovery.faults_after``)."""
        cfg, job = self.config, self.job
        # an attached cluster's node names are known only now: a rack naming another is refused
        self._topology = cfg.topology.resolve(nodes) if cfg.topology is not None else None
        program = launch.program_launch(cfg, self._environ)
        # a program restarts every rank: enough warm interpreters per node for a whole group
        spares = cfg.job.spare_workers_per_node if program is None else \
            max(cfg.job.spare_workers_per_node, cfg.job.ranks_per_node)
        pool = self._pool = self._runtime.pool(spares, program)
        first = recovery is None  # a resumed job has had its first attempt
        warm_up = cfg.job.ranks_per_node  # no process of this run yet: start them early
        while True:
            if job.stopping.is_set():
                return self._stopper.between()
            t_place = time.monotonic()
            self.store.set_job_state(job.job_id, JobState.PLACING, "placing worker group")
            chosen = self._checked_nodes(nodes, warm_up)
            warm_up = 0
            if chosen is None or job.stopping.is_set():
                return self._stopper.between()
            placement = [n for n in chosen for _ in range(cfg.job.ranks_per_node)]
            attempt = self.store.create_attempt(job.job_id)
            if self._placement_reasons:
                self.store.record_action(job.job_id, attempt, "placement", "; ".join(self._placement_reasons))
            actors, reused = pool.acquire(placement)
            group = self._group = self._runtime.workers(placement, actors)
            master_addr = self._master_addr(placement)
            try:
                pids = group.pids(timeout_s=120)
                port = group.rendezvous_port(master_addr, timeout_s=30)
            except Exception as exc:
                group.kill()
                raise UnavailableError(f"worker group could not be placed: {exc}") from None
            job.move_to(attempt, [n.name for n in placement], no_copies=copies_problem(
                cfg.job.data_parallel, len(placement), len(chosen), not self._builtin) or "")
            self.store.record_ranks(job.job_id, attempt, [
                (rank, node.name, pid) for rank, (node, pid) in enumerate(zip(placement, pids, strict=True))])
            specs = launch.worker_specs(
                cfg, job_id=job.job_id, attempt=attempt, placement=placement, port=port,
                checkpoint_dir=self._ckpt_dir, local_addresses=self._agents.local_addresses,
                master_addr=master_addr,
                launch=launch.program_launch(cfg, self._environ, job.job_id, attempt),
                restore_at_most=self._restore_at_most)
            self._watchdog.watch(attempt, [n.name for n in placement], self._topology)
            self._early_exits.reset()
            self._start_tee(specs[0].launch)
            group.run(specs)
            t_run = time.time()
            log.info("attempt %d: %d rank(s) started %.2f s after placing began (%d warm process(es) reused)",
                     attempt, len(placement), time.monotonic() - t_place, reused)
            # replacements for the spares this attempt used start once it made progress:
            # a process starting competes with the restore and first step for the CPU
            spares_due = time.monotonic() + SPARES_DELAY_S
            self.store.set_attempt_state(job.job_id, attempt, AttemptState.RUNNING, "worker group running")
            self.store.set_job_state(job.job_id, JobState.RUNNING, f"attempt {attempt} running")
            if first:
                self._timings_s["placement_s"] = time.monotonic() - t_place
                first = False
                orders = cfg.chaos.orders()
                for order in orders if resumed_at is None else faults_after(orders, resumed_at):
                    self.scheduler.submit(order)
            if recovery is not None:
                recovery.attempt, recovery.t_run, recovery.reused = attempt, t_run, reused
                recovery.place_s += time.monotonic() - t_place
                self.firer.rearm(recovery.last_step)

            with DeferredInterrupt() as ctrl_c:   # Ctrl-C while watching: raised between polls
                outcome = self._watch(group, attempt, recovery, ctrl_c, lambda: pool.fill_spares(chosen),
                                      spares_due)
            recovery = None
            if outcome == "stop":
                try:
                    return self._stopper.stop(group, attempt)
                finally:
                    self.stop_tee()  # after the stop: a program may print as it leaves
            self.stop_tee()
            if outcome is None:  # every rank finished
                self._agents.flush(timeout_s=15)
                final = self.store.last_step(job.job_id, attempt)
                self.store.set_attempt_final_step(job.job_id, attempt, final)
                self.store.set_attempt_state(job.job_id, attempt, AttemptState.SUCCEEDED, "all ranks finished")
                if cfg.job.user_program is None:
                    return JobState.SUCCEEDED, f"completed {final} steps"
                return JobState.SUCCEEDED, "every rank's program exited with code 0" + \
                    (f" (last step reported: {final})" if final else "")
            recovery, decision = self._end_attempt(group, attempt, outcome)
            if not decision.restart:
                return JobState.FAILED, decision.reason
            job.restarts += 1
            self.store.record_action(job.job_id, attempt, "restart", decision.reason)
            self.store.set_job_state(job.job_id, JobState.RESTARTING, decision.reason)
            self._progress(decision.reason)
            # after an attempt that made progress: at once; after attempts that failed before
            # their first step: restart_backoff_s, doubling each time
            backoff = 0.0 if self._fruitless == 0 else \
                min(60.0, cfg.job.restart_backoff_s * 2 ** (self._fruitless - 1))
            t = time.monotonic()
            if backoff and job.stopping.wait(backoff):
                return self._stopper.between()
            recovery.place_s = time.monotonic() - t

    def _master_addr(self, placement: list[NodeInfo]) -> str:
        """Rendezvous host: rank 0's node (always loopback for the local cluster)."""
        return "127.0.0.1" if self.config.ray.address is None else placement[0].address

    def _watch(self, group: Workers, attempt: int, recovery: PendingRecovery | None, ctrl_c: DeferredInterrupt,
               fill_spares: Callable[[], None] | None = None, spares_due: float = 0.0) -> Incident | str | None:
        """Block until the attempt ends: None = success, "stop", or the Incident that
        ends it. Meanwhile: act on incidents that do not end it (agent loss, straggler,
        loss spike), finish timing a recovery once its first step lands, show progress,
        and ``fill_spares()`` once the attempt made progress or ``spares_due`` (monotonic)
        passed: new processes starting would compete with its ranks' start (the restore
        and first step of a restart) for the CPU.
        A Ctrl-C noted by ``ctrl_c`` is raised at the top of the loop, between two calls."""
        job = self.job
        next_tick = next_note = 0.0
        while True:
            ctrl_c.check()
            failures = group.poll(POLL_INTERVAL_S)
            if failures:
                log.info("attempt %d: rank(s) %s failed; collecting the others' failures", attempt,
                         sorted(f.rank for f in failures))
                settle = time.monotonic() + (FAILURE_SETTLE_S if self._builtin else PROGRAM_SETTLE_S)
                while not group.finished and time.monotonic() < settle:
                    failures += group.poll(0.05)
                nodes = [n.name for n in group.placement]
                incident = exits.attribute_exits(failures, exits.finished_ranks(group.returned()), nodes) or \
                    attribute_failures(failures, nodes)
                log.warning("attempt %d failed: %s", attempt, incident.evidence)
                return incident
            if group.finished:
                return None
            early = self._early_exits.check(exits.finished_ranks(group.returned()), group.running(),
                                            [n.name for n in group.placement], time.monotonic())
            if early is not None:
                log.warning("attempt %d: %s", attempt, early.evidence)
                return early
            if job.stopping.is_set():
                return "stop"
            try:
                incident = self._incidents.get_nowait()
            except queue.Empty:
                incident = None
            if incident is not None:
                response = self._respond(incident)
                if response.observed:
                    self._observe(incident, attempt, response.reason)
                elif incident.kind.ends_attempt:
                    log.warning("attempt %d: %s", attempt, incident.evidence)
                    return incident
                else:
                    ended = self._side_incident(incident, attempt, group, at_once=response.quarantine_now)
                    if ended is not None:
                        return ended
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + 0.5
                self._supervisor.check(attempt)
                if now >= next_note:  # the process tree changes only when processes start
                    next_note = now + 5.0
                    note_processes(self._state_dir)
                span = self.store.step_span(job.job_id, attempt)
                self._current_step = span[1] if span else self._current_step
                if self._restore_at_most and span is not None and span[1] > self._ceiling_until:
                    log.info("attempt %d trained past step %d: restores are no longer held to step %d",
                             attempt, self._ceiling_until, self._restore_at_most)
                    self._restore_at_most = 0
                # progress: the built-in trainer's first step (its restore's collectives are
                # not yet progress); a program's first step or collective (it may not report steps)
                if fill_spares is not None and (now >= spares_due or span is not None or (
                        not self._builtin and self.store.last_progress_ns(
                            job.job_id, attempt, time.time_ns()) is not None)):
                    fill_spares()
                    fill_spares = None
                if recovery is not None and span is not None:
                    self._record_recovery(recovery, span)
                    recovery = None
                self._progress("training")

    def _respond(self, incident: Incident) -> Response:
        """The response ``detect.<kind>.action`` asks for to a detector's incident."""
        action = self.config.detect.action_of(incident.kind)
        would = self._would_quarantine(incident) if action is DetectorAction.OBSERVE else \
            QuarantineDecision(False, "")
        return decide_response(incident, action, self.job.restarts, self.config.job.max_restarts, would)

    def _would_quarantine(self, incident: Incident) -> QuarantineDecision:
        """The policy's decision about the incident's node were the incident counted."""
        if not incident.node:
            return QuarantineDecision(False, "no node named")
        policy, now = self.config.policy, time.time()
        history = self.store.incidents_on_node(incident.node, now - policy.quarantine_window_s)
        history.append(IncidentRecord(
            id=0, job_id=self.job.job_id, attempt=self.job.attempt, kind=incident.kind, rank=incident.rank,
            node=incident.node, detector=incident.detector, evidence=incident.evidence, detected_at=now))
        return decide_quarantine(now, incident.node, history, policy)

    def _observe(self, incident: Incident, attempt: int, would: str) -> None:
        """Store an observed incident with what acting on it would have done; nothing else."""
        self.store.record_incident(self.job.job_id, attempt, incident.kind, incident.detector, incident.evidence,
                                   rank=incident.rank, node=incident.node, observed=would)
        log.warning("attempt %d: observed (detect.%s.action: observe), %s: %s", attempt, incident.kind, would,
                    incident.evidence)
        self._progress(f"observed {incident.kind} on {incident.node or '?'}: {would}")

    def _side_incident(self, incident: Incident, attempt: int, group: Workers, *,
                       at_once: bool = False) -> Incident | None:
        """Record an incident that does not end the attempt by itself; returns an
        incident that ends it after all (its node was quarantined: by the policy, or
        ``at_once``), else None."""
        self.store.record_incident(self.job.job_id, attempt, incident.kind, incident.detector, incident.evidence,
                                   rank=incident.rank, node=incident.node)
        log.warning("attempt %d: %s", attempt, incident.evidence)
        self._progress(f"{incident.kind} on {incident.node or '?'}: {incident.evidence}")
        quarantined = self._quarantine_at_once(incident, attempt) if at_once else \
            self._maybe_quarantine(incident.node, attempt)
        if quarantined and incident.node in {n.name for n in group.placement}:
            return Incident(incident.kind, incident.detector, incident.rank, incident.node,
                            f"{incident.node} quarantined; moving off it. {incident.evidence}",
                            rollback_step=incident.rollback_step)
        return None

    def _end_attempt(self, group: Workers, attempt: int,
                     incident: Incident) -> tuple[PendingRecovery, RestartDecision]:
        """Tear down a failed attempt and record why; returns (recovery so far, decision).

        Only what must die is killed: the culprit of a hang (a rank stuck in gloo never
        returns) and whatever is still running after the grace. Ranks whose ``run`` ended
        go back to the pool with their in-memory snapshots."""
        job_id = self.job.job_id
        t_detect, t0 = time.time(), time.monotonic()
        assert self._pool is not None
        self._watchdog.pause()
        while not self._incidents.empty():  # fired before the pause: about this attempt, now moot
            self._incidents.get_nowait()
        kind = incident.kind
        if incident.rank >= 0 and incident.rank in group.running() and kind in _STUCK_CULPRIT:
            group.kill_ranks([incident.rank])
        if kind is IncidentKind.NODE_LOSS and incident.node:
            group.kill_ranks([r for r in group.running() if group.placement[r].name == incident.node])
        # a program's survivors hold nothing worth a graceful exit: it resumes from its own checkpoint
        group.wind_down(TEARDOWN_GRACE_S if self._builtin else 0.0)
        if kind is IncidentKind.ERROR:  # let the traces name the culprit: they must be in the store
            self._agents.flush(timeout_s=5)
            incident = self._attribute_by_trace(incident, attempt)
        incident = self._node_lost(incident, group)
        teardown_s = time.monotonic() - t0
        log.info("attempt %d: torn down in %.2f s", attempt, teardown_s)
        if incident.kind in _STUCK_CULPRIT:  # a hang blamed on a rank that had left says so
            incident = exits.explain_early_exit(incident, exits.finished_ranks(group.returned()))
        incident_id = self.store.record_incident(
            job_id, attempt, incident.kind, incident.detector, incident.evidence,
            rank=incident.rank, node=incident.node, detected_at=t_detect,
            traceback=incident.traceback, exit_code=incident.exit_code,
        )
        if self.config.detect.action_of(incident.kind) is DetectorAction.QUARANTINE and incident.node:
            self._quarantine_at_once(incident, attempt)
        else:
            self._maybe_quarantine(incident.node, attempt)
        self._pool.release(group.survivors())
        self.firer.forget_caused(incident)  # it fired: never re-arm it
        if incident.kind is not IncidentKind.ERROR:  # an error flushed above
            # the attempt's final step, and which armed faults it reached, are read from
            # its steps: the survivors' last reports (sent as their runs ended) must be in
            # the store first, or the final step reads one short (a flush with nothing
            # pending is one round trip)
            self._agents.flush(timeout_s=2)
        span = self.store.step_span(job_id, attempt)
        last_step = span[1] if span else 0
        failed_at = span[2] / 1e9 if span else t_detect
        self.store.set_attempt_final_step(job_id, attempt, last_step)
        self.store.set_attempt_state(job_id, attempt, AttemptState.FAILED, incident.evidence)
        self._hold_restores(incident, last_step)
        # failures in a row without progress (a step; for a program without the step API, a
        # collective) back off; one after progress does not
        no_progress = span is None and self.store.last_progress_ns(job_id, attempt, time.time_ns()) is None
        self._fruitless = self._fruitless + 1 if no_progress else 0
        decision = decide_restart(self.job.restarts, self.config.job.max_restarts, incident)
        if no_progress and exits.same_startup_failure(self._startup_failure, incident):
            decision = RestartDecision(False, f"the program fails the same way at start-up on every attempt "
                                       f"({self.job.restarts + 1} in a row), so restarting cannot help: "
                                       f"{incident.evidence}")
        self._startup_failure = incident if no_progress else None
        recovery = PendingRecovery(incident_id, attempt, failed_at, last_step,
                                   detect_s=max(0.0, t_detect - failed_at), teardown_s=teardown_s)
        return recovery, decision

    def _hold_restores(self, incident: Incident, last_step: int) -> None:
        """After silent data corruption, hold the next attempts' restores to the step
        verified before it until one trains past ``last_step`` (the corrupted attempt's);
        an attempt that ended past the held-to step ends the hold."""
        if self._restore_at_most and last_step > self._ceiling_until:
            self._restore_at_most = 0  # this attempt trained past it (its watch may not have seen it)
        if incident.kind is not IncidentKind.SDC or incident.rollback_step is None:
            return
        if incident.rollback_step <= 0:
            # WorkerSpec.restore_at_most 0 means "no ceiling": nothing verified to hold to
            log.warning("attempt's SDC incident has no verified step to roll back to; restores are not held")
            return
        held = self._ceiling_until if self._restore_at_most else 0
        self._restore_at_most = incident.rollback_step
        self._ceiling_until = max(held, last_step, incident.rollback_step)
        log.info("next attempts restore at most step %d (verified before the corruption)", incident.rollback_step)

    def _node_lost(self, incident: Incident, group: Workers) -> Incident:
        """A crash that took every rank of a node together with its agent is a node loss."""
        if incident.kind is not IncidentKind.CRASH or not incident.node:
            return incident
        on_node = [r for r, n in enumerate(group.placement) if n.name == incident.node]
        agent_gone = incident.node not in self._registry.connected_nodes()
        if agent_gone and on_node and all(r in group.died or r in group.killed for r in on_node):
            return Incident(IncidentKind.NODE_LOSS, "node_loss", incident.rank, incident.node,
                            f"{incident.node} lost: its agent and all its ranks {on_node} are gone; "
                            + incident.evidence)
        return incident

    def _checked_nodes(self, nodes: list[NodeInfo], warm_up: int = 0) -> list[NodeInfo] | None:
        """The healthy nodes of the next attempt, their agents running and (``sdc.preflight``)
        each having passed the known-answer GEMM test. A node that fails it is quarantined
        (``node_checks``) and the nodes are chosen again; one whose test could not run is
        used (the test says nothing about it) and the reason is shown. None if stopped.

        ``warm_up``: start that many processes per chosen node while the test runs (their
        interpreter and torch load overlap it; a node that fails drops its own)."""
        while True:
            chosen = self._healthy_nodes(nodes)
            if chosen is None:
                return None
            self._restore_agents(chosen)
            if self._node_checks is None or not self.config.sdc.preflight:
                return chosen
            if warm_up and self._pool is not None:
                self._pool.warm_up(chosen, warm_up)
            results = self._node_checks.preflight([n.name for n in chosen], PREFLIGHT_TIMEOUT_S,
                                                  job_id=self.job.job_id, attempt=self.job.attempt)
            failed = [c for c in results.values() if c.verdict == node_checks.FAILED]
            for c in results.values():
                if not c.ok and c.verdict != node_checks.FAILED:
                    self._progress(f"pre-flight GEMM test on {c.node} did not run ({c.verdict}): {c.reason}")
            if not failed:
                return chosen
            for c in failed:
                reason = f"pre-flight known-answer GEMM test failed: {c.reason}"
                self.store.record_action(self.job.job_id, self.job.attempt, "quarantine", f"{c.node}: {reason}")
                self._progress(f"quarantined {c.node}: {reason}")
                if self._pool is not None:
                    self._pool.discard_node(c.node)

    def _restore_agents(self, chosen: list[NodeInfo]) -> None:
        """Start a new agent on every chosen node whose agent is gone."""
        connected = self._registry.connected_nodes()
        attempt = self.job.attempt
        for node in chosen:
            if node.name in connected:
                continue
            if not self._supervisor.is_lost(node.name) and attempt:  # lost between attempts
                self.store.record_incident(self.job.job_id, attempt, IncidentKind.AGENT_LOSS, "heartbeat",
                                           f"agent on {node.name} is gone (found before placing the next "
                                           "attempt)", rank=-1, node=node.name)
            self._progress(f"restarting the agent on {node.name}")
            self._agents.restart(node.name)
            missing = self._registry.wait_for({node.name}, self.config.controller.agent_start_timeout_s)
            if missing:
                raise UnavailableError(f"the agent on {node.name} did not reconnect after a restart")
            self._supervisor.restored(node.name)
            self.store.record_action(self.job.job_id, attempt, "restart_agent", f"agent on {node.name} restarted")

    def _healthy_nodes(self, nodes: list[NodeInfo]) -> list[NodeInfo] | None:
        """The nodes of the next attempt: never a quarantined one. Waits (bounded by
        ``job.capacity_wait_s``, showing why) while too few are healthy; None if stopped."""
        wait_s = self.config.job.capacity_wait_s
        deadline = time.monotonic() + wait_s
        shown = ""
        while True:
            quarantined = {n.name: n.quarantine_reason for n in self.store.list_nodes()
                           if n.state == NODE_QUARANTINED}
            down = self._supervisor.down_nodes(time.monotonic())
            job = self.config.job
            decision = choose_nodes([n.name for n in nodes], quarantined, job.nodes, down,
                                    minimum=job.min_nodes if 0 < job.min_nodes < job.nodes else None,
                                    topology=self._topology, layout=self._layout())
            if decision.nodes:
                self._placement_reasons = decision.reasons
                by_name = {n.name: n for n in nodes}
                if decision.reason:  # shrunk: fewer data-parallel ranks this attempt
                    self.store.record_action(self.job.job_id, self.job.attempt, "shrink", decision.reason)
                    self._progress(decision.reason)
                return [by_name[name] for name in decision.nodes]
            if time.monotonic() >= deadline:
                raise UnavailableError(f"{decision.reason}; waited {wait_s:.0f} s (job.capacity_wait_s)")
            if decision.reason != shown:
                shown = decision.reason
                self.store.set_job_reason(self.job.job_id, f"waiting: {decision.reason}")
                self._progress(f"waiting for healthy nodes: {decision.reason} (fleet release NODE)")
            if self.job.stopping.wait(1.0):
                return None

    def _layout(self) -> JobLayout:
        """The process groups placement keeps close: the built-in trainer's (EP, data
        parallelism); a program's only known group is the world."""
        job = self.config.job
        if not self._builtin:
            return JobLayout(job.ranks_per_node)
        return JobLayout(job.ranks_per_node, job.ep_size, job.data_parallel)

    def _maybe_quarantine(self, node: str | None, attempt: int) -> bool:
        """Quarantine ``node`` when the policy says its incidents point at the hardware."""
        if not node:
            return False
        policy, now = self.config.policy, time.time()
        history = self.store.incidents_on_node(node, now - policy.quarantine_window_s)
        decision = decide_quarantine(now, node, history, policy)
        if decision.quarantine:
            self._quarantine(node, decision.reason, attempt)
        return decision.quarantine

    def _quarantine_at_once(self, incident: Incident, attempt: int) -> bool:
        """``detect.<kind>.action: quarantine``: the incident's node leaves placement now."""
        if not incident.node:
            return False
        self._quarantine(incident.node, f"{incident.kind} of rank {incident.rank} on {incident.node} "
                         f"(detect.{incident.kind}.action: quarantine, at once): {incident.evidence}", attempt)
        return True

    def _quarantine(self, node: str, reason: str, attempt: int) -> None:
        self.store.quarantine_node(node, reason, actor=NodeActor.POLICY, job_id=self.job.job_id)
        self.store.record_action(self.job.job_id, attempt, "quarantine", reason)
        self._progress(f"quarantined {node}: {reason}")
        if self._pool is not None:
            self._pool.discard_node(node)

    def _attribute_by_trace(self, incident: Incident, attempt: int) -> Incident:
        """Let the attempt's collective traces name the culprit when no process died."""
        if incident.kind is not IncidentKind.ERROR:
            return incident
        try:
            _, diagnosis = diagnose_attempt(self.store, self.job.job_id, attempt)
        except Exception:  # noqa: BLE001 - attribution must not take the controller down
            log.exception("desync diagnosis of attempt %d failed", attempt)
            return incident
        nodes = self.job.position()[1]
        refined = attribute_with_trace(incident, diagnosis.verdict, diagnosis.culprit_ranks,
                                       diagnosis.summary, nodes)
        if incident.exit_code is not None and refined.rank == incident.rank:
            return incident  # the program's own exit says more than "the others waited for it"
        if refined is not incident:
            log.warning("attempt %d: the flight recorder blames rank %d: %s", attempt, refined.rank,
                        diagnosis.summary)
        return refined

    def _record_recovery(self, r: PendingRecovery, span: tuple[int, int, int]) -> None:
        """The new attempt made its first step: store the recovery's phases."""
        rec = finish_recovery(self.job.job_id, r, span, self.store.worker_status(self.job.job_id, r.attempt))
        self.store.record_recovery(rec)
        log.info("recovered in %.2f s (detect %.2f, teardown %.2f, place %.2f, pg %.2f, restore %.2f, "
                 "first step %.2f); restored step %d from %s, %d step(s) lost, %d process(es) reused",
                 rec.total_s, rec.detect_s, rec.teardown_s, rec.place_s, rec.pg_init_s, rec.restore_s,
                 rec.first_step_s, rec.restored_step, rec.restored_from, rec.steps_lost, rec.reused_workers)
