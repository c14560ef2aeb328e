"""Failure detection and attribution: pure functions over snapshots.

No Ray, no gRPC, no store: callers pass what they observed (literal numbers, seconds
and ranks) and get back a decision with the reason string that is stored and shown to
the user. ``controlplane.watchdog`` keeps the live state these are applied to while an
attempt runs; the controller applies ``attribute_failures`` when ranks end badly.

Incident kinds: crash (a rank's process died), error (a rank raised), hang (ranks
stopped progressing), desync (ranks issued different collectives), straggler (one rank
consistently late), nan (a non-finite loss), loss_spike, agent_loss (a node agent went
silent), node_loss, sdc (silent data corruption proven by comparing copies: a
persistent one ends the attempt through the ranks' own ``SdcError``, a transient or
ambiguous one is a verdict row the watchdog reads). Every incident names a rank (-1 if
none), its node ("" if none), the detector that fired and its evidence; an SDC incident
also the step the next attempt may restore at most (``rollback_step``).

Responses: what the controller does about an incident a detector raised while the
attempt runs is the kind's ``DetectorAction`` (``detect.<kind>.action``):
``restart`` (acted on as always), ``quarantine`` (its node at once) or ``observe``
(stored with what acting would have done, ``observed_outcome``; nothing else).
Phases: a rank inside a named phase (checkpointing, eval, a program's own) is not
hung until that phase's timeout passes (``phase_hang_threshold``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Protocol

import numpy as np

from fleet.controlplane.policy import QuarantineDecision
from fleet.controlplane.sdc import PERSISTENT_DETECTOR, SdcFailure, SdcVerdict, detector_of
from fleet.proto.kinds import IncidentKind


class ObservedFailure(Protocol):
    """What the orchestrator saw of one rank's bad end."""

    rank: int
    node: str
    actor_died: bool
    error: str
    nonfinite_step: int                # > 0: the rank failed on a non-finite loss at this step
    nonfinite_ranks: Sequence[int]     # ...and these ranks' own loss was not finite
    exit_code: int | None              # a launched process's exit code (negative: signal)
    traceback: str                     # ...its traceback or output tail
    exited_at: float                   # ...when it exited, Unix seconds (0: unknown)
    reached_pg: bool                   # ...whether it had created its process group
    sdc: SdcFailure | None             # the rank raised SdcError (persistent silent data corruption)


@dataclass(frozen=True)
class Incident:
    """A detected failure, blamed on one rank and node, with evidence. ``kind`` may be
    given as its string value; it is an ``IncidentKind`` once built (ValueError if none)."""

    kind: IncidentKind  # see the module docstring
    detector: str
    rank: int          # -1: no rank can be named
    node: str          # "": no node can be named
    evidence: str
    #: the culprit's traceback (a user entrypoint's error file or output tail; "" if none)
    traceback: str = ""
    #: the culprit process's exit code (negative: killed by that signal); None if unknown
    exit_code: int | None = None
    #: silent data corruption: the newest step verified before it, which the next attempt
    #: restores at most (None: no rollback is needed)
    rollback_step: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", IncidentKind(self.kind))


def _node_of(rank: int, nodes: Sequence[str] | None, failures: Iterable[ObservedFailure] = ()) -> str:
    if nodes is not None and 0 <= rank < len(nodes):
        return nodes[rank]
    return next((f.node for f in failures if f.rank == rank), "")


