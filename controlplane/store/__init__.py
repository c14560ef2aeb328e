"""fleet's persistence: one ``Store`` object with domain methods, returning frozen records.

SQLAlchemy engines, sessions and ORM objects never leave this package.
"""

from controlplane.store.records import (
    ActionRecord,
    AttemptRecord,
    CheckpointRecord,
    CollectiveRecord,
    CollectiveSummary,
    HealthRecord,
    IncidentRecord,
    IngestDropRecord,
    JobRecord,
    NodeRecord,
    ProcessGroupRecord,
    RankRecord,
    SdcCheckRecord,
    StepRecord,
    TransitionRecord,
    WorkerStatusRecord,
)
from controlplane.store.store import Store

__all__ = [
    "ActionRecord",
    "AttemptRecord",
    "CheckpointRecord",
    "CollectiveRecord",
    "CollectiveSummary",
    "HealthRecord",
    "IncidentRecord",
    "IngestDropRecord",
    "JobRecord",
    "NodeRecord",
    "ProcessGroupRecord",
    "RankRecord",
    "SdcCheckRecord",
    "StepRecord",
    "Store",
    "TransitionRecord",
    "WorkerStatusRecord",
]
