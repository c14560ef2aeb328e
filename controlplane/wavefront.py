"""Where every rank of a large job stands, live: the controller's view of the agents'
collective fronts (``CollectiveFronts``), and the hang and desync suspects they show.

A job too large to ship every collective sends, per (rank, group), its front: the newest
sequence number entered and completed, when, and the signature of the op entered
(``fleet.proto.fronts``). ``Wavefronts`` keeps one slot per (rank, group) in numpy
columns; ``apply`` finds the rows' slots with a vectorised search of a sorted key index
and updates them in one pass, so the work of a report is proportional to what changed
(and no Python step per row), never to the job's size. ``verdict`` reads
every slot at once (vectorised, a few milliseconds at 16,384 ranks x 4 groups) and is
only called while a hang is suspected.

The verdict follows the flight recorder's wait-for rule (``controlplane.diagnosis``):
  * a group is *blocked* when a member has waited longer than ``settle_s`` in the group's
    newest op (entered, not completed) while another member has not entered it yet (is
    *behind*); each such waiter waits on the members behind;
  * the culprits are the members behind in a blocked group who wait on nobody themselves:
    ranks blocked by others are consequences, not causes;
  * a *mismatch* (desync): members that all entered a group's newest op and wait in it
    with different signatures; the ranks whose signature is not the majority's are named.
Groups of point-to-point ops (``:p2p``) are left out: their sequence numbers count per
pair, not per group. Members declared by ``ProcessGroupInfo`` that sent no front yet
stand at sequence 0 (behind); given the ranks' nodes, such a member is blamed only once
its node's agent sent some front of the attempt (before, its silence may be delivery lag). Invariant: a front never moves back (the row with the
higher entered, then completed, sequence number wins), so blocks sent again or out of
order change nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fleet.proto import events_pb2
from fleet.proto.flight_record import P2P_SUFFIX
from fleet.proto.fronts import FrontRow, merge


@dataclass(frozen=True)
class FrontVerdict:
    """What the fronts show: ``verdict`` "hang" or "mismatch", the ranks to blame, the
    groups that show it (their members are what a diagnosis must read) and the reason."""

    verdict: str
    culprits: list[int]
    groups: list[str]
    summary: str
    waiting: int                 # ranks waiting in some collective longer than settle_s
    members: dict[str, list[int]] = field(default_factory=dict)  # group -> its members


def intern(index: dict[str, int], names: list[str], name: str) -> int:
    """``name``'s number in ``index`` (appended to ``names`` when new)."""
    ix = index.get(name)
    if ix is None:
        ix = index[name] = len(names)
        names.append(name)
    return ix


