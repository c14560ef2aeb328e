"""The controller's watchdog: live failure detection while an attempt runs.

One named daemon thread (``fleet-watchdog``) wakes every ``detect.interval_s`` and
applies the pure decisions of ``controlplane.detectors`` to what it has seen:

  * hang: no rank finished a step for longer than the hang threshold, confirmed by a
    flight-recorder diagnosis of the attempt's newest collectives (ranks waiting longer
    than the threshold in a collective another rank never entered); unconfirmed after
    ``unconfirmed_hang_s`` more. Before the first step: ``startup_timeout_s``.
    A job that reports no steps (a user's program without ``fleet.step``) is judged from
    its collectives alone, once a few gaps between each rank's consecutive collective
    enters are known: no rank entered or completed a collective for ``hang_factor`` x
    the largest recent gap (or ``hang_floor_s``), then the same confirmation.
    While a rank is in a named phase (a TRAINING status's ``phase``: checkpointing, eval,
    a program's ``fleet.phase``) listed in ``phase_timeouts_s``, the threshold is at
    least that phase's timeout (``detectors.phase_hang_threshold``).
  * nan (``nan_from_steps`` only): a reported step whose loss is not finite.
  * straggler: the same rank entered each step's collectives last, by more than
    ``straggler_lag_s``, in ``straggler_steps`` consecutive steps.
  * loss_spike: a step's loss far above the median of the previous ones.
  * agent_loss: a node of the attempt whose agent stayed silent past the agent timeout
    (one this watchdog never heard from: past the timeout after the newest agent it heard
    for the first time, so that agents still in line to be welcomed back after a
    controller restart are not lost).
  * sdc: a triage verdict row (workers/sdc.py) of the attempt saying "transient" or
    "ambiguous": the ranks rolled back in memory and went on; the incident names the
    suspect rank and its node, the first bad step, the triage and the rollback point.
    "persistent" verdicts end the attempt through the ranks' own ``SdcError`` (the
    controller's attribution), "clean" ones are no incident. Verdict rows are read from
    the store ``SDC_SETTLE_S`` after a batch with SDC checks arrived (it is committed just
    after it is observed), and every ``SDC_POLL_S`` in any case; each is judged once
    (by row id, so a row committed late is not missed).
  * slow_comm (``controlplane.collective_perf``): a group's completed collectives, matched
    across its members, show a late rank or a bus bandwidth below
    ``detect.slow_comm.min_utilization`` of its slowest link (``topology``); judged at most
    every ``collective_perf.JUDGE_EVERY_S``, only after new collectives completed.

Its inputs are the rows of the batches agents deliver (``observe``, installed as the
``AgentServicer`` observer, only queues a batch: the thread reads it through the batch's
typed views, ``StepRow``/``CollectiveRow``/``StatusRow``), the store (a bounded
diagnosis, only while a hang is suspected, built by ``controlplane.diagnosis``) and
``silent_for``.

Timing: progress is measured with the workers' own wall-clock timestamps (a step's
``end_ns``, a collective's ``enter_ns``; all ranks share one clock), so reporting latency
does not delay detection. But what has not arrived yet is unknown, so every judgement is
made as of ``now - telemetry lag``: the lag is measured, as the most a recent batch's
oldest new timestamp (step end, collective start; without steps also a collective's
completion) trailed its arrival. The flight recorder's verdict must hold for
``VERDICT_STABLE_S`` before it counts. Its clock starts that long before the threshold:
from then on a stall is diagnosed counting waits older than the threshold less
``VERDICT_STABLE_S`` (``verdict_settle_s``), and a verdict that held since is acted on
once the threshold passes, when its culprit has been missing for the threshold. A hang
starting at T is thus reported at about T + threshold + lag + one interval (a large
job's, whose suspects' entries are pulled, at T + threshold + lag + the pull).

A large job (its agents send collective fronts, not collectives): the fronts are folded
into ``controlplane.wavefront.Wavefronts``; while a hang is suspected, the suspects' raw
entries are pulled from their agents and diagnosed (``controlplane.fronts_pull``), else
the fronts' own verdict decides. The straggler check and the collective-cadence hang
threshold of jobs without steps need raw collectives: a large job is judged by its steps
(or the start-up timeout) instead.

Invariants:
  * ``on_incident`` runs on the watchdog thread, at most once per incident: one hang (or
    desync, or startup hang) per watched attempt, one straggler per (attempt, rank), one
    loss spike per attempt, one nan per attempt, one agent loss per node until its agent
    is heard from again, one sdc per transient or ambiguous verdict row, one slow_comm per
    (cause, subject): a late rank, a slow node, a group.
    ``watch`` re-arms them all. Never while paused; never once ``pause`` has returned.
  * Only rows of the watched job and attempt count; rows that arrive before ``watch``
    names their attempt are dropped (call ``watch`` before the workers start).
  * A rank that reported FAILED stops hang detection for the attempt (the controller
    attributes failures itself); so does the job's last step being done, or for a job
    without steps a rank that reported FINISHED (ranks are finishing, not hanging).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fleet.controlplane import collective_perf, detectors
from fleet.controlplane.config import ControllerConfig, DetectConfig
from fleet.controlplane.detectors import Incident
from fleet.controlplane.sdc import SdcVerdict
from fleet.controlplane.diagnosis import Diagnosis, DiagnosisConfig, diagnose, recent_traces
from fleet.controlplane.store import CollectiveRow, Store
from fleet.controlplane.store.ingest import PreparedBatch
from fleet.controlplane.fronts_pull import FrontsPull, prefetch_settle_s
from fleet.controlplane.wavefront import Wavefronts
from fleet.proto import events_pb2, fronts
from fleet.proto.flight_record import P2P_SUFFIX
from fleet.proto.kinds import IncidentKind

log = logging.getLogger(__name__)

#: Step times the hang threshold's median is taken over, per rank of the attempt.
STEP_TIMES_PER_RANK = 20
#: Newest collectives per process group a live diagnosis reads
#: (``controlplane.diagnosis.recent_traces``).
DIAGNOSIS_SEQS = 64
#: Batches whose telemetry lag is remembered; the lag allowed for is the largest of them.
LAG_SAMPLES = 64
#: Batches queued for the thread at most (it drains them every interval); beyond it the
#: oldest are dropped.
INBOX_MAX = 50_000

#: Gaps between one rank's consecutive collective enters remembered, per rank of the
#: attempt (pooled over ranks): the collective hang threshold is taken over them. Enough
#: to span many steps of a DDP or FSDP loop, so its compute gap stays in view; few
#: enough that a long start-up gap is forgotten after that many collectives.
COLLECTIVE_GAPS_PER_RANK = 128
#: Gaps per rank of the attempt (pooled) known before a job without steps is judged from
#: its collectives; before that, the start-up timeout applies. More than one step's
#: bucket of short gaps: the set-up collectives and the first burst alone do not show
#: the compute gap, and a threshold learned from them would call it a hang.
MIN_COLLECTIVE_GAPS_PER_RANK = 8
#: Each rank's first gaps are not the job's cadence: set-up collectives, then the first
#: step (lazy initialisation, compilation, the first data) — left out of the window, they
#: do not inflate the threshold for the next many collectives.
WARMUP_GAPS_PER_RANK = 4
#: (group, seq) entries kept per step for the straggler check: without the step API every
#: collective is "step 0", a step that never ends; the oldest are dropped beyond this.
ARRIVALS_PER_STEP = 4096

#: Seconds between recomputations of the step-based hang threshold (a median over up to
#: STEP_TIMES_PER_RANK steps of every rank: 80,000 values at 4,096 ranks).
THRESHOLD_EVERY_S = 1.0

#: How long a flight-recorder verdict must hold, unchanged, before a hang is declared on it.
VERDICT_STABLE_S = 0.5
#: After a batch with SDC checks arrives, its rows are read from the store this much later
#: (the batch is observed before it is committed).
SDC_SETTLE_S = 0.5
#: The store's SDC verdicts are read at least this often while an attempt is watched (a
#: batch the observer missed, e.g. a full inbox, is seen all the same).
SDC_POLL_S = 5.0


class _RecentMax:
    """The largest of the last ``size`` values pushed (a sliding-window maximum: O(1)
    amortised per push, whatever the window)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pushed = 0
        self._candidates: deque[tuple[int, float]] = deque()  # (index, value), values decreasing

    def push(self, value: float) -> None:
        index, self.pushed = self.pushed, self.pushed + 1
        while self._candidates and self._candidates[-1][1] <= value:
            self._candidates.pop()
        self._candidates.append((index, value))
        if self._candidates[0][0] <= index - self.size:
            self._candidates.popleft()

    def known(self) -> int:
        """How many values the window holds."""
        return min(self.pushed, self.size)

    def values(self) -> list[float]:
        """The values of the window that can still be its maximum (the maximum first)."""
        return [v for _, v in self._candidates]


