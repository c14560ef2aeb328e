"""Measured collective durations.

``collectives.duration_ns``: the op's measured duration (NULL: not measured, as every
row stored before it); ``collectives.timing``: where it comes from, a
``fleet.proto.kinds.Timing`` wire number (1 a blocking call timed by its thread, 2 NCCL's
device timing, 3 an async op's issue to completion; 0 or NULL: not measured). Bandwidth
figures read only measured durations, never ``exit_ns - enter_ns`` (``exit_estimated``).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("collectives") as batch:
        batch.add_column(sa.Column("duration_ns", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("timing", sa.SmallInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("collectives") as batch:
        batch.drop_column("timing")
        batch.drop_column("duration_ns")
