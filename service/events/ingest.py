"""Ingestion: validate each event, drop repeats, write events + outbox rows in one transaction."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from service.deps import AppContext
from service.errors import Unavailable
from service.events.schemas import EVENT_TYPES, IngestResult, RejectedEvent, parse_event
from service.events.trust import REASONS, screen
from service.metrics import FEEDBACK_REFUSED, INGEST_EVENTS
from tabloop.core.memory import settle
from tabloop.core.outbox import outbox_row
from tabloop.core.privacy import withhold_settled_texts
from tabloop.core.stream.topics import FEEDBACK, encode
from tabloop.core.tables import dead_letters, events, outbox, utcnow

_sqlite_writer = threading.Lock()
for _reason in REASONS:  # every reason is on /metrics from the start, at 0
    FEEDBACK_REFUSED.labels(reason=_reason)


def insert_ignoring_conflicts(conn: sa.Connection, table: sa.Table, key: str) -> Any:
    """`INSERT ... ON CONFLICT (key) DO NOTHING RETURNING key` for either database."""
    dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    return (
        dialect_insert(table).on_conflict_do_nothing(index_elements=[key]).returning(table.c[key])
    )


# PostgreSQL: the whole batch in one statement and one round trip, run in autocommit mode: a
# statement is its own transaction, atomic, so the batch needs no BEGIN and COMMIT round trips
# (the trust checks' read before it is a statement of its own, as it would be in a transaction
# at READ COMMITTED). The columns travel as arrays (a short, constant query text that psycopg
# prepares once per connection). Events are inserted skipping known ids, in event_id order so
# that two batches sharing ids wait for each other instead of deadlocking; an outbox row is
# written for each event that was new, in batch order (the relay publishes by outbox id: a
# user's events stay in the order they were sent); the batch's dead letters are written too.
_PG_INSERT = """
WITH batch AS (
    SELECT * FROM unnest(
        %(event_id)b::text[], %(type)b::text[], %(user_id)b::text[], %(suggestion_id)b::text[],
        %(occurred_at)b::text[]::timestamptz[], %(payload)b::text[], %(message)b::text[]
    ) WITH ORDINALITY AS b(event_id, type, user_id, suggestion_id, occurred_at, payload, message, n)
), stored AS (
    INSERT INTO events (event_id, type, user_id, suggestion_id, occurred_at, received_at, payload)
    SELECT event_id, type, user_id, suggestion_id, occurred_at, %(now)s, payload::jsonb
    FROM batch ORDER BY event_id
    ON CONFLICT (event_id) DO NOTHING
    RETURNING event_id
), queued AS (
    INSERT INTO outbox (topic, key, payload, created_at, published_at)
    SELECT %(topic)s, b.user_id, b.message, %(now)s, %(published_at)s::timestamptz
    FROM batch b JOIN stored s ON s.event_id = b.event_id ORDER BY b.n
), dead AS (
    INSERT INTO dead_letters (received_at, source, api_key_id, raw, error)
    SELECT %(now)s, %(source)s, %(api_key_id)s, d.raw, d.error
    FROM unnest(%(dead_raw)b::text[], %(dead_error)b::text[]) WITH ORDINALITY AS d(raw, error, n)
    ORDER BY d.n
)
SELECT event_id FROM stored
"""


@dataclass(frozen=True)
class _Batch:
    """What a batch stores: its valid events and its dead letters (all of one request)."""

    valid: list[dict[str, Any]]
    dead: list[dict[str, Any]]
    now: datetime
    source: str
    api_key_id: str | None
    embedded: bool


def _store_postgresql(conn: sa.Connection, batch: _Batch) -> set[str]:
    valid = batch.valid
    params = {
        "event_id": [e["event_id"] for e in valid],
        "type": [e["type"] for e in valid],
        "user_id": [e["user_id"] for e in valid],
        "suggestion_id": [e.get("suggestion_id") for e in valid],
        "occurred_at": [e["occurred_at"] for e in valid],  # RFC 3339, already normalized to UTC
        "payload": [orjson.dumps(e).decode() for e in valid],
        "message": [encode(e) for e in valid],
        "now": batch.now,
        "topic": FEEDBACK,
        "published_at": batch.now if batch.embedded else None,
        "source": batch.source,
        "api_key_id": batch.api_key_id,
        "dead_raw": [d["raw"] for d in batch.dead],
        "dead_error": [d["error"] for d in batch.dead],
    }
    return set(conn.exec_driver_sql(_PG_INSERT, params).scalars().all())


def _store_portable(conn: sa.Connection, batch: _Batch) -> set[str]:
    rows = [
        {
            "event_id": e["event_id"],
            "type": e["type"],
            "user_id": e["user_id"],
            "suggestion_id": e.get("suggestion_id"),
            "occurred_at": datetime.fromisoformat(e["occurred_at"]),
            "received_at": batch.now,
            "payload": e,
        }
        for e in batch.valid
    ]
    inserted: set[str] = set()
    if rows:
        result = conn.execute(insert_ignoring_conflicts(conn, events, "event_id"), rows)
        inserted = set(result.scalars().all())
    if inserted:
        conn.execute(
            outbox.insert(),
            [
                outbox_row(FEEDBACK, e["user_id"], e, now=batch.now, embedded=batch.embedded)
                for e in batch.valid
                if e["event_id"] in inserted
            ],
        )
    if batch.dead:
        conn.execute(
            dead_letters.insert(),
            [
                {
                    "received_at": batch.now,
                    "source": batch.source,
                    "api_key_id": batch.api_key_id,
                    "raw": d["raw"],
                    "error": d["error"],
                }
                for d in batch.dead
            ],
        )
    return inserted


@contextmanager
def _batch_connection(engine: sa.Engine) -> Iterator[sa.Connection]:
    """Where a batch is checked and stored. PostgreSQL: an autocommit connection (the batch is
    written by one atomic statement). SQLite takes one writer at a time, and its busy handler
    polls with sleeps of up to 100 ms: concurrent batches wait for the in-process lock instead,
    in turn, rather than seconds in the worst case, and write in one transaction."""
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")
    else:
        with _sqlite_writer, engine.begin() as conn:
            yield conn


def store_derived(
    conn: sa.Connection,
    raw_events: list[dict[str, Any]],
    *,
    api_key_id: str | None,
    embedded: bool,
    source: str,
) -> set[str]:
    """Store events the service derived from its own rows, in the caller's transaction, so that
    they commit with what they were derived from; the ids stored (a repeat is skipped). Each is
    parsed as a client's would be. The trust checks are not run: the caller derives an event
    only where they hold (tabloop.core.memory.typed_through reads the suggestion of the same
    key and person, shown minutes ago), and nothing it derives is settled text."""
    valid = [parse_event(e) for e in raw_events]
    store = _store_postgresql if conn.dialect.name == "postgresql" else _store_portable
    inserted = store(conn, _Batch(valid, [], utcnow(), source, api_key_id, embedded))
    for ev in valid:
        outcome = "accepted" if ev["event_id"] in inserted else "duplicate"
        INGEST_EVENTS.labels(type=ev["type"], outcome=outcome).inc()
    return inserted


def check_admission(ctx: AppContext) -> None:
    """Unavailable (503, Retry-After) while the database is away or, in full mode, while the
    outbox holds TABLOOP_OUTBOX_BACKLOG_LIMIT rows the relay has not published yet."""
    settings = ctx.settings
    retry = {"Retry-After": str(settings.retry_after_s)}
    if not ctx.health.db_usable():
        raise Unavailable("the database is unavailable", headers=retry)
    if not settings.embedded and ctx.health.backlog_rows >= settings.outbox_backlog_limit:
        raise Unavailable(
            f"{ctx.health.backlog_rows} events wait for the broker; try again shortly",
            headers=retry,
        )


def ingest_events(
    engine: sa.Engine,
    raw_events: list[Any],
    *,
    api_key_id: str | None,
    max_event_bytes: int,
    embedded: bool,
    profile: str = "prod",
    source: str = "events",
    no_train: bool = False,
) -> IngestResult:
    """Record a batch. Invalid events go to dead_letters; repeats of an event_id are counted, not
    stored. Events about a suggestion that must not count (service/events/trust.py: another
    key's or person's, implausible) go to dead_letters too, with the reason. Returns only after
    the transaction commits, so a 202 means durable.

    `api_key_id`: the sending key (None: an internal caller, whose events skip the key check);
    `profile`: whose default reward horizon applies before a spec is stored; `source`: the
    dead letters' source (the endpoint); `no_train`: the key is in privacy mode (its settled
    text is not stored: service/privacy.py)."""
    now = utcnow()
    valid: list[dict[str, Any]] = []
    positions: list[tuple[int, str]] = []  # per valid event: its index in the batch, raw text
    rejected: list[RejectedEvent] = []
    dead: list[dict[str, str]] = []  # dead letters: the raw text and the error of each
    seen: set[str] = set()
    outcomes: Counter[tuple[str, str]] = Counter()  # (type, outcome) -> events
    refusals: Counter[str] = Counter()  # reason -> events (service/events/trust.py)
    for index, raw in enumerate(raw_events):
        try:
            raw_text, unstorable = orjson.dumps(raw).decode(), None
        except orjson.JSONEncodeError as e:  # a lone surrogate, an integer past 64 bits
            raw_text, unstorable = json.dumps(raw), f"event cannot be stored as JSON: {e}"
        try:
            if unstorable:
                raise ValueError(unstorable)
            if len(raw_text) > max_event_bytes:
                raise ValueError(f"event is {len(raw_text)} bytes; the limit is {max_event_bytes}")
            event = parse_event(raw)
        except ValueError as e:
            rejected.append(RejectedEvent(index=index, error=str(e)))
            claimed = raw.get("type") if isinstance(raw, dict) else None
            outcomes[(claimed if claimed in EVENT_TYPES else "unknown", "rejected")] += 1
            dead.append({"raw": raw_text, "error": str(e)})
            continue
        if event["event_id"] in seen:
            outcomes[(event["type"], "duplicate")] += 1
            continue
        seen.add(event["event_id"])
        valid.append(event)
        positions.append((index, raw_text))

    with _batch_connection(engine) as conn:
        refused = screen(conn, valid, api_key_id=api_key_id, received_at=now, profile=profile)
        for i, why in refused.items():
            index, raw_text = positions[i]
            rejected.append(RejectedEvent(index=index, error=why.error))
            outcomes[(valid[i]["type"], "rejected")] += 1
            refusals[why.reason] += 1
            dead.append({"raw": raw_text, "error": why.error})
        if refused:
            valid = [e for i, e in enumerate(valid) if i not in refused]
            rejected.sort(key=lambda r: r.index)
        # privacy mode: settled text of a no_train key or rollout is never stored (nor refused
        # text in dead_letters)
        valid, dead = withhold_settled_texts(conn, valid, dead, key_no_train=no_train)
        inserted: set[str] = set()
        if valid or dead:
            store = _store_postgresql if conn.dialect.name == "postgresql" else _store_portable
            inserted = store(conn, _Batch(valid, dead, now, source, api_key_id, embedded))
        if not no_train:  # accepted and settled text joins the workspace memory
            settle(conn, [e for e in valid if e["event_id"] in inserted])

    for ev in valid:
        outcomes[(ev["type"], "accepted" if ev["event_id"] in inserted else "duplicate")] += 1
    for (event_type, outcome), n in outcomes.items():
        INGEST_EVENTS.labels(type=event_type, outcome=outcome).inc(n)
    for reason, n in refusals.items():
        FEEDBACK_REFUSED.labels(reason=reason).inc(n)
    return IngestResult(
        accepted=len(inserted),
        duplicates=outcomes.total() - len(inserted) - len(rejected),
        rejected=rejected,
    )
