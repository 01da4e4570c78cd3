"""the workspace memory's documents keep the end of their latest request's prefix apart, so that
telling a typed-through suggestion reads a few hundred characters, not the whole file

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workspace_code") as batch:
        batch.add_column(sa.Column("prefix_tail", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workspace_code") as batch:
        batch.drop_column("prefix_tail")
