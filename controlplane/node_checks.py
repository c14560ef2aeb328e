"""Node checks on the controller: the known-answer GEMM test, asked of agents and judged.

An agent runs the test (``fleet.agent.gemm_check``) when a ``health_check`` command
reaches it, and by itself while its node is idle; every run comes back over its stream
as one ``SdcCheckEvent`` of kind "gemm" (rank -1, the agent's node; the command's job
and attempt, or none for an idle run), which ingest stores in ``sdc_checks`` like any
event, and which ``AgentServicer`` also hands to ``NodeChecks.observe``.

``observe`` keeps each node's verdict: ``nodes.health`` becomes "ok" or "failed" (or
"error": the test could not run) with the one-line reason in ``health_reason``, and a
failed test quarantines the node at once (actor policy, the reason naming the element, its error and bound): a product
that misses a derived bound is proof of a defective unit, not a symptom to count.
Results older than the newest one already seen for a node (an agent's resend after a
reconnect) change nothing.

``check(nodes, timeout_s)`` asks each node's agent to run the test now and waits,
bounded, for every result: what the pre-flight gate before placement (``preflight``)
and the release gate (ControlService ``CheckNode``, ``fleet release``) call. A node
without a connected agent, or whose result does not come in time, is reported as such
(``no-agent``, ``timed-out``) and is neither marked nor quarantined: that is no
evidence about its arithmetic.

No Ray and no gRPC here: commands go out through ``CommandSink`` (``AgentRegistry``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from fleet.controlplane.errors import FleetError, UnavailableError
from fleet.controlplane.lifecycle import NodeActor
from fleet.proto import events_pb2

log = logging.getLogger(__name__)

#: ``SdcCheckEvent.kind`` of a known-answer GEMM test.
GEMM_KIND = "gemm"
#: What ``NodeCheck.verdict`` can be. ``error``: the agent could not run the test (e.g.
#: torch failed to load): no evidence about the arithmetic, so no quarantine.
OK, FAILED, ERROR, NO_AGENT, TIMED_OUT = "ok", "failed", "error", "no-agent", "timed-out"
VERDICTS = (OK, FAILED, ERROR, NO_AGENT, TIMED_OUT)


class CommandSink(Protocol):
    """Delivers a command to a node's agent (``agent_server.AgentRegistry``);
    ``UnavailableError`` when the node has no connected agent."""

    def send(self, node_name: str, command: events_pb2.Command) -> None: ...


class NodeBook(Protocol):
    """Where verdicts go (``store.Store``)."""

    def set_node_health(self, name: str, health: str, reason: str) -> None: ...

    def quarantine_node(self, name: str, reason: str, *, actor: NodeActor = NodeActor.OPERATOR,
                        job_id: str | None = None) -> bool: ...


@dataclass(frozen=True)
class NodeCheck:
    """One node's known-answer GEMM test as the controller judged it.

    ``verdict``: ok | failed | error | no-agent | timed-out; ``reason``: one line for people.
    The rest describe the worst element (``row``, ``col``, its ``error`` and ``bound``)
    and the test (``dtype``, ``size``, ``device``, ``duration_s``; ``at``: Unix seconds
    the agent ran it); zero / empty without a result. ``quarantined``: this result
    moved the node to quarantine (False when it was there already)."""

    node: str
    verdict: str
    reason: str
    quarantined: bool = False
    error: float = 0.0
    bound: float = 0.0
    row: int = -1
    col: int = -1
    dtype: str = ""
    size: int = 0
    device: str = ""
    duration_s: float = 0.0
    at: float = 0.0
    command_id: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == OK


def judge(node: str, event: events_pb2.SdcCheckEvent) -> NodeCheck:
    """The verdict of one "gemm" event (pure). A detail that is not the agent's JSON
    (``agent.node_agent.GemmChecker``) still gives a verdict from ``ok``."""
    try:
        detail = json.loads(event.detail)
        if not isinstance(detail, dict):
            raise ValueError("not an object")
    except ValueError:
        detail = {"summary": event.detail}
    worst = detail.get("worst") if isinstance(detail.get("worst"), dict) else {}
    summary = str(detail.get("summary") or f"error {event.value or '?'}, bound {event.expected or '?'}")

    def field(name: str, kind: type, default: object) -> object:
        value = worst.get(name, default)
        try:
            return kind(value)
        except (TypeError, ValueError):
            return default

    verdict = OK if event.ok else ERROR if detail.get("error") else FAILED
    return NodeCheck(
        node=node, verdict=verdict,
        reason={OK: summary, ERROR: summary}.get(verdict, f"known-answer GEMM test failed: {summary}"),
        error=field("error", float, 0.0), bound=field("bound", float, 0.0), row=field("row", int, -1),
        col=field("col", int, -1), dtype=field("dtype", str, ""), size=field("size", int, 0),
        device=field("device", str, ""), duration_s=field("duration_s", float, 0.0),
        at=event.time_ns / 1e9, command_id=str(detail.get("command_id") or ""),
    )


def health_of(check: NodeCheck) -> tuple[str, str]:
    """(``nodes.health``, ``nodes.health_reason``) for a node whose last test is ``check``:
    "ok", "failed" or "error" (the column holds a short word), and the test's one line."""
    return check.verdict, check.reason


