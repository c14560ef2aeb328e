"""A large job's pulled raw entries, kept by the watchdog as they arrive.

When the fronts name a suspect, the watchdog pulls the raw entries of the suspect groups'
members from their agents (``TracePull``). The answers come in as collective rows of
ordinary batches: the store writes them like any, and the watchdog sees the same rows
when the batch is observed, before its commit. Diagnosing from those rows, not from the
store, keeps the confirmation of a hang off the store's write latency, which at 16,384
ranks is seconds (every agent's batches queue ahead of the answer).

``PulledEntries`` keeps the rows of one attempt per (rank, group, seq), a completion
replacing its start as the store's upsert does, up to ``MAX_ROWS`` (the oldest (rank,
group) dropped first), and is a ``diagnosis.source.TraceSource`` over them, with the
groups' members as the fronts declared them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleet.controlplane.store.records import CollectiveRow

#: Rows kept at most (a 16,384-rank job's data-parallel group: 512 members x 32 entries).
MAX_ROWS = 200_000


@dataclass(frozen=True)
class _Entry:
    """A pulled row as the diagnosis reads a stored one (sizes and dtypes parsed)."""

    rank: int
    group: str
    seq: int
    op: str
    input_sizes: Sequence[Sequence[int]]
    output_sizes: Sequence[Sequence[int]]
    input_dtypes: Sequence[str]
    output_dtypes: Sequence[str]
    enter_ns: int
    exit_ns: int | None
    exit_estimated: bool
    duration_ns: int | None
    timing: int
    state: str


@dataclass(frozen=True)
class _Declared:
    rank: int
    group: str
    desc: str
    ranks: Sequence[int]


class PulledEntries:
    """Pulled collective rows of one attempt (see the module docstring). Not thread-safe:
    the watchdog's thread adds and reads."""

    def __init__(self, job_id: str, attempt: int) -> None:
        self.job_id, self.attempt = job_id, attempt
        self._rows: dict[tuple[int, str], dict[int, _Entry]] = {}
        self._count = 0
        self._members: Mapping[str, Sequence[int]] = {}

    def add(self, rows: Iterable[CollectiveRow]) -> None:
        for row in rows:
            if row.job_id != self.job_id or row.attempt != self.attempt:
                continue
            by_seq = self._rows.setdefault((row.rank, row.group), {})
            old = by_seq.get(row.seq)
            if old is None:
                self._count += 1
            elif row.state == "started" and old.state != "started":
                continue   # a completion is never undone by a late start
            by_seq[row.seq] = _entry(row)   # parsed once: a suspect is diagnosed every interval
        while self._count > MAX_ROWS and self._rows:
            oldest = next(iter(self._rows))
            self._count -= len(self._rows.pop(oldest))

    def members(self, members: Mapping[str, Sequence[int]]) -> PulledEntries:
        """Diagnose with these groups' members (the fronts' ``FrontVerdict.members``)."""
        self._members = members
        return self

    # -- diagnosis.source.TraceSource -----------------------------------------------------

    def recent_collectives(self, job_id: str, attempt: int, per_group: int,
                           groups: Sequence[str] | None = None) -> list[_Entry]:
        """The newest ``per_group`` rows of each (rank, group), of ``groups`` when given."""
        only = None if groups is None else set(groups)
        out = []
        for (rank, group), by_seq in sorted(self._rows.items()):
            if only is not None and group not in only:
                continue
            for seq in sorted(by_seq)[-per_group:]:
                out.append(by_seq[seq])
        return out

    def collectives(self, job_id: str, attempt: int) -> list[_Entry]:
        return self.recent_collectives(job_id, attempt, 1 << 62)

    def process_groups(self, job_id: str, attempt: int, *,
                       groups: Sequence[str] | None = None) -> list[_Declared]:
        return [_Declared(rank, group, "", list(ranks)) for group, ranks in self._members.items()
                if groups is None or group in groups for rank in ranks]

    def ranks(self, job_id: str, attempt: int) -> list:
        return []   # a pull's diagnosis names its groups: other ranks are not asked after

    def get_attempts(self, job_id: str) -> list:
        return []


def _entry(row: CollectiveRow) -> _Entry:
    return _Entry(row.rank, row.group, row.seq, row.op, json.loads(row.input_sizes), json.loads(row.output_sizes),
                  json.loads(row.input_dtypes), json.loads(row.output_dtypes), row.enter_ns, row.exit_ns,
                  row.exit_estimated, row.duration_ns, row.timing, row.state)
