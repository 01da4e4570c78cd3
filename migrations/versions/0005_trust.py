"""trust and privacy: the key behind each rollout, privacy mode, the audit log

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # nullable, no default: adding them rewrites no row; NULL (every older row) means
    # "unknown key" and "not no_train"
    op.add_column("rollouts", sa.Column("api_key_id", sa.String(32), nullable=True))
    op.add_column("rollouts", sa.Column("no_train", sa.Boolean(), nullable=True))
    op.add_column("api_keys", sa.Column("no_train", sa.Boolean(), nullable=True))
    op.create_table(
        "audit_log",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", TS, nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("key_name", sa.String(200), nullable=True),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.Text(), nullable=True),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("detail", JSON, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_audit_log"),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_at", table_name="audit_log")
    op.drop_table("audit_log")
    with op.batch_alter_table("api_keys") as batch:  # SQLite: a copy of the table
        batch.drop_column("no_train")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("no_train")
        batch.drop_column("api_key_id")
