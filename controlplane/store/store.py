"""The Store: fleet's one persistence object, with domain methods over SQLAlchemy.

``Store`` is the only class callers use; its body is split by domain into mixins over
``base.StoreBase`` (engine, sessions, ``_tx``):

- ``jobs.JobMethods``: jobs and attempts, their lifecycle transitions and history;
- ``nodes.NodeMethods``: nodes (state, history, health checks), rank placement and
  host health samples;
- ``telemetry.TelemetryMethods``: agent batches in; steps, collectives, process
  groups, worker status, SDC checks and ingest drops out;
- ``incidents.IncidentMethods``: incidents, actions, recoveries and checkpoints.

Invariants (each module states its own in detail):
- Every method runs in its own short transaction from a pooled sessionmaker, so one
  Store is safe to share between threads (gRPC server threads and the controller).
- Nothing SQLAlchemy leaves this package: methods take and return plain values and
  the frozen records of ``records.py``.
- Every job/attempt/node state change is checked with ``check_transition`` and stored
  in the same transaction; an illegal one raises ``StateError`` and writes nothing.
- Opening a Store brings its schema to the newest migration (``migrate.upgrade``).
"""

from __future__ import annotations

from fleet.controlplane.lifecycle import NodeState
from fleet.controlplane.store.incidents import IncidentMethods
from fleet.controlplane.store.jobs import JobMethods
from fleet.controlplane.store.nodes import NodeMethods
from fleet.controlplane.store.telemetry import TelemetryMethods

#: kept as a name: the controller compares node states with it
NODE_QUARANTINED = NodeState.QUARANTINED


class Store(JobMethods, NodeMethods, TelemetryMethods, IncidentMethods):
    """Persistence for jobs, attempts, nodes and telemetry. Thread-safe; a context manager."""
