"""Collective fronts on the wire (``CollectiveFronts``); hand-written, not generated: the
codec of one message of the contract, shared by agents, the controller and the scale
benchmark's synthetic agents.

A large job's agents do not send every collective: per (rank, group) they send where the
rank stands (its front: the newest sequence number entered and completed, when, and the
signature of the op entered), and keep the raw entries in a ring for a ``TracePull``.
``signature`` is how a desync shows in a front: ranks at the same sequence number of one
group that entered different ops (or sizes, or dtypes) have different signatures.

``FrontRow`` is one row; ``pack`` and ``unpack`` convert rows to and from a block.
A block's columns travel in ``packed`` (int64 little-endian, ``PACKED_COLUMNS`` order):
the controller reads a block with ``numpy.frombuffer``, not a Python step per value (the
repeated fields are still read, slowly, for senders that use them). ``FrontColumns`` is
many blocks as numpy columns (``merge``): the controller's writer and watchdog work on
those; ``newest`` folds blocks into one row per key.
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


#: Column order of ``CollectiveFronts.packed``: what stays the same for a (rank, group)
#: first, so a sender can keep those bytes and append the rest.
PACKED_COLUMNS = ("job_id", "rank", "group", "group_size", "attempt", "entered_seq", "completed_seq",
                  "entered_ns", "completed_ns", "op", "signature", "step", "entered")
_PACKED_DTYPE = np.dtype("<i8")
_COLUMN_SET = frozenset(COLUMNS)


class BadBlock(ValueError):
    """A block whose columns cannot be read (the message names the field)."""


def pack(rows: Iterable[FrontRow], *, packed: bool = True) -> events_pb2.CollectiveFronts:
    """One block holding ``rows``: its columns in ``packed`` (what agents send), or in the
    repeated fields with ``packed=False``."""
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
    if packed:
        block.packed = np.asarray([cols[c] for c in PACKED_COLUMNS], dtype=_PACKED_DTYPE).tobytes()
    else:
        for name, values in cols.items():
            getattr(block, name).extend(values)
    return block


def rows_in(block: events_pb2.CollectiveFronts) -> int:
    """How many rows ``block`` holds (of ``packed``, or of its repeated columns)."""
    if block.packed:
        return len(block.packed) // (_PACKED_DTYPE.itemsize * len(PACKED_COLUMNS))
    return len(block.job_id)


def packed_matrix(block: events_pb2.CollectiveFronts) -> np.ndarray | None:
    """``block.packed`` as a (columns x rows) int64 view in ``PACKED_COLUMNS`` order, None
    when the block is not packed; ``BadBlock`` when it cannot be read (a length that is not
    whole rows, or a repeated column set as well)."""
    packed = block.packed
    if not packed:
        return None
    width = _PACKED_DTYPE.itemsize * len(PACKED_COLUMNS)
    if len(packed) % width:
        raise BadBlock(f"fronts.packed: {len(packed)} bytes is not a whole number of "
                       f"{len(PACKED_COLUMNS)}-column int64 rows")
    if any(fd.name in _COLUMN_SET for fd, _ in block.ListFields()):  # set fields only: one C call
        raise BadBlock("fronts: both packed and repeated columns")
    return np.frombuffer(packed, dtype=_PACKED_DTYPE).reshape(len(PACKED_COLUMNS), -1)


def columns(block: events_pb2.CollectiveFronts) -> dict[str, np.ndarray]:
    """``block``'s columns as int64 arrays by ``COLUMNS`` name; ``BadBlock`` when they
    cannot be read (unequal lengths, both forms, a packed length that is not whole rows).
    A packed block costs no step per value: the arrays are views of its bytes."""
    m = packed_matrix(block)
    if m is not None:
        return dict(zip(PACKED_COLUMNS, m))
    n = len(block.job_id)
    for name in COLUMNS:
        if len(getattr(block, name)) != n:
            raise BadBlock(f"fronts.{name} has {len(getattr(block, name))} values, fronts.job_id has {n}")
    return {name: np.array(getattr(block, name), dtype=np.int64) for name in COLUMNS}


def stalest_ns(block: events_pb2.CollectiveFronts) -> int | None:
    """The oldest of the rows' newest times (enter, or completion once completed): how
    stale the block's news is. None for an empty block."""
    c = columns(block)
    return int(np.maximum(c["entered_ns"], c["completed_ns"]).min()) if len(c["job_id"]) else None


def unpack(block: events_pb2.CollectiveFronts) -> list[FrontRow]:
    """The rows of ``block`` (the controller's ingest validates; this does not)."""
    return FrontColumns(list(block.strings), columns(block)).rows()


class FrontColumns(NamedTuple):
    """Rows of one or more blocks as int64 columns (``COLUMNS`` names; those of
    ``STRING_COLUMNS`` hold indexes into ``strings``)."""

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
    """The rows of ``blocks`` (validated) as one ``FrontColumns``, in order, string
    indexes resolved to one table."""
    texts: list[str] = []
    offsets: list[int] = []
    parts: list[dict[str, np.ndarray]] = []
    for block in blocks:
        offsets.append(len(texts))
        parts.append(columns(block))
        texts.extend(block.strings)
    strings: dict[str, int] = {}
    ids = np.fromiter((strings.setdefault(t, len(strings)) for t in texts), dtype=np.int64, count=len(texts))
    if not parts:
        return FrontColumns([], {name: np.zeros(0, dtype=np.int64) for name in COLUMNS})
    cols = {name: np.concatenate([p[name] for p in parts]) for name in COLUMNS}
    if len(cols["job_id"]):
        base = np.repeat(np.asarray(offsets, dtype=np.int64), [len(p["job_id"]) for p in parts])
        for name in STRING_COLUMNS:
            cols[name] = ids[base + cols[name]]
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
