"""rollouts.reports_views: whether the rollout's client sends `view` events

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


def upgrade() -> None:
    # nullable, no default: adding it rewrites no row, and NULL (every older rollout) is false
    op.add_column("rollouts", sa.Column("reports_views", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:  # SQLite: a copy of the table
        batch.drop_column("reports_views")
