"""The simulated job of ``bench/scale.py``: its layout, its collective schedule and its
planted faults, as pure functions of time (no I/O), shared by the synthetic agents and
the driver (which must know when a fault took effect and whom it blames).

Layout of R ranks (R a multiple of 32): tensor parallel 8 inside a node, pipeline
parallel 4, data parallel R/32. Rank r = tp + 8 * (pp + 4 * dp): node r // 8 holds one TP
group; ``tp<node>`` (8 members), ``pp<dp>.<tp>`` (4 members, on 4 nodes), ``dp<pp>.<tp>``
(R/32 members, one per DP replica). Every rank belongs to exactly these three groups.

Schedule: a synchronous training loop. Step k (1-based) runs from t0 + (k-1) S to t0 + k S
(S = ``step_s``); its C ops (``per_step``) enter at even gaps dt = S / C and complete dt / 2
later, every rank at the same times. Ops are split over the kinds 60 % tp, 30 % dp, 10 % pp
(interleaved); each kind's p-th op of a step has a fixed op name, sizes and dtypes, so the
signature (``fleet.proto.fronts.signature``) of a sequence number is the same on every
member. ``G(t)``: ops entered by t, counted over the whole run (step k's op j is op
(k-1) C + j); ``Gc(t)``: ops completed by t.

Faults, planted at an op boundary: the first op entered after the fault's time, N.
  * hang: the culprit never enters op N (it completed every op before it); every other
    rank enters op N and never completes it (the cascade of a synchronous loop). Steps stop.
  * desync: the culprit enters op N as a different op (``DESYNC_OP``: another signature);
    every rank enters op N and none completes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from fleet.proto.columns import dtypes_json, shapes_json
from fleet.proto.fronts import signature

TP, PP = 8, 4
RANKS_PER_NODE = TP
KINDS = ("tp", "pp", "dp")
#: Share of a step's ops per kind (KINDS order).
SHARES = (0.6, 0.1, 0.3)
DTYPES = dtypes_json(["bfloat16"])
#: What the desync culprit enters instead of the scheduled op.
DESYNC_OP = ("all_to_all", shapes_json([[3, 1024]]))


def node_name(node: int) -> str:
    return f"scale-node-{node:05d}"


def agent_id(node: int) -> str:
    return f"scale-agent-{node:05d}"


@dataclass(frozen=True)
class Layout:
    """TP 8 x PP 4 x DP ranks/32; see the module docstring."""

    ranks: int

    def __post_init__(self) -> None:
        if self.ranks < TP * PP or self.ranks % (TP * PP):
            raise ValueError(f"--ranks: must be a positive multiple of {TP * PP}, got {self.ranks}")

    @property
    def nodes(self) -> int:
        return self.ranks // RANKS_PER_NODE

    @property
    def dp(self) -> int:
        return self.ranks // (TP * PP)

    def groups(self, rank: int) -> list[tuple[str, list[int]]]:
        """(name, members) of ``rank``'s groups, in KINDS order."""
        tp, node = rank % TP, rank // TP
        pp, dp = node % PP, node // PP
        return [(f"tp{node}", [node * TP + i for i in range(TP)]),
                (f"pp{dp}.{tp}", [tp + TP * (p + PP * dp) for p in range(PP)]),
                (f"dp{pp}.{tp}", [tp + TP * (pp + PP * d) for d in range(self.dp)])]

    def node_of(self, rank: int) -> str:
        return node_name(rank // RANKS_PER_NODE)


@dataclass(frozen=True)
class Schedule:
    """The ops of every step (see the module docstring); times in ns."""

    per_step: int = 100
    step_s: float = 1.0

    def __post_init__(self) -> None:
        if self.per_step < len(KINDS):
            raise ValueError(f"--collectives-per-step: at least {len(KINDS)}, got {self.per_step}")
        if self.step_s <= 0:
            raise ValueError(f"--step-s: must be > 0, got {self.step_s}")

    @property
    def step_ns(self) -> int:
        return int(self.step_s * 1e9)

    @property
    def dt_ns(self) -> int:
        return self.step_ns // self.per_step

    @cached_property
    def kind_of(self) -> np.ndarray:
        """Kind index of each op of a step (largest-remainder interleaving)."""
        c = self.per_step
        want = [max(1, round(s * c)) for s in SHARES]
        want[0] = c - sum(want[1:])
        kinds, given = [], [0] * len(KINDS)
        for j in range(c):
            k = max(range(len(KINDS)), key=lambda i: want[i] * (j + 1) / c - given[i])
            kinds.append(k)
            given[k] += 1
        return np.asarray(kinds, dtype=np.int64)

    @cached_property
    def per_kind(self) -> np.ndarray:
        """Ops of each kind per step."""
        return np.bincount(self.kind_of, minlength=len(KINDS)).astype(np.int64)

    @cached_property
    def count_before(self) -> np.ndarray:
        """count_before[k, j]: ops of kind k among a step's first j ops (j = 0..C)."""
        out = np.zeros((len(KINDS), self.per_step + 1), dtype=np.int64)
        for k in range(len(KINDS)):
            out[k, 1:] = np.cumsum(self.kind_of == k)
        return out

    @cached_property
    def index_of(self) -> list[np.ndarray]:
        """index_of[k][p]: op index within a step of its p-th op of kind k."""
        return [np.flatnonzero(self.kind_of == k) for k in range(len(KINDS))]

    @cached_property
    def ops(self) -> list[list[tuple[str, str, int]]]:
        """ops[k][p]: (op name, sizes JSON, signature) of a step's p-th op of kind k."""
        out = []
        for k, kind in enumerate(KINDS):
            row = []
            for p in range(int(self.per_kind[k])):
                if kind == "tp":
                    op, sizes = ("all_gather" if p % 2 == 0 else "reduce_scatter"), [[4096, 1024 * (1 + p % 3)]]
                elif kind == "pp":
                    op, sizes = "broadcast", [[8, 4096, 1024]]
                else:
                    op, sizes = "all_reduce", [[1 << (20 + p % 4)]]
                s = shapes_json(sizes)
                row.append((op, s, signature(op, s, DTYPES, s, DTYPES)))
            out.append(row)
        return out

    def entered(self, t0_ns: int, now_ns: int) -> int:
        """G(now): ops entered by ``now_ns`` since ``t0_ns``."""
        return self._count(now_ns - t0_ns)

    def completed(self, t0_ns: int, now_ns: int) -> int:
        """Gc(now): ops completed by ``now_ns``."""
        return self._count(now_ns - t0_ns - self.dt_ns // 2)

    def _count(self, elapsed_ns: int) -> int:
        if elapsed_ns < 0:
            return 0
        step, within = divmod(elapsed_ns, self.step_ns)
        return step * self.per_step + min(self.per_step, within // self.dt_ns + 1)

    def op_enter_ns(self, t0_ns: int, op_index: int) -> int:
        """When global op ``op_index`` (0-based) is entered."""
        step, j = divmod(op_index, self.per_step)
        return t0_ns + step * self.step_ns + j * self.dt_ns

    def seqs(self, counts: np.ndarray, kind: int) -> np.ndarray:
        """Per-group sequence number of the newest of ``counts`` global ops, for kind ``kind``."""
        steps, j = np.divmod(counts, self.per_step)
        return steps * self.per_kind[kind] + self.count_before[kind][j]

    def seq_op(self, seq: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """(global op index, position p within the step's ops of the kind) of 1-based ``seq``
        (seq 0: index -1, position 0)."""
        s = np.maximum(seq, 1) - 1
        steps, p = np.divmod(s, self.per_kind[kind])
        index = steps * self.per_step + self.index_of[kind][p]
        return np.where(seq > 0, index, -1), p


@dataclass
class Fault:
    """A planted fault: ``kind`` "hang" or "desync", the culprit rank and op N."""

    kind: str
    rank: int
    op_index: int

    def caps(self, rank: int) -> tuple[float, float]:
        """(most ops ``rank`` enters, most it completes)."""
        if self.kind == "hang" and rank == self.rank:
            return self.op_index, self.op_index
        return self.op_index + 1, self.op_index


@dataclass
class Trial:
    """The driver's record of one planted fault."""

    kind: str
    rank: int
    node: str
    onset_ns: int                     # when op N is entered: the fault shows from then on
    attempt: int
    result: dict = field(default_factory=dict)


def fault_at(schedule: Schedule, t0_ns: int, at_ns: int, kind: str, rank: int) -> Fault:
    """The fault planted at the first op entered after ``at_ns``."""
    if kind not in ("hang", "desync"):
        raise ValueError(f"fault kind: 'hang' or 'desync', got {kind!r}")
    return Fault(kind, rank, schedule.entered(t0_ns, at_ns))


def steps_done(schedule: Schedule, t0_ns: int, now_ns: int, fault: Fault | None) -> int:
    """Steps every rank has finished by ``now_ns`` (a fault stops them all)."""
    done = max(0, (now_ns - t0_ns) // schedule.step_ns)
    if fault is not None:
        done = min(done, fault.op_index // schedule.per_step)
    return int(done)


def p90(values: list[float]) -> float | None:
    """The 90th percentile (nearest rank), None without values."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(0.9 * len(v)) - 1)]
