"""the copy proposal a rollout was served with

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
    # what the policy was offered to copy and whether it did (tabloop/core/policy/sampling.py): the
    # trainer needs it to recompute the rollout's log-probability
    json = sa.JSON().with_variant(sa.dialects.postgresql.JSONB(), "postgresql")
    op.add_column("rollouts", sa.Column("recall", json, nullable=True))


def downgrade() -> None:
    op.drop_column("rollouts", "recall")
