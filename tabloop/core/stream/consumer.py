"""Reading the event log: one interface over Kafka (full mode) and the outbox table (embedded).

Consumers never auto-commit: `commit(records)` is called by the reader once what it read is
durable, so a crash replays from the last commit and nothing is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from tabloop.core.config import Settings
from tabloop.core.tables import outbox, trainer_state, utcnow


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


# A group member's partitions changed: called from inside `poll` with the partitions, as
# (topic, partition) pairs, revoked from it (before the group reassigns them) or assigned to it
# (before their records are fetched).
Rebalanced = Callable[[set[tuple[str, int]]], None]


def partition_of(key: str, partitions: int) -> int:
    """The partition a keyed record goes to: the producer's default partitioner (murmur2 of the
    key, as Kafka's Java client and kafka-python both compute it)."""
    from kafka.partitioner.default import murmur2

    hashed: int = murmur2(key.encode())
    return (hashed & 0x7FFFFFFF) % partitions


class KafkaLogConsumer:
    """A consumer-group member with manual commits (auto-commit off).

    Partitions are assigned by range per topic, so topics with as many partitions (rollouts and
    feedback, both keyed by user id) give each member the same partition numbers of each: all of
    one person's records reach one member. `on_revoked` and `on_assigned` let the reader drop
    and rebuild what it holds of the partitions that moved."""

    def __init__(
        self,
        settings: Settings,
        group: str,
        topics: Sequence[str],
        on_revoked: Rebalanced | None = None,
        on_assigned: Rebalanced | None = None,
        **overrides: Any,
    ) -> None:
        from kafka import ConsumerRebalanceListener, KafkaConsumer
        from kafka.coordinator.assignors.range import RangePartitionAssignor

        config: dict[str, Any] = dict(
            bootstrap_servers=settings.kafka_bootstrap_servers,
            group_id=group,
            client_id=f"tabloop-{group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=settings.kafka_session_timeout_ms,
            heartbeat_interval_ms=settings.kafka_heartbeat_interval_ms,
            max_poll_interval_ms=settings.kafka_max_poll_interval_ms,
            max_poll_records=5000,
            partition_assignment_strategy=[RangePartitionAssignor],
        )
        config.update(overrides)
        self._consumer = KafkaConsumer(**config)

        class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            def on_partitions_revoked(self, revoked: Any) -> None:
                if on_revoked is not None:
                    on_revoked({(tp.topic, tp.partition) for tp in revoked})

            def on_partitions_assigned(self, assigned: Any) -> None:
                if on_assigned is not None:
                    on_assigned({(tp.topic, tp.partition) for tp in assigned})

        self._consumer.subscribe(list(topics), listener=Listener())

    def partitions(self, topic: str) -> int:
        """How many partitions `topic` has (0 if the broker does not know it yet)."""
        partitions: set[int] | None = self._consumer.partitions_for_topic(topic)
        return len(partitions or ())

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
    settings: Settings,
    engine: sa.Engine,
    group: str,
    topics: Sequence[str],
    on_revoked: Rebalanced | None = None,
    on_assigned: Rebalanced | None = None,
) -> LogConsumer:
    """The group's reader of `topics`. The outbox is one partition read by one process, so it
    never rebalances; the callbacks are for Kafka (KafkaLogConsumer)."""
    if settings.embedded:
        return OutboxLogConsumer(engine, group, topics)
    return KafkaLogConsumer(settings, group, topics, on_revoked, on_assigned)
