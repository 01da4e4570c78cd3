"""A load of editor plugins for the fault and soak runs: numbered feedback events and completions.

Every event id is derived from a counter (`event_id(run, n)`), so what the service acknowledged can
be compared, id by id, with what reached PostgreSQL and the topics. Events go in batches through
POST /v1/events, retried the way a plugin retries — same body, same event ids — on 429, 503,
connection errors and timeouts, after `Retry-After`. A batch is acknowledged when a 202 counts
every one of its events accepted or duplicate. Completions are never retried (a late suggestion
is worthless); shown ones get an accept or reject event, so the trainer has rewards to join.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson

from benchmarks.loadgen import make_event

CLIENT_TIMEOUT_S = 10.0  # what a plugin waits for an answer before it gives up on a request
EXPECTED = (202, 200, 429, 503)  # anything else is a failure of the service


def event_id(run: int, n: int) -> str:
    """The n-th event of run `run` (32 random bits, so two runs never share an id)."""
    return str(uuid.UUID(int=(run << 96) | n))


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Answer:
    """One HTTP attempt as the client saw it."""

    route: str  # "events" | "complete"
    t0: float  # monotonic start
    seconds: float
    status: int | str  # HTTP status, or the transport error's name
    retry_after: bool


@dataclass
class Plugins:
    """State of the whole simulated fleet; the coroutines below fill it."""

    run: int = field(default_factory=lambda: random.getrandbits(32))
    users: int = 2000
    next_n: int = 0
    sent: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    answers: list[Answer] = field(default_factory=list)
    suggestions: deque[tuple[str, str, str]] = field(default_factory=lambda: deque(maxlen=5000))
    gave_up: int = 0  # batches abandoned after `give_up_s` of retries
    unexpected: list[str] = field(default_factory=list)  # bodies of 5xx/4xx other than 429/503

    def batch(self, rng: random.Random, size: int) -> list[dict[str, Any]]:
        now = now_rfc3339()
        out = []
        for _ in range(size):
            n, self.next_n = self.next_n, self.next_n + 1
            if self.suggestions and rng.random() < 0.5:  # feedback about a real suggestion
                sid, user, text = self.suggestions.popleft()
                ev: dict[str, Any] = {
                    "type": "reject",
                    "suggestion_id": sid,
                    "user_id": user,
                    "occurred_at": now,
                }
                if rng.random() < 0.35:
                    ev.update(type="accept", accepted_chars=max(1, len(text)))
            else:
                ev = make_event(rng, now)
                ev["user_id"] = f"u-{n * 7919 % self.users}"
            ev["event_id"] = event_id(self.run, n)
            out.append(ev)
        return out

    def record(self, route: str, t0: float, status: int | str, headers: Any, body: bytes) -> None:
        self.answers.append(
            Answer(
                route,
                t0,
                time.monotonic() - t0,
                status,
                headers is not None and "retry-after" in headers,
            )
        )
        if status not in EXPECTED and isinstance(status, int) and len(self.unexpected) < 50:
            self.unexpected.append(f"{route} {status}: {body[:300]!r}")


async def _post(
    client: httpx.AsyncClient, plugins: Plugins, route: str, body: bytes
) -> tuple[int | str, httpx.Response | None]:
    t0 = time.monotonic()
    try:
        r = await client.post(f"/v1/{route}", content=body)
    except httpx.TimeoutException:
        plugins.record(route, t0, "timeout", None, b"")
        return "timeout", None
    except httpx.TransportError as e:
        plugins.record(route, t0, type(e).__name__, None, b"")
        return type(e).__name__, None
    plugins.record(route, t0, r.status_code, r.headers, r.content)
    return r.status_code, r


async def send_events(
    client: httpx.AsyncClient, plugins: Plugins, events: list[dict[str, Any]], give_up_s: float
) -> None:
    """Post one batch until it is acknowledged (or `give_up_s` passes): the plugin's retry."""
    ids = [e["event_id"] for e in events]
    plugins.sent.update(ids)
    body = orjson.dumps({"events": events})
    deadline = time.monotonic() + give_up_s
    backoff = 0.25
    while True:
        status, r = await _post(client, plugins, "events", body)
        if status == 202 and r is not None:
            out = r.json()
            if out["accepted"] + out["duplicates"] == len(ids) and not out["rejected"]:
                plugins.acked.update(ids)
            else:
                plugins.unexpected.append(f"events 202 not all taken: {r.text[:300]}")
            return
        if isinstance(status, int) and status not in (429, 503) and status < 500:
            return  # the client's fault: a plugin would drop the batch
        if time.monotonic() > deadline:
            plugins.gave_up += 1
            return
        wait = backoff
        if r is not None and r.headers.get("retry-after", "").isdigit():
            wait = float(r.headers["retry-after"])
        else:
            backoff = min(backoff * 2, 4.0)
        await asyncio.sleep(wait * random.uniform(0.8, 1.2))


async def events_loop(
    client: httpx.AsyncClient,
    plugins: Plugins,
    *,
    rate: float,
    batch: int,
    concurrency: int,
    stop: asyncio.Event,
    give_up_s: float = 120,
    seed: int = 0,
    max_events: int | None = None,
) -> None:
    """Batches started at `rate` events/s with at most `concurrency` in flight (a full pipe slows
    the start of new batches, as a plugin's send buffer would)."""
    rng = random.Random(seed)
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    k = 0
    while not stop.is_set() and (max_events is None or plugins.next_n < max_events):
        await asyncio.sleep(max(0.0, t0 + k * batch / rate - time.monotonic()))
        k += 1
        await slots.acquire()

        async def one(events: list[dict[str, Any]]) -> None:
            try:
                await send_events(client, plugins, events, give_up_s)
            finally:
                slots.release()

        task = asyncio.create_task(one(plugins.batch(rng, batch)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


PREFIXES = (
    "import os\nimport sys\n\ndef main(argv):\n    parser = ",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.",
    "for i, line in enumerate(lines):\n    if line.startswith('#'):\n        ",
    "def read_config(path):\n    with open(path) as f:\n        return ",
)


async def complete_loop(
    client: httpx.AsyncClient,
    plugins: Plugins,
    *,
    rate: float,
    concurrency: int,
    stop: asyncio.Event,
    seed: int = 1,
) -> None:
    """Completions at `rate` per second (at most `concurrency` at once), never retried."""
    rng = random.Random(seed)
    slots = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    k = 0
    while not stop.is_set():
        await asyncio.sleep(max(0.0, t0 + k / rate - time.monotonic()))
        k += 1
        await slots.acquire()
        user = f"u-{rng.randrange(plugins.users)}"
        body = orjson.dumps({"user_id": user, "prefix": rng.choice(PREFIXES), "max_new_tokens": 16})

        async def one(body: bytes, user: str) -> None:
            try:
                status, r = await _post(client, plugins, "complete", body)
                if status == 200 and r is not None:
                    out = r.json()
                    if out["shown"]:
                        plugins.suggestions.append((out["suggestion_id"], user, out["text"]))
            finally:
                slots.release()

        task = asyncio.create_task(one(body, user))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)


def client(url: str, token: str, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        trust_env=False,
        timeout=CLIENT_TIMEOUT_S,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]
