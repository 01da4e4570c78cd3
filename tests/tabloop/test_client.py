"""tabloop.client against the real service: a suggestion, then its feedback in gzipped batches,
retried as the service says (Retry-After on 429/503) and delivered once.

The service answers 429 only past a key's rate limit and 503 only when its database is down, so
a loopback relay stands in front of it: it passes every request on to the real service, and
answers in its place (or loses its answer) when a test scripts it to.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa
import torch

from tabloop.client import ApiError, Client, EventSender, utc_now
from tabloop.core.db import make_engine, upgrade
from tabloop.core.keys import create_key
from tabloop.core.policy.checkpoint import save_checkpoint
from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.registry import bootstrap
from tabloop.core.tables import events, rollouts
from tests.service.conftest import RunningService, make_settings


@dataclass
class Served:
    url: str
    token: str
    engine: sa.Engine

    def stored(self) -> list[str]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(events.c.event_id)).scalars())


@pytest.fixture
def served(tmp_path: Path, tiny_tokenizer: Any) -> Iterator[Served]:
    """The service with a tiny random policy live and an ingest key."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tiny_tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
    )
    checkpoint = save_checkpoint(
        tmp_path / "policy",
        GPT(cfg).eval(),
        tiny_tokenizer,
        version=0,
        parent=None,
        summary={},
        overwrite=True,
    )
    settings = make_settings(tmp_path, base_checkpoint=checkpoint, policy_poll_interval_s=0.2)
    upgrade(settings)
    engine = make_engine(settings)
    with engine.begin() as conn:
        bootstrap(conn, checkpoint)
        token = create_key(conn, name="plugin", scopes=frozenset({"ingest"}))[1]
    service = RunningService(settings).start()
    try:
        yield Served(service.url, token, engine)
    finally:
        service.stop()
        engine.dispose()