class Wavefronts:
    """The fronts of one attempt of one job (not thread-safe: one owner thread)."""

    _COLUMNS = ("rank", "group", "entered", "completed", "entered_ns", "completed_ns", "sig", "step", "op", "heard")

    def __init__(self, job_id: str, attempt: int, capacity: int = 1024,
                 nodes: Sequence[str] | None = None) -> None:
        """``nodes[r]``: rank r's node, when known: a member no front was heard of is then
        blamed only once its node's agent sent fronts of the attempt (else its silence may
        be the agent's delivery lag, not the rank's)."""
        self.job_id = job_id
        self.attempt = attempt
        index: dict[str, int] = {}
        self._node_of = (None if nodes is None else
                         np.asarray([index.setdefault(n, len(index)) for n in nodes], dtype=np.int64))
        self._slots: dict[int, int] = {}   # _key(rank, group index) -> slot
        # the same, as sorted arrays for a vectorised lookup; rebuilt after slots are added
        self._index_keys = np.zeros(0, dtype=np.int64)
        self._index_slots = np.zeros(0, dtype=np.int64)
        self._groups: dict[str, int] = {}
        self._group_names: list[str] = []
        self._group_size: dict[str, int] = {}
        self._declared: dict[str, tuple[int, ...]] = {}
        self._ops: dict[str, int] = {"": 0}
        self._op_names: list[str] = [""]
        self._n = 0
        self._cols = {c: np.zeros(capacity, dtype=np.int64) for c in self._COLUMNS}
        self.rows_applied = 0

    def __len__(self) -> int:
        return self._n

    # -- input ------------------------------------------------------------------------------

    @staticmethod
    def _key(rank: int | np.ndarray, gix: int | np.ndarray) -> int | np.ndarray:
        return (gix << 32) | rank

    def _group(self, name: str) -> int:
        return intern(self._groups, self._group_names, name)

    def _slot(self, rank: int, group: str, size: int) -> int:
        gix = self._group(group)
        if size:
            self._group_size[group] = size
        key = self._key(rank, gix)
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        if self._n == len(self._cols["rank"]):
            self._cols = {c: np.concatenate([a, np.zeros(len(a), dtype=np.int64)]) for c, a in self._cols.items()}
        slot = self._slots[key] = self._n
        self._n += 1
        self._cols["rank"][slot] = rank
        self._cols["group"][slot] = gix
        return slot

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys``; -1 where there is none in the index."""
        if not len(self._index_keys):
            return np.full(len(keys), -1, dtype=np.int64)
        pos = np.searchsorted(self._index_keys, keys)
        pos[pos == len(self._index_keys)] = 0
        return np.where(self._index_keys[pos] == keys, self._index_slots[pos], -1)

    def _reindex(self) -> None:
        if len(self._index_keys) != len(self._slots):
            keys = np.fromiter(self._slots, dtype=np.int64, count=len(self._slots))
            slots = np.fromiter(self._slots.values(), dtype=np.int64, count=len(self._slots))
            order = np.argsort(keys)
            self._index_keys, self._index_slots = keys[order], slots[order]

    def declare(self, group: str, ranks: Sequence[int]) -> None:
        """Members of ``group`` (from ``ProcessGroupInfo``): each gets a slot, at seq 0
        until its first front arrives."""
        if group in self._declared or group.endswith(P2P_SUFFIX):
            return
        self._declared[group] = tuple(ranks)
        for r in ranks:
            self._slot(r, group, len(ranks))

    def declared(self, group: str) -> bool:
        return group in self._declared

    def apply(self, blocks: Iterable[events_pb2.CollectiveFronts]) -> int:
        """Fold blocks in (their rows of this job and attempt), in one vectorised update;
        returns the rows taken. A row costs no Python step unless its (rank, group) is new."""
        self._reindex()  # slots added since the last call (here or by ``declare``)
        merged = merge(blocks)
        strings = merged.strings
        if self.job_id not in strings:
            return 0
        job = strings.index(self.job_id)
        v = merged.cols
        take = (v["job_id"] == job) & (v["attempt"] == self.attempt)
        if not take.all():
            v = {name: values[take] for name, values in v.items()}
        if not len(v["rank"]):
            return 0
        # string indexes -> this table's group and op indexes
        gmap = np.zeros(len(strings), dtype=np.int64)
        omap = np.zeros(len(strings), dtype=np.int64)
        for i in np.unique(v["group"]).tolist():
            gmap[i] = self._group(strings[i])
        for i in np.unique(v["op"]).tolist():
            omap[i] = self._op(strings[i])
        slot = self._lookup(self._key(v["rank"], gmap[v["group"]]))
        for i in np.flatnonzero(slot < 0).tolist():  # new (rank, group)s
            slot[i] = self._slot(int(v["rank"][i]), strings[int(v["group"][i])], int(v["group_size"][i]))
        op = omap[v["op"]]
        e, c = v["entered_seq"], v["completed_seq"]
        # the furthest row per slot (rows of one slot may repeat across blocks)
        order = np.lexsort((c, e, slot))
        last = np.ones(len(order), dtype=bool)
        last[:-1] = slot[order][1:] != slot[order][:-1]
        keep = order[last]
        rows = len(slot)
        slot, e, c = slot[keep], e[keep], c[keep]
        cols = self._cols
        have_e, have_c = cols["entered"][slot], cols["completed"][slot]
        newer = (e > have_e) | ((e == have_e) & (c >= have_c))
        s = slot[newer]
        cols["entered"][s] = e[newer]
        cols["completed"][s] = c[newer]
        cols["heard"][slot] = 1
        for col, values in (("entered_ns", v["entered_ns"]), ("completed_ns", v["completed_ns"]),
                            ("sig", v["signature"]), ("step", v["step"]), ("op", op)):
            cols[col][s] = values[keep][newer]
        self.rows_applied += rows
        return rows

    def _op(self, name: str) -> int:
        return intern(self._ops, self._op_names, name)

    # -- output -----------------------------------------------------------------------------

    def rows(self, ranks: Iterable[int] | None = None) -> list[FrontRow]:
        """The fronts held (of ``ranks`` only, when given), ordered by rank and group."""
        want = None if ranks is None else set(ranks)
        cols = {c: a[:self._n].tolist() for c, a in self._cols.items()}
        out = []
        for i in range(self._n):
            rank = cols["rank"][i]
            if want is not None and rank not in want:
                continue
            group = self._group_names[cols["group"][i]]
            out.append(FrontRow(self.job_id, self.attempt, rank, group, self._group_size.get(group, 0),
                                cols["entered"][i], cols["completed"][i], cols["entered_ns"][i],
                                cols["completed_ns"][i], self._op_names[cols["op"][i]], cols["sig"][i],
                                cols["step"][i], 0))
        out.sort(key=lambda r: (r.rank, r.group))
        return out

    def newest_ns(self) -> int:
        """The newest enter or completion time any front shows (0 without fronts)."""
        if not self._n:
            return 0
        return int(max(self._cols["entered_ns"][:self._n].max(), self._cols["completed_ns"][:self._n].max()))

    def verdict(self, now_ns: int, settle_s: float) -> FrontVerdict | None:
        """The hang or desync the fronts show as of ``now_ns``, counting only waits longer
        than ``settle_s``; None when no group is blocked and none mismatches."""
        n = self._n
        if not n:
            return None
        cols = {c: a[:n] for c, a in self._cols.items()}
        gi, e, c = cols["group"], cols["entered"], cols["completed"]
        ranks = cols["rank"]
        n_groups = len(self._group_names)
        p2p = np.fromiter((g.endswith(P2P_SUFFIX) for g in self._group_names), dtype=bool, count=n_groups)
        top = np.zeros(n_groups, dtype=np.int64)
        np.maximum.at(top, gi, e)
        at_top = e == top[gi]
        waiting = (e > c) & (cols["entered_ns"] <= now_ns - int(settle_s * 1e9)) & ~p2p[gi]
        behind = (e < top[gi]) & ~p2p[gi]
        waits_at_top = np.zeros(n_groups, dtype=bool)
        waits_at_top[gi[waiting & at_top]] = True
        has_behind = np.zeros(n_groups, dtype=bool)
        has_behind[gi[behind]] = True
        blocked = waits_at_top & has_behind
        waiter = waiting & at_top & blocked[gi]
        rank_waits = np.zeros(int(ranks.max()) + 1, dtype=bool)
        rank_waits[ranks[waiter]] = True
        blamed = behind & blocked[gi] & ~rank_waits[ranks]
        if self._node_of is not None and blamed.any():
            # never heard of, on a node whose agent sent nothing of the attempt yet: lag, not a culprit
            known = ranks < len(self._node_of)
            node = np.where(known, self._node_of[np.minimum(ranks, len(self._node_of) - 1)], -1)
            node_heard = np.zeros(len(self._node_of) + 1, dtype=bool)
            node_heard[node[(cols["heard"] == 1) & known]] = True
            blamed &= (cols["heard"] == 1) | ~known | node_heard[node]
        n_waiting = len(np.unique(ranks[waiting]))

        mismatch = self._mismatches(gi, ranks, cols["sig"], waiting & at_top & ~blocked[gi])
        if mismatch:
            culprits = sorted({r for rs in mismatch.values() for r, _ in rs})
            groups = sorted(mismatch)
            g = groups[0]
            odd = mismatch[g]
            seq = int(top[self._groups[g]])
            detail = ", ".join(f"rank {r} entered {self._op_names[op]}" for r, op in odd[:4])
            summary = (f"desync in group {g} at seq {seq}: {detail}, unlike the other "
                       f"{self._members_count(g) - len(odd)} member(s); {n_waiting} rank(s) wait")
            return FrontVerdict("mismatch", culprits, groups, summary, n_waiting, self._members(groups))
        if not blamed.any():
            return None
        culprit_slots = np.flatnonzero(blamed)
        culprits = sorted({int(r) for r in ranks[culprit_slots]})
        groups = sorted({self._group_names[int(g)] for g in gi[culprit_slots]})
        first = int(culprit_slots[0])
        g = self._group_names[int(gi[first])]
        gix = self._groups[g]
        in_g = (gi == gix) & waiter
        seq = int(top[gix])
        op = self._op_names[int(cols["op"][np.flatnonzero(in_g)[0]])] if in_g.any() else "?"
        longest = (now_ns - int(cols["entered_ns"][in_g].min())) / 1e9 if in_g.any() else 0.0
        who = ", ".join(f"rank {r}" for r in culprits[:8]) + (" ..." if len(culprits) > 8 else "")
        summary = (f"{who} never entered {op} seq {seq} of group {g}, in which "
                   f"{int(in_g.sum())} of {self._members_count(g)} members wait (up to {longest:.1f} s); "
                   f"{n_waiting} rank(s) wait in all; the culprit waits on no one")
        return FrontVerdict("hang", culprits, groups, summary, n_waiting, self._members(groups))

    def _members(self, groups: Iterable[str]) -> dict[str, list[int]]:
        out = {}
        for g in groups:
            declared = self._declared.get(g)
            if declared is not None:
                out[g] = sorted(declared)
            else:
                gix = self._groups[g]
                cols = self._cols
                out[g] = sorted(int(r) for r in cols["rank"][:self._n][cols["group"][:self._n] == gix])
        return out

    def _members_count(self, group: str) -> int:
        declared = self._declared.get(group)
        return len(declared) if declared is not None else self._group_size.get(group, 0)

    def _mismatches(self, gi: np.ndarray, ranks: np.ndarray, sig: np.ndarray,
                    candidates: np.ndarray) -> dict[str, list[tuple[int, int]]]:
        """Groups whose members wait in their newest op with different signatures:
        group -> [(rank, op index)] of the members unlike the majority."""
        idx = np.flatnonzero(candidates)
        if len(idx) < 2:
            return {}
        order = np.lexsort((sig[idx], gi[idx]))
        g_sorted, s_sorted = gi[idx][order], sig[idx][order]
        change = np.flatnonzero((g_sorted[1:] == g_sorted[:-1]) & (s_sorted[1:] != s_sorted[:-1]))
        out: dict[str, list[tuple[int, int]]] = {}
        ops = self._cols["op"]
        for g in sorted({int(g_sorted[i]) for i in change}):
            slots = idx[gi[idx] == g]
            counts = Counter(int(s) for s in sig[slots])
            majority, _ = counts.most_common(1)[0]
            odd = [(int(ranks[s]), int(ops[s])) for s in slots if int(sig[s]) != majority]
            out[self._group_names[g]] = sorted(odd)
        return out
