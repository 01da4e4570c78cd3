"""policies: rollouts, the policy registry, artifacts, deployments

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BIGPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("suggestion_id", sa.String(36), nullable=False),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("session_id", sa.String(256), nullable=True),
        sa.Column("workspace_id", sa.String(256), nullable=True),
        sa.Column("language", sa.String(64), nullable=True),
        sa.Column("file_path", sa.String(1024), nullable=True),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("context_token_ids", JSON, nullable=False),
        sa.Column("heal_text", sa.Text(), nullable=False),
        sa.Column("token_ids", JSON, nullable=False),
        sa.Column("token_logprobs", JSON, nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("shown", sa.Boolean(), nullable=False),
        sa.Column("gate_prob_show", sa.Float(), nullable=False),
        sa.Column("decision_logprob", sa.Float(), nullable=False),
        sa.Column("logprob_total", sa.Float(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("top_p", sa.Float(), nullable=True),
        sa.Column("stop_reason", sa.String(16), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("suggestion_id", name="pk_rollouts"),
    )
    op.create_index("ix_rollouts_user_id_created_at", "rollouts", ["user_id", "created_at"])
    op.create_index(
        "ix_rollouts_policy_version_created_at", "rollouts", ["policy_version", "created_at"]
    )
    op.create_table(
        "policies",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("manifest", JSON, nullable=False),
        sa.Column("summary", JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("api_key_id", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("version", name="pk_policies"),
    )
    op.create_table(
        "policy_artifacts",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("version", "name", name="pk_policy_artifacts"),
    )
    op.create_table(
        "deployments",
        sa.Column("id", BIGPK, autoincrement=True, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("live_version", sa.Integer(), nullable=False),
        sa.Column("canary_version", sa.Integer(), nullable=True),
        sa.Column("canary_fraction", sa.Float(), server_default="0", nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("api_key_id", sa.String(32), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_deployments"),
    )


def downgrade() -> None:
    op.drop_table("deployments")
    op.drop_table("policy_artifacts")
    op.drop_table("policies")
    op.drop_index("ix_rollouts_policy_version_created_at", table_name="rollouts")
    op.drop_index("ix_rollouts_user_id_created_at", table_name="rollouts")
    op.drop_table("rollouts")
