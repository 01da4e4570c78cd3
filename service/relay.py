"""The relay: outbox rows -> Kafka, each committed row published exactly once.

Each round takes the oldest unpublished rows, sends them with an idempotent acks=all producer,
waits until every send is settled, and stamps `published_at` on those the broker acknowledged.
A send is never abandoned and re-sent blindly: if the broker fails a send, acknowledges one as a
duplicate without its offset, or the relay starts after a crash (rows may have reached the topic
without being stamped), it first *reconciles*:
reads the tail of each partition and stamps every row whose `outbox_id` header is already there.
Run one relay per database: on PostgreSQL an advisory lock makes extra replicas wait as standbys.
"""

from __future__ import annotations

import functools
import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from kafka import TopicPartition
from kafka.errors import KafkaError

from service.metrics import RELAY_ERRORS, RELAY_PUBLISHED, RELAY_RECONCILED
from tabloop.core.config import Settings
from tabloop.core.db import StandbyLock, json_array, json_rows
from tabloop.core.stream.kafka import ensure_topics, make_producer, make_reader, read_to_end
from tabloop.core.stream.topics import ALL_TOPICS
from tabloop.core.tables import outbox, utcnow

log = logging.getLogger(__name__)

HEADER = "outbox_id"
RELAY_LOCK_ID = 0x7AB1_00B0  # pg_advisory_lock key held by the active relay
RECONCILE_MARGIN = timedelta(minutes=5)


@functools.cache
def _stamp_query(dialect: str) -> sa.Update:
    """UPDATE outbox SET published_at for a JSON array of ids: one statement of constant text
    for a round of any size (an `IN (...)` of thousands of parameters cost the relay a fifth of
    its CPU, and PostgreSQL a plan per round)."""
    ids = json_rows(dialect, "ids")
    return (
        outbox.update()
        .where(outbox.c.id.in_(sa.select(sa.cast(ids.c.value, outbox.c.id.type))))
        .values(published_at=sa.bindparam("stamped_at"))
    )


def stamp_published(conn: sa.Connection, ids: list[int]) -> int:
    """Mark outbox rows published, now; the number of rows stamped."""
    query = _stamp_query(conn.dialect.name)
    return conn.execute(query, {"ids": json_array(ids), "stamped_at": utcnow()}).rowcount