def attribute_failures(failures: Sequence[ObservedFailure],
                       nodes: Sequence[str] | None = None) -> Incident | None:
    """Blame the failure of an attempt on one rank.

    Silent data corruption is the cause when a rank raised ``SdcError`` (every rank does,
    after the same triage): its suspect is named, with the rollback step. Else a
    non-finite loss is the cause when any rank reports one (``nonfinite_step`` > 0):
    the first of its ``nonfinite_ranks`` is named, or the reporting rank when none is
    listed (its node from ``nodes``, where ``nodes[r]`` is rank r's node). Else a rank
    whose process died is the cause; ranks that merely raised (typically a gloo
    "connection closed by peer" because their partner died) are its victims. With several
    deaths, the lowest rank is named and the others are listed as evidence.
    """
    if not failures:
        return None
    sdc = _sdc_incident(failures, nodes)
    if sdc is not None:
        return sdc
    nan = _nonfinite_incident(failures, nodes)
    if nan is not None:
        return nan
    died = sorted((f for f in failures if f.actor_died), key=lambda f: f.rank)
    if died:
        culprit = died[0]
        others = [f.rank for f in failures if f.rank != culprit.rank]
        evidence = f"rank {culprit.rank} on {culprit.node}: {culprit.error}"
        if others:
            evidence += f"; then ranks {others} failed"
        return Incident(IncidentKind.CRASH, "crash", culprit.rank, culprit.node, evidence)
    first = min(failures, key=lambda f: f.rank)
    return Incident(IncidentKind.ERROR, "crash", first.rank, first.node, f"rank {first.rank} raised: {first.error}")


def _nonfinite_incident(failures: Sequence[ObservedFailure], nodes: Sequence[str] | None) -> Incident | None:
    reports = sorted((f for f in failures if f.nonfinite_step > 0), key=lambda f: f.rank)
    if not reports:
        return None
    reporter = reports[0]
    step, ranks = reporter.nonfinite_step, list(reporter.nonfinite_ranks)
    rank = ranks[0] if ranks else reporter.rank
    node = _node_of(rank, nodes, failures)
    return Incident(IncidentKind.NAN, "nan", rank, node,
                    f"non-finite loss at step {step} on rank(s) {ranks or [reporter.rank]} "
                    f"(raised by rank(s) {[f.rank for f in reports]})")


def _sdc_incident(failures: Sequence[ObservedFailure], nodes: Sequence[str] | None) -> Incident | None:
    reports = sorted((f for f in failures if getattr(f, "sdc", None) is not None), key=lambda f: f.rank)
    if not reports:
        return None
    sdc = reports[0].sdc
    assert sdc is not None
    node = _node_of(sdc.rank, nodes, failures) if sdc.rank >= 0 else ""
    who = f"rank {sdc.rank}" + (f" on {node}" if node else "") if sdc.rank >= 0 else "no rank"
    evidence = (f"{sdc.verdict} silent data corruption first seen at step {sdc.step}: suspect {who}; "
                f"{sdc.evidence}; roll back to step {sdc.rollback_step} (raised by rank(s) "
                f"{[f.rank for f in reports]})")
    detector = PERSISTENT_DETECTOR if sdc.verdict == "persistent" else detector_of(sdc.verdict)
    return Incident(IncidentKind.SDC, detector, sdc.rank, node, evidence, rollback_step=sdc.rollback_step)


def sdc_verdict_incident(verdict: SdcVerdict, nodes: Sequence[str]) -> Incident | None:
    """The side incident of a triage verdict the ranks went on after: transient or
    ambiguous (they rolled back in memory). None for "clean" (the trigger was the data's)
    and for "persistent", which ends the attempt through the ranks' ``SdcError`` instead."""
    if verdict.verdict not in ("transient", "ambiguous"):
        return None
    node = _node_of(verdict.suspect, nodes) if verdict.suspect >= 0 else ""
    return Incident(IncidentKind.SDC, detector_of(verdict.verdict), verdict.suspect, node,
                    verdict.describe(node), rollback_step=verdict.rollback_step)


def attribute_with_trace(incident: Incident, verdict: str, culprit_ranks: Sequence[int], summary: str,
                         nodes: Sequence[str]) -> Incident:
    """Blame the rank the flight recorder names when no process died.

    Ranks that merely raised (a process-group timeout, a closed connection) are usually
    the victims of a rank that hung or called the wrong collective; the desync verdict
    (controlplane/diagnosis) names that rank. A process death stays the cause.
    """
    if incident.kind is not IncidentKind.ERROR or verdict not in ("hang", "mismatch") or not culprit_ranks:
        return incident
    rank = culprit_ranks[0]
    node = nodes[rank] if 0 <= rank < len(nodes) else incident.node
    kind = IncidentKind.HANG if verdict == "hang" else IncidentKind.DESYNC
    return Incident(kind, "flight-recorder", rank, node,
                    f"{summary} Then: {incident.evidence}")


