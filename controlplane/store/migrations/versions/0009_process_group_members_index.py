"""An index to read a process group's members without scanning the attempt's groups.

``process_groups`` is keyed (job_id, attempt, rank, group_name): reading one group's
declaration (``Store.group_members``, what `fleet replay` of a large job asks for its
suspect groups) scanned every declaration of the attempt, about 49,000 rows and their
member lists at 16,384 ranks (0.9 s on PostgreSQL). (job_id, attempt, group_name, rank)
makes it one index probe per group.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_NAME = "ix_process_groups_job_id_attempt_group_name_rank"


def upgrade() -> None:
    op.create_index(_NAME, "process_groups", ["job_id", "attempt", "group_name", "rank"])


def downgrade() -> None:
    op.drop_index(_NAME, table_name="process_groups")
