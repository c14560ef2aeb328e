"""The Store's nodes: registration, state and its history, health, and rank placement.

Invariants:
- A node registers once: its first ``node_transitions`` row (to healthy, actor
  controller) is written by exactly one registrant; re-registering refreshes its
  identity and keeps any quarantine.
- Every node state change is checked with ``check_transition`` and stored as a
  ``node_transitions`` row naming the actor (``NodeActor``) and the job involved, if
  any; a move to the state the node is already in writes nothing.
- Host health samples are append-only, read back by node in time order.
- A node's known-answer GEMM tests are its ``sdc_checks`` rows of kind "gemm" (stored by
  ingest like any event, with or without a job); its last verdict is ``nodes.health``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fleet.controlplane.errors import NotFoundError
from fleet.controlplane.lifecycle import NodeActor, NodeState, check_transition
from fleet.controlplane.store.base import StoreBase
from fleet.controlplane.store.engine import upsert
from fleet.controlplane.store.records import (
    HealthRecord,
    NodeRecord,
    NodeTransitionRecord,
    RankRecord,
    SdcCheckRecord,
)
from fleet.controlplane.store.schema import HealthSample, Node, NodeTransition, Rank, SdcCheck

#: ``sdc_checks.kind`` of a node's known-answer GEMM test.
GEMM_CHECK = "gemm"


class NodeMethods(StoreBase):
    """The Store's node, rank and host-health methods (a mixin of ``store.Store``)."""

    # -- nodes and ranks ------------------------------------------------------------------

    def upsert_node(self, name: str, ray_node_id: str, hostname: str, resources_json: str | None) -> None:
        """Register a node or refresh its identity; keeps any quarantine. Sets last_seen.
        A new node starts healthy, with a first ``node_transitions`` row (actor controller).
        ``resources_json`` None keeps the stored resources (an agent's Hello does not know
        them; the controller stored Ray's), "{}" for a new node."""
        self.upsert_nodes([(name, ray_node_id, hostname)], resources_json)

    def upsert_nodes(self, nodes: Sequence[tuple[str, str, str]], resources_json: str | None = None) -> None:
        """``upsert_node`` for many (name, ray_node_id, hostname) in one transaction (a
        reconnect storm's Hellos); a name given twice keeps its last identity."""
        if not nodes:
            return
        now = time.time()
        identity = {name: {"ray_node_id": ray, "hostname": host, "last_seen": now} for name, ray, host in nodes}
        if resources_json is not None:
            for row in identity.values():
                row["resources_json"] = resources_json
        # Insert-or-nothing first, so exactly one registrant (the one that gets its row back)
        # writes the first history row; rowcount is not reliable here on every driver.
        insert = upsert(self.dialect, Node.__table__, ["name"], None).values([
            {"name": name, "state": NodeState.HEALTHY.value, "quarantine_reason": "", "quarantined_since": None,
             "resources_json": "{}", **row} for name, row in identity.items()]).returning(Node.__table__.c.name)
        with self._tx(write=True) as s:
            new = set(s.scalars(insert).all())
            for name in new:
                s.add(NodeTransition(node=name, from_state=None, to_state=NodeState.HEALTHY.value,
                                     reason="registered", actor=NodeActor.CONTROLLER.value, job_id=None, at=now))
            # executemany: bound names must differ from the columns'
            known = [{"b_name": name, **{f"b_{c}": v for c, v in row.items()}}
                     for name, row in identity.items() if name not in new]
            if known:
                table = Node.__table__
                s.execute(update(table).where(table.c.name == bindparam("b_name")).values(
                    {c: bindparam(f"b_{c}") for c in next(iter(identity.values()))}), known)

    def touch_node(self, name: str) -> None:
        """Set the node's last_seen to now; ``NotFoundError`` if unknown."""
        with self._tx(write=True) as s:
            res = s.execute(update(Node).where(Node.name == name).values(last_seen=time.time()))
            if res.rowcount == 0:
                raise NotFoundError(f"node {name!r} not found")

    def _move_node(self, s: Session, name: str, to: NodeState, reason: str, actor: NodeActor,
                   job_id: str | None, now: float) -> Node | None:
        """Lock the node and move it to ``to``, storing the transition; None (nothing
        written) when it is there already. ``NotFoundError`` if unknown."""
        node = s.get(Node, name, with_for_update=True)
        if node is None:
            raise NotFoundError(f"node {name!r} not found")
        old = NodeState(node.state)
        if old is to:
            return None
        check_transition(old, to)
        node.state = to.value
        s.add(NodeTransition(node=name, from_state=old.value, to_state=to.value, reason=reason,
                             actor=NodeActor(actor).value, job_id=job_id, at=now))
        return node

    def quarantine_node(self, name: str, reason: str, *, actor: NodeActor = NodeActor.OPERATOR,
                        job_id: str | None = None) -> bool:
        """Take the node out of placement with ``reason``, recording who (``actor``) and the
        job whose incidents led to it. A node already quarantined keeps its first reason and
        nothing is written: return whether it moved. ``NotFoundError`` if unknown."""
        with self._tx(write=True) as s:
            now = time.time()
            node = self._move_node(s, name, NodeState.QUARANTINED, reason, actor, job_id, now)
            if node is not None:
                node.quarantine_reason, node.quarantined_since = reason, now
            return node is not None

    def release_node(self, name: str, *, actor: NodeActor = NodeActor.OPERATOR,
                     reason: str = "released") -> bool:
        """Return a quarantined node to healthy, recording who and why. A healthy node is
        left as it is and nothing is written: return whether it moved. ``NotFoundError``
        if unknown."""
        with self._tx(write=True) as s:
            node = self._move_node(s, name, NodeState.HEALTHY, reason, actor, None, time.time())
            if node is not None:
                node.quarantine_reason, node.quarantined_since = "", None
            return node is not None

    def node_history(self, name: str) -> list[NodeTransitionRecord]:
        """Every state change of the node, oldest first (empty for a node never seen)."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(NodeTransition).where(NodeTransition.node == name)
                             .order_by(NodeTransition.id)).all()
            return [self._node_transition_record(r) for r in rows]

    def last_node_transitions(self) -> dict[str, NodeTransitionRecord]:
        """Each node's latest state change, by node name (in name order)."""
        latest = select(func.max(NodeTransition.id)).group_by(NodeTransition.node).scalar_subquery()
        with self._tx(write=False) as s:
            rows = s.scalars(select(NodeTransition).where(NodeTransition.id.in_(latest))
                             .order_by(NodeTransition.node)).all()
            return {r.node: self._node_transition_record(r) for r in rows}

    @staticmethod
    def _node_transition_record(r: NodeTransition) -> NodeTransitionRecord:
        return NodeTransitionRecord(
            node=r.node, from_state=None if r.from_state is None else NodeState(r.from_state),
            to_state=NodeState(r.to_state), reason=r.reason, actor=r.actor, job_id=r.job_id, at=r.at)

    def set_node_health(self, name: str, health: str, reason: str) -> None:
        """Store the node's latest health-check verdict and why; ``NotFoundError`` if unknown."""
        with self._tx(write=True) as s:
            res = s.execute(update(Node).where(Node.name == name)
                            .values(health=health, health_reason=reason))
            if res.rowcount == 0:
                raise NotFoundError(f"node {name!r} not found")

    def gemm_checks(self, node: str, limit: int = 100) -> list[SdcCheckRecord]:
        """The node's latest ``limit`` known-answer GEMM tests, oldest first."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(SdcCheck).where(SdcCheck.node == node, SdcCheck.kind == GEMM_CHECK)
                             .order_by(SdcCheck.time_ns.desc(), SdcCheck.id.desc()).limit(limit)).all()
            return [self._sdc_record(r) for r in reversed(rows)]

    def last_gemm_checks(self) -> dict[str, SdcCheckRecord]:
        """Each node's latest known-answer GEMM test, by node name."""
        newest = (select(SdcCheck.node, func.max(SdcCheck.time_ns).label("t"))
                  .where(SdcCheck.kind == GEMM_CHECK, SdcCheck.node.is_not(None))
                  .group_by(SdcCheck.node).subquery())
        with self._tx(write=False) as s:
            rows = s.scalars(select(SdcCheck).join(newest, (SdcCheck.node == newest.c.node)
                                                   & (SdcCheck.time_ns == newest.c.t))
                             .where(SdcCheck.kind == GEMM_CHECK).order_by(SdcCheck.id)).all()
            return {r.node: self._sdc_record(r) for r in rows}

    @staticmethod
    def _sdc_record(r: SdcCheck) -> SdcCheckRecord:
        return SdcCheckRecord(id=r.id, job_id=r.job_id, attempt=r.attempt, rank=r.rank, node=r.node,
                              step=r.step, kind=r.kind, value=r.value, expected=r.expected, ok=r.ok,
                              detail=r.detail, time_ns=r.time_ns)

    def list_nodes(self) -> list[NodeRecord]:
        with self._tx(write=False) as s:
            rows = s.scalars(select(Node).order_by(Node.name)).all()
            return [NodeRecord(name=n.name, ray_node_id=n.ray_node_id, hostname=n.hostname,
                               resources_json=n.resources_json, state=NodeState(n.state),
                               quarantine_reason=n.quarantine_reason,
                               quarantined_since=n.quarantined_since, last_seen=n.last_seen,
                               health=n.health, health_reason=n.health_reason)
                    for n in rows]

    def record_rank(self, job_id: str, attempt: int, rank: int, node: str, pid: int) -> None:
        """Record (or correct) where a rank of an attempt runs."""
        self.record_ranks(job_id, attempt, [(rank, node, pid)])

    def record_ranks(self, job_id: str, attempt: int, placed: Sequence[tuple[int, str, int]]) -> None:
        """``record_rank`` for many (rank, node, pid) of one attempt, in one transaction
        (a 16,384-rank attempt is one write, not 16,384)."""
        if not placed:
            return
        stmt = upsert(self.dialect, Rank.__table__, ["job_id", "attempt", "rank"],
                      {"node": lambda new: new.node, "pid": lambda new: new.pid})
        try:
            with self._tx(write=True) as s:
                s.execute(stmt, [{"job_id": job_id, "attempt": attempt, "rank": rank, "node": node, "pid": pid}
                                 for rank, node, pid in placed])
        except IntegrityError as e:
            raise NotFoundError(f"job {job_id!r} not found") from e

    def ranks(self, job_id: str, attempt: int) -> list[RankRecord]:
        with self._tx(write=False) as s:
            rows = s.scalars(select(Rank).where(Rank.job_id == job_id, Rank.attempt == attempt)
                             .order_by(Rank.rank)).all()
            return [RankRecord(job_id=r.job_id, attempt=r.attempt, rank=r.rank, node=r.node,
                               pid=r.pid) for r in rows]

    # -- host health ----------------------------------------------------------------------

    def record_health(self, node: str, time_ns: int, cpu_percent: float, load1: float,
                      mem_used_bytes: int, mem_total_bytes: int, workers_alive: int) -> None:
        self.record_health_samples([HealthRecord(node, time_ns, cpu_percent, load1, mem_used_bytes,
                                                 mem_total_bytes, workers_alive)])

    def record_health_samples(self, samples: Sequence[HealthRecord]) -> None:
        """Store host health samples (one transaction for all)."""
        if not samples:
            return
        with self._tx(write=True) as s:
            s.execute(HealthSample.__table__.insert(), [dataclasses.asdict(h) for h in samples])

    def health_samples(self, node: str, since_ns: int = 0) -> list[HealthRecord]:
        """The node's health samples with ``time_ns >= since_ns``, oldest first."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(HealthSample).where(
                HealthSample.node == node, HealthSample.time_ns >= since_ns)
                .order_by(HealthSample.time_ns, HealthSample.id)).all()
            return [HealthRecord(node=r.node, time_ns=r.time_ns, cpu_percent=r.cpu_percent,
                                 load1=r.load1, mem_used_bytes=r.mem_used_bytes,
                                 mem_total_bytes=r.mem_total_bytes,
                                 workers_alive=r.workers_alive) for r in rows]