# -- hangs ----------------------------------------------------------------------------------

def hang_threshold_s(step_times_s: Sequence[float], factor: float, floor_s: float) -> float:
    """How long no rank may finish a step before a hang is suspected, seconds:
    ``factor`` x the median of the recent step times, never less than ``floor_s``."""
    times = np.fromiter(step_times_s, dtype=np.float64, count=len(step_times_s))
    times = times[np.isfinite(times) & (times >= 0)]  # a large job keeps ~100k of them: no Python loop
    return max(factor * float(np.median(times)), floor_s) if len(times) else floor_s


def phase_hang_threshold(threshold_s: float, phases: Mapping[int, str],
                         timeouts_s: Mapping[str, float]) -> tuple[float, str]:
    """The hang threshold while ranks are in named phases, seconds, and the note the
    evidence carries ("" when no phase changed it).

    ``phases`` maps rank -> the phase it is in ("" or absent: none); ``timeouts_s`` is
    ``detect.phase_timeouts_s``. In a synchronous job one rank in a long phase (rank 0
    writing a checkpoint) holds up the others, so the longest timeout of any rank's phase
    applies, never less than ``threshold_s``; a phase without a timeout changes nothing."""
    timed = [(timeouts_s[p], r, p) for r, p in phases.items() if p and p in timeouts_s]
    if not timed:
        return threshold_s, ""
    timeout, rank, phase = max(timed, key=lambda t: (t[0], -t[1]))
    if timeout <= threshold_s:
        return threshold_s, ""
    return timeout, f"rank {rank} is in phase {phase!r} (detect.phase_timeouts_s.{phase}: {timeout:g} s)"


def collective_hang_threshold_s(gaps_s: Iterable[float], factor: float, floor_s: float) -> float:
    """How long no rank may enter (or complete) a collective before a hang is suspected,
    for a job that reports no steps, seconds: ``factor`` x the LARGEST of the recent gaps
    between one rank's consecutive collective enters, never less than ``floor_s``.

    The largest, not a median: a DDP step issues many bucket all-reduces a few
    milliseconds apart and then computes for most of the step with no collective at
    all; a threshold below that compute gap would call every slow step a hang."""
    gaps = [g for g in gaps_s if math.isfinite(g) and g >= 0]
    return max(factor * max(gaps), floor_s) if gaps else floor_s


def collective_stall_reason(stalled_s: float, threshold_s: float, largest_gap_s: float, factor: float) -> str:
    """The evidence sentence of a stall judged from collectives (``decide_hang``'s ``why``)."""
    learned = factor * largest_gap_s
    cadence = f"largest recent gap {largest_gap_s:.1f} s x hang_factor {factor:g}"
    source = (f"from the job's collective cadence ({cadence})" if learned >= threshold_s else
              f"from hang_floor_s (the job's collective cadence gives {learned:.1f} s: {cadence})")
    return f"no collective entered or completed for {stalled_s:.1f} s, threshold {threshold_s:.1f} s {source}"


def _confirmed(verdict: str | None, culprit_ranks: Sequence[int], summary: str, nodes: Sequence[str],
               why: str) -> Incident | None:
    """The incident of a flight-recorder verdict that names culprits, else None."""
    if verdict not in ("hang", "mismatch") or not culprit_ranks:
        return None
    rank = culprit_ranks[0]
    return Incident(IncidentKind.HANG if verdict == "hang" else IncidentKind.DESYNC, "hang", rank, _node_of(rank, nodes),
                    f"{why}; flight recorder: {summary}")


def oldest_rank(progress: Mapping[int, tuple[int, float]]) -> int | None:
    """The rank that progressed least recently: ``progress`` maps rank -> (last step,
    seconds since its last step ended or collective started; ``math.inf`` if never).
    None when no rank stands out (no rank, or a tie for oldest)."""
    if not progress:
        return None
    idle = max(i for _, i in progress.values())
    oldest = [r for r, (_, i) in progress.items() if i == idle]
    return oldest[0] if len(oldest) == 1 else None


