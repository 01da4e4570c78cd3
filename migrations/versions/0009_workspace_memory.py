"""workspaces on keys, and the workspace memory's documents

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("workspace", sa.String(200), nullable=True))
    op.create_table(
        "workspace_code",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("workspace", sa.String(200), nullable=False),
        sa.Column("scope", sa.String(256), nullable=False),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("document", sa.String(1024), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("workspace", "scope", "user_id", "document", name="uq_workspace_code"),
    )
    op.create_index(
        "ix_workspace_code_workspace_updated_at", "workspace_code", ["workspace", "updated_at"]
    )
    op.create_index("ix_workspace_code_user_id", "workspace_code", ["user_id"])


def downgrade() -> None:
    op.drop_table("workspace_code")
    op.drop_column("api_keys", "workspace")
