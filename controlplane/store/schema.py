"""The store's tables: SQLAlchemy 2.x declarative models over one ``MetaData``.

Metadata tables (jobs, attempts, transitions, nodes, node_transitions, ranks, incidents,
actions) are used through the ORM. High-volume telemetry tables (collectives, steps, worker_status,
health_samples, process_groups) are written with Core bulk inserts of dicts, never ORM objects.

Invariants:
- Times are float Unix seconds (``*_at``, ``last_seen``) or int Unix nanoseconds (``*_ns``).
- States are stored as the enum's string value (``JobState.RUNNING.value``) so a schema
  migration never has to touch a native enum type.
- Telemetry tables carry no foreign key to ``jobs``: ingest must never fail a whole
  agent batch because one event names an unknown job.
- ``metadata`` has a naming convention so Alembic autogenerate produces stable names.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an ``INTEGER PRIMARY KEY``; elsewhere use 64 bits.
BigId = BigInteger().with_variant(Integer, "sqlite")

JOB_ID_LEN = 64
NAME_LEN = 255
STATE_LEN = 32
PHASE_LEN = 64  # a phase name (workers/phases.py NAME_PATTERN)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


metadata = Base.metadata


def _job_fk() -> ForeignKey:
    return ForeignKey("jobs.id", ondelete="CASCADE")


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(JOB_ID_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    state: Mapped[str] = mapped_column(String(STATE_LEN))
    total_steps: Mapped[int] = mapped_column(BigInteger)
    config_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text, default="")


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), _job_fk())
    number: Mapped[int] = mapped_column(Integer)  # 1-based
    state: Mapped[str] = mapped_column(String(STATE_LEN))
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    restored_step: Mapped[int | None] = mapped_column(BigInteger)
    final_step: Mapped[int | None] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text, default="")


class Transition(Base):
    __tablename__ = "transitions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), _job_fk(), index=True)
    attempt: Mapped[int | None] = mapped_column(Integer)
    entity: Mapped[str] = mapped_column(String(16))  # "job" | "attempt"
    from_state: Mapped[str | None] = mapped_column(String(STATE_LEN))  # None on creation
    to_state: Mapped[str] = mapped_column(String(STATE_LEN))
    reason: Mapped[str] = mapped_column(Text, default="")
    at: Mapped[float] = mapped_column(Float)


class Node(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    ray_node_id: Mapped[str] = mapped_column(String(NAME_LEN))
    hostname: Mapped[str] = mapped_column(String(NAME_LEN))
    resources_json: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(STATE_LEN))  # a NodeState value
    quarantine_reason: Mapped[str] = mapped_column(Text, default="")
    quarantined_since: Mapped[float | None] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    # Last node health-check verdict ("unknown" until the first check); server defaults so
    # the migration that added them could fill rows that already existed.
    health: Mapped[str] = mapped_column(String(STATE_LEN), default="unknown",
                                        server_default="unknown")
    health_reason: Mapped[str] = mapped_column(Text, default="", server_default="")


class NodeTransition(Base):
    """One node state change: who (``NodeActor``), why, and the job it came from, if any.
    No foreign key to ``nodes`` or ``jobs``: the history outlives either row."""

    __tablename__ = "node_transitions"
    __table_args__ = (Index(None, "node", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    from_state: Mapped[str | None] = mapped_column(String(STATE_LEN))  # None on registration
    to_state: Mapped[str] = mapped_column(String(STATE_LEN))
    reason: Mapped[str] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(STATE_LEN))
    job_id: Mapped[str | None] = mapped_column(String(JOB_ID_LEN))
    at: Mapped[float] = mapped_column(Float)


class Rank(Base):
    __tablename__ = "ranks"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "rank"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), _job_fk())
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(NAME_LEN), index=True)
    pid: Mapped[int] = mapped_column(Integer)


class Collective(Base):
    """One row per (job, attempt, rank, group, seq): "started" then updated on completion."""

    __tablename__ = "collectives"
    __table_args__ = (
        # The primary key doubles as the (job, attempt, rank, group, seq) index.
        Index(None, "job_id", "attempt", "group_name", "seq"),
        Index(None, "job_id", "attempt", "enter_ns"),  # Store.last_progress_ns: the newest entries
    )

    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    group_size: Mapped[int] = mapped_column(Integer)
    op: Mapped[str] = mapped_column(String(64))
    input_sizes: Mapped[str] = mapped_column(Text)  # JSON list of lists of ints
    input_dtypes: Mapped[str] = mapped_column(Text)  # JSON list of strings
    output_sizes: Mapped[str] = mapped_column(Text)
    output_dtypes: Mapped[str] = mapped_column(Text)
    enter_ns: Mapped[int] = mapped_column(BigInteger)
    exit_ns: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))  # "started" | "completed" | "failed"
    exit_estimated: Mapped[bool] = mapped_column(Boolean, default=False)
    step: Mapped[int] = mapped_column(BigInteger)
    duration_ns: Mapped[int | None] = mapped_column(BigInteger)  # measured; NULL = not measured
    timing: Mapped[int | None] = mapped_column(SmallInteger)     # fleet.proto.kinds.Timing wire number


class CollectiveFront(Base):
    """Where one rank stood in one process group (``fleet.proto.fronts.FrontRow``): the
    telemetry of a large job instead of every collective. The controller keeps the live
    fronts in memory (``controlplane.wavefront``) and writes them here every few seconds
    and at every incident, so ``fleet replay`` shows the wavefront around it."""

    __tablename__ = "collective_fronts"

    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    group_size: Mapped[int] = mapped_column(Integer)
    entered_seq: Mapped[int] = mapped_column(BigInteger)
    completed_seq: Mapped[int] = mapped_column(BigInteger)
    entered_ns: Mapped[int] = mapped_column(BigInteger)
    completed_ns: Mapped[int] = mapped_column(BigInteger)
    op: Mapped[str] = mapped_column(String(64))
    signature: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)


class ProcessGroupRow(Base):
    """A process group as one rank declared it: its members, so the diagnosis engine can
    tell a member that never entered a collective from a rank outside the group."""

    __tablename__ = "process_groups"
    __table_args__ = (
        Index(None, "job_id", "attempt", "group_name", "rank"),  # one group's members: Store.group_members
    )

    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    desc: Mapped[str] = mapped_column(String(NAME_LEN))
    ranks: Mapped[str] = mapped_column(Text)  # JSON list of global ranks


class Step(Base):
    __tablename__ = "steps"
    __table_args__ = (
        Index(None, "job_id", "attempt", "step"),
        Index(None, "job_id", "step"),  # last_step / steps_completed across attempts
        Index(None, "job_id", "attempt", "end_ns"),  # Store.last_progress_ns: the newest step end
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float] = mapped_column(Float)
    step_time_s: Mapped[float] = mapped_column(Float)
    tokens_per_s: Mapped[float] = mapped_column(Float)
    end_ns: Mapped[int] = mapped_column(BigInteger)
    grad_norm: Mapped[float] = mapped_column(Float, default=0.0)
    lr: Mapped[float] = mapped_column(Float, default=0.0)
    mfu: Mapped[float] = mapped_column(Float, default=0.0)
    aux_loss: Mapped[float] = mapped_column(Float, default=0.0)
    imbalanced: Mapped[bool] = mapped_column(Boolean, default=False)
    expert_load: Mapped[str] = mapped_column(Text, default="[]")  # JSON, one object per MoE layer


class WorkerStatusRow(Base):
    __tablename__ = "worker_status"
    __table_args__ = (Index(None, "job_id", "attempt", "rank"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(STATE_LEN))  # WorkerStatus.State name
    time_ns: Mapped[int] = mapped_column(BigInteger)
    pid: Mapped[int] = mapped_column(Integer)
    hostname: Mapped[str] = mapped_column(String(NAME_LEN))
    restored_step: Mapped[int] = mapped_column(BigInteger)
    detail: Mapped[str] = mapped_column(Text)
    phase_s: Mapped[float] = mapped_column(Float)
    # the named phase the rank entered (checkpointing, eval, ...; "" = none); NULL before 0007
    phase: Mapped[str | None] = mapped_column(String(PHASE_LEN))


class HealthSample(Base):
    __tablename__ = "health_samples"
    __table_args__ = (Index(None, "node", "time_ns"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    time_ns: Mapped[int] = mapped_column(BigInteger)
    cpu_percent: Mapped[float] = mapped_column(Float)
    load1: Mapped[float] = mapped_column(Float)
    mem_used_bytes: Mapped[int] = mapped_column(BigInteger)
    mem_total_bytes: Mapped[int] = mapped_column(BigInteger)
    workers_alive: Mapped[int] = mapped_column(Integer)


class Incident(Base):
    __tablename__ = "incidents"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), _job_fk(), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int | None] = mapped_column(Integer)
    node: Mapped[str | None] = mapped_column(String(NAME_LEN))
    detector: Mapped[str] = mapped_column(String(64))
    evidence: Mapped[str] = mapped_column(Text)
    detected_at: Mapped[float] = mapped_column(Float)
    # The failed program's traceback (its error file, else its stderr's tail) and exit code
    # (negative: killed by that signal); NULL when there was none, as in rows from before 0005.
    traceback: Mapped[str | None] = mapped_column(Text)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    # detect.<kind>.action observe: what acting on it would have done ("would restart ...");
    # NULL when it was acted on, as every incident from before 0007 was.
    observed: Mapped[str | None] = mapped_column(Text)


class Recovery(Base):
    """How long one restart took, phase by phase (seconds), from the failure to the first
    step of the next attempt."""

    __tablename__ = "recoveries"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), _job_fk(), index=True)
    incident_id: Mapped[int | None] = mapped_column(BigInteger)
    failed_attempt: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    failed_at: Mapped[float] = mapped_column(Float)      # last progress of the failed attempt
    detect_s: Mapped[float] = mapped_column(Float)
    teardown_s: Mapped[float] = mapped_column(Float)
    place_s: Mapped[float] = mapped_column(Float)
    pg_init_s: Mapped[float] = mapped_column(Float)
    restore_s: Mapped[float] = mapped_column(Float)
    first_step_s: Mapped[float] = mapped_column(Float)
    total_s: Mapped[float] = mapped_column(Float)
    restored_step: Mapped[int] = mapped_column(BigInteger)
    steps_lost: Mapped[int] = mapped_column(BigInteger)
    restored_from: Mapped[str] = mapped_column(String(64))
    reused_workers: Mapped[int] = mapped_column(Integer)


class Action(Base):
    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), _job_fk(), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # restart | quarantine | release | rollback | stop | inject_fault
    cause: Mapped[str] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    # The unique (job_id, step) index also serves latest_valid_checkpoint: it walks the
    # job's steps backwards and skips the rare invalid ones, so no (job, valid, step) index.
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    manifest_sha256: Mapped[str] = mapped_column(String(64))
    save_s: Mapped[float] = mapped_column(Float)
    valid: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[float] = mapped_column(Float)


class IngestBatch(Base):
    """One row per committed agent batch; its key makes ``record_batch`` idempotent."""

    __tablename__ = "ingest_batches"

    agent_id: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    committed_at: Mapped[float] = mapped_column(Float)
    n_events: Mapped[int] = mapped_column(Integer)


class SdcCheck(Base):
    """One silent-data-corruption check: a cross-replica parameter checksum, a known-answer
    GEMM on a node, or the replay of a step elsewhere; ``ok`` is whether value == expected."""

    __tablename__ = "sdc_checks"
    __table_args__ = (
        Index(None, "job_id", "step"),
        Index(None, "node", "time_ns"),  # a node's check history, for quarantine evidence
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN))  # telemetry: no foreign key
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer)  # None for a node-level check
    node: Mapped[str | None] = mapped_column(String(NAME_LEN))
    step: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(32))  # "fingerprint" | "trigger" | "replay" | "verdict" | "gemm"
    value: Mapped[str] = mapped_column(String(255))
    expected: Mapped[str] = mapped_column(String(255))
    ok: Mapped[bool] = mapped_column(Boolean)
    detail: Mapped[str] = mapped_column(Text)
    time_ns: Mapped[int] = mapped_column(BigInteger)


class IngestDrop(Base):
    """Events known to be lost before the store, so reports can say what is missing."""

    __tablename__ = "ingest_drops"
    __table_args__ = (Index(None, "node", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    agent_id: Mapped[str] = mapped_column(String(NAME_LEN))
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    epoch: Mapped[int] = mapped_column(BigInteger)
    first_seq: Mapped[int] = mapped_column(BigInteger)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    events: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    # "agent": the agent lost them (e.g. spill disk full);
    # "controller": the controller refused a malformed batch
    source: Mapped[str] = mapped_column(String(16))
    at: Mapped[float] = mapped_column(Float)