def decide_hang(stalled_s: float, threshold_s: float, unconfirmed_s: float, verdict: str | None,
                culprit_ranks: Sequence[int], summary: str, progress: Mapping[int, tuple[int, float]],
                nodes: Sequence[str], why: str | None = None) -> Incident | None:
    """Whether an attempt whose ranks finished no step for ``stalled_s`` hangs.

    Past ``threshold_s`` the flight recorder decides: a hang verdict names the rank the
    others wait for (a mismatch verdict makes it a desync). The verdict must come from a
    diagnosis that counts only waits older than the threshold (``DiagnosisConfig.settle_s``),
    since ranks normally enter a collective at different times. Without a verdict naming
    a culprit, the stall is a hang once it is ``unconfirmed_s`` past the threshold, blamed
    on the rank with the oldest ``progress`` (rank -1 when none stands out).
    ``verdict`` None: no diagnosis could be made. ``why`` describes the stall in the
    evidence (default: no step finished; ``collective_stall_reason`` for a job without steps).
    """
    if stalled_s <= threshold_s:
        return None
    if why is None:
        why = f"no rank finished a step for {stalled_s:.1f} s (hang threshold {threshold_s:.1f} s)"
    confirmed = _confirmed(verdict, culprit_ranks, summary, nodes, why)
    if confirmed is not None:
        return confirmed
    if stalled_s <= threshold_s + unconfirmed_s:
        return None
    seen = f"the flight recorder named no culprit ({verdict or 'no diagnosis'})"
    rank = oldest_rank(progress)
    if rank is None:
        return Incident(IncidentKind.HANG, "hang", -1, "", f"unconfirmed: {why} and {seen}; no rank stands out")
    step, idle = progress[rank]
    ago = "never progressed" if math.isinf(idle) else f"progressed last, {idle:.1f} s ago (step {step})"
    return Incident(IncidentKind.HANG, "hang", rank, _node_of(rank, nodes),
                    f"unconfirmed: {why} and {seen}; rank {rank} {ago}, the longest ago")


def startup_hang(waited_s: float, timeout_s: float, verdict: str | None, culprit_ranks: Sequence[int],
                 summary: str, nodes: Sequence[str]) -> Incident | None:
    """An attempt that finished no step ``waited_s`` after it started hangs once that is
    past ``timeout_s``: on the culprit of a flight-recorder verdict, else on no rank."""
    if waited_s <= timeout_s:
        return None
    why = f"no step finished {waited_s:.0f} s after the attempt started (startup timeout {timeout_s:g} s)"
    confirmed = _confirmed(verdict, culprit_ranks, summary, nodes, why)
    if confirmed is not None:
        return confirmed
    return Incident(IncidentKind.HANG, "hang", -1, "",
                    f"unconfirmed: {why}; the flight recorder named no culprit ({verdict or 'no diagnosis'})")


# -- stragglers -----------------------------------------------------------------------------

def collective_laggard(enter_ns: Mapping[int, int]) -> tuple[int, float] | None:
    """The member that entered one collective last (lowest rank on a tie) and how many
    seconds after the median of the other members; None with fewer than two members."""
    if len(enter_ns) < 2:
        return None
    rank = max(sorted(enter_ns), key=lambda r: enter_ns[r])
    others = [t for r, t in enter_ns.items() if r != rank]
    return rank, (enter_ns[rank] - median(others)) / 1e9


def step_laggard(collectives: Iterable[Mapping[int, int]], lag_s: float) -> tuple[int, float] | None:
    """The rank that entered one step's collectives (each: rank -> enter_ns, every member
    present) last by the most, when that is more than ``lag_s`` seconds; else None."""
    worst: tuple[int, float] | None = None
    for enter_ns in collectives:
        found = collective_laggard(enter_ns)
        if found is not None and found[1] > lag_s and (worst is None or found[1] > worst[1]):
            worst = found
    return worst