class NodeChecks:
    """Runs known-answer GEMM tests through the agents and keeps every node's verdict
    (thread-safe: ``observe`` runs on agent receiver threads, ``check`` on any)."""

    def __init__(self, book: NodeBook, commands: CommandSink,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._book = book
        self._commands = commands
        self._clock = clock
        self._cond = threading.Condition()
        self._latest_ns: dict[str, int] = {}
        self._waiting: set[str] = set()            # command ids a check() waits for
        self._results: dict[str, NodeCheck] = {}  # their results, until collected

    def observe(self, node: str, event: events_pb2.SdcCheckEvent) -> None:
        """Take in a "gemm" event from ``node``'s agent: store the verdict, quarantine a
        failed node, wake the ``check`` waiting for it. Other kinds are ignored."""
        if event.kind != GEMM_KIND:
            return
        check = judge(node, event)
        with self._cond:
            fresh = event.time_ns > self._latest_ns.get(node, 0)
            if fresh:
                self._latest_ns[node] = event.time_ns
        if fresh:
            check = self._record(check, event.job_id)
        with self._cond:
            if check.command_id in self._waiting:
                self._results[check.command_id] = check
                self._cond.notify_all()

    def _record(self, check: NodeCheck, job_id: str) -> NodeCheck:
        health, reason = health_of(check)
        try:
            self._book.set_node_health(check.node, health, reason)
            if check.verdict != FAILED:
                return check
            log.error("node %s: %s; quarantining it", check.node, check.reason)
            moved = self._book.quarantine_node(check.node, check.reason, actor=NodeActor.POLICY,
                                               job_id=job_id or None)
        except FleetError as exc:  # e.g. a node the store does not know: the verdict still stands
            log.error("node %s: could not store its GEMM test verdict (%s): %s", check.node, health, exc)
            return check
        return dataclasses.replace(check, quarantined=moved)

    def check(self, nodes: Iterable[str], timeout_s: float, *, job_id: str = "", attempt: int = 0,
              purpose: str = "on demand") -> dict[str, NodeCheck]:
        """Ask every node in ``nodes`` to run the test now; wait up to ``timeout_s``
        seconds in all for their results. One ``NodeCheck`` per node, in ``nodes``' order.
        ``job_id``, ``attempt``: what the results are stored under (none: a node check
        outside any job); ``purpose``: for the log."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s}")
        deadline = self._clock() + timeout_s
        sent: dict[str, str] = {}
        out: dict[str, NodeCheck] = {}
        for node in dict.fromkeys(nodes):
            command_id = uuid.uuid4().hex[:12]
            with self._cond:
                self._waiting.add(command_id)
            try:
                self._commands.send(node, events_pb2.Command(
                    command_id=command_id, job_id=job_id, attempt=attempt, rank=-1, health_check=True))
            except UnavailableError as exc:
                with self._cond:
                    self._waiting.discard(command_id)
                out[node] = NodeCheck(node, NO_AGENT, f"no GEMM test on {node}: {exc}")
                continue
            sent[node] = command_id
        if sent:
            log.info("GEMM test (%s) asked of %s", purpose, ", ".join(sent))
        with self._cond:
            while True:
                left = deadline - self._clock()
                if left <= 0 or all(c in self._results for c in sent.values()):
                    break
                self._cond.wait(min(left, 0.5))
            for node, command_id in sent.items():
                self._waiting.discard(command_id)
                result = self._results.pop(command_id, None)
                out[node] = result if result is not None else NodeCheck(
                    node, TIMED_OUT, f"no GEMM test result from {node} within {timeout_s:g} s")
        return {node: out[node] for node in dict.fromkeys(nodes)}

    def preflight(self, nodes: Iterable[str], timeout_s: float, *, job_id: str = "",
                  attempt: int = 0) -> dict[str, NodeCheck]:
        """The gate before an attempt is placed on ``nodes``: ``check`` them; place only
        on the nodes whose ``NodeCheck.ok``. A failed one is quarantined already."""
        return self.check(nodes, timeout_s, job_id=job_id, attempt=attempt, purpose="pre-flight")
