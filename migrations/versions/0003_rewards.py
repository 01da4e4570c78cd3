"""rewards: reward specs and finalized rewards

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "reward_specs",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("api_key_id", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("version", name="pk_reward_specs"),
    )
    op.create_table(
        "rewards",
        sa.Column("suggestion_id", sa.String(36), nullable=False),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("rollout_created_at", TS, nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("components", JSON, nullable=False),
        sa.Column("spec_version", sa.Integer(), nullable=False),
        sa.Column("finalized_at", TS, nullable=False),
        sa.Column("trained_at", TS, nullable=True),
        sa.Column("trained_into", sa.Integer(), nullable=True),
        sa.Column("late_events", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("suggestion_id", name="pk_rewards"),
    )
    op.create_index(
        "ix_rewards_policy_version_finalized_at", "rewards", ["policy_version", "finalized_at"]
    )
    op.create_index(
        "ix_rewards_untrained",
        "rewards",
        ["finalized_at"],
        postgresql_where=sa.text("trained_at IS NULL"),
        sqlite_where=sa.text("trained_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_rewards_untrained", table_name="rewards")
    op.drop_index("ix_rewards_policy_version_finalized_at", table_name="rewards")
    op.drop_table("rewards")
    op.drop_table("reward_specs")
