"""Frozen records that the Store returns to callers.

These are plain values: no SQLAlchemy object or session ever leaves the store package.
Times are float Unix seconds unless the field name ends in ``_ns`` (Unix nanoseconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from fleet.controlplane.lifecycle import AttemptState, JobState, NodeState
from fleet.proto.kinds import IncidentKind

#: The action kind that records why a checkpoint stopped being valid (its cause says why).
CKPT_INVALID = "ckpt_invalid"


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    state: JobState
    total_steps: int
    steps_completed: int  # max step recorded in any attempt, 0 if none
    attempts: int  # number of attempts created
    created_at: float
    ended_at: float | None
    reason: str
    config_json: str


@dataclass(frozen=True)
class AttemptRecord:
    job_id: str
    number: int  # 1-based
    state: AttemptState
    started_at: float
    ended_at: float | None
    restored_step: int | None  # checkpoint step restored (0 = fresh start), None if unknown
    final_step: int | None
    reason: str


@dataclass(frozen=True)
class TransitionRecord:
    job_id: str
    attempt: int | None  # None for job transitions
    entity: str  # "job" | "attempt"
    from_state: str | None  # None for the creation row
    to_state: str
    reason: str
    at: float


@dataclass(frozen=True)
class NodeRecord:
    name: str
    ray_node_id: str
    hostname: str
    resources_json: str
    state: NodeState  # a StrEnum: compares equal to "healthy" / "quarantined"
    quarantine_reason: str
    quarantined_since: float | None
    last_seen: float
    health: str = "unknown"  # last node health-check verdict; "unknown" until the first check
    health_reason: str = ""  # why, as the check reported it


@dataclass(frozen=True)
class NodeTransitionRecord:
    """One node state change. ``actor`` is a ``NodeActor`` value, or ``migration`` for the
    first row of a node that existed before node history was kept."""

    node: str
    from_state: NodeState | None  # None for the node's first row
    to_state: NodeState
    reason: str
    actor: str
    job_id: str | None  # the job whose incidents led to it, if any
    at: float  # Unix seconds


@dataclass(frozen=True)
class RankRecord:
    job_id: str
    attempt: int
    rank: int
    node: str
    pid: int


class CollectiveRecord(NamedTuple):
    """One rank's stored collective. A named tuple, not a frozen dataclass: a large job's
    replay reads ~10^5 of them, and a frozen dataclass is built field by field."""

    job_id: str
    attempt: int
    rank: int
    group: str
    group_size: int
    seq: int
    op: str
    input_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_sizes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    enter_ns: int
    exit_ns: int | None  # None while not completed
    state: str  # "started" | "completed" | "failed"
    step: int
    exit_estimated: bool = False  # exit_ns observed by the recorder's poll, not measured
    duration_ns: int | None = None  # measured duration; None = not measured
    timing: int = 0                 # fleet.proto.kinds.Timing wire number of duration_ns


@dataclass(frozen=True)
class ProcessGroupRecord:
    job_id: str
    attempt: int
    rank: int  # the rank that declared the group
    group: str
    desc: str
    ranks: tuple[int, ...]  # members, global ranks


@dataclass(frozen=True)
class CollectiveSummary:
    """Aggregate of one (attempt, rank, group) stream of collectives."""

    attempt: int
    rank: int
    group: str
    count: int
    first_seq: int
    last_seq: int
    consecutive: bool  # count == last_seq - first_seq + 1 (no gap)
    completed: int
    last_completed_seq: int | None
    ops: Mapping[str, int]  # op -> count
    mean_duration_ms: float | None  # over the ops with a measured duration; None if none
    measured: int = 0                # ops with a measured duration
    timings: tuple[str, ...] = ()    # where those durations come from (fleet.proto.kinds.Timing values)


@dataclass(frozen=True)
class StepRecord:
    job_id: str
    attempt: int
    rank: int
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    end_ns: int
    grad_norm: float = 0.0
    lr: float = 0.0
    mfu: float = 0.0
    aux_loss: float = 0.0
    imbalanced: bool = False
    expert_load: tuple[Mapping[str, Any], ...] = ()  # per MoE layer: layer, tokens_per_expert, shares


@dataclass(frozen=True)
class WorkerStatusRecord:
    job_id: str
    attempt: int
    rank: int
    state: str  # WorkerStatus.State name: "STARTING", "RESTORED", ...
    time_ns: int
    pid: int
    hostname: str
    restored_step: int
    detail: str
    phase_s: float
    phase: str = ""  # with TRAINING: the named phase the rank entered ("" = none)


@dataclass(frozen=True)
class HealthRecord:
    node: str
    time_ns: int
    cpu_percent: float
    load1: float
    mem_used_bytes: int
    mem_total_bytes: int
    workers_alive: int


@dataclass(frozen=True)
class IncidentRecord:
    id: int
    job_id: str
    attempt: int
    kind: IncidentKind
    rank: int | None
    node: str | None
    detector: str
    evidence: str
    detected_at: float
    traceback: str = ""  # the failed program's traceback or stderr tail; "" when none
    exit_code: int | None = None  # the failed process's exit status; negative: killed by that signal
    #: with detect.<kind>.action observe: what acting on it would have done; "" = it was acted on
    observed: str = ""


@dataclass(frozen=True)
class RecoveryRecord:
    """One restart, phase by phase (seconds). ``failed_at`` is the wall time of the failed
    attempt's last step; ``total_s`` runs from it to the first step of ``attempt``."""

    job_id: str
    incident_id: int | None
    failed_attempt: int
    attempt: int
    failed_at: float
    detect_s: float
    teardown_s: float
    place_s: float
    pg_init_s: float
    restore_s: float
    first_step_s: float
    total_s: float
    restored_step: int
    steps_lost: int
    restored_from: str
    reused_workers: int

    PHASES = ("detect_s", "teardown_s", "place_s", "pg_init_s", "restore_s", "first_step_s")


