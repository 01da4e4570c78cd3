"""kafka-python clients configured the one way tabloop uses them (docs/OPERATIONS.md)."""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError, KafkaTimeoutError, TopicAlreadyExistsError

from tabloop.core.config import Settings
from tabloop.core.stream.topics import ALL_TOPICS, FEEDBACK, ROLLOUTS

log = logging.getLogger(__name__)

CODE_TOPICS = (ROLLOUTS, FEEDBACK)  # their messages can carry code text (service/privacy.py)


def make_producer(settings: Settings, **overrides: Any) -> KafkaProducer:
    """Idempotent, acks=all, retrying: a message acknowledged to us is on every in-sync replica,
    and internal retries never write it twice within this producer's life."""
    config: dict[str, Any] = dict(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        client_id="tabloop-relay",
        acks="all",
        enable_idempotence=True,
        max_in_flight_requests_per_connection=5,
        linger_ms=5,
        batch_size=256 * 1024,
        request_timeout_ms=10_000,
        # Keep retrying for a long time rather than giving up on an acked-or-not message.
        delivery_timeout_ms=600_000,
        max_block_ms=10_000,
    )
    config.update(overrides)
    return KafkaProducer(**config)


def make_admin(settings: Settings) -> KafkaAdminClient:
    return KafkaAdminClient(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        client_id="tabloop-admin",
        request_timeout_ms=10_000,
    )


def topic_configs(settings: Settings, topic: str) -> dict[str, str]:
    """Configs a topic is created with. With TABLOOP_CODE_RETENTION_DAYS, the topics that carry
    code text (rollouts, settled text) keep messages that long at most (`retention.ms`); the
    broker's default applies otherwise. An existing topic is never altered (docs/PRIVACY.md)."""
    days = settings.code_retention_days
    if days is None or topic not in CODE_TOPICS:
        return {}
    return {"retention.ms": str(days * 86_400_000)}


def ensure_topics(settings: Settings, topics: tuple[str, ...] = ALL_TOPICS) -> None:
    """Create the topics if missing, with the configured partition count (keyed by user_id)."""
    admin = make_admin(settings)
    try:
        existing = set(admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics(
                    [
                        NewTopic(
                            t,
                            settings.kafka_topic_partitions,
                            settings.kafka_replication_factor,
                            topic_configs=topic_configs(settings, t),
                        )
                        for t in missing
                    ]
                )
                log.info(
                    "created topics %s (%d partitions%s)",
                    missing,
                    settings.kafka_topic_partitions,
                    f", code topics kept {settings.code_retention_days} days"
                    if settings.code_retention_days is not None
                    else "",
                )
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


def make_reader(settings: Settings, **overrides: Any) -> KafkaConsumer:
    """A consumer with no group, for reading partitions by explicit assignment."""
    config: dict[str, Any] = dict(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        client_id="tabloop-reader",
        group_id=None,
        enable_auto_commit=False,
        request_timeout_ms=15_000,
    )
    config.update(overrides)
    return KafkaConsumer(**config)


def read_to_end(
    consumer: KafkaConsumer, tps: list[Any], timeout_s: float, hole_s: float = 5.0
) -> list[Any]:
    """Poll assigned partitions until each position reaches the high watermark that the fetch
    responses report. (ListOffsets' "latest" is not trusted: some brokers answer it per batch.)

    A partition whose position has not moved for `hole_s` while still below the watermark, on
    a broker that answers, is taken as read: a broker killed mid-write can count offsets it never
    stored (seen with Tansu: watermark 307, records up to 303, fetches at 304-306 answer
    nothing until a later record exists, then skip to it). Without this, a reader waiting for
    the end, such as the relay's reconciliation, would wait for records only it can send."""
    deadline = time.monotonic() + timeout_s
    records: list[Any] = []
    moved = {tp: (consumer.position(tp), time.monotonic()) for tp in tps}
    holes: set[Any] = set()
    while True:
        for batch in consumer.poll(timeout_ms=200, max_records=5000).values():
            records.extend(batch)
        now = time.monotonic()
        behind = []
        for tp in tps:
            hw, pos = consumer.highwater(tp), consumer.position(tp)
            if tp in holes or (hw is not None and pos >= hw):
                continue
            if pos != moved[tp][0]:
                moved[tp] = (pos, now)
            elif hw is not None and now - moved[tp][1] >= hole_s and _answers(consumer, tp):
                log.warning(
                    "%s: the broker reports offsets %d-%d but serves none of them (a hole "
                    "left by a crash); taking the partition as read to its end",
                    tp,
                    pos,
                    hw - 1,
                )
                holes.add(tp)
                continue
            behind.append(tp)
        if not behind:
            return records
        if time.monotonic() > deadline:
            raise KafkaTimeoutError(f"could not read to the end of {[str(tp) for tp in behind]}")


def _answers(consumer: KafkaConsumer, tp: Any) -> bool:
    """Whether the broker answers a request about `tp` now (a stopped one times out)."""
    try:
        consumer.end_offsets([tp])
    except KafkaError:
        return False
    return True