def detect_straggler(laggards: Sequence[tuple[int, int, float] | None], steps: int,
                     nodes: Sequence[str]) -> Incident | None:
    """A straggler: the same rank was each step's laggard in the last ``steps`` consecutive
    steps. ``laggards``, oldest first: per step judged, ``(step, rank, lag_s)`` from
    ``step_laggard``, or None when no rank was late by more than the limit."""
    recent = list(laggards)[-steps:] if steps > 0 else []
    if len(recent) < steps or any(x is None for x in recent):
        return None
    picked = [x for x in recent if x is not None]
    ranks = {rank for _, rank, _ in picked}
    numbers = [step for step, _, _ in picked]
    if len(ranks) != 1 or numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return None
    rank = picked[0][1]
    lag = median(lag for _, _, lag in picked)
    return Incident(IncidentKind.STRAGGLER, "straggler", rank, _node_of(rank, nodes),
                    f"rank {rank} entered collectives last in each of {steps} consecutive steps "
                    f"({numbers[0]}-{numbers[-1]}), a median {lag:.2f} s after the other members")


# -- losses ---------------------------------------------------------------------------------

def nan_step_incident(step: int, rank: int, loss: float, nodes: Sequence[str]) -> Incident | None:
    """The nan incident of a step that rank ``rank`` reported with a non-finite ``loss``
    (``nodes[r]`` is rank r's node); None when the loss is finite. For programs that go on
    after a NaN (a user's script): the built-in trainer raises on one itself."""
    if math.isfinite(loss):
        return None
    node = _node_of(rank, nodes)
    return Incident(IncidentKind.NAN, "nan", rank, node,
                    f"rank {rank} on {node or 'no node'} reported a non-finite loss ({loss}) at step {step}")


def loss_spike(recent_losses: Sequence[float], loss: float, factor: float, window: int) -> bool:
    """True when ``loss`` is above ``factor`` x the median of the last ``window`` finite
    losses of ``recent_losses`` (oldest first). Never with fewer than ``window`` of them,
    with ``factor`` <= 0 (off), for a non-finite ``loss`` (the nan detector's case) or a
    median <= 0."""
    if factor <= 0 or window <= 0 or not math.isfinite(loss):
        return False
    finite = [x for x in recent_losses if math.isfinite(x)][-window:]
    if len(finite) < window:
        return False
    mid = median(finite)
    return mid > 0 and loss > factor * mid


def loss_spike_incident(step: int, loss: float, recent_losses: Sequence[float], factor: float,
                        window: int) -> Incident | None:
    """The loss_spike incident of step ``step`` (see ``loss_spike``), or None. The loss is
    the global mean, so no rank is named."""
    if not loss_spike(recent_losses, loss, factor, window):
        return None
    mid = median([x for x in recent_losses if math.isfinite(x)][-window:])
    return Incident(IncidentKind.LOSS_SPIKE, "loss", -1, "",
                    f"loss {loss:.4g} at step {step} is {loss / mid:.1f}x the median {mid:.4g} of the "
                    f"previous {window} steps (limit {factor:g}x)")


# -- agents ---------------------------------------------------------------------------------

def agents_lost(silent_for: Mapping[str, float], timeout_s: float) -> list[str]:
    """Nodes whose agent was not heard from for more than ``timeout_s`` seconds, sorted."""
    return sorted(node for node, silent in silent_for.items() if silent > timeout_s)


def agent_loss_incident(node: str, silent_s: float, timeout_s: float, nodes: Sequence[str]) -> Incident:
    """The agent_loss incident of ``node``, named by its lowest rank (``nodes[r]`` is rank
    r's node; -1 when none runs there)."""
    ranks = [r for r, n in enumerate(nodes) if n == node]
    on = f"; rank(s) {ranks} run there" if ranks else ""
    return Incident(IncidentKind.AGENT_LOSS, "agent", ranks[0] if ranks else -1, node,
                    f"the agent of {node} was not heard from for {silent_s:.1f} s "
                    f"(timeout {timeout_s:g} s){on}")


# -- restarts -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    reason: str


