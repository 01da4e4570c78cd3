"""Reading the event log the way the trainer will: by offset, committing only what it keeps."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import sqlalchemy as sa

from service.events.ingest import ingest_events
from service.relay import Relay
from tabloop.core.config import Settings
from tabloop.core.stream.consumer import open_consumer
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
from tabloop.testing.factories import event


def read_until(consumer: Any, ids: set[str], rounds: int = 120) -> list:
    """Poll until every id in `ids` was read (other tests' records may come along)."""
    got: list = []
    for _ in range(rounds):
        got += consumer.poll(max_records=500, timeout_s=0.5)
        if ids <= {r.value.get("event_id") for r in got}:
            break
    return got


def test_consumer_reads_everything_once_and_resumes_after_commit(
    settings: Settings, engine: sa.Engine
) -> None:
    first = [event("accept", user_id=f"u{i % 4}") for i in range(30)]
    ingest_events(
        engine, first, api_key_id=None, max_event_bytes=10_000, embedded=settings.embedded
    )
    stop = threading.Event()
    relay_thread = None
    if not settings.embedded:
        relay_thread = threading.Thread(
            target=Relay(settings, engine).run, args=(stop,), daemon=True
        )
        relay_thread.start()
    group = f"g-{uuid.uuid4().hex[:8]}"
    try:
        c1 = open_consumer(settings, engine, group, [ROLLOUTS, FEEDBACK])
        ours = {e["event_id"] for e in first}
        got = read_until(c1, ours)
        mine = [r for r in got if r.value["event_id"] in ours]
        assert sorted(r.value["event_id"] for r in mine) == sorted(ours)
        assert all(r.key == r.value["user_id"] and r.value["schema_version"] == 1 for r in mine)
        c1.commit(got)
        c1.close()

        second = [event("reject") for _ in range(5)]
        ingest_events(
            engine, second, api_key_id=None, max_event_bytes=10_000, embedded=settings.embedded
        )
        c2 = open_consumer(settings, engine, group, [ROLLOUTS, FEEDBACK])
        new = {e["event_id"] for e in second}
        again = read_until(c2, new)
        ids = [r.value["event_id"] for r in again]
        assert sorted(i for i in ids if i in new) == sorted(new)
        assert not ours.intersection(ids), "committed records were delivered again"
        c2.close()

        # Without a commit the same records come back to the next member of the group.
        c3 = open_consumer(settings, engine, group, [ROLLOUTS, FEEDBACK])
        replay = read_until(c3, new)
        assert sorted(r.value["event_id"] for r in replay if r.value["event_id"] in new) == sorted(
            new
        )
        c3.close()
    finally:
        stop.set()
        if relay_thread is not None:
            relay_thread.join(timeout=30)