class Relay(BaseHTTPRequestHandler):
    """Passes POSTs on to `target`, recording each; `script` entries answer in its place:
    (status, headers) answers that without passing the request on, ("lose", status) passes it on
    and answers `status` instead of what the service said (an answer lost on the way back)."""

    target = ""
    script: list[tuple[Any, Any]] = []
    seen: list[tuple[str, dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in ("host", "content-length", "connection")
        }
        Relay.seen.append((self.path, headers, raw))
        step = Relay.script.pop(0) if Relay.script else None
        if step is not None and step[0] != "lose":
            self._answer(step[0], step[1], b'{"error": {"code": "x", "message": "scripted"}}')
            return
        r = httpx.post(Relay.target + self.path, content=raw, headers=headers, timeout=30)
        if step is not None:  # the service did the work; its answer is lost
            self._answer(step[1], {}, b'{"error": {"code": "x", "message": "lost"}}')
            return
        self._answer(r.status_code, {}, r.content)

    def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def relay(served: Served) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    Relay.target, Relay.script, Relay.seen = served.url, [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def churn(i: int) -> dict[str, Any]:
    return {"type": "churn", "user_id": f"u{i}", "reason": "inactive"}


def sent_batches() -> list[list[dict[str, Any]]]:
    """The event batches the relay saw, gunzipped where they were gzipped."""
    out = []
    for path, headers, raw in Relay.seen:
        if path != "/v1/events":
            continue
        gzipped = headers.get("Content-Encoding") == "gzip"
        out.append(orjson.loads(gzip.decompress(raw) if gzipped else raw)["events"])
    return out


def test_a_suggestion_then_its_feedback_in_gzipped_batches(served: Served, relay: str) -> None:
    async def go() -> tuple[dict[str, Any], EventSender, list[str]]:
        async with Client(relay, served.token) as client:
            s = await client.complete({"user_id": "u-1", "prefix": "def add(a, b):\n    return a"})
            assert s is not None
            async with EventSender(client, batch_size=3, gzip_min_bytes=1) as sender:
                # what stands after the cursor: feedback about any suggestion, shown or not
                ids = [
                    sender.add(
                        {
                            "type": "code_settled",
                            "user_id": "u-1",
                            "suggestion_id": s["suggestion_id"],
                            "after_seconds": 2,
                            "text": " + b",
                        }
                    )
                ]
                ids += [sender.add(churn(i)) for i in range(6)]
        return s, sender, ids

    suggestion, sender, ids = asyncio.run(go())
    with served.engine.connect() as conn:
        user = conn.execute(
            sa.select(rollouts.c.user_id).where(
                rollouts.c.suggestion_id == suggestion["suggestion_id"]
            )
        ).scalar_one()
    assert user == "u-1"
    assert all(str(uuid.UUID(i)) == i for i in ids) and len(set(ids)) == 7
    assert sorted(served.stored()) == sorted(ids)
    assert (sender.stats.sent, sender.stats.accepted, sender.stats.duplicates) == (7, 7, 0)
    assert sender.stats.batches == 3 and sender.pending == 0
    feedback = [h for path, h, _ in Relay.seen if path == "/v1/events"]
    assert len(feedback) == 3 and all(h.get("Content-Encoding") == "gzip" for h in feedback)
    assert [len(b) for b in sent_batches()] == [3, 3, 1]
    assert [e["event_id"] for b in sent_batches() for e in b] == ids  # in the order added


def test_429_and_503_are_retried_after_what_retry_after_says(served: Served, relay: str) -> None:
    Relay.script = [(429, {"Retry-After": "1"}), (503, {"Retry-After": "0"})]

    async def go() -> tuple[Client, EventSender, float]:
        async with Client(relay, served.token) as client:
            sender = EventSender(client)
            for i in range(4):
                sender.add(churn(i))
            started = time.monotonic()
            assert await sender.flush()
            return client, sender, time.monotonic() - started

    client, sender, took = asyncio.run(go())
    assert (client.stats.throttled, client.stats.unavailable, client.stats.retries) == (1, 1, 2)
    assert client.stats.waited_s == 1.0 and took >= 1.0  # as told, not its own backoff
    batches = sent_batches()
    assert len(batches) == 3 and batches[0] == batches[1] == batches[2]
    assert sorted(served.stored()) == sorted(e["event_id"] for e in batches[0])
    assert (sender.stats.accepted, sender.stats.duplicates) == (4, 0)


def test_a_lost_answer_is_redelivered_with_the_same_ids_and_counted_once(
    served: Served, relay: str
) -> None:
    Relay.script = [("lose", 503)]  # the service stores the batch; the client hears 503

    async def go() -> EventSender:
        async with Client(relay, served.token, backoff_base_s=0.01) as client:
            sender = EventSender(client)
            for i in range(5):
                sender.add(churn(i))
            assert await sender.flush()
            return sender

    sender = asyncio.run(go())
    first, second = sent_batches()
    assert first == second  # the same events, ids and all
    assert sorted(served.stored()) == sorted(e["event_id"] for e in first)  # stored once
    assert (sender.stats.accepted, sender.stats.duplicates, sender.pending) == (0, 5, 0)


def test_a_refused_request_raises_and_is_not_retried(served: Served) -> None:
    async def go() -> Client:
        async with Client(served.url, served.token) as client:
            with pytest.raises(ApiError) as e:
                await client.complete({"user_id": "u-1", "prefix": 42})
            assert e.value.status == 422 and "prefix" in str(e.value)
            return client

    assert asyncio.run(go()).stats.requests == 1


def test_no_answer_backs_off_then_gives_up_keeping_the_events() -> None:
    async def go() -> tuple[Client, EventSender, bool]:
        async with Client(
            "http://127.0.0.1:9", "k", max_attempts=3, backoff_base_s=0.01, seed=1
        ) as client:
            sender = EventSender(client)
            sender.add(churn(0))
            return client, sender, await sender.flush()

    client, sender, delivered = asyncio.run(go())
    assert not delivered and sender.pending == 1
    assert (client.stats.transport_errors, client.stats.retries, client.stats.gave_up) == (3, 2, 1)
    assert 0.0075 <= client.stats.waited_s <= 0.03  # 0.01 then 0.02, each jittered to [1/2, 1]


def test_an_event_keeps_the_id_it_was_given_or_gets_one_once() -> None:
    given, at = str(uuid.uuid4()), utc_now()

    async def go() -> tuple[str, list[dict[str, Any]]]:
        async with Client("http://127.0.0.1:9", "k") as client:
            sender = EventSender(client)
            assert sender.add({**churn(0), "event_id": given, "occurred_at": at}) == given
            return sender.add(churn(1)), list(sender._queue)

    minted, queued = asyncio.run(go())
    assert [e["event_id"] for e in queued] == [given, minted]
    assert queued[0]["occurred_at"] == at and queued[1]["occurred_at"].endswith("Z")


def test_refused_events_are_counted_each_and_logged_once_a_minute(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """Three batches, each with one event the service refuses (a churn with an unknown field):
    all three counted by type, one warning (the next would come a minute later)."""

    async def go() -> EventSender:
        async with Client(served.url, served.token) as client:
            sender = EventSender(client, batch_size=2)
            for i in range(3):
                sender.add(churn(i))
                sender.add({**churn(i), "mood": "bad"})
                assert await sender.flush()
            return sender

    with caplog.at_level("WARNING", logger="tabloop.client"):
        sender = asyncio.run(go())
    assert (sender.stats.sent, sender.stats.accepted, sender.stats.rejected) == (6, 3, 3)
    assert sender.stats.rejected_by_type == {"churn": 3}
    warnings = [r for r in caplog.records if r.name == "tabloop.client"]
    assert len(warnings) == 1 and "refused 1 event(s)" in warnings[0].getMessage()