@dataclass(frozen=True)
class ActionRecord:
    id: int
    job_id: str
    attempt: int
    kind: str  # restart | quarantine | release | rollback | stop | resume | inject_fault
    cause: str
    at: float


@dataclass(frozen=True)
class CheckpointRecord:
    job_id: str
    attempt: int
    step: int
    path: str
    manifest_sha256: str
    save_s: float
    valid: bool
    created_at: float


@dataclass(frozen=True)
class SdcCheckRecord:
    id: int
    job_id: str
    attempt: int
    rank: int | None  # None for a node-level check
    node: str | None
    step: int
    kind: str  # "fingerprint" | "trigger" | "replay" | "verdict" | "gemm"
    value: str  # what was measured (hex digest or number as text)
    expected: str  # what it should have been ("" when decided by majority)
    ok: bool
    detail: str
    time_ns: int


@dataclass(frozen=True)
class IngestDropRecord:
    """Events lost before the store: by the agent, or refused by the controller."""

    id: int
    agent_id: str
    node: str
    epoch: int
    first_seq: int  # batch seqs covered (0 when the events never got a batch)
    last_seq: int
    events: int
    reason: str
    source: str  # "agent" | "controller"
    at: float


# -- prepared rows: a batch's rows as the live path (the watchdog) reads them -------------
# NamedTuples, not dataclasses: a view is built per row of every batch the watchdog
# sees, and a tuple costs the least to make.


class StepRow(NamedTuple):
    """One step of one rank, as a prepared batch carries it."""

    job_id: str
    attempt: int
    rank: int
    step: int
    end_ns: int  # when the step ended (the worker's clock)
    step_time_s: float
    loss: float
    tokens_per_s: float = 0.0  # tokens this rank processed per second
    #: per MoE layer: layer, tokens_per_expert, min_share, max_share, imbalanced (JSON text,
    #: as stored; "[]" without MoE): parsed only by the reader that needs it
    expert_load: str = "[]"


class CollectiveRow(NamedTuple):
    """One collective of one rank, as a prepared batch carries it (the ``collectives``
    table's columns, in order; sizes and dtypes still as JSON text)."""

    job_id: str
    attempt: int
    rank: int
    group: str
    seq: int
    group_size: int
    op: str  # canonical (fleet.proto.vocab)
    input_sizes: str
    input_dtypes: str
    output_sizes: str
    output_dtypes: str
    enter_ns: int
    exit_ns: int | None
    state: str  # "started" | "completed" | "failed"
    exit_estimated: bool
    step: int
    duration_ns: int | None = None  # measured; None = not measured (never exit - enter)
    timing: int = 0                 # fleet.proto.kinds.Timing wire number of duration_ns


class StatusRow(NamedTuple):
    """One worker status report, as a prepared batch carries it."""

    job_id: str
    attempt: int
    rank: int
    state: str  # a WorkerStatus.State name, e.g. "FAILED"
    time_ns: int = 0
    phase: str = ""  # with TRAINING: the named phase the rank is in from time_ns on ("" = none)
