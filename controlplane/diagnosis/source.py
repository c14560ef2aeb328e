"""Diagnosis traces from stored collectives: the ``TraceSource`` Protocol and the adapter
that turns its records into a ``TraceSet``.

The store (``fleet.controlplane.store.Store``) satisfies ``TraceSource``; so can anything
else that keeps collectives as records with the attributes below (a test double, an
agent-side buffer at scale). Detection (the watchdog's live diagnosis, the controller's
attribution) and reporting (``fleet replay``) all build their traces here.

Invariants:
  * Records are canonical already (op and dtype names made so where they entered the
    store, ``fleet.proto.vocab``): nothing is renamed here. A point-to-point op's name
    carries its peer (``"send 0->1"``), which ``vocab.split_op`` takes apart.
  * Pure Python over the Protocol: no SQLAlchemy, torch, Ray or gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from fleet.controlplane.diagnosis.engine import Diagnosis, DiagnosisConfig, diagnose
from fleet.controlplane.diagnosis.traces import SignatureTable, TraceBuilder, TraceSet
from fleet.controlplane.lifecycle import AttemptState
from fleet.proto.flight_record import P2P_SUFFIX, p2p_group
from fleet.proto.vocab import P2P_OPS, split_op

#: Attempt states whose traces may still grow (their waits can be in flight).
LIVE_STATES = frozenset({AttemptState.PLACING, AttemptState.RUNNING})


class StoredCollective(Protocol):
    """One rank's record of one collective (``store.CollectiveRecord`` is one)."""

    @property
    def rank(self) -> int: ...
    @property
    def group(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def input_sizes(self) -> Sequence[Sequence[int]]: ...
    @property
    def output_sizes(self) -> Sequence[Sequence[int]]: ...
    @property
    def input_dtypes(self) -> Sequence[str]: ...
    @property
    def output_dtypes(self) -> Sequence[str]: ...
    @property
    def enter_ns(self) -> int: ...
    @property
    def exit_ns(self) -> int | None: ...
    @property
    def exit_estimated(self) -> bool: ...
    @property
    def duration_ns(self) -> int | None: ...
    @property
    def timing(self) -> int: ...
    @property
    def state(self) -> str: ...


class StoredGroup(Protocol):
    """What one rank declared of one process group (``store.ProcessGroupRecord``)."""

    @property
    def rank(self) -> int: ...
    @property
    def group(self) -> str: ...
    @property
    def desc(self) -> str: ...
    @property
    def ranks(self) -> Sequence[int]: ...


class StoredRank(Protocol):
    """A rank that belongs to the attempt (``store.RankRecord``)."""

    @property
    def rank(self) -> int: ...


class StoredAttempt(Protocol):
    """An attempt's number and state (``store.AttemptRecord``)."""

    @property
    def number(self) -> int: ...
    @property
    def state(self) -> AttemptState: ...


class TraceSource(Protocol):
    """Where stored collectives come from: the few reads the diagnosis needs."""

    def collectives(self, job_id: str, attempt: int) -> Iterable[StoredCollective]:
        """Every collective of the attempt."""
        ...

    def recent_collectives(self, job_id: str, attempt: int, per_group: int,
                           groups: Sequence[str] | None = None) -> Iterable[StoredCollective]:
        """The newest ``per_group`` collectives of each (rank, group) of the attempt (of
        ``groups`` only, when given)."""
        ...

    def process_groups(self, job_id: str, attempt: int, *,
                       groups: Sequence[str] | None = None) -> Iterable[StoredGroup]:
        """What each rank of the attempt declared of its groups (of ``groups`` only, when
        given: a large job's every declaration is tens of thousands of member lists)."""
        ...

    def ranks(self, job_id: str, attempt: int) -> Iterable[StoredRank]:
        """The ranks of the attempt (a rank that shipped nothing still belongs)."""
        ...

    def get_attempts(self, job_id: str) -> Sequence[StoredAttempt]:
        """The job's attempts."""
        ...


def attempt_traces(source: TraceSource, job_id: str, attempt: int,
                   rows: Iterable[StoredCollective] | None = None,
                   groups: Sequence[str] | None = None) -> TraceSet:
    """Every rank's stored collectives of one attempt (or just ``rows`` of them), as
    diagnosis traces. ``groups``: only these process groups and their members count (a
    large job's diagnosis around a suspect: its other groups' members left no rows)."""
    only = None if groups is None else set(groups)
    table = SignatureTable()
    builders: dict[int, TraceBuilder] = {}

    def builder(rank: int) -> TraceBuilder:
        b = builders.get(rank)
        if b is None:
            b = builders[rank] = TraceBuilder(rank, table, source="store")
        return b

    canonical: dict[tuple, tuple[int, ...]] = {}   # a group's members, sorted once, not per member
    for g in source.process_groups(job_id, attempt, groups=groups):
        key = tuple(g.ranks)
        members = canonical.get(key)
        if members is None:
            members = canonical[key] = tuple(sorted(int(r) for r in key))
        for name in (g.group, p2p_group(g.group)):
            builder(g.rank).declare_group(name, g.desc, members, canonical=True)
    for c in source.collectives(job_id, attempt) if rows is None else rows:
        if only is not None and c.group not in only and c.group.removesuffix(P2P_SUFFIX) not in only:
            continue
        b = builder(c.rank)
        op, meta = split_op(c.op)
        sig = table.intern(op, c.input_sizes, c.output_sizes, c.input_dtypes, c.output_dtypes)
        done = c.state != "started"
        if op in P2P_OPS:
            b.add_p2p(c.group, op, meta, c.seq, sig, c.enter_ns, done)
        else:
            b.add_collective(c.group, c.seq, sig, c.enter_ns, 0 if c.exit_estimated else (c.exit_ns or 0), done,
                             dur_ns=c.duration_ns or 0, timing=c.timing)
    ranks = {r: b.finish() for r, b in builders.items()}
    for r in source.ranks(job_id, attempt) if only is None else ():
        ranks.setdefault(r.rank, builder(r.rank).finish())
    return TraceSet(source=f"store:{job_id}", ranks=ranks, table=table, attempt=attempt)


def recent_traces(source: TraceSource, job_id: str, attempt: int, per_group: int,
                  groups: Sequence[str] | None = None) -> TraceSet:
    """The attempt's newest ``per_group`` collectives per (rank, group) as traces: what
    ``attempt_traces`` builds, bounded to a window, so that a live diagnosis costs the
    same at step 10 and at step 100,000. ``groups``: only these groups (``attempt_traces``)."""
    rows = (source.recent_collectives(job_id, attempt, per_group) if groups is None else
            source.recent_collectives(job_id, attempt, per_group, groups=groups))
    return attempt_traces(source, job_id, attempt, rows, groups)


def diagnose_attempt(source: TraceSource, job_id: str, attempt: int,
                     config: DiagnosisConfig = DiagnosisConfig()) -> tuple[TraceSet, Diagnosis]:
    """The traces and desync verdict of one attempt (a running one is judged as live)."""
    traces = attempt_traces(source, job_id, attempt)
    live = any(a.number == attempt and a.state in LIVE_STATES for a in source.get_attempts(job_id))
    return traces, diagnose(traces, config, now_ns=time.time_ns() if live else None)
