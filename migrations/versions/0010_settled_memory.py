"""the workspace memory's documents remember their latest request's cursor, for accepted and
settled text

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workspace_code") as batch:
        batch.add_column(sa.Column("suggestion_id", sa.String(36), nullable=True))
        batch.add_column(sa.Column("cursor_at", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("line_end", sa.Integer(), nullable=True))
    op.create_index("ix_workspace_code_suggestion_id", "workspace_code", ["suggestion_id"])


def downgrade() -> None:
    op.drop_index("ix_workspace_code_suggestion_id", table_name="workspace_code")
    with op.batch_alter_table("workspace_code") as batch:
        batch.drop_column("line_end")
        batch.drop_column("cursor_at")
        batch.drop_column("suggestion_id")
