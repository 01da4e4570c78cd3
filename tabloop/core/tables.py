"""The tables, as SQLAlchemy Core: the contract between the code and the Alembic migrations.

Portable across PostgreSQL and SQLite: ids are strings, times are UTC-aware, JSON is JSONB on
PostgreSQL. A migration must accompany every change here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Stores UTC; always returns timezone-aware datetimes (SQLite keeps no zone itself)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        when: datetime = (
            value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        )
        return when


JSONType = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
# Version numbers (policies, reward specs) are INTEGER columns: 32 bits in PostgreSQL, and a
# larger Python int does not even reach SQLite. The API refuses bigger ones (422).
MAX_VERSION = 2**31 - 1
# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL wants a bigint identity.
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),  # public part of the token
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("scopes", sa.String(200), nullable=False),  # comma-separated
    sa.Column("secret_sha256", sa.String(64), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("revoked_at", UTCDateTime(), nullable=True),
    # privacy mode: the key's requests are served, but no code text of them is stored and none
    # of their rollouts or feedback is trained on. NULL: false.
    sa.Column("no_train", sa.Boolean(), nullable=True),
    # the workspace whose memory its requests read and feed (tabloop/core/memory.py); NULL: the
    # key's own (its id)
    sa.Column("workspace", sa.String(200), nullable=True),
)

# The workspace memory: the code each person's editor sent, as it last stood, per document
# (tabloop/core/memory.py). Code text: never written for a no_train key or request, deleted
# with the person, aged out by TABLOOP_CODE_RETENTION_DAYS.
workspace_code = sa.Table(
    "workspace_code",
    metadata,
    sa.Column("id", BigIntPK, primary_key=True, autoincrement=True),
    sa.Column("workspace", sa.String(200), nullable=False),  # the key's workspace
    # what the client named: a request's workspace_id (Tabby: git_url), "" when none; a memory
    # narrowed to it reads only these rows
    sa.Column("scope", sa.String(256), nullable=False),
    sa.Column("user_id", sa.String(256), nullable=False),
    sa.Column("document", sa.String(1024), nullable=False),  # the file path ("" when none)
    sa.Column("text", sa.Text(), nullable=False),  # the document as it stood (prefix + suffix)
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    # the latest request's rollout, and where its cursor and the cursor's line end are in `text`:
    # its accepted and settled text goes there
    sa.Column("suggestion_id", sa.String(36), nullable=True),
    sa.Column("cursor_at", sa.Integer(), nullable=True),
    sa.Column("line_end", sa.Integer(), nullable=True),
    # the end of that request's prefix (tabloop.core.memory.TYPED_ANCHOR_CHARS + 1 characters),
    # read to tell a suggestion typed through without reading the whole document back
    sa.Column("prefix_tail", sa.Text(), nullable=True),
    sa.UniqueConstraint("workspace", "scope", "user_id", "document", name="uq_workspace_code"),
    sa.Index("ix_workspace_code_workspace_updated_at", "workspace", "updated_at"),
    sa.Index("ix_workspace_code_user_id", "user_id"),
    sa.Index("ix_workspace_code_suggestion_id", "suggestion_id"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("event_id", sa.String(36), primary_key=True),  # client-made; the idempotency key
    sa.Column("type", sa.String(32), nullable=False),
    sa.Column("user_id", sa.String(256), nullable=False),
    sa.Column("suggestion_id", sa.String(36), nullable=True),
    sa.Column("occurred_at", UTCDateTime(), nullable=False),
    sa.Column("received_at", UTCDateTime(), nullable=False),
    sa.Column("payload", JSONType, nullable=False),  # the validated event as received
    sa.Index("ix_events_user_id_occurred_at", "user_id", "occurred_at"),
    sa.Index("ix_events_suggestion_id", "suggestion_id"),
    # settled text is code: the retention job walks these by age (tabloop/core/retention.py)
    sa.Index(
        "ix_events_code_settled_received_at",
        "received_at",
        postgresql_where=sa.text("type = 'code_settled'"),
        sqlite_where=sa.text("type = 'code_settled'"),
    ),
)

dead_letters = sa.Table(
    "dead_letters",
    metadata,
    sa.Column("id", BigIntPK, primary_key=True, autoincrement=True),
    sa.Column("received_at", UTCDateTime(), nullable=False),
    sa.Column("source", sa.String(32), nullable=False),  # the endpoint, e.g. "events"
    sa.Column("api_key_id", sa.String(32), nullable=True),
    sa.Column("raw", sa.Text(), nullable=False),  # the event exactly as sent, as JSON text
    sa.Column("error", sa.Text(), nullable=False),
)

outbox = sa.Table(
    "outbox",
    metadata,
    # In embedded mode this id is the log offset; SQLite commits serially, so it is gapless.
    sa.Column("id", BigIntPK, primary_key=True, autoincrement=True),
    sa.Column("topic", sa.String(100), nullable=False),
    sa.Column("key", sa.String(256), nullable=False),
    sa.Column("payload", sa.Text(), nullable=False),  # the message value (JSON)
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("published_at", UTCDateTime(), nullable=True),
    sa.Index(
        "ix_outbox_unpublished",
        "id",
        postgresql_where=sa.text("published_at IS NULL"),
        sqlite_where=sa.text("published_at IS NULL"),
    ),
)

TRAINER_STATE_NAME = "trainer"  # the trainer's own row (heartbeat, paused flag, state)
TRAINER_MEMBER_PREFIX = "member:"  # + host:pid: a join member's row (full mode, Kafka)

trainer_state = sa.Table(
    "trainer_state",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),  # consumer group / trainer name
    sa.Column("log_offset", sa.BigInteger(), nullable=False, server_default="0"),  # embedded log
    sa.Column("paused", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("heartbeat_at", UTCDateTime(), nullable=True),
    sa.Column("info", JSONType, nullable=True),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
)

rollouts = sa.Table(
    "rollouts",
    metadata,
    sa.Column("suggestion_id", sa.String(36), primary_key=True),
    sa.Column("user_id", sa.String(256), nullable=False),
    sa.Column("session_id", sa.String(256), nullable=True),
    sa.Column("workspace_id", sa.String(256), nullable=True),
    sa.Column("language", sa.String(64), nullable=True),
    sa.Column("file_path", sa.String(1024), nullable=True),
    sa.Column("policy_version", sa.Integer(), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    # The action: what the policy saw, sampled and decided, with behaviour log-probs.
    sa.Column("context_token_ids", JSONType, nullable=False),
    sa.Column("heal_text", sa.Text(), nullable=False),
    sa.Column("token_ids", JSONType, nullable=False),
    sa.Column("token_logprobs", JSONType, nullable=False),
    sa.Column("text", sa.Text(), nullable=False),  # the sampled completion (shown only if shown)
    # len(text), kept when the text is not (privacy mode, code retention): the reward's size.
    # NULL (older rows): len(text).
    sa.Column("text_chars", sa.Integer(), nullable=True),
    sa.Column("shown", sa.Boolean(), nullable=False),
    # the copy proposal and the copy head's draw (tabloop.core.policy.actions.Completion.recall);
    # JSON null where the request had none. Code: blanked like `text` (service/privacy.py)
    sa.Column("recall", JSONType, nullable=True),
    # what the decisions read of the person and the moment (Completion.person): numbers, no code;
    # NULL where none were read (privacy mode, older rows: the heads read 0)
    sa.Column("person", JSONType, nullable=True),
    # how far it suggested (Completion.extend): {"at", "extended"} where the confidence stop came
    # and the extend head drew; NULL where it did not (older rows: the stop held as a rule)
    sa.Column("extend", JSONType, nullable=True),
    sa.Column("gate_prob_show", sa.Float(), nullable=False),
    sa.Column("decision_logprob", sa.Float(), nullable=False),
    sa.Column("logprob_total", sa.Float(), nullable=False),
    sa.Column("temperature", sa.Float(), nullable=False),
    sa.Column("top_p", sa.Float(), nullable=True),
    sa.Column("stop_reason", sa.String(16), nullable=False),
    sa.Column("latency_ms", sa.Float(), nullable=False),
    # The client sends a `view` event when it displays a suggestion (Tabby clients, or
    # /v1/complete with reports_views): unviewed, a shown suggestion is no reject. NULL: false.
    sa.Column("reports_views", sa.Boolean(), nullable=True),
    # The key that asked for it: feedback about it counts only through that key. NULL: unknown.
    sa.Column("api_key_id", sa.String(32), nullable=True),
    # Privacy mode (the key's or the request's): no code text stored, never trained on. NULL: false.
    sa.Column("no_train", sa.Boolean(), nullable=True),
    sa.Index("ix_rollouts_user_id_created_at", "user_id", "created_at"),
    # has this key served this person? (ingestion's check of model_switch and churn)
    sa.Index("ix_rollouts_user_id_api_key_id", "user_id", "api_key_id"),
    sa.Index("ix_rollouts_policy_version_created_at", "policy_version", "created_at"),
    sa.Index("ix_rollouts_created_at", "created_at"),  # code retention walks rollouts by age
)

policies = sa.Table(
    "policies",
    metadata,
    sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("parent", sa.Integer(), nullable=True),
    sa.Column("sha256", sa.String(64), nullable=False),  # of the weights: the artifact's identity
    sa.Column("manifest", JSONType, nullable=False),
    sa.Column("summary", JSONType, nullable=False),  # training summary
    sa.Column(
        "status", sa.String(16), nullable=False
    ),  # registered|canary|live|retired|rolled_back
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("api_key_id", sa.String(32), nullable=True),
)

# Checkpoint files live in the database so every worker and host can load any version.
policy_artifacts = sa.Table(
    "policy_artifacts",
    metadata,
    sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("name", sa.String(64), primary_key=True),  # model.safetensors, tokenizer.json, ...
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("data", sa.LargeBinary(), nullable=False),
)

# Append-only timeline: each row is the routing state from then on (the last row is current).
deployments = sa.Table(
    "deployments",
    metadata,
    sa.Column("id", BigIntPK, primary_key=True, autoincrement=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("action", sa.String(16), nullable=False),  # deploy|promote|rollback|bootstrap
    sa.Column("live_version", sa.Integer(), nullable=False),
    sa.Column("canary_version", sa.Integer(), nullable=True),
    sa.Column("canary_fraction", sa.Float(), nullable=False, server_default="0"),
    sa.Column("reason", sa.Text(), nullable=True),
    sa.Column("api_key_id", sa.String(32), nullable=True),
)

reward_specs = sa.Table(
    "reward_specs",
    metadata,
    sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("spec", JSONType, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("api_key_id", sa.String(32), nullable=True),
)

# One finalized reward per rollout; never rewritten once a policy has trained on it.
rewards = sa.Table(
    "rewards",
    metadata,
    sa.Column("suggestion_id", sa.String(36), primary_key=True),
    sa.Column("user_id", sa.String(256), nullable=False),
    sa.Column("policy_version", sa.Integer(), nullable=False),
    sa.Column("rollout_created_at", UTCDateTime(), nullable=False),
    sa.Column("value", sa.Float(), nullable=False),
    # abstained|accepted|rejected|ignored|unviewed (tabloop/core/reward.py OUTCOMES)
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("components", JSONType, nullable=False),
    sa.Column("spec_version", sa.Integer(), nullable=False),
    sa.Column("finalized_at", UTCDateTime(), nullable=False),
    sa.Column("trained_at", UTCDateTime(), nullable=True),
    sa.Column("trained_into", sa.Integer(), nullable=True),  # the candidate version it trained
    sa.Column("late_events", sa.Integer(), nullable=False, server_default="0"),
    sa.Index("ix_rewards_policy_version_finalized_at", "policy_version", "finalized_at"),
    sa.Index(
        "ix_rewards_untrained",
        "finalized_at",
        postgresql_where=sa.text("trained_at IS NULL"),
        sqlite_where=sa.text("trained_at IS NULL"),
    ),
)

# Append-only: every admin and deploy action, who did it and how it ended (GET /admin/audit).
audit_log = sa.Table(
    "audit_log",
    metadata,
    sa.Column("id", BigIntPK, primary_key=True, autoincrement=True),
    sa.Column("at", UTCDateTime(), nullable=False),
    sa.Column("key_id", sa.String(32), nullable=True),  # the key's public id
    sa.Column("key_name", sa.String(200), nullable=True),
    sa.Column("action", sa.String(32), nullable=False),  # e.g. "key.create", "deploy", "purge"
    sa.Column("target", sa.Text(), nullable=True),  # what it acted on: a version, key id, user
    sa.Column("request_id", sa.String(64), nullable=True),
    sa.Column("outcome", sa.String(16), nullable=False),  # "ok" or the refusal's status
    sa.Column("detail", JSONType, nullable=True),
    sa.Index("ix_audit_log_at", "at"),
)
