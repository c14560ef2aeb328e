"""Collective fronts on the wire (``CollectiveFronts``); hand-written, not generated: the
codec of one message of the contract, shared by agents, the controller and the scale
benchmark's synthetic agents.

A large job's agents do not send every collective: per (rank, group) they send where the
rank stands (its front: the newest sequence number entered and completed, when, and the
signature of the op entered), and keep the raw entries in a ring for a ``TracePull``.
``signature`` is how a desync shows in a front: ranks at the same sequence number of one
group that entered different ops (or sizes, or dtypes) have different signatures.

``FrontRow`` is one row; ``pack`` and ``unpack`` convert rows to and from a block.
``FrontColumns`` is many blocks read at once into numpy columns (``merge``): the
controller's writer and watchdog work on those, column-wise. Converting a message's
repeated field to an array costs microseconds however short it is, so blocks are merged
first (a list ``extend`` per column, at C speed) and converted once. ``newest`` folds
blocks into one row per key.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from fleet.proto import events_pb2

#: Columns of a block, in ``FrontRow`` order (``strings`` aside).
COLUMNS = ("job_id", "attempt", "rank", "group", "group_size", "entered_seq", "completed_seq",
           "entered_ns", "completed_ns", "op", "signature", "step", "entered")
#: Columns whose values are indexes into ``strings``.
STRING_COLUMNS = ("job_id", "group", "op")


class FrontRow(NamedTuple):
    """Where one rank stands in one process group."""

    job_id: str
    attempt: int
    rank: int
    group: str
    group_size: int
    entered_seq: int     # newest seq entered (0: none yet)
    completed_seq: int   # newest seq completed
    entered_ns: int      # when entered_seq was entered
    completed_ns: int    # when completed_seq completed (0: none yet)
    op: str              # op of entered_seq ("" before any)
    signature: int       # ``signature(...)`` of entered_seq
    step: int            # training step of entered_seq
    entered: int         # ops entered since the previous row of this (rank, group)

    @property
    def open(self) -> bool:
        """True while the rank waits in a collective it entered (entered, not completed)."""
        return self.entered_seq > self.completed_seq


def signature(op: str, input_sizes: str, input_dtypes: str, output_sizes: str, output_dtypes: str) -> int:
    """A 32-bit digest of one op as ranks must agree on it: its canonical name and the JSON
    text of its sizes and dtypes (as ``fleet.proto.columns`` writes them)."""
    return zlib.crc32(f"{op}|{input_sizes}|{input_dtypes}|{output_sizes}|{output_dtypes}".encode())


def pack(rows: Iterable[FrontRow]) -> events_pb2.CollectiveFronts:
    """One block holding ``rows``."""
    strings: dict[str, int] = {}
    block = events_pb2.CollectiveFronts()
    cols: dict[str, list] = {c: [] for c in COLUMNS}
    for row in rows:
        for name, value in zip(COLUMNS, row):
            if name in STRING_COLUMNS:
                i = strings.get(value)
                if i is None:
                    i = strings[value] = len(strings)
                value = i
            cols[name].append(value)
    block.strings.extend(strings)
    for name, values in cols.items():
        getattr(block, name).extend(values)
    return block


def unpack(block: events_pb2.CollectiveFronts) -> list[FrontRow]:
    """The rows of ``block`` (no validation: the controller's ingest validates)."""
    strings = list(block.strings)
    columns = []
    for name in COLUMNS:
        values = getattr(block, name)
        columns.append([strings[i] for i in values] if name in STRING_COLUMNS else list(values))
    return [FrontRow(*values) for values in zip(*columns)]


class FrontColumns(NamedTuple):
    """A block's columns as int64 arrays (``COLUMNS`` names; those of ``STRING_COLUMNS``
    hold indexes into ``strings``)."""

    strings: list[str]
    cols: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.cols["job_id"])

    def rows(self) -> list[FrontRow]:
        """The block's rows."""
        names = self.strings
        columns = [[names[i] for i in self.cols[c].tolist()] if c in STRING_COLUMNS else self.cols[c].tolist()
                   for c in COLUMNS]
        return [FrontRow(*values) for values in zip(*columns)]


def merge(blocks: Iterable[events_pb2.CollectiveFronts]) -> FrontColumns:
    """The rows of ``blocks`` (validated: columns of equal length) as one ``FrontColumns``,
    in order, string indexes resolved to one table."""
    values: dict[str, list[int]] = {c: [] for c in COLUMNS}
    texts: list[str] = []
    offsets: list[int] = []
    lengths: list[int] = []
    for block in blocks:
        offsets.append(len(texts))
        lengths.append(len(block.job_id))
        texts.extend(block.strings)
        for name, column in values.items():
            column.extend(getattr(block, name))
    strings: dict[str, int] = {}
    ids = np.fromiter((strings.setdefault(t, len(strings)) for t in texts), dtype=np.int64, count=len(texts))
    base = np.repeat(np.asarray(offsets, dtype=np.int64), lengths)
    cols = {}
    for name, column in values.items():
        array = np.array(column, dtype=np.int64)
        cols[name] = ids[base + array] if name in STRING_COLUMNS and len(array) else array
    return FrontColumns(list(strings), cols)


def newest(blocks: Iterable[events_pb2.CollectiveFronts]) -> list[FrontRow]:
    """One row per (job, attempt, rank, group) of ``blocks``: the one furthest on (the
    highest ``entered_seq``, then ``completed_seq``; of equals, the later one), its
    ``entered`` the sum over the key's rows. Column-wise: a few numpy passes over all rows,
    not a Python step per row, so a large job's reports fold cheaply."""
    merged = merge(blocks)
    if not len(merged):
        return []
    col = merged.cols
    key = (col["group"], col["rank"], col["attempt"], col["job_id"])
    order = np.lexsort((np.arange(len(merged)), col["completed_seq"], col["entered_seq"], *key))
    ordered = [k[order] for k in key]
    last = np.ones(len(order), dtype=bool)  # the last row of each key's run
    last[:-1] = np.logical_or.reduce([k[1:] != k[:-1] for k in ordered])
    starts = np.flatnonzero(np.concatenate(([True], last[:-1])))
    picked = {name: col[name][order[last]] for name in COLUMNS}
    picked["entered"] = np.add.reduceat(col["entered"][order], starts)
    return FrontColumns(merged.strings, picked).rows()