@dataclass
class _Watched:
    """What the watchdog knows of the attempt it watches."""

    number: int
    nodes: list[str]                          # nodes[r]: rank r's node
    started: float                            # monotonic, when watch() was called
    step_times: deque[float]
    losses: deque[float]
    gaps: _RecentMax                          # s between one rank's consecutive collective enters
    gaps_seen: dict[int, int] = field(default_factory=dict)  # rank -> gaps it had, warm-up included
    last_step: dict[int, int] = field(default_factory=dict)
    last_end_ns: dict[int, int] = field(default_factory=dict)
    last_enter_ns: dict[int, int] = field(default_factory=dict)
    coll_progress_ns: int = 0                 # newest collective enter or completion, any rank
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))
    loss_step: int = -1                       # newest step whose loss was judged
    failed: bool = False                      # a rank reported FAILED
    phases: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (since ns, phase)
    finished: bool = False                    # a rank reported FINISHED
    # straggler: per step, per (group, seq): (group size, rank -> enter_ns)
    arrivals: dict[int, dict[tuple[str, int], tuple[int, dict[int, int]]]] = field(default_factory=dict)
    coll_step: dict[int, int] = field(default_factory=dict)  # rank -> newest step of its collectives
    judged: int | None = None                 # newest step judged for stragglers
    laggards: deque = field(default_factory=deque)
    fired: set[tuple] = field(default_factory=set)
    last_diagnosis: Diagnosis | None = None
    next_diagnosis: float = 0.0               # monotonic
    verdict_key: tuple = ()                   # (verdict, culprits) of the newest diagnosis
    verdict_since: float = 0.0                # monotonic: since when it has stayed the same
    sdc_read_at: float = math.inf             # monotonic: read the store's SDC rows then
    sdc_next_poll: float = 0.0                # monotonic: ... and at the latest then
    threshold_s: float = 0.0                  # the step-based hang threshold, as last computed
    threshold_due: float = 0.0                # monotonic: compute it again then
    fronts: Wavefronts | None = None          # a large job's collective fronts (None: raw collectives)
    pull: FrontsPull | None = None            # a large job's pulls and pulled entries
    slow_comm: collective_perf.SlowCommMonitor | None = None


