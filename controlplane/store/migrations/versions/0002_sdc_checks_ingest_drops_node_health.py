"""SDC checks, ingest drops, and the node's last health-check verdict.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # Server defaults fill the rows that already exist (and keep SQLite's ADD COLUMN legal).
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("health", sa.String(32), nullable=False,
                                   server_default="unknown"))
        batch.add_column(sa.Column("health_reason", sa.Text(), nullable=False,
                                   server_default=""))

    op.create_table(
        "sdc_checks",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("node", sa.String(255), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("value", sa.String(255), nullable=False),
        sa.Column("expected", sa.String(255), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("time_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sdc_checks"),
    )
    op.create_index("ix_sdc_checks_job_id_step", "sdc_checks", ["job_id", "step"])
    op.create_index("ix_sdc_checks_node_time_ns", "sdc_checks", ["node", "time_ns"])

    op.create_table(
        "ingest_drops",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("agent_id", sa.String(255), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ingest_drops"),
    )
    op.create_index("ix_ingest_drops_node_at", "ingest_drops", ["node", "at"])


def downgrade() -> None:
    op.drop_table("ingest_drops")
    op.drop_table("sdc_checks")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("health_reason")
        batch.drop_column("health")
