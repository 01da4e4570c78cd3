"""Ingestion: validate each event, drop repeats, write events + outbox rows in one transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from service.events.schemas import EVENT_TYPES, IngestResult, RejectedEvent, parse_event
from service.metrics import INGEST_EVENTS
from service.outbox import outbox_row
from service.stream.topics import FEEDBACK
from service.tables import dead_letters, events, outbox, utcnow


def insert_ignoring_conflicts(conn: sa.Connection, table: sa.Table, key: str) -> Any:
    """`INSERT ... ON CONFLICT (key) DO NOTHING RETURNING key` for either database."""
    dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    return dialect_insert(table).on_conflict_do_nothing(index_elements=[key]).returning(table.c[key])


def ingest_events(
    engine: sa.Engine,
    raw_events: list[Any],
    *,
    api_key_id: str | None,
    max_event_bytes: int,
    embedded: bool,
) -> IngestResult:
    """Record a batch. Invalid events go to dead_letters; repeats of an event_id are counted, not
    stored. Returns only after the transaction commits, so a 202 means durable."""
    now = utcnow()
    valid: list[dict[str, Any]] = []
    rejected: list[RejectedEvent] = []
    dead: list[dict[str, Any]] = []
    seen: set[str] = set()
    repeats_in_batch: list[str] = []
    rejected_types: list[str] = []
    for index, raw in enumerate(raw_events):
        raw_text = orjson.dumps(raw).decode()
        try:
            if len(raw_text) > max_event_bytes:
                raise ValueError(f"event is {len(raw_text)} bytes; the limit is {max_event_bytes}")
            event = parse_event(raw)
        except ValueError as e:
            rejected.append(RejectedEvent(index=index, error=str(e)))
            claimed = raw.get("type") if isinstance(raw, dict) else None
            rejected_types.append(claimed if claimed in EVENT_TYPES else "unknown")
            dead.append(
                {"received_at": now, "source": "events", "api_key_id": api_key_id,
                 "raw": raw_text, "error": str(e)}
            )
            continue
        if event["event_id"] in seen:
            repeats_in_batch.append(event["type"])
            continue
        seen.add(event["event_id"])
        valid.append(event)

    inserted: set[str] = set()
    with engine.begin() as conn:
        if valid:
            rows = [
                {
                    "event_id": e["event_id"],
                    "type": e["type"],
                    "user_id": e["user_id"],
                    "suggestion_id": e.get("suggestion_id"),
                    "occurred_at": datetime.fromisoformat(e["occurred_at"]),
                    "received_at": now,
                    "payload": e,
                }
                for e in valid
            ]
            result = conn.execute(insert_ignoring_conflicts(conn, events, "event_id"), rows)
            inserted = set(result.scalars().all())
            if inserted:
                conn.execute(
                    outbox.insert(),
                    [
                        outbox_row(FEEDBACK, e["user_id"], e, now=now, embedded=embedded)
                        for e in valid
                        if e["event_id"] in inserted
                    ],
                )
        if dead:
            conn.execute(dead_letters.insert(), dead)

    for e in valid:
        outcome = "accepted" if e["event_id"] in inserted else "duplicate"
        INGEST_EVENTS.labels(type=e["type"], outcome=outcome).inc()
    for event_type in repeats_in_batch:
        INGEST_EVENTS.labels(type=event_type, outcome="duplicate").inc()
    for event_type in rejected_types:
        INGEST_EVENTS.labels(type=event_type, outcome="rejected").inc()
    return IngestResult(
        accepted=len(inserted),
        duplicates=len(repeats_in_batch) + len(valid) - len(inserted),
        rejected=rejected,
    )
