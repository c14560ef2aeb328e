"""A large job's suspects confirmed on raw entries pulled from their agents.

A large job's agents send collective fronts, not collectives (``controlplane.wavefront``).
While a hang is suspected, the fronts' verdict names the suspects and their groups;
``FrontsPull`` asks the agents of those groups' members for their newest
``PULL_ENTRIES`` raw entries (a ``TracePull`` through the watchdog's ``send``), keeps the
answers as they are observed (``PulledEntries``), and once every member's are in, the
flight recorder diagnoses those groups. A pull is made already at ``prefetch_settle_s`` of
the hang threshold, so that the answers are in when it passes. Entries that do not come,
or whose verdict names no culprit, within ``PULL_WAIT_S`` of the pull leave the decision
to the fronts' own verdict.

Invariants:
  * One pull per suspect (verdict, culprits, groups); a changed suspect is pulled again.
  * A pull asks at most ``PULL_MAX_NODES`` nodes; a suspicion over more is left to the
    fronts.
  * Runs on the watchdog thread; the fronts are read under the watchdog's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fleet.controlplane.diagnosis import Diagnosis, DiagnosisConfig, diagnose, recent_traces
from fleet.controlplane.pulled_entries import PulledEntries
from fleet.controlplane.store import CollectiveRow
from fleet.controlplane.wavefront import FrontVerdict, Wavefronts
from fleet.proto import events_pb2

log = logging.getLogger(__name__)

#: Raw entries per (rank, group) a large job's agents are asked for (``TracePull``) when
#: the fronts show a suspect: the window the diagnosis reads and ``fleet replay`` shows.
PULL_ENTRIES = 32
#: How long the watchdog waits for pulled entries before it decides on the fronts alone.
PULL_WAIT_S = 2.0
#: Most nodes one pull asks. A hang's suspect groups span a few hundred (a 512-way data
#: parallel group); a verdict whose members span more blames thousands of ranks at once,
#: which is telemetry not yet in (agents reconnecting after a controller restart), not a
#: hang to confirm, and pulling all their entries would bury the ingest under them.
#: Such a verdict is left to the fronts alone.
PULL_MAX_NODES = 1024
#: The share of the hang threshold a large job has stalled for (and its suspects waited
#: for) when their raw entries are asked for: a pull's answers take a second or two from
#: hundreds of agents on a loaded controller, and must be in when the threshold passes.
PREFETCH_AT = 1 / 3
#: ... but never before half the threshold where that is under this (seconds): waits that
#: short come with first steps and checkpoints of a fast job, and each would cost a pull.
PREFETCH_MIN_S = 1.0

#: How a command reaches a node's agent (``AgentRegistry.send``).
Send = Callable[[str, events_pb2.Command], None]


def prefetch_settle_s(threshold_s: float) -> float:
    """How long a large job has stalled (and its suspects waited) when their raw entries
    are asked for, given the hang threshold: a third of it, or half where that is under
    ``PREFETCH_MIN_S``."""
    return max(threshold_s * PREFETCH_AT, min(threshold_s / 2, PREFETCH_MIN_S))


@dataclass
class FrontsPull:
    """What was pulled for one attempt of a large job, and its verdicts."""

    job_id: str
    attempt: int
    nodes: list[str]                          # nodes[r]: rank r's node
    send: Send | None
    key: tuple = ()                           # (verdict, culprits, groups) whose entries were asked for
    sent: float = 0.0                         # monotonic: when
    entries: PulledEntries | None = None      # the answers, as observed

    def add(self, rows: Iterable[CollectiveRow]) -> None:
        """Keep the collective rows of an observed batch: a large job's are pulled entries."""
        if self.entries is None:
            self.entries = PulledEntries(self.job_id, self.attempt)
        self.entries.add(rows)

    def prefetch(self, fronts: Wavefronts, lock: threading.Lock, horizon_ns: int, settle_s: float) -> None:
        """Ask for the raw entries of the suspect the fronts show already (a hang's entries
        no longer change; a stall that resolves cost one small pull)."""
        if self.send is None:
            return
        with lock:
            front = fronts.verdict(horizon_ns, settle_s)
        if front is not None:
            self._ask(front, time.monotonic())

    def diagnose(self, fronts: Wavefronts, lock: threading.Lock, settle_s: float,
                 horizon_ns: int) -> Diagnosis | None:
        """The fronts name the suspect and its groups; their members' pulled entries are
        diagnosed by the flight recorder. Until they are in and it confirms (at most
        ``PULL_WAIT_S`` from the pull): no verdict; then the fronts' own."""
        with lock:
            front = fronts.verdict(horizon_ns, settle_s)
        if front is None:
            return None
        now = time.monotonic()
        self._ask(front, now)
        try:
            # the answers as observed (the store has them too, later): see pulled_entries
            source = (self.entries or PulledEntries(self.job_id, self.attempt)).members(front.members)
            traces = recent_traces(source, self.job_id, self.attempt, PULL_ENTRIES, groups=front.groups)
        except Exception:  # noqa: BLE001 - the fronts still say something
            log.exception("reading the pulled entries of attempt %d failed", self.attempt)
            traces = None
        members = {r for ranks in front.members.values() for r in ranks}
        if traces is not None and members <= {r for r, t in traces.ranks.items() if t.entries}:
            d = diagnose(traces, DiagnosisConfig(settle_s=settle_s), now_ns=horizon_ns)
            if d.verdict in ("hang", "mismatch") and d.culprit_ranks:
                return d
        # entries pulled early hold waits still short of the threshold: as the horizon moves
        # on they grow past it, and the flight recorder's verdict is waited for (from the
        # pull, PULL_WAIT_S at most) before the fronts' own is taken
        if now - self.sent >= PULL_WAIT_S:
            return front_diagnosis(front, self.attempt)
        return None

    def _ask(self, front: FrontVerdict, now: float) -> None:
        key = (front.verdict, tuple(front.culprits), tuple(front.groups))
        if key != self.key:
            self.key, self.sent = key, now
            self._pull(front)

    def _pull(self, front: FrontVerdict) -> None:
        """Ask the agents of the suspect groups' members for their newest raw entries."""
        if self.send is None:
            return
        by_node: dict[str, list[int]] = {}
        for rank in sorted({r for ranks in front.members.values() for r in ranks}):
            if 0 <= rank < len(self.nodes):
                by_node.setdefault(self.nodes[rank], []).append(rank)
        if len(by_node) > PULL_MAX_NODES:
            log.warning("attempt %d: %s suspected of %d rank(s) in %d group(s) over %d nodes (%s); not pulling "
                        "raw entries from more than %d nodes: the fronts decide", self.attempt, front.verdict,
                        len(front.culprits), len(front.groups), len(by_node), front.summary, PULL_MAX_NODES)
            return
        log.info("attempt %d: %s suspected (%s); pulling the raw entries of %d rank(s) on %d node(s)",
                 self.attempt, front.verdict, front.summary, sum(map(len, by_node.values())), len(by_node))
        for node, ranks in by_node.items():
            pull = events_pb2.TracePull(job_id=self.job_id, attempt=self.attempt, ranks=ranks,
                                        groups=front.groups, last=PULL_ENTRIES)
            try:
                self.send(node, events_pb2.Command(command_id=f"pull-{self.attempt}-{node}", job_id=self.job_id,
                                                   attempt=self.attempt, rank=-1, pull=pull))
            except Exception as exc:  # noqa: BLE001 - an unreachable agent: decide without it
                log.warning("could not ask node %s for raw entries: %s", node, exc)


def front_diagnosis(front: FrontVerdict, attempt: int) -> Diagnosis:
    """The fronts' verdict as a diagnosis (no raw entries behind it)."""
    return Diagnosis(source="fronts", attempt=attempt, verdict=front.verdict, culprit_ranks=list(front.culprits),
                     findings=[], ranks=[], missing_ranks=[], groups=[], wavefront=[],
                     summary=f"{front.summary} (from the agents' collective fronts)")
