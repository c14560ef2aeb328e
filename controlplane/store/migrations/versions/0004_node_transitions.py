"""Node transitions: every node state change, with who made it, why, and the job if any.

Nodes that exist already get one row each, from no state to the state they are in, so
that every node's history starts somewhere: actor ``migration``, the quarantine reason
(or "registered before node history was kept"), at its quarantine time or last contact.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "node_transitions",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("from_state", sa.String(32), nullable=True),
        sa.Column("to_state", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(32), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_node_transitions"),
    )
    op.create_index("ix_node_transitions_node_id", "node_transitions", ["node", "id"])
    op.execute(
        "INSERT INTO node_transitions (node, from_state, to_state, reason, actor, job_id, at) "
        "SELECT name, NULL, state, CASE WHEN quarantine_reason <> '' THEN quarantine_reason "
        "ELSE 'registered before node history was kept' END, 'migration', NULL, "
        "COALESCE(quarantined_since, last_seen) FROM nodes ORDER BY name")


def downgrade() -> None:
    op.drop_table("node_transitions")
