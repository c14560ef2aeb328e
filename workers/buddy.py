"""Peer copies of sharded training state: every rank's in-memory snapshot
(workers/snapshot.py) is also held in the memory of its *buddy*, a rank on another node,
so that losing a rank, or a whole node, restores from memory instead of from disk.

Pairing (``Buddies``): ranks are numbered node by node (LOCAL_RANK within a node,
GROUP_RANK the node's index, the same number of ranks on every node). Rank r's buddy is
the rank with r's local index on the next node, cyclically; its *ward* (whose copy r
holds) the one on the previous node. On one node there is no buddy. A rank and its
buddy are never on one node, so one node's loss leaves a copy of each of its shards.

Exchange (``PeerLink.exchange``): when a step's snapshot commits (after the step's
closing all-reduce), each rank sends it to its buddy and receives its ward's, over a
gloo group of its own (the snapshots are in CPU memory whatever the training backend),
and waits for both before the next step starts. So once a rank has begun step S+1, its
ward's copy of step S is committed in its memory: a rank killed in step S+1 is restored
at S from its buddy and only the step in flight is recomputed. A rank killed during step
S's exchange is restored at S-1, though its buddy may have received its copy and reported
step S: that one step is recomputed (a recovery's ``steps_lost`` counts it).

Restore (``plan``): every rank's two newest own snapshots and the two newest copies its
buddy holds of it are gathered in one all-reduce; the newest step every rank can get
from memory (its own snapshot, or its buddy's copy) wins when it is at least as new as
the disk checkpoint, and each rank missing its own snapshot receives the copy from its
buddy. When a rank and its buddy were both lost, there is no copy: the plan says why,
and the restore falls back to disk.

Invariants:
  * A peer copy is used only for the same layout key as the snapshot it copies.
  * ``PeerHolder`` keeps the ``snapshot.KEEP`` newest committed copies per ward layout;
    a copy is committed only once every byte of it arrived.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fleet.workers import snapshot

#: Header words before the buffer sizes: step, data position (-1 = none).
_HEAD = 2
#: Message tags: header, RNG state, then one per buffer.
_TAG_HEAD, _TAG_RNG, _TAG_WORDS = 0, 1, 2


@dataclass(frozen=True)
class Buddies:
    """Who holds whose copy, from a rank's place (all nodes hold ``per_node`` ranks)."""

    rank: int
    per_node: int
    node: int
    nodes: int

    @property
    def active(self) -> bool:
        return self.nodes > 1

    def _at(self, node: int) -> int:
        return (node % self.nodes) * self.per_node + self.rank % self.per_node

    @property
    def buddy(self) -> int:
        """The rank that holds this rank's copy (-1: none)."""
        return self._at(self.node + 1) if self.active else -1

    @property
    def ward(self) -> int:
        """The rank whose copy this rank holds (-1: none)."""
        return self._at(self.node - 1) if self.active else -1

    def buddy_of(self, rank: int) -> int:
        return Buddies(rank, self.per_node, rank // self.per_node, self.nodes).buddy


@dataclass
class PeerCopy:
    """A ward's snapshot as received: its step, data position, RNG state and the packed
    words of its ``FlatState`` (in the ward's buffer order)."""

    step: int
    data_position: int | None
    rng: torch.Tensor
    words: list[torch.Tensor]


class PeerHolder:
    """This process's copies of other ranks' snapshots, by the ward's layout key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_layout: dict[tuple, list[PeerCopy]] = {}
        self._spare: dict[tuple, PeerCopy] = {}

    def buffer(self, layout: tuple, sizes: Sequence[int], rng_numel: int) -> PeerCopy:
        """A copy to receive into: a spare one of these sizes, or a new one."""
        with self._lock:
            spare = self._spare.pop(layout, None)
        if spare is not None and [w.numel() for w in spare.words] == list(sizes) \
                and spare.rng.numel() == rng_numel:
            return spare
        return PeerCopy(0, None, torch.empty(rng_numel, dtype=torch.uint8),
                        [torch.empty(n, dtype=torch.int64) for n in sizes])

    def release(self, layout: tuple, copy: PeerCopy) -> None:
        """Give back a buffer whose receive did not complete."""
        with self._lock:
            self._spare[layout] = copy

    def commit(self, layout: tuple, copy: PeerCopy) -> None:
        with self._lock:
            kept = self._by_layout.setdefault(layout, [])
            for old in [c for c in kept if c.step >= copy.step]:
                kept.remove(old)
            kept.append(copy)
            while len(kept) > snapshot.KEEP:
                self._spare[layout] = kept.pop(0)

    def steps(self, layout: tuple) -> list[int]:
        """Steps held for ``layout``, newest first."""
        with self._lock:
            return sorted((c.step for c in self._by_layout.get(layout, [])), reverse=True)

    def get(self, layout: tuple, step: int) -> PeerCopy | None:
        with self._lock:
            return next((c for c in self._by_layout.get(layout, []) if c.step == step), None)

    def drop_newer(self, layout: tuple, step: int) -> None:
        with self._lock:
            kept = self._by_layout.get(layout, [])
            for c in [c for c in kept if c.step > step]:
                kept.remove(c)

    def forget_other_jobs(self, job_id: str) -> None:
        with self._lock:
            for table in (self._by_layout, self._spare):
                for key in [k for k in table if k[0] != job_id]:
                    del table[key]

    def clear(self) -> None:
        with self._lock:
            self._by_layout.clear()
            self._spare.clear()

    def nbytes(self) -> int:
        """Bytes held in committed copies and spare buffers."""
        with self._lock:
            copies = [c for kept in self._by_layout.values() for c in kept] + list(self._spare.values())
        return sum(sum(w.numel() * 8 for w in c.words) + c.rng.numel() for c in copies)


_HOLDER = PeerHolder()


def holder() -> PeerHolder:
    """The peer copies this process holds (they outlive one attempt's Trainer)."""
    return _HOLDER


@dataclass(frozen=True)
class Plan:
    """Where every rank's state comes from. ``step`` 0: not from memory (``reason`` says
    why when peer copies could not cover a rank). ``sources[r]``: -1 when rank r restores
    its own snapshot, else the rank that sends it a copy."""

    step: int
    sources: tuple[int, ...] = ()
    reason: str = ""


def plan(own: Sequence[Sequence[int]], held: Sequence[Sequence[int]], buddy_of: Sequence[int],
         disk: int) -> Plan:
    """The restore plan from every rank's own snapshot steps (``own[r]``), the steps of
    rank r's copies its buddy holds (``held[r]``), each rank's buddy and the newest valid
    checkpoint on disk (0: none). Pure: the same on every rank."""
    world = len(own)
    reachable = [set(own[r]) | set(held[r]) for r in range(world)]
    candidates = set.intersection(*reachable) if reachable else set()
    candidates.discard(0)
    best = max(candidates, default=0)
    if best and best >= disk:
        return Plan(best, tuple(-1 if best in own[r] else buddy_of[r] for r in range(world)))
    if best:
        return Plan(0, reason=f"the checkpoint of step {disk} on disk is newer than memory (step {best})")
    lost = [r for r in range(world) if not reachable[r]]
    if lost:
        r = lost[0]
        return Plan(0, reason=f"no copy of the state of rank {', '.join(map(str, lost))} is left in memory: "
                              f"rank {r} and its buddy rank {buddy_of[r]} were both lost")
    newest = [max(s) for s in reachable]
    return Plan(0, reason=f"the ranks' snapshots in memory share no step (newest per rank: {newest})")


@dataclass
class PeerLink:
    """Sends this rank's snapshots to its buddy and keeps its ward's, over ``group``."""

    buddies: Buddies
    group: dist.ProcessGroup
    layout: tuple           # this rank's snapshot layout key
    ward_layout: tuple      # the ward's
    timeout: timedelta
    #: seconds spent exchanging and bytes sent, for the step-time cost
    exchange_s: float = 0.0
    sent_bytes: int = 0
    _sizes: list[int] | None = field(default=None, repr=False)

    def exchange(self, snap: snapshot.Snapshot) -> None:
        """Send ``snap`` (just committed) to the buddy; receive the ward's copy of the same
        step and commit it. Raises when either side fails or the timeout passes."""
        t0 = time.perf_counter()
        words = [w for _, w in snap.state.words]
        head = torch.tensor([snap.step, -1 if snap.data_position is None else snap.data_position,
                             *(w.numel() for w in words)], dtype=torch.int64)
        b, w = self.buddies.buddy, self.buddies.ward
        sends = [dist.isend(head, dst=b, group=self.group, tag=_TAG_HEAD),
                 dist.isend(snap.rng, dst=b, group=self.group, tag=_TAG_RNG)]
        sends += [dist.isend(t, dst=b, group=self.group, tag=_TAG_WORDS + i) for i, t in enumerate(words)]
        their_head = torch.empty_like(head)
        dist.irecv(their_head, src=w, group=self.group, tag=_TAG_HEAD).wait(self.timeout)
        sizes = [int(x) for x in their_head[_HEAD:].tolist()]
        copy = holder().buffer(self.ward_layout, sizes, snap.rng.numel())
        try:
            recvs = [dist.irecv(copy.rng, src=w, group=self.group, tag=_TAG_RNG)]
            recvs += [dist.irecv(t, src=w, group=self.group, tag=_TAG_WORDS + i) for i, t in enumerate(copy.words)]
            for work in recvs + sends:
                work.wait(self.timeout)
        except BaseException:
            holder().release(self.ward_layout, copy)
            raise
        copy.step = int(their_head[0])
        pos = int(their_head[1])
        copy.data_position = None if pos < 0 else pos
        holder().commit(self.ward_layout, copy)
        self.sent_bytes += sum(t.numel() * 8 for t in words) + snap.rng.numel()
        self.exchange_s += time.perf_counter() - t0

    def send_copy(self, step: int, to: int) -> list[dist.Work]:
        """Start sending the held copy of the ward's ``step`` to ``to`` (a restore)."""
        copy = holder().get(self.ward_layout, step)
        if copy is None:
            raise RuntimeError(f"rank {self.buddies.rank} holds no copy of rank {to}'s step {step}")
        head = torch.tensor([copy.step, -1 if copy.data_position is None else copy.data_position,
                             *(t.numel() for t in copy.words)], dtype=torch.int64)
        works = [dist.isend(head, dst=to, group=self.group, tag=_TAG_HEAD),
                 dist.isend(copy.rng, dst=to, group=self.group, tag=_TAG_RNG)]
        works += [dist.isend(t, dst=to, group=self.group, tag=_TAG_WORDS + i) for i, t in enumerate(copy.words)]
        return works

    def receive_into(self, snap: snapshot.Snapshot, src: int) -> None:
        """Receive this rank's own state from ``src`` into a staged snapshot ``snap``."""
        words = [w for _, w in snap.state.words]
        head = torch.empty(_HEAD + len(words), dtype=torch.int64)
        dist.irecv(head, src=src, group=self.group, tag=_TAG_HEAD).wait(self.timeout)
        sizes = [int(x) for x in head[_HEAD:].tolist()]
        if sizes != [t.numel() for t in words]:
            raise RuntimeError(f"rank {src}'s copy of rank {self.buddies.rank}'s state does not match its layout "
                               f"(buffers of {sizes} words, expected {[t.numel() for t in words]})")
        works = [dist.irecv(snap.rng, src=src, group=self.group, tag=_TAG_RNG)]
        works += [dist.irecv(t, src=src, group=self.group, tag=_TAG_WORDS + i) for i, t in enumerate(words)]
        for work in works:
            work.wait(self.timeout)
        snap.step = int(head[0])
        pos = int(head[1])
        snap.data_position = None if pos < 0 else pos


def state_bytes(total_params: int, world: int, sharded: bool) -> int:
    """Bytes of one rank's training state (float32 parameters and AdamW's two moments)."""
    full = total_params * 4 * 3
    return -(-full // world) if sharded else full


def snapshot_memory(total_params: int, world: int, nodes: int, sharded: bool, peer: bool) -> int:
    """Bytes a rank holds for in-memory snapshots: ``snapshot.KEEP`` copies of its own
    state and the buffer the next one is taken into, and, with peer copies of sharded
    state on 2+ nodes, as many of its ward's."""
    one = state_bytes(total_params, world, sharded)
    copies = (snapshot.KEEP + 1) * (2 if peer and sharded and nodes > 1 else 1)
    return one * copies
