"""Reading the event log: one interface over Kafka (full mode) and the outbox table (embedded).

Consumers never auto-commit: `commit(records)` is called by the reader once what it read is
durable, so a crash replays from the last commit and nothing is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from service.config import Settings
from service.tables import outbox, trainer_state, utcnow


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str
    value: dict[str, Any]


class LogConsumer(Protocol):
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]: ...

    def commit(self, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


class OutboxLogConsumer:
    """The outbox table read as one partition by id; the group's offset lives in trainer_state."""

    def __init__(self, engine: sa.Engine, group: str, topics: Sequence[str]) -> None:
        self.engine, self.group, self.topics = engine, group, tuple(topics)
        with engine.connect() as conn:
            offset = conn.execute(
                sa.select(trainer_state.c.log_offset).where(trainer_state.c.name == group)
            ).scalar()
        self.position = int(offset or 0)  # the last id read

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    sa.select(outbox.c.id, outbox.c.topic, outbox.c.key, outbox.c.payload)
                    .where(outbox.c.id > self.position, outbox.c.topic.in_(self.topics))
                    .order_by(outbox.c.id)
                    .limit(max_records)
                ).all()
            if rows:
                self.position = rows[-1].id
                return [Record(r.topic, 0, r.id, r.key, orjson.loads(r.payload)) for r in rows]
            if time.monotonic() >= deadline:
                return []
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def commit(self, records: Sequence[Record]) -> None:
        if not records:
            return
        offset = max(r.offset for r in records)
        with self.engine.begin() as conn:
            commit_offset(conn, self.group, offset)

    def seek(self, offset: int) -> None:
        self.position = offset

    def close(self) -> None:
        pass


def commit_offset(conn: sa.Connection, group: str, offset: int) -> None:
    """Store a group's embedded-log offset in the caller's transaction (so it can commit
    atomically with what the records produced)."""
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    now = utcnow()
    stmt = insert(trainer_state).values(name=group, log_offset=offset, updated_at=now)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["name"], set_={"log_offset": offset, "updated_at": now}
        )
    )


def _decode(value: bytes | None) -> dict[str, Any]:
    """A record's JSON object; {} for anything else (not JSON, not an object, a tombstone's
    None), which the reader rejects as a record it cannot use and counts."""
    try:
        decoded = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


class KafkaLogConsumer:
    """A consumer-group member with manual commits (auto-commit off)."""

    def __init__(
        self, settings: Settings, group: str, topics: Sequence[str], **overrides: Any
    ) -> None:
        from kafka import KafkaConsumer

        config: dict[str, Any] = dict(
            bootstrap_servers=settings.kafka_bootstrap_servers,
            group_id=group,
            client_id=f"tabloop-{group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=settings.kafka_heartbeat_interval_ms,
            max_poll_records=5000,
        )
        config.update(overrides)
        self._consumer = KafkaConsumer(*topics, **config)

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out = []
        for tp, records in batches.items():
            for r in records:
                key = r.key.decode(errors="replace") if r.key is not None else ""
                out.append(Record(tp.topic, tp.partition, r.offset, key, _decode(r.value)))
        return out

    def commit(self, records: Sequence[Record]) -> None:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        highest: dict[tuple[str, int], int] = {}
        for r in records:
            k = (r.topic, r.partition)
            highest[k] = max(highest.get(k, -1), r.offset)
        if highest:
            self._consumer.commit(
                {
                    TopicPartition(t, p): OffsetAndMetadata(o + 1, "", -1)
                    for (t, p), o in highest.items()
                }
            )

    def close(self) -> None:
        self._consumer.close(autocommit=False)


def open_consumer(
    settings: Settings, engine: sa.Engine, group: str, topics: Sequence[str]
) -> LogConsumer:
    if settings.embedded:
        return OutboxLogConsumer(engine, group, topics)
    return KafkaLogConsumer(settings, group, topics)
