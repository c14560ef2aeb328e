"""fleet's persistence: one ``Store`` object with domain methods, returning frozen records.

SQLAlchemy engines, sessions and ORM objects never leave this package.
"""

from fleet.controlplane.store.records import (
    ActionRecord,
    AttemptRecord,
    CheckpointRecord,
    CollectiveRecord,
    CollectiveRow,
    CollectiveSummary,
    HealthRecord,
    IncidentRecord,
    IngestDropRecord,
    JobRecord,
    NodeRecord,
    NodeTransitionRecord,
    ProcessGroupRecord,
    RankRecord,
    RecoveryRecord,
    SdcCheckRecord,
    StatusRow,
    StepRecord,
    StepRow,
    TransitionRecord,
    WorkerStatusRecord,
)
from fleet.controlplane.store.store import NODE_QUARANTINED, Store

__all__ = [
    "NODE_QUARANTINED",
    "ActionRecord",
    "AttemptRecord",
    "CheckpointRecord",
    "CollectiveRecord",
    "CollectiveRow",
    "CollectiveSummary",
    "HealthRecord",
    "IncidentRecord",
    "IngestDropRecord",
    "JobRecord",
    "NodeRecord",
    "NodeTransitionRecord",
    "ProcessGroupRecord",
    "RankRecord",
    "RecoveryRecord",
    "SdcCheckRecord",
    "StatusRow",
    "StepRecord",
    "StepRow",
    "Store",
    "TransitionRecord",
    "WorkerStatusRecord",
]
