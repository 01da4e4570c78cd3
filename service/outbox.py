"""The transactional outbox: messages written in the same transaction as the rows they describe.

In full mode the relay publishes unpublished rows to Kafka and stamps `published_at`. In embedded
mode the table is the log itself, so rows are born published and consumers read them by id.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from service.stream.topics import encode
from service.tables import outbox, utcnow


def outbox_row(
    topic: str, key: str, value: dict[str, Any], *, now: datetime, embedded: bool
) -> dict:
    return {
        "topic": topic,
        "key": key,
        "payload": encode(value),
        "created_at": now,
        "published_at": now if embedded else None,
    }


@dataclass(frozen=True)
class Backlog:
    rows: int
    oldest_age_s: float  # age of the oldest unpublished row; 0 when there is none


def backlog(conn: sa.Connection) -> Backlog:
    """Unpublished rows and how long the oldest has waited (served by a partial index)."""
    row = conn.execute(
        sa.select(sa.func.count(), sa.func.min(outbox.c.created_at)).where(
            outbox.c.published_at.is_(None)
        )
    ).one()
    count, oldest = row
    if not count or oldest is None:
        return Backlog(0, 0.0)
    if isinstance(oldest, str):  # SQLite aggregates lose the column type
        oldest = datetime.fromisoformat(oldest)
    if oldest.tzinfo is None:
        from datetime import UTC

        oldest = oldest.replace(tzinfo=UTC)
    return Backlog(int(count), max(0.0, (utcnow() - oldest).total_seconds()))
