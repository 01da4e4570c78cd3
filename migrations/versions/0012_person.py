"""what a rollout's decisions read of the person and the moment (tabloop/core/person.py): numbers,
no code; and its extend draw (how far it suggested); the trainer needs both to recompute the
decisions' log-probability

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    json = sa.JSON().with_variant(sa.dialects.postgresql.JSONB(), "postgresql")
    op.add_column("rollouts", sa.Column("person", json, nullable=True))
    op.add_column("rollouts", sa.Column("extend", json, nullable=True))


def downgrade() -> None:
    op.drop_column("rollouts", "extend")
    op.drop_column("rollouts", "person")