class Relay:
    def __init__(self, settings: Settings, engine: sa.Engine) -> None:
        assert not settings.embedded, "the relay publishes to Kafka; embedded mode needs none"
        self.settings, self.engine = settings, engine
        self.batch_size = settings.relay_batch_size
        self.producer: Any = None
        self.needs_reconcile = True
        self.lock = StandbyLock(engine, RELAY_LOCK_ID, "relay")

    # -- the steps -------------------------------------------------------------------------

    def reconcile(self) -> int:
        """Stamp unpublished rows already present in their topic (sent before a crash or a
        failed ack): same outbox id, topic, key and value. Reads every partition from the time
        the oldest pending row was written."""
        with self.engine.connect() as conn:
            oldest = conn.execute(
                sa.select(sa.func.min(outbox.c.created_at)).where(outbox.c.published_at.is_(None))
            ).scalar()
        if oldest is None:
            return 0
        if isinstance(oldest, str):  # SQLite aggregates lose the column type
            oldest = datetime.fromisoformat(oldest)
        if oldest.tzinfo is None:
            oldest = oldest.replace(tzinfo=UTC)
        # Anything of ours in the topics was sent after the oldest pending row was written;
        # the margin covers clock skew between the API hosts and the relay.
        since_ms = int((oldest - RECONCILE_MARGIN).timestamp() * 1000)
        # outbox id -> {(topic, key, value)} as found in the topics. Ids alone are not enough: a
        # restored or re-created database (or another deployment on the same broker) reuses them.
        found: dict[int, set[tuple[str, bytes, bytes]]] = {}
        reader = make_reader(self.settings)
        try:
            tps = [
                TopicPartition(t, p)
                for t in ALL_TOPICS
                for p in sorted(reader.partitions_for_topic(t) or ())
            ]
            starts = reader.offsets_for_times({tp: since_ms for tp in tps})
            tps = [tp for tp in tps if starts.get(tp) is not None]
            reader.assign(tps)
            for tp in tps:
                reader.seek(tp, starts[tp].offset)
            for r in read_to_end(reader, tps, timeout_s=120):
                for name, value in r.headers or ():
                    if name == HEADER:
                        found.setdefault(int(value), set()).add(
                            (r.topic, r.key or b"", r.value or b"")
                        )
        finally:
            reader.close()
        marked = 0
        if found:
            ids = sorted(found)
            with self.engine.begin() as conn:
                for i in range(0, len(ids), 5000):
                    rows = conn.execute(
                        sa.select(
                            outbox.c.id, outbox.c.topic, outbox.c.key, outbox.c.payload
                        ).where(outbox.c.id.in_(ids[i : i + 5000]), outbox.c.published_at.is_(None))
                    ).all()
                    same = [
                        r.id
                        for r in rows
                        if (r.topic, r.key.encode(), r.payload.encode()) in found[r.id]
                    ]
                    if same:
                        marked += stamp_published(conn, same)
        if marked:
            RELAY_RECONCILED.inc(marked)
            log.warning("reconciled %d rows already in the topics; they will not be resent", marked)
        return marked

    def publish_once(self, stop: threading.Event) -> int:
        """One round: send the oldest unpublished rows, wait for every ack, stamp them."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(outbox.c.id, outbox.c.topic, outbox.c.key, outbox.c.payload)
                .where(outbox.c.published_at.is_(None))
                .order_by(outbox.c.id)
                .limit(self.batch_size)
            ).all()
        if not rows:
            return 0
        sends = [
            (
                r.id,
                r.topic,
                self.producer.send(
                    r.topic,
                    key=r.key.encode(),
                    value=r.payload.encode(),
                    headers=[(HEADER, str(r.id).encode())],
                ),
            )
            for r in rows
        ]
        # Wait for every future to settle: a pending send may still land, so it is never resent.
        while not all(f.is_done for _, _, f in sends):
            try:
                self.producer.flush(timeout=5)
            except KafkaError:
                log.warning(
                    "broker slow or away: %d sends still in flight",
                    sum(not f.is_done for _, _, f in sends),
                )
            if stop.is_set() and not all(f.is_done for _, _, f in sends):
                self.needs_reconcile = True  # whatever landed is found at the next start
                return 0
        # An ack without an offset is the client turning the broker's DUPLICATE_SEQUENCE_NUMBER
        # into success. Tansu answers that, after a SIGKILL, for a batch it never stored (its
        # producer state outlived the data): such rows are checked against the topic, not stamped.
        acked = [(i, t) for i, t, f in sends if f.succeeded() and f.value.offset >= 0]
        unconfirmed = sum(1 for _, _, f in sends if f.succeeded() and f.value.offset < 0)
        failed = [f.exception for _, _, f in sends if f.failed()]
        if acked:
            with self.engine.begin() as conn:
                stamp_published(conn, [i for i, _ in acked])
            for _, topic in acked:
                RELAY_PUBLISHED.labels(topic=topic).inc()
        if unconfirmed:
            log.warning(
                "%d sends acknowledged as duplicates without an offset; looking for "
                "them in the topics before resending",
                unconfirmed,
            )
            self.needs_reconcile = True
        if failed:
            # An expired send may or may not be in the topic: look before resending.
            self.needs_reconcile = True
            raise KafkaError(f"{len(failed)} sends failed, first: {failed[0]!r}")
        return len(acked)

    # -- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        log.info("relay starting (bootstrap %s)", self.settings.kafka_bootstrap_servers)
        backoff = 0.5
        while not stop.is_set():
            try:
                if not self.lock.acquire(stop):
                    break
                if self.producer is None:
                    ensure_topics(self.settings)
                    self.producer = make_producer(self.settings)
                if self.needs_reconcile:
                    self.reconcile()
                    self.needs_reconcile = False
                sent = self.publish_once(stop)
                backoff = 0.5
                if sent == 0:
                    stop.wait(self.settings.relay_poll_interval_s)
            except (KafkaError, OSError) as e:
                RELAY_ERRORS.inc()
                log.warning("relay: broker error (%s); retrying in %.1fs", e, backoff)
                self.needs_reconcile = True
                self._close_producer()
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except sa.exc.SQLAlchemyError as e:
                RELAY_ERRORS.inc()
                log.warning(
                    "relay: database error (%s); retrying in %.1fs", str(e).split("\n")[0], backoff
                )
                self.needs_reconcile = True
                self.lock.release()
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        self._close_producer()
        self.lock.release()
        log.info("relay stopped")

    def _close_producer(self) -> None:
        if self.producer is not None:
            try:
                self.producer.close(timeout=5)
            except KafkaError:
                log.debug("closing producer failed", exc_info=True)
            self.producer = None
