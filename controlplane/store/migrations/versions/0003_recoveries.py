"""Recoveries: each restart's time by phase, restored step and steps lost.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "recoveries",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("incident_id", sa.BigInteger(), nullable=True),
        sa.Column("failed_attempt", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("failed_at", sa.Float(), nullable=False),
        sa.Column("detect_s", sa.Float(), nullable=False),
        sa.Column("teardown_s", sa.Float(), nullable=False),
        sa.Column("place_s", sa.Float(), nullable=False),
        sa.Column("pg_init_s", sa.Float(), nullable=False),
        sa.Column("restore_s", sa.Float(), nullable=False),
        sa.Column("first_step_s", sa.Float(), nullable=False),
        sa.Column("total_s", sa.Float(), nullable=False),
        sa.Column("restored_step", sa.BigInteger(), nullable=False),
        sa.Column("steps_lost", sa.BigInteger(), nullable=False),
        sa.Column("restored_from", sa.String(64), nullable=False),
        sa.Column("reused_workers", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_recoveries_job_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_recoveries"),
    )
    op.create_index("ix_recoveries_job_id", "recoveries", ["job_id"])


def downgrade() -> None:
    op.drop_table("recoveries")
