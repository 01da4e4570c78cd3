"""Load for POST /v1/events: realistic 100-event batches, sent over raw HTTP/1.1 keep-alive
connections on asyncio (a few microseconds per event, so the generator is not what it measures).

`closed_loop` posts back to back on every connection (peak throughput); `open_loop` starts
batches on a fixed schedule whatever the server's pace, and counts each batch's latency from
when it should have been sent (so a stalled server cannot hide its queue).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

HOST = "127.0.0.1"
BATCH = 100
USERS = 10_000
# Event types by share of all feedback: most shown suggestions are rejected (or ignored);
# an accepted one gets up to four retention checks; switches and churn are rare.
MIX = {"reject": 0.50, "accept": 0.16, "code_retained": 0.31, "model_switch": 0.02, "churn": 0.01}
MODELS = ("tabloop", "copilot", "other")
CHURN_REASONS = ("cancelled", "inactive", "too_noisy")
PERSON = ("model_switch", "churn")  # events that name a person, not a suggestion


@dataclass(frozen=True)
class Load:
    """Who sends the batches and what they hold: `users` people, and `person_share` of the
    events a model_switch or churn (None: MIX as it is; otherwise the two keep their ratio, and
    so do the suggestion events)."""

    users: int = USERS
    person_share: float | None = None

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ValueError("users must be at least 1")
        if self.person_share is not None and not 0 <= self.person_share <= 1:
            raise ValueError("person_share must be between 0 and 1")

    @property
    def mix(self) -> dict[str, float]:
        if self.person_share is None:
            return MIX
        person = sum(MIX[k] for k in PERSON)
        scale = {True: self.person_share / person, False: (1 - self.person_share) / (1 - person)}
        return {k: w * scale[k in PERSON] for k, w in MIX.items()}


def make_event(rng: random.Random, now: str, load: Load = Load()) -> dict[str, Any]:
    mix = load.mix
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    ev: dict[str, Any] = {
        "event_id": str(uuid.uuid4()),
        "type": kind,
        "user_id": f"u-{rng.randrange(load.users)}",
        "occurred_at": now,
    }
    if kind in ("accept", "reject", "code_retained"):
        ev["suggestion_id"] = str(uuid.uuid4())
    if kind == "accept":
        ev["accepted_chars"] = rng.randint(1, 80)
    elif kind == "code_retained":
        ev["after_seconds"] = float(rng.choice((30, 120, 300, 600)))
        ev["retained_fraction"] = round(rng.random(), 3)
    elif kind == "model_switch":
        ev["from_model"], ev["to_model"] = rng.sample(MODELS, 2)
    elif kind == "churn":
        ev["reason"] = rng.choice(CHURN_REASONS)
    return ev


def make_body(rng: random.Random, batch: int = BATCH, load: Load = Load()) -> bytes:
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return orjson.dumps({"events": [make_event(rng, now, load) for _ in range(batch)]})


class Conn:
    """One HTTP/1.1 keep-alive connection: just enough protocol for POST /v1/events."""

    def __init__(self, port: int, token: str | None) -> None:
        self.port = port
        self.head = (
            f"POST /v1/events HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            + (f"Authorization: Bearer {token}\r\n" if token else "")
            + "Content-Type: application/json\r\nContent-Length: "
        ).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        assert self.reader is not None
        try:
            self.writer.write(self.head + str(len(body)).encode() + b"\r\n\r\n" + body)
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            assert "chunked" not in headers.get("transfer-encoding", ""), "chunked reply"
            payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
            if headers.get("connection", "").lower() == "close":
                self.close()
            return status, payload
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.close()
            raise

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)  # seconds per 202 batch
    accepted: int = 0  # events the server answered as accepted
    statuses: dict[str, int] = field(default_factory=dict)  # non-202 answers and errors
    elapsed: float = 0.0
    sent: int = 0

    def record(self, status: int | str, payload: bytes, latency: float) -> None:
        if status == 202:
            self.latencies.append(latency)
            self.accepted += orjson.loads(payload)["accepted"]
        else:
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1

    @property
    def rate(self) -> float:
        return self.accepted / self.elapsed if self.elapsed else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def _send(conn: Conn, body: bytes, stats: Stats, start: float) -> None:
    try:
        status, payload = await conn.post(body)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        status, payload = type(e).__name__, b""  # type: ignore[assignment]
    stats.record(status, payload, time.perf_counter() - start)


async def closed_loop(
    port: int,
    token: str | None,
    connections: int,
    duration: float,
    max_requests: int,
    seed: int,
    load: Load = Load(),
) -> Stats:
    """`connections` clients posting back to back until the time or request budget runs out."""
    stats = Stats()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    deadline = t0 + duration

    async def client() -> None:
        conn = Conn(port, token)
        try:
            while time.perf_counter() < deadline and stats.sent < max_requests:
                stats.sent += 1
                body = make_body(rng, load=load)
                await _send(conn, body, stats, time.perf_counter())
        finally:
            conn.close()

    await asyncio.gather(*(client() for _ in range(connections)))
    stats.elapsed = time.perf_counter() - t0
    return stats


async def open_loop(
    port: int,
    token: str | None,
    connections: int,
    rate_rps: float,
    duration: float,
    max_requests: int,
    seed: int,
    load: Load = Load(),
) -> Stats:
    """Batches started on a fixed schedule, whatever the server's pace; a batch waiting for a
    free connection is late, and its latency counts from when it should have been sent."""
    stats = Stats()
    rng = random.Random(seed)
    pool: asyncio.Queue[Conn] = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(Conn(port, token))
    n = min(max_requests, int(rate_rps * duration))
    tasks = []

    async def one(body: bytes, scheduled: float) -> None:
        conn = await pool.get()
        try:
            await _send(conn, body, stats, scheduled)
        finally:
            pool.put_nowait(conn)

    t0 = time.perf_counter()
    for i in range(n):
        scheduled = t0 + i / rate_rps
        body = make_body(rng, load=load)
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        stats.sent += 1
        tasks.append(asyncio.ensure_future(one(body, scheduled)))
    await asyncio.gather(*tasks)
    stats.elapsed = time.perf_counter() - t0
    while not pool.empty():
        pool.get_nowait().close()
    return stats
