"""Observed incidents and worker phases.

``incidents.observed``: with ``detect.<kind>.action: observe``, what acting on the
incident would have done ("would restart the attempt ..."); NULL when it was acted on,
as every incident stored before it was. ``worker_status.phase``: the named phase a rank
entered (checkpointing, eval, a program's own; "" = none); NULL in older rows.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("incidents") as batch:
        batch.add_column(sa.Column("observed", sa.Text(), nullable=True))
    with op.batch_alter_table("worker_status") as batch:
        batch.add_column(sa.Column("phase", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("worker_status") as batch:
        batch.drop_column("phase")
    with op.batch_alter_table("incidents") as batch:
        batch.drop_column("observed")
