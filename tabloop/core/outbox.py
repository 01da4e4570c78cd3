"""The transactional outbox: messages written in the same transaction as the rows they describe.

In full mode the relay publishes unpublished rows to Kafka and stamps `published_at`. In embedded
mode the table is the log itself, so rows are born published and consumers read them by id.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tabloop.core.stream.topics import encode
from tabloop.core.tables import outbox, utcnow


def outbox_row(
    topic: str, key: str, value: dict[str, Any], *, now: datetime, embedded: bool
) -> dict[str, Any]:
    return {
        "topic": topic,
        "key": key,
        "payload": encode(value),
        "created_at": now,
        "published_at": now if embedded else None,
    }


@dataclass(frozen=True)
class Backlog:
    rows: int  # rows from the oldest unpublished one to the newest (see `backlog`)
    oldest_age_s: float  # age of the oldest unpublished row; 0 when there is none


def backlog(conn: sa.Connection, *, count_from: int | None = None) -> Backlog:
    """How far the relay is behind: the rows from the oldest unpublished one to the newest, and
    how long the oldest has waited. Two index probes (the partial index of unpublished rows, then
    the primary key), whatever the backlog: counting the unpublished rows cost a scan of them, run
    twice a second by every API process, and slowed the database most when the relay was already
    behind. The relay publishes in id order, so this is the number of unpublished rows, give or
    take ids a rolled-back transaction never used and rows published out of turn (an upper bound
    either way). From `count_from` rows on (the admission limit), the unpublished rows are
    counted instead, so that one row stuck behind published ones never turns ingestion away."""
    oldest = conn.execute(
        sa.select(outbox.c.id, outbox.c.created_at)
        .where(outbox.c.published_at.is_(None))
        .order_by(outbox.c.id)
        .limit(1)
    ).first()
    if oldest is None:
        return Backlog(0, 0.0)
    newest = conn.execute(sa.select(sa.func.max(outbox.c.id))).scalar_one()
    rows = int(newest) - int(oldest.id) + 1
    if count_from is not None and rows >= count_from:
        rows = conn.execute(
            sa.select(sa.func.count()).where(outbox.c.published_at.is_(None))
        ).scalar_one()
    age = (utcnow() - oldest.created_at).total_seconds()
    return Backlog(rows, max(0.0, age))