def verdict_settle_s(threshold_s: float) -> float:
    """The age a wait must have to count in a stall's diagnosis, given the hang threshold:
    ``VERDICT_STABLE_S`` less (at least half the threshold), so that a verdict that has held
    for ``VERDICT_STABLE_S`` names a culprit missing for the whole threshold."""
    return max(threshold_s - VERDICT_STABLE_S, threshold_s / 2)


def _early(stalled_s: float, threshold_s: float, horizon_ns: int) -> tuple | None:
    """The suspect of a stall past ``verdict_settle_s`` but not yet past its threshold:
    kind "early", which is diagnosed to start the verdict's clock and never fires. None for
    a shorter stall."""
    if stalled_s <= verdict_settle_s(threshold_s):
        return None
    return "early", stalled_s, threshold_s, horizon_ns, {}, None


class Watchdog:
    """Live failure detection for one job (a context manager).

    ``on_incident`` is called on the watchdog thread and must not block. ``silent_for``
    returns the seconds since each connected node agent was last heard from (e.g.
    ``lambda: registry.silent_for(time.monotonic())``); None turns agent-loss detection
    off. An agent that disconnects counts as silent from its last report on.
    ``agent_timeout_s``: silence after which an agent is lost (controller.heartbeat_timeout_s).
    ``nan_from_steps``: a reported step whose loss is not finite is a nan incident (for
    user programs, which do not raise on one as the built-in trainer does).
    ``send(node, command)``: how a command reaches a node's agent (``AgentRegistry.send``);
    a large job's diagnosis asks the agents for raw entries through it (None: it decides
    on the fronts alone). ``topology``: the links' bandwidths the slow_comm detector rates
    groups against (None: only arrival skew is judged); ``watch`` may replace it once the
    nodes are known. ``on_watch(attempt, nodes_by_rank, topology)``: told of each placed
    attempt (the metrics' utilization needs the same placement and links).
    """

    def __init__(self, store: Store, job_id: str, cfg: DetectConfig, on_incident: Callable[[Incident], None],
                 silent_for: Callable[[], dict[str, float]] | None = None, *,
                 agent_timeout_s: float = ControllerConfig.model_fields["heartbeat_timeout_s"].default,
                 nan_from_steps: bool = False,
                 send: Callable[[str, events_pb2.Command], None] | None = None,
                 topology: collective_perf.Topology | None = None,
                 on_watch: Callable[[int, list[str], collective_perf.Topology | None], None] | None = None) -> None:
        self._store = store
        self._job_id = job_id
        self._cfg = cfg
        self._on_incident = on_incident
        self._silent_for = silent_for
        self._agent_timeout_s = agent_timeout_s
        self._nan_from_steps = nan_from_steps
        self._send = send
        self._topology = topology
        self._on_watch = on_watch
        self._inbox: deque[tuple[int, PreparedBatch]] = deque(maxlen=INBOX_MAX)
        self._lock = threading.RLock()        # the watched state
        self._fire_lock = threading.RLock()   # held while firing; pause() takes it
        self._watched: _Watched | None = None
        self._paused = True
        self._heard: dict[str, float] = {}    # node -> monotonic time its agent was last heard
        self._seen: set[str] = set()          # nodes whose agent this watchdog has heard at all
        self._newest_arrival = 0.0            # monotonic time one of them was first heard, the newest
        self._total_steps: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Watchdog:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-watchdog", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop firing and stop the thread (idempotent)."""
        self.pause()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the watchdog thread did not stop within %.0f s", timeout_s)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def watch(self, attempt: int, nodes_by_rank: list[str], topology: collective_perf.Topology | None = None) -> None:
        """Watch ``attempt`` (ranks ``0..len(nodes_by_rank)-1``) from now on: forget the
        previous attempt, re-arm every detector and resume firing. ``topology``: the
        cluster's, resolved against its nodes (kept for later attempts)."""
        if topology is not None:
            self._topology = topology
        if self._on_watch is not None:
            self._on_watch(attempt, list(nodes_by_rank), self._topology)
        now = time.monotonic()
        world = max(len(nodes_by_rank), 1)
        with self._fire_lock, self._lock:
            self._watched = _Watched(
                number=attempt, nodes=list(nodes_by_rank), started=now,
                step_times=deque(maxlen=STEP_TIMES_PER_RANK * world),
                losses=deque(maxlen=self._cfg.loss_window),
                gaps=_RecentMax(COLLECTIVE_GAPS_PER_RANK * world),
                laggards=deque(maxlen=self._cfg.straggler_steps),
                slow_comm=collective_perf.SlowCommMonitor(self._job_id, attempt, nodes_by_rank, self._topology,
                                                          self._cfg.slow_comm))
            for node in nodes_by_rank:
                self._heard.setdefault(node, now)  # never heard: silent from now on
            self._paused = False

    def pause(self) -> None:
        """Stop firing (teardown, recovery) until the next ``watch``. Once this returns,
        ``on_incident`` is not running and will not be called."""
        with self._fire_lock, self._lock:
            self._paused = True

    def observe(self, node_name: str, batch: PreparedBatch) -> None:
        """The ``AgentServicer`` observer: queue ``batch`` for the thread (O(1)); nothing
        while paused, stopped or not started."""
        if self._paused or self._thread is None or self._stop.is_set():
            return
        if batch.steps or batch.collectives or batch.statuses or batch.sdc or batch.fronts or batch.groups:
            self._inbox.append((time.time_ns(), batch))

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._cfg.interval_s):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the watchdog must outlive a bad check
                log.exception("watchdog check failed")

    def _tick(self) -> None:
        batches = []
        while self._inbox:
            batches.append(self._inbox.popleft())
        total_steps = self._job_total_steps()  # a store read: not under the lock
        now_ns, now = time.time_ns(), time.monotonic()
        found: list[Incident] = []
        with self._lock:
            w = self._watched
            if w is None:
                return
            for arrival_ns, batch in batches:
                found += self._ingest(w, arrival_ns, batch)
            if w.arrivals:  # once per check: each judgement reads every rank's newest step
                found += self._stragglers(w)
            self._fronts(w, batches)
            if self._paused:
                return
            found += self._agents(w, now)
            found += self._slow_comm(w, now)
            suspect = self._suspect(w, now_ns, now, total_steps)
            if suspect is None:
                w.verdict_key = ()  # a verdict's clock runs only through one stall
            if any(batch.sdc for _, batch in batches):
                w.sdc_read_at = min(w.sdc_read_at, now + SDC_SETTLE_S)
            read_sdc = now >= min(w.sdc_read_at, w.sdc_next_poll)
            if read_sdc:
                w.sdc_read_at, w.sdc_next_poll = math.inf, now + SDC_POLL_S
        if suspect is not None:
            found += self._judge_hang(w, *suspect, now)
        if read_sdc:
            found += self._sdc_verdicts(w)
        self._fire(w, found)

    def _fire(self, w: _Watched, incidents: list[Incident]) -> None:
        for incident in incidents:
            with self._fire_lock:
                if self._paused or self._watched is not w:
                    return
                log.warning("attempt %d: %s incident on rank %d (%s): %s", w.number, incident.kind,
                            incident.rank, incident.node or "no node", incident.evidence)
                try:
                    self._on_incident(incident)
                except Exception:  # noqa: BLE001 - a failing callback must not stop detection
                    log.exception("on_incident failed for %s", incident)

    def _once(self, w: _Watched, key: tuple, incident: Incident | None) -> list[Incident]:
        if incident is None or key in w.fired:
            return []
        w.fired.add(key)
        return [incident]

    # -- what the batches say -------------------------------------------------------------

    def _ingest(self, w: _Watched, arrival_ns: int, batch: PreparedBatch) -> list[Incident]:
        """Fold one batch's rows of the watched attempt into ``w``; incidents they complete."""
        job, number, cfg = self._job_id, w.number, self._cfg
        found: list[Incident] = []
        oldest_new = None
        nonfinite: tuple[int, int, float] | None = None  # (step, rank, loss): the batch's first NaN
        for s in batch.step_rows():
            if s.job_id != job or s.attempt != number:
                continue
            rank, step, end_ns = s.rank, s.step, s.end_ns
            oldest_new = end_ns if oldest_new is None else min(oldest_new, end_ns)
            took = s.step_time_s
            prev_end = w.last_end_ns.get(rank)
            if prev_end is not None and step == w.last_step.get(rank, -1) + 1:
                took = max(took, (end_ns - prev_end) / 1e9)  # the gap counts: the loop, reports
            w.step_times.append(took)
            if step >= w.last_step.get(rank, -1):
                w.last_step[rank], w.last_end_ns[rank] = step, max(end_ns, prev_end or 0)
            if step > w.loss_step:
                w.loss_step = step
                if cfg.loss_spike_factor > 0:
                    found += self._once(w, (IncidentKind.LOSS_SPIKE,), detectors.loss_spike_incident(
                        step, s.loss, w.losses, cfg.loss_spike_factor, cfg.loss_window))
                if math.isfinite(s.loss):
                    w.losses.append(s.loss)
            if self._nan_from_steps and not math.isfinite(s.loss) and (
                    nonfinite is None or (step, rank) < nonfinite[:2]):
                nonfinite = (step, rank, s.loss)
        if nonfinite is not None:
            found += self._once(w, (IncidentKind.NAN,), detectors.nan_step_incident(*nonfinite, w.nodes))
        for st in batch.status_rows():
            if st.job_id == job and st.attempt == number:
                if st.state == "FAILED":
                    w.failed = True
                elif st.state == "FINISHED":
                    w.finished = True
                elif st.state == "TRAINING" and st.time_ns >= w.phases.get(st.rank, (0, ""))[0]:
                    w.phases[st.rank] = (st.time_ns, st.phase)
        if batch.collectives and w.fronts is not None:
            # a large job's collectives are entries pulled on suspicion: kept for its
            # diagnosis as they arrive, not when the store has them (seconds later at scale)
            self._pull_of(w).add(batch.collective_rows())
        # Once fronts came, collectives are only such entries: old by design, they say
        # nothing of cadence, lag, stragglers or bandwidth (the job is judged by its steps
        # and fronts), and a pull's hundreds of answers come as a hang is being confirmed.
        if batch.collectives and not (w.fronts is not None and w.fronts.rows_applied):
            started, fresh = self._collectives(w, batch.collective_rows())
            # Without steps, completions are the progress judged, so their delivery counts too.
            new = started if w.last_end_ns else fresh
            if new is not None:
                oldest_new = new if oldest_new is None else min(oldest_new, new)
            if w.slow_comm is not None:
                w.slow_comm.add(batch.collective_rows())
        if oldest_new is not None:
            w.lags.append(max(0.0, (arrival_ns - oldest_new) / 1e9))
        return found

    def _fronts(self, w: _Watched, batches: list[tuple[int, PreparedBatch]]) -> None:
        """Fold the batches' fronts and group declarations into ``w.fronts``, in one
        update; each batch's telemetry lag is measured as for collectives."""
        job, number = self._job_id, w.number
        blocks = []
        for arrival_ns, batch in batches:
            for g in batch.groups.values():
                if g["job_id"] == job and g["attempt"] == number and not (w.fronts and w.fronts.declared(g["group_name"])):
                    if w.fronts is None:
                        w.fronts = Wavefronts(job, number, nodes=w.nodes)
                    w.fronts.declare(g["group_name"], json.loads(g["ranks"]))
            oldest = None
            for block in batch.fronts:
                stalest = fronts.stalest_ns(block)
                if stalest is not None:
                    oldest = stalest if oldest is None else min(oldest, stalest)
                    blocks.append(block)
            if oldest is not None:
                w.lags.append(max(0.0, (arrival_ns - oldest) / 1e9))
        if blocks:
            if w.fronts is None:
                w.fronts = Wavefronts(job, number, nodes=w.nodes)
            if w.fronts.apply(blocks):
                w.coll_progress_ns = max(w.coll_progress_ns, w.fronts.newest_ns())

    def _collectives(self, w: _Watched, rows: Iterable[CollectiveRow]) -> tuple[int | None, int | None]:
        """Fold collective rows into ``w``. Returns the oldest start among "started" rows
        and the oldest of the rows' newest timestamps (enter, or exit once completed),
        each None without rows of the attempt."""
        job, number = self._job_id, w.number
        last_enter, coll_step, arrivals, gaps = w.last_enter_ns, w.coll_step, w.arrivals, w.gaps
        judged = -1 if w.judged is None else w.judged
        oldest_started = oldest_fresh = None
        progress = w.coll_progress_ns
        for row in rows:
            if row.job_id != job or row.attempt != number:
                continue
            rank, enter = row.rank, row.enter_ns
            prev = last_enter.get(rank, 0)
            if enter > prev:
                if prev:
                    seen = w.gaps_seen.get(rank, 0)
                    w.gaps_seen[rank] = seen + 1
                    if seen >= WARMUP_GAPS_PER_RANK:
                        gaps.push((enter - prev) / 1e9)
                last_enter[rank] = enter
            if row.state == "started" and (oldest_started is None or enter < oldest_started):
                oldest_started = enter
            fresh = max(enter, row.exit_ns or 0)
            progress = max(progress, fresh)
            if oldest_fresh is None or fresh < oldest_fresh:
                oldest_fresh = fresh
            step, group = row.step, row.group
            if step <= judged or group.endswith(P2P_SUFFIX):
                continue
            if step > coll_step.get(rank, -1):
                coll_step[rank] = step
            per_step = arrivals.get(step)
            if per_step is None:
                per_step = arrivals[step] = {}
            key = (group, row.seq)
            entry = per_step.get(key)
            if entry is None:
                if len(per_step) >= ARRIVALS_PER_STEP:
                    del per_step[next(iter(per_step))]
                entry = per_step[key] = (row.group_size, {})
            entry[1][rank] = enter
        w.coll_progress_ns = progress
        return oldest_started, oldest_fresh

    def _stragglers(self, w: _Watched) -> list[Incident]:
        """Judge every step all ranks have moved past (their collectives of a later step
        arrived, so those of this one did); fire on a straggler."""
        cfg, world = self._cfg, len(w.nodes)
        if world < 2:
            w.arrivals.clear()
            return []
        ready = min(w.coll_step.get(r, -1) for r in range(world))
        found: list[Incident] = []
        for step in sorted(s for s in w.arrivals if s < ready):
            per_step = w.arrivals.pop(step)
            if w.judged is not None and step != w.judged + 1:
                w.laggards.clear()
            w.judged = step
            complete = (ranks for size, ranks in per_step.values() if size >= 2 and len(ranks) >= size)
            laggard = detectors.step_laggard(complete, cfg.straggler_lag_s)
            w.laggards.append(None if laggard is None else (step, *laggard))
            incident = detectors.detect_straggler(w.laggards, cfg.straggler_steps, w.nodes)
            if incident is not None:
                found += self._once(w, (IncidentKind.STRAGGLER, incident.rank), incident)
        excess = len(w.arrivals) - (2 * cfg.straggler_steps + 16)  # a rank that sends no collectives
        for step in sorted(w.arrivals)[:max(excess, 0)]:
            del w.arrivals[step]
        return found

    def _slow_comm(self, w: _Watched, now: float) -> list[Incident]:
        found: list[Incident] = []
        for f in w.slow_comm.judge(now) if w.slow_comm is not None else ():
            found += self._once(w, (IncidentKind.SLOW_COMM, *f.key), f.incident)
        return found

    # -- agents ---------------------------------------------------------------------------

    def _agents(self, w: _Watched, now: float) -> list[Incident]:
        if self._silent_for is None:
            return []
        try:
            silent = self._silent_for()
        except Exception:  # noqa: BLE001
            log.exception("silent_for failed; agent loss not checked")
            return []
        for node, seconds in silent.items():
            self._heard[node] = now - seconds
            if node not in self._seen:
                self._seen.add(node)
                self._newest_arrival = now
        # an agent this controller never heard from is silent only since the others stopped
        # arriving: after a controller restart thousands reconnect at once and are welcomed
        # in turn (2,048 agents: 5-21 s on 2 cores); one still in line is not lost
        silence = {n: now - (self._heard.get(n, w.started) if n in self._seen
                             else max(self._heard.get(n, w.started), self._newest_arrival))
                   for n in set(w.nodes)}
        lost = detectors.agents_lost(silence, self._agent_timeout_s)
        for node in silence.keys() - set(lost):
            w.fired.discard((IncidentKind.AGENT_LOSS, node))  # heard again: re-armed
        found: list[Incident] = []
        for node in lost:
            found += self._once(w, (IncidentKind.AGENT_LOSS, node), detectors.agent_loss_incident(
                node, silence[node], self._agent_timeout_s, w.nodes))
        return found

    # -- hangs ----------------------------------------------------------------------------

    def _lag_s(self, w: _Watched) -> float:
        """Telemetry latency to allow for: the worst of recent batches, bounded."""
        return min(max(w.lags, default=0.0), self._cfg.unconfirmed_hang_s)

    def _suspect(self, w: _Watched, now_ns: int, now: float, total_steps: int | None) -> tuple | None:
        """``(kind, seconds, threshold_s, horizon_ns, progress, why)`` when a hang is
        suspected: kind "startup" (no step yet, nor a known collective cadence) or "stall"
        (``why``: the stall's evidence, None for the default); None otherwise."""
        cfg = self._cfg
        if w.failed or (IncidentKind.HANG,) in w.fired:
            return None
        lag_ns = int(self._lag_s(w) * 1e9)
        horizon_ns = now_ns - lag_ns
        if not w.last_end_ns:
            if w.gaps.known() >= MIN_COLLECTIVE_GAPS_PER_RANK * max(len(w.nodes), 1):
                return self._collective_suspect(w, now_ns, horizon_ns)
            waited = now - w.started
            if waited <= cfg.startup_timeout_s:
                return None
            return "startup", waited, cfg.hang_floor_s, horizon_ns, {}, None
        if total_steps and max(w.last_step.values()) >= total_steps:  # 0: a program's, unknown
            return None  # the last step is done: ranks are finishing
        stalled = (horizon_ns - max(w.last_end_ns.values())) / 1e9
        if now >= w.threshold_due:  # a median over every rank's recent steps: not every tick
            w.threshold_s = detectors.hang_threshold_s(w.step_times, cfg.hang_factor, cfg.hang_floor_s)
            w.threshold_due = now + THRESHOLD_EVERY_S
        threshold, note = self._phase_threshold(w, w.threshold_s)
        if stalled <= threshold:
            if w.fronts is not None and w.fronts.rows_applied:
                early = prefetch_settle_s(threshold)
                if stalled > early:
                    self._pull_of(w).prefetch(w.fronts, self._lock, horizon_ns, early)
                return None
            return _early(stalled, threshold, horizon_ns)
        why = f"no rank finished a step for {stalled:.1f} s (hang threshold {threshold:.1f} s: {note})" \
            if note else None
        return "stall", stalled, threshold, horizon_ns, self._progress(w, now_ns), why

    def _phase_threshold(self, w: _Watched, threshold_s: float) -> tuple[float, str]:
        """The hang threshold given the phases the ranks are in, and the evidence's note."""
        if not w.phases or not self._cfg.phase_timeouts_s:
            return threshold_s, ""
        phases = {rank: phase for rank, (_, phase) in w.phases.items()}
        return detectors.phase_hang_threshold(threshold_s, phases, self._cfg.phase_timeouts_s)

    def _pull_of(self, w: _Watched) -> FrontsPull:
        if w.pull is None:
            w.pull = FrontsPull(self._job_id, w.number, w.nodes, self._send)
        return w.pull

    def _collective_suspect(self, w: _Watched, now_ns: int, horizon_ns: int) -> tuple | None:
        """A job without steps: stalled since its newest collective enter or completion,
        against a threshold learned from its collective cadence."""
        if w.finished:
            return None  # a rank is done: the others are finishing, not hanging
        cfg = self._cfg
        gaps = w.gaps.values()
        stalled = (horizon_ns - w.coll_progress_ns) / 1e9
        learned = detectors.collective_hang_threshold_s(gaps, cfg.hang_factor, cfg.hang_floor_s)
        threshold, note = self._phase_threshold(w, learned)
        if stalled <= threshold:
            return _early(stalled, threshold, horizon_ns)
        why = (f"no collective entered or completed for {stalled:.1f} s, threshold {threshold:.1f} s: {note}"
               if note else detectors.collective_stall_reason(stalled, threshold, max(gaps), cfg.hang_factor))
        return "stall", stalled, threshold, horizon_ns, self._progress(w, now_ns), why

    @staticmethod
    def _progress(w: _Watched, now_ns: int) -> dict[int, tuple[int, float]]:
        """rank -> (last step, seconds since its last step end or collective enter)."""
        progress = {}
        for r in range(len(w.nodes)):
            last = max(w.last_end_ns.get(r, 0), w.last_enter_ns.get(r, 0))
            progress[r] = (w.last_step.get(r, 0), (now_ns - last) / 1e9 if last else math.inf)
        return progress

    def _judge_hang(self, w: _Watched, kind: str, seconds: float, threshold: float, horizon_ns: int,
                    progress: dict, why: str | None, now: float) -> list[Incident]:
        """Diagnose (at most every interval, and never more than half the time) and decide;
        kind "early" (``_early``) only starts the verdict's clock."""
        cfg = self._cfg
        large = w.fronts is not None and w.fronts.rows_applied > 0
        if now >= w.next_diagnosis:
            t = time.monotonic()
            settle = threshold if kind == "startup" or large else verdict_settle_s(threshold)
            w.last_diagnosis = self._diagnose(w.number, settle, horizon_ns)
            took = time.monotonic() - t
            w.next_diagnosis = time.monotonic() + max(cfg.interval_s, took)
        d = w.last_diagnosis
        verdict, culprits, summary = (d.verdict, d.culprit_ranks, d.summary) if d else (None, [], "")
        # A verdict counts once it has held for VERDICT_STABLE_S: rows reach the store a
        # little apart per rank, and a rank whose entry is not stored yet looks like the
        # odd one out for a moment (a "mismatch" naming the wrong rank). Not so for a large
        # job's verdict: it is made on pulled entries only once every member's are stored
        # (or on the fronts, after waiting fronts_pull.PULL_WAIT_S for them).
        key = (verdict, tuple(culprits))
        if key != w.verdict_key:
            w.verdict_key, w.verdict_since = key, now
        if kind == "early":
            return []
        if verdict in ("hang", "mismatch") and not large and now - w.verdict_since < VERDICT_STABLE_S:
            return []  # judge again next interval
        with self._lock:
            if kind == "startup":
                incident = detectors.startup_hang(seconds, cfg.startup_timeout_s, verdict, culprits, summary,
                                                  w.nodes)
            else:
                incident = detectors.decide_hang(seconds, threshold, cfg.unconfirmed_hang_s, verdict, culprits,
                                                 summary, progress, w.nodes, why)
            return self._once(w, (IncidentKind.HANG,), incident)

    # -- silent data corruption -----------------------------------------------------------

    def _sdc_verdicts(self, w: _Watched) -> list[Incident]:
        """Side incidents of the watched attempt's verdict rows stored since the last read."""
        try:
            # verdict rows are few (one per triage): read them all, judge each once
            rows = self._store.sdc_checks(self._job_id, w.number, kind="verdict")
        except Exception:  # noqa: BLE001 - read again at the next poll
            log.exception("reading the SDC checks of attempt %d failed", w.number)
            return []
        found: list[Incident] = []
        with self._lock:
            if self._watched is not w:
                return []
            for row in rows:
                key = (IncidentKind.SDC, row.id)
                if key in w.fired:
                    continue
                w.fired.add(key)  # judged: a clean or persistent verdict is not read twice either
                incident = detectors.sdc_verdict_incident(SdcVerdict.from_row(row), w.nodes)
                if incident is not None:
                    found.append(incident)
        return found

    def _diagnose(self, attempt: int, settle_s: float, horizon_ns: int) -> Diagnosis | None:
        """The flight recorder's verdict over the newest collectives, as of ``horizon_ns``,
        counting only waits older than ``settle_s``; None if the store cannot say."""
        w = self._watched
        if w is not None and w.number == attempt and w.fronts is not None and w.fronts.rows_applied:
            # a large job: its steps stalled past the threshold already, so the suspects'
            # waits need only be as old as when their entries were asked for (the prefetch's
            # settle, the same suspect: not pulled again), not the threshold once more
            return self._pull_of(w).diagnose(w.fronts, self._lock, prefetch_settle_s(settle_s), horizon_ns)
        try:
            traces = recent_traces(self._store, self._job_id, attempt, DIAGNOSIS_SEQS)
            return diagnose(traces, DiagnosisConfig(settle_s=settle_s), now_ns=horizon_ns)
        except Exception:  # noqa: BLE001 - no verdict is a verdict (unconfirmed path)
            log.exception("live diagnosis of attempt %d failed", attempt)
            return None

    def _job_total_steps(self) -> int | None:
        if self._total_steps is None:
            try:
                self._total_steps = self._store.get_job(self._job_id).total_steps
            except Exception:  # noqa: BLE001 - asked again next check
                log.debug("could not read the job's total steps", exc_info=True)
        return self._total_steps

