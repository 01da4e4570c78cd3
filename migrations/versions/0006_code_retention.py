"""code retention: rollouts.text_chars, and the indexes the retention job walks

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable, no default: adding it rewrites no row; NULL (every older row) means "the length
    # of `text`", which still holds the suggestion there
    op.add_column("rollouts", sa.Column("text_chars", sa.Integer(), nullable=True))
    # the retention job walks rollouts and code_settled events by age, oldest first
    op.create_index("ix_rollouts_created_at", "rollouts", ["created_at"])
    op.create_index(
        "ix_events_code_settled_received_at",
        "events",
        ["received_at"],
        postgresql_where=sa.text("type = 'code_settled'"),
        sqlite_where=sa.text("type = 'code_settled'"),
    )


def downgrade() -> None:
    op.drop_index("ix_events_code_settled_received_at", table_name="events")
    op.drop_index("ix_rollouts_created_at", table_name="rollouts")
    with op.batch_alter_table("rollouts") as batch:  # SQLite: a copy of the table
        batch.drop_column("text_chars")
