"""The simulator's HTTP client: Retry-After, backoff, batching and redelivery.

The 429 path runs against the real service (its per-key rate limit); 503 with an HTTP-date
Retry-After and a refused batch come from a scripted loopback server, since the service only
answers 503 when its database is down.
"""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from simulator.client import Client, EventSender, backoff_s, retry_after_s, wait_s
from tabloop.core.db import make_engine, upgrade
from tabloop.core.keys import create_key
from tabloop.core.tables import events
from tests.service.conftest import RunningService, make_settings

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": " 0.5 "}, 0.5),
        ({"retry-after": "-2"}, 0.0),
        ({"retry-after": email.utils.formatdate(NOW + 7, usegmt=True)}, 7.0),  # an HTTP date
        ({"retry-after": email.utils.formatdate(NOW - 60, usegmt=True)}, 0.0),  # in the past
        ({"retry-after": "soon"}, None),
        ({}, None),
    ],
)
def test_retry_after(headers: dict[str, str], expected: float | None) -> None:
    got = retry_after_s(headers, now=NOW)
    assert got == (None if expected is None else pytest.approx(expected, abs=0.01))


@pytest.mark.parametrize(
    ("status", "headers", "attempt", "low", "high"),
    [
        (429, {"retry-after": "2"}, 0, 2.0, 2.0),  # told: wait exactly that
        (503, {"retry-after": "1"}, 5, 1.0, 1.0),  # told, whatever the attempt
        (429, {"retry-after": "600"}, 0, 10.0, 10.0),  # capped
        (503, {}, 0, 0.1, 0.2),  # not told: backoff, jittered in [half, all]
        (503, {}, 3, 0.8, 1.6),
        (None, {}, 10, 5.0, 10.0),  # no answer at all: backoff, capped
        (500, {"retry-after": "2"}, 0, 0.1, 0.2),  # Retry-After only counts on 429/503
    ],
)
def test_wait(
    status: int | None, headers: dict[str, str], attempt: int, low: float, high: float
) -> None:
    assert low <= wait_s(status, headers, attempt, 0.2, 10.0, random.Random(attempt)) <= high


def test_backoff_is_seeded() -> None:
    assert backoff_s(2, 0.2, 10, random.Random(1)) == backoff_s(2, 0.2, 10, random.Random(1))


def event(i: int) -> dict[str, Any]:
    return {
        "event_id": str(uuid.uuid4()),
        "type": "churn",
        "user_id": f"u{i}",
        "occurred_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }


@pytest.mark.integration  # the app on a socket
def test_sender_honours_429_from_the_real_service(tmp_path: Path) -> None:
    """A per-key limit of 1 request/s (burst 2): batches beyond it get 429 + Retry-After and
    are delivered after waiting, each event stored once."""
    settings = make_settings(tmp_path, rate_limit_per_s=1.0, rate_limit_burst=2)
    upgrade(settings)
    engine = make_engine(settings)
    with engine.begin() as conn:
        token = create_key(conn, name="sim", scopes=frozenset({"ingest"}))[1]
    service = RunningService(settings).start()
    try:
        sent = [event(i) for i in range(5)]

        async def go() -> tuple[Client, EventSender, float]:
            client = Client(service.url, token, seed=0)
            sender = EventSender(client, batch_size=1)
            for e in sent:
                sender.add(e)
            started = time.monotonic()
            assert await sender.drain(30)
            await client.aclose()
            return client, sender, time.monotonic() - started

        client, sender, took = asyncio.run(go())
        assert client.stats.throttled >= 1 and client.stats.retries >= 1
        assert client.stats.gave_up == 0
        assert took >= 1.0  # it waited as told (Retry-After is at least 1 s)
        assert (sender.stats.sent, sender.stats.accepted, sender.stats.duplicates) == (5, 5, 0)
        with engine.connect() as conn:
            stored = conn.execute(sa.select(events.c.event_id)).scalars().all()
        assert sorted(stored) == sorted(e["event_id"] for e in sent)
    finally:
        service.stop()
        engine.dispose()


class Scripted(BaseHTTPRequestHandler):
    """Answers POST /v1/events from a script of (status, headers); records every body."""

    script: list[tuple[int, dict[str, str]]] = []
    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        body = json.loads(raw)
        Scripted.bodies.append(body)
        status, headers = Scripted.script.pop(0) if Scripted.script else (202, {})
        n = len(body["events"])
        payload = (
            json.dumps({"accepted": n, "duplicates": 0, "rejected": []})
            if status == 202
            else json.dumps({"error": {"code": "x", "message": "scripted"}})
        )
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    Scripted.script, Scripted.bodies = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_503_with_a_date_then_redelivery_with_the_same_ids(scripted: str) -> None:
    soon = email.utils.formatdate(time.time() + 1, usegmt=True)
    Scripted.script = [(503, {"Retry-After": soon}), (503, {"Retry-After": "0"})]
    sent = [event(i) for i in range(30)]

    async def go() -> tuple[Client, EventSender]:
        client = Client(scripted, "k", seed=0)
        sender = EventSender(client, batch_size=100, gzip_min_bytes=1)
        for e in sent:
            sender.add(e)
        assert await sender.drain(10)
        await client.aclose()
        return client, sender

    client, sender = asyncio.run(go())
    assert client.stats.unavailable == 2 and client.stats.retries == 2
    assert len(Scripted.bodies) == 3  # one batch, sent three times: the same events each time
    assert Scripted.bodies[0] == Scripted.bodies[1] == Scripted.bodies[2] == {"events": sent}
    assert (sender.stats.sent, sender.stats.batches, sender.pending) == (30, 1, 0)


def test_a_refused_batch_is_dropped_and_a_too_large_one_split(scripted: str) -> None:
    Scripted.script = [(413, {}), (422, {})]
    sent = [event(i) for i in range(4)]

    async def go() -> EventSender:
        client = Client(scripted, "k", seed=0)
        sender = EventSender(client, batch_size=4)
        for e in sent:
            sender.add(e)
        assert await sender.drain(10)
        await client.aclose()
        return sender

    sender = asyncio.run(go())
    # 413 on all four: halved to two; 422 on the first two: dropped; the last two delivered
    assert [len(b["events"]) for b in Scripted.bodies] == [4, 2, 2]
    assert Scripted.bodies[2] == {"events": sent[2:]}
    assert (sender.stats.dropped, sender.stats.sent, sender.pending) == (2, 2, 0)


def test_no_answer_gives_up_after_max_attempts_and_keeps_the_events() -> None:
    async def go() -> tuple[Client, EventSender, bool]:
        client = Client("http://127.0.0.1:9", "k", seed=0, max_attempts=3, backoff_base_s=0.01)
        sender = EventSender(client)
        sender.add(event(0))
        delivered = await sender.flush()
        await client.aclose()
        return client, sender, delivered

    client, sender, delivered = asyncio.run(go())
    assert not delivered and sender.pending == 1  # kept for the next flush
    assert (client.stats.transport_errors, client.stats.gave_up) == (3, 1)
