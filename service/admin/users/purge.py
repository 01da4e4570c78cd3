"""Purge a person: delete their rows and tell the log's consumers, in one transaction.

Deleted: `rollouts`, `events` and `rewards` rows with the user id; `outbox` rows on
tabloop.rollouts / tabloop.feedback keyed by it (in embedded mode the outbox is the log, so the
messages are gone; in full mode an unpublished row deleted here is never published, and the
relay's stamp of a row it already sent touches nothing); and `dead_letters` whose raw event
names the user (`"user_id": <id>` at its top level — a rejected event without a readable
user id cannot be attributed and stays). Then a `user_purged` tombstone goes through the outbox
to both topics, keyed by the user id, so it lands after the user's earlier messages in their
partition: the trainer drops what it holds of the user (trainer/join.py). Messages already
published stay in Kafka until its retention removes them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import orjson
import sqlalchemy as sa

from tabloop.core.memory import forget_user
from tabloop.core.outbox import outbox_row
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS, USER_PURGED, encode, user_purged
from tabloop.core.tables import dead_letters, events, outbox, rewards, rollouts, utcnow

_sqlite_writer = threading.Lock()  # one purge at a time on SQLite, like ingestion
USER_TOPICS = (ROLLOUTS, FEEDBACK)  # keyed by user id (tabloop.policies is keyed by version)


@dataclass(frozen=True)
class PurgeResult:
    user_id: str
    purged_at: str  # RFC 3339, as in the tombstone
    removed: dict[str, int]  # table -> rows deleted


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _tombstone_prefix() -> str:
    """How every tombstone's payload starts (encode() writes schema_version, then type)."""
    return encode({"type": USER_PURGED})[:-1]


def _dead_letter_ids(conn: sa.Connection, user_id: str) -> list[int]:
    """Dead letters whose raw event is a JSON object with this `user_id`. A LIKE on the
    id as the raw text spells it (orjson keeps UTF-8, json.dumps escapes) narrows the scan;
    the JSON is then read to be sure (the id inside another field does not count)."""
    spellings = {orjson.dumps(user_id).decode()[1:-1], json.dumps(user_id)[1:-1]}
    found = conn.execute(
        sa.select(dead_letters.c.id, dead_letters.c.raw).where(
            sa.or_(
                *(dead_letters.c.raw.like(f"%{_like_escape(s)}%", escape="\\") for s in spellings)
            )
        )
    ).all()
    ids = []
    for row in found:
        try:
            raw = json.loads(row.raw)
        except ValueError:
            continue
        if isinstance(raw, dict) and raw.get("user_id") == user_id:
            ids.append(row.id)
    return ids


def purge_user(
    engine: sa.Engine,
    user_id: str,
    *,
    embedded: bool,
    before_commit: Callable[[sa.Connection, PurgeResult], None] | None = None,
) -> PurgeResult:
    """Delete the user's rows and queue the tombstone; idempotent (a repeat removes nothing
    and queues another, harmless, tombstone). Returns the rows removed per table.

    `before_commit(conn, result)` runs last inside the transaction (the audit row); the audit log
    itself is never purged: it names the user as a purge's target, and holds no code."""
    now = utcnow()
    purged_at = now.isoformat().replace("+00:00", "Z")
    removed: dict[str, int] = {}
    writer = _sqlite_writer if engine.dialect.name == "sqlite" else nullcontext()
    with writer, engine.begin() as conn:
        for name, table in (("rollouts", rollouts), ("events", events), ("rewards", rewards)):
            removed[name] = conn.execute(table.delete().where(table.c.user_id == user_id)).rowcount
        removed["outbox"] = conn.execute(
            outbox.delete().where(
                outbox.c.topic.in_(USER_TOPICS),
                outbox.c.key == user_id,
                # earlier tombstones stay: a consumer that has not read one yet still must
                ~outbox.c.payload.startswith(_tombstone_prefix(), autoescape=True),
            )
        ).rowcount
        removed["workspace_code"] = forget_user(conn, user_id)
        dead = _dead_letter_ids(conn, user_id)
        for i in range(0, len(dead), 1000):
            conn.execute(dead_letters.delete().where(dead_letters.c.id.in_(dead[i : i + 1000])))
        removed["dead_letters"] = len(dead)
        message = user_purged(user_id, purged_at)
        conn.execute(
            outbox.insert(),
            [outbox_row(t, user_id, message, now=now, embedded=embedded) for t in USER_TOPICS],
        )
        result = PurgeResult(user_id=user_id, purged_at=purged_at, removed=removed)
        if before_commit is not None:
            before_commit(conn, result)
    return result
