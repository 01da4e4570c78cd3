"""ingestion: api keys, events, dead letters, outbox, trainer state

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
BIGPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("scopes", sa.String(200), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("revoked_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
    )
    op.create_table(
        "events",
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("suggestion_id", sa.String(36), nullable=True),
        sa.Column("occurred_at", TS, nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.Column("payload", JSON, nullable=False),
        sa.PrimaryKeyConstraint("event_id", name="pk_events"),
    )
    op.create_index("ix_events_user_id_occurred_at", "events", ["user_id", "occurred_at"])
    op.create_index("ix_events_suggestion_id", "events", ["suggestion_id"])
    op.create_table(
        "dead_letters",
        sa.Column("id", BIGPK, autoincrement=True, nullable=False),
        sa.Column("received_at", TS, nullable=False),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("api_key_id", sa.String(32), nullable=True),
        sa.Column("raw", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_dead_letters"),
    )
    op.create_table(
        "outbox",
        sa.Column("id", BIGPK, autoincrement=True, nullable=False),
        sa.Column("topic", sa.String(100), nullable=False),
        sa.Column("key", sa.String(256), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("published_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_outbox"),
    )
    op.create_index(
        "ix_outbox_unpublished",
        "outbox",
        ["id"],
        postgresql_where=sa.text("published_at IS NULL"),
        sqlite_where=sa.text("published_at IS NULL"),
    )
    op.create_table(
        "trainer_state",
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("log_offset", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("info", JSON, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_trainer_state"),
    )


def downgrade() -> None:
    op.drop_table("trainer_state")
    op.drop_index("ix_outbox_unpublished", table_name="outbox")
    op.drop_table("outbox")
    op.drop_table("dead_letters")
    op.drop_index("ix_events_suggestion_id", table_name="events")
    op.drop_index("ix_events_user_id_occurred_at", table_name="events")
    op.drop_table("events")
    op.drop_table("api_keys")
