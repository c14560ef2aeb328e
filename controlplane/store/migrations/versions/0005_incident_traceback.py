"""Incidents keep the failed program's traceback and exit code; progress is found by index.

``incidents.traceback`` and ``incidents.exit_code`` are nullable: incidents stored before
them read back with no traceback and no exit code. Two indexes let ``Store.last_progress_ns``
find an attempt's last progress before a time in one bounded lookup per table: the newest
step end, and the newest collectives by entry time.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("incidents") as batch:
        batch.add_column(sa.Column("traceback", sa.Text(), nullable=True))
        batch.add_column(sa.Column("exit_code", sa.Integer(), nullable=True))
    op.create_index("ix_steps_job_id_attempt_end_ns", "steps", ["job_id", "attempt", "end_ns"])
    op.create_index("ix_collectives_job_id_attempt_enter_ns", "collectives",
                    ["job_id", "attempt", "enter_ns"])


def downgrade() -> None:
    op.drop_index("ix_collectives_job_id_attempt_enter_ns", "collectives")
    op.drop_index("ix_steps_job_id_attempt_end_ns", "steps")
    with op.batch_alter_table("incidents") as batch:
        batch.drop_column("exit_code")
        batch.drop_column("traceback")