def decide_restart(restarts_done: int, max_restarts: int, incident: Incident) -> RestartDecision:
    """Restart the attempt while the restart budget lasts; give up after. After silent
    data corruption the restart rolls back to the incident's ``rollback_step``."""
    if restarts_done < max_restarts:
        rollback = "" if incident.rollback_step is None else \
            f", rolling back to step {incident.rollback_step} (verified before the corruption)"
        return RestartDecision(
            True,
            f"{incident.kind} of rank {incident.rank} on {incident.node}: "
            f"restart {restarts_done + 1} of {max_restarts}{rollback}",
        )
    return RestartDecision(
        False, f"{incident.kind} of rank {incident.rank} on {incident.node}: "
        f"all {max_restarts} restarts used; giving up",
    )


# -- responses ------------------------------------------------------------------------------

class DetectorAction(enum.StrEnum):
    """What the controller does about an incident a detector raised (``detect.<kind>.action``)."""

    #: store the incident and what acting on it would have done; nothing else
    OBSERVE = "observe"
    #: act as fleet always has: a kind that ends the attempt restarts it, the others are
    #: recorded; each counts towards quarantining its node (``policy``)
    RESTART = "restart"
    #: quarantine the incident's node at once, then restart the attempt off it
    QUARANTINE = "quarantine"


#: The incident kinds a detector raises while the attempt runs, whose response
#: ``detect.<kind>.action`` chooses. Not crash, error, node_loss or controller_crash: a
#: rank that died or raised (or a lost controller) ends the attempt by itself.
DETECTOR_KINDS = (IncidentKind.HANG, IncidentKind.DESYNC, IncidentKind.STRAGGLER, IncidentKind.NAN,
                  IncidentKind.LOSS_SPIKE, IncidentKind.AGENT_LOSS, IncidentKind.SDC, IncidentKind.SLOW_COMM)
#: Detector kinds whose incidents never name a node (the loss is the global mean), so
#: ``quarantine`` has nothing to act on.
NO_NODE_KINDS = frozenset({IncidentKind.LOSS_SPIKE})


@dataclass(frozen=True)
class Response:
    """What the controller does about one detector incident while its attempt runs."""

    observed: bool        # store it with ``reason`` (what acting would have done); nothing else
    quarantine_now: bool  # quarantine the incident's node without counting incidents
    ends_attempt: bool    # tear the attempt down; the restart decision follows
    reason: str


def decide_response(incident: Incident, action: DetectorAction, restarts_done: int, max_restarts: int,
                    would_quarantine: QuarantineDecision) -> Response:
    """The response to a detector's ``incident`` under ``action``.

    ``restarts_done`` of ``max_restarts``: the job's restart budget; ``would_quarantine``:
    the policy's decision about the incident's node, counting this incident. ``restart``:
    the kind's usual course (a side incident ends the attempt only when the policy
    quarantines the node it runs on). ``quarantine`` without a node to blame is ``restart``."""
    if action is DetectorAction.OBSERVE:
        return Response(True, False, False, observed_outcome(incident, restarts_done, max_restarts,
                                                             would_quarantine))
    if action is DetectorAction.QUARANTINE and incident.node:
        return Response(False, True, True, f"{incident.kind} of rank {incident.rank} on {incident.node}: "
                        f"detect.{incident.kind}.action is quarantine")
    return Response(False, False, incident.kind.ends_attempt, would_quarantine.reason)


def observed_outcome(incident: Incident, restarts_done: int, max_restarts: int,
                     would_quarantine: QuarantineDecision) -> str:
    """What ``restart`` would have done about an observed incident, as stored and shown
    by ``fleet report``: "would restart the attempt (...)", "would quarantine node-1 (...)
    and restart the attempt (...)", or for a side incident "would record it and go on"."""
    restart = (f"restart the attempt (restart {restarts_done + 1} of {max_restarts})"
               if restarts_done < max_restarts else f"end the job (all {max_restarts} restarts used)")
    if would_quarantine.quarantine and incident.node:
        return f"would quarantine {incident.node} ({would_quarantine.reason}) and {restart}"
    if incident.kind.ends_attempt:
        return f"would {restart}"
    counted = f" ({would_quarantine.reason})" if incident.node else ""
    return f"would record it and go on{counted}"
