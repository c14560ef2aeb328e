"""How a user program's ranks ended: who failed first, and whether a start-up failure repeats.

Pure functions over what the launchers reported (``RankFailure`` with ``exit_code``,
``exited_at``, ``traceback``, ``reached_pg``); no Ray, no store. The rank whose process
failed FIRST is the culprit: when one rank dies, its peers fail after it (gloo's
"Connection closed by peer", a timeout), and blaming the lowest rank, or the one whose
error reached the controller first, would name a victim. A death by signal counts as a
crash, a non-zero exit as an error (the flight recorder may still name a hung rank
behind it: ``detectors.attribute_with_trace``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from fleet.controlplane.detectors import Incident, ObservedFailure
from fleet.proto.kinds import IncidentKind
from fleet.workers.failures import describe_exit

#: Exits closer together than this are simultaneous: then a signal death is the cause.
SIMULTANEOUS_S = 0.005
#: How long ranks may go on after one exited 0 before creating its process group: they
#: may be about to exit too (a program that never uses the group); past it they are waiting.
EARLY_EXIT_GRACE_S = 5.0


def finished_ranks(returned: Mapping[int, Mapping[str, object]]) -> dict[int, bool]:
    """Ranks whose program exited 0 (``Workers.returned()``), and whether each had created
    its process group (the built-in trainer's ranks always had)."""
    return {r: bool(res.get("reached_pg", True)) for r, res in returned.items()}


def last_line(traceback: str) -> str:
    """The line a traceback ends with (the exception), or ""."""
    lines = [ln.strip() for ln in traceback.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def attribute_exits(failures: Sequence[ObservedFailure], finished: Mapping[int, bool] | None = None,
                    nodes: Sequence[str] | None = None) -> Incident | None:
    """Blame the rank whose program failed first; None when no failure carries an exit code
    (the built-in trainer's failures: ``detectors.attribute_failures``).

    ``finished``: ranks whose program exited 0, and whether each had created its process
    group (they are named in the evidence: a rank that left early explains its peers)."""
    exits = [f for f in failures if f.exit_code is not None]
    if not exits:
        return None
    first_at = min(f.exited_at for f in exits)
    early = [f for f in exits if f.exited_at - first_at <= SIMULTANEOUS_S]
    culprit = min(early, key=lambda f: (f.exit_code >= 0, f.rank))
    node = nodes[culprit.rank] if nodes is not None and 0 <= culprit.rank < len(nodes) else culprit.node
    evidence = f"rank {culprit.rank} on {node} {describe_exit(culprit.exit_code)}"
    if not culprit.reached_pg:
        evidence += " before creating its process group"
    cause = last_line(culprit.traceback) if culprit.exit_code > 0 else ""  # a signal leaves no exception
    if cause:
        evidence += f": {cause}"
    after = sorted((f for f in exits if f is not culprit), key=lambda f: f.exited_at)
    if after:
        evidence += "; then " + ", ".join(
            f"rank {f.rank} {describe_exit(f.exit_code)} {f.exited_at - culprit.exited_at:+.2f} s later"
            for f in after)
    done = sorted(r for r in (finished or {}) if r not in {f.rank for f in failures})
    if done:
        evidence += f"; rank(s) {done} had exited with code 0"
    kind = IncidentKind.CRASH if culprit.exit_code < 0 else IncidentKind.ERROR
    return Incident(kind, "exit", culprit.rank, node, evidence, traceback=culprit.traceback,
                    exit_code=culprit.exit_code)


class EarlyExitWatch:
    """Calls ``early_exit`` once a rank has been gone, before creating its process group,
    for ``EARLY_EXIT_GRACE_S`` (``reset`` for each attempt)."""

    def __init__(self) -> None:
        self._since: float | None = None  # monotonic: such a rank was first seen

    def reset(self) -> None:
        self._since = None

    def check(self, finished: Mapping[int, bool], running: Sequence[int], nodes: Sequence[str],
              now: float) -> Incident | None:
        early = {r: pg for r, pg in finished.items() if not pg}
        if not early:
            self._since = None
            return None
        if self._since is None:
            self._since = now
        if now - self._since < EARLY_EXIT_GRACE_S:
            return None
        return early_exit(early, running, nodes)


def explain_early_exit(incident: Incident, finished: Mapping[int, bool]) -> Incident:
    """A culprit whose program had already exited 0 (its peers still needed it) says so."""
    if incident.rank not in finished:
        return incident
    pg = "" if finished[incident.rank] else " before creating its process group"
    return dataclasses.replace(incident, evidence=f"{incident.evidence} (rank {incident.rank}'s program had "
                               f"exited with code 0{pg}: it left while its peers still needed it)")


def early_exit(finished: Mapping[int, bool], running: Sequence[int], nodes: Sequence[str]) -> Incident | None:
    """A rank whose program exited 0 before creating its process group while others still
    run: they wait for it in the rendezvous until their timeout. None otherwise."""
    left = sorted(r for r, reached_pg in finished.items() if not reached_pg)
    if not left or not running:
        return None
    rank = left[0]
    node = nodes[rank] if 0 <= rank < len(nodes) else ""
    return Incident(IncidentKind.ERROR, "exit", rank, node,
                    f"rank {rank} on {node} exited with code 0 before creating its process group; ranks "
                    f"{sorted(running)} wait for it in the rendezvous (its program returned early: is "
                    "init_process_group reached on every rank?)", exit_code=0)


def same_startup_failure(previous: Incident | None, current: Incident) -> bool:
    """Whether two attempts that both failed before any progress failed the same way: the
    same kind, exit code and exception line, numbers aside (on any rank: which rank fails
    first varies, and messages often name it)."""
    if previous is None or current.exit_code is None:
        return False
    return (previous.kind, previous.exit_code, _shape(last_line(previous.traceback))) == \
        (current.kind, current.exit_code, _shape(last_line(current.traceback)))


def _shape(line: str) -> str:
    """An exception line with its numbers left out: "... on rank 3" fails like "... on rank 0"."""
    return re.sub(r"\d+", "#", line)
