"""Collective fronts: where each rank of a large job stands in each of its process groups.

Jobs with more ranks than ``agent.raw_ingest_max_ranks`` send per-(rank, group) fronts
instead of every collective; the controller writes them to ``collective_fronts``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "collective_fronts",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("group_name", sa.String(255), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("entered_seq", sa.BigInteger(), nullable=False),
        sa.Column("completed_seq", sa.BigInteger(), nullable=False),
        sa.Column("entered_ns", sa.BigInteger(), nullable=False),
        sa.Column("completed_ns", sa.BigInteger(), nullable=False),
        sa.Column("op", sa.String(64), nullable=False),
        sa.Column("signature", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "attempt", "rank", "group_name", name="pk_collective_fronts"),
    )


def downgrade() -> None:
    op.drop_table("collective_fronts")
