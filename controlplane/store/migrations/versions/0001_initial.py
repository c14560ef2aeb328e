"""The schema as it was when migrations were introduced (``metadata.create_all`` until then).

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Frozen: never edit a released revision; change the schema in a new one. Stores created
before migrations existed hold exactly these tables and are stamped 0001.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# SQLite only auto-increments an INTEGER PRIMARY KEY; elsewhere 64 bits.
BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _id() -> sa.Column:
    return sa.Column("id", BIG_ID, autoincrement=True, nullable=False)


def _job_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=f"fk_{table}_job_id_jobs",
                                   ondelete="CASCADE")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("total_steps", sa.BigInteger(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])

    op.create_table(
        "attempts",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("restored_step", sa.BigInteger(), nullable=True),
        sa.Column("final_step", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_attempts"),
        sa.UniqueConstraint("job_id", "number", name="uq_attempts_job_id_number"),
        _job_fk("attempts"),
    )

    op.create_table(
        "transitions",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("entity", sa.String(16), nullable=False),
        sa.Column("from_state", sa.String(32), nullable=True),
        sa.Column("to_state", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        _job_fk("transitions"),
        sa.PrimaryKeyConstraint("id", name="pk_transitions"),
    )
    op.create_index("ix_transitions_job_id", "transitions", ["job_id"])

    op.create_table(
        "nodes",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("ray_node_id", sa.String(255), nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("resources_json", sa.Text(), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("quarantine_reason", sa.Text(), nullable=False),
        sa.Column("quarantined_since", sa.Float(), nullable=True),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_nodes"),
    )

    op.create_table(
        "ranks",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ranks"),
        sa.UniqueConstraint("job_id", "attempt", "rank", name="uq_ranks_job_id_attempt_rank"),
        _job_fk("ranks"),
    )
    op.create_index("ix_ranks_node", "ranks", ["node"])

    op.create_table(
        "collectives",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("group_name", sa.String(255), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("op", sa.String(64), nullable=False),
        sa.Column("input_sizes", sa.Text(), nullable=False),
        sa.Column("input_dtypes", sa.Text(), nullable=False),
        sa.Column("output_sizes", sa.Text(), nullable=False),
        sa.Column("output_dtypes", sa.Text(), nullable=False),
        sa.Column("enter_ns", sa.BigInteger(), nullable=False),
        sa.Column("exit_ns", sa.BigInteger(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("exit_estimated", sa.Boolean(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "attempt", "rank", "group_name", "seq",
                                name="pk_collectives"),
    )
    op.create_index("ix_collectives_job_id_attempt_group_name_seq", "collectives",
                    ["job_id", "attempt", "group_name", "seq"])

    op.create_table(
        "process_groups",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("group_name", sa.String(255), nullable=False),
        sa.Column("desc", sa.String(255), nullable=False),
        sa.Column("ranks", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "attempt", "rank", "group_name",
                                name="pk_process_groups"),
    )

    op.create_table(
        "steps",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("end_ns", sa.BigInteger(), nullable=False),
        sa.Column("grad_norm", sa.Float(), nullable=False),
        sa.Column("lr", sa.Float(), nullable=False),
        sa.Column("mfu", sa.Float(), nullable=False),
        sa.Column("aux_loss", sa.Float(), nullable=False),
        sa.Column("imbalanced", sa.Boolean(), nullable=False),
        sa.Column("expert_load", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_steps"),
    )
    op.create_index("ix_steps_job_id_attempt_step", "steps", ["job_id", "attempt", "step"])
    op.create_index("ix_steps_job_id_step", "steps", ["job_id", "step"])

    op.create_table(
        "worker_status",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("time_ns", sa.BigInteger(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("restored_step", sa.BigInteger(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("phase_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_worker_status"),
    )
    op.create_index("ix_worker_status_job_id_attempt_rank", "worker_status",
                    ["job_id", "attempt", "rank"])

    op.create_table(
        "health_samples",
        _id(),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("time_ns", sa.BigInteger(), nullable=False),
        sa.Column("cpu_percent", sa.Float(), nullable=False),
        sa.Column("load1", sa.Float(), nullable=False),
        sa.Column("mem_used_bytes", sa.BigInteger(), nullable=False),
        sa.Column("mem_total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("workers_alive", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_health_samples"),
    )
    op.create_index("ix_health_samples_node_time_ns", "health_samples", ["node", "time_ns"])

    op.create_table(
        "incidents",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("node", sa.String(255), nullable=True),
        sa.Column("detector", sa.String(64), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("detected_at", sa.Float(), nullable=False),
        _job_fk("incidents"),
        sa.PrimaryKeyConstraint("id", name="pk_incidents"),
    )
    op.create_index("ix_incidents_job_id", "incidents", ["job_id"])

    op.create_table(
        "actions",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("cause", sa.Text(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        _job_fk("actions"),
        sa.PrimaryKeyConstraint("id", name="pk_actions"),
    )
    op.create_index("ix_actions_job_id", "actions", ["job_id"])

    op.create_table(
        "checkpoints",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("manifest_sha256", sa.String(64), nullable=False),
        sa.Column("save_s", sa.Float(), nullable=False),
        sa.Column("valid", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.UniqueConstraint("job_id", "step", name="uq_checkpoints_job_id_step"),
    )

    op.create_table(
        "ingest_batches",
        sa.Column("agent_id", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("committed_at", sa.Float(), nullable=False),
        sa.Column("n_events", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("agent_id", "epoch", "seq", name="pk_ingest_batches"),
    )


def downgrade() -> None:
    for table in ("ingest_batches", "checkpoints", "actions", "incidents", "health_samples",
                  "worker_status", "steps", "process_groups", "collectives", "ranks", "nodes",
                  "transitions", "attempts", "jobs"):
        op.drop_table(table)
