"""A small asyncio client for editor plugins: suggestions and feedback, delivered once.

    import asyncio
    from tabloop.client import Client, EventSender

    async def main() -> None:
        async with Client("http://localhost:8000", "tlk_...") as client:
            async with EventSender(client) as sender:  # flushes in the background
                s = await client.complete({"user_id": "u-42", "prefix": "x = 1 +"})
                if s is not None and s["shown"]:
                    sender.add({"type": "accept", "user_id": "u-42",
                                "suggestion_id": s["suggestion_id"]})
            # leaving the block delivered what was queued

    asyncio.run(main())

- Every call is retried on 429 and 503, waiting what `Retry-After` says (seconds or an HTTP
  date; a jittered exponential backoff when it is missing), and on connection errors and
  timeouts with that backoff; bounded in attempts, never forever.
- Feedback events are buffered and sent in batches (`POST /v1/events`, gzip above a size), by
  size or every `flush_interval_s`. Each event gets its `event_id` (a UUID) once, when it is
  added; a batch that could not be delivered stays queued and is sent again with the same ids,
  and the service counts a repeat as a duplicate, never twice.
- Anything else the service refuses (400, 401, 403, 413, 422) is a bug in the caller or its
  key: `ApiError`, not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import gzip
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import httpx
import orjson

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 503})
REFUSAL_LOG_INTERVAL_S = 60.0  # the most often refused events are logged (EventSender)


class ApiError(Exception):
    """The service refused a request for a reason retrying cannot fix."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP-date); None if absent
    or unreadable. A date in the past is 0."""
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Jittered exponential backoff: uniform in [half, all] of min(cap, base * 2**attempt)."""
    full = min(cap_s, base_s * 2**attempt)
    return full * (0.5 + 0.5 * rng.random())


def wait_s(
    status: int | None,
    headers: Mapping[str, str],
    attempt: int,
    base_s: float,
    cap_s: float,
    rng: random.Random,
) -> float:
    """How long to wait before retry `attempt` (0-based): Retry-After when the service sent one
    (capped at cap_s), else the backoff. `status` None: the request never got an answer."""
    told = retry_after_s(headers) if status in RETRY_STATUSES else None
    return min(cap_s, told) if told is not None else backoff_s(attempt, base_s, cap_s, rng)


def utc_now() -> str:
    """Now as RFC 3339 in UTC, as events' `occurred_at` wants it."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class ClientStats:
    requests: int = 0  # HTTP requests made, retries included
    retries: int = 0
    throttled: int = 0  # 429 answers
    unavailable: int = 0  # 503 answers
    transport_errors: int = 0  # no answer (connection refused, reset, timeout)
    gave_up: int = 0  # calls abandoned after max_attempts
    waited_s: float = 0.0  # total time spent waiting to retry


@dataclass
class EventStats:
    queued: int = 0  # events handed to the sender
    sent: int = 0  # events the service acknowledged (202), whatever it said of each
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0  # refused one by one (kept in the service's dead letters)
    rejected_by_type: dict[str, int] = field(default_factory=dict)  # event type -> refused
    dropped: int = 0  # in batches the service refused whole (400/413/422)
    batches: int = 0


class Client:
    """The tabloop API at `api` (e.g. http://localhost:8000) with an ingest key.

    `max_attempts` bounds the tries of one call; the waits between them back off from
    `backoff_base_s` up to `backoff_cap_s`. `seed` fixes the backoff jitter (for reproducible
    runs). Use it as `async with Client(...)`, or call `aclose()`."""

    def __init__(
        self,
        api: str,
        key: str,
        *,
        seed: int | None = None,
        timeout_s: float = 30.0,
        max_attempts: int = 8,
        backoff_base_s: float = 0.2,
        backoff_cap_s: float = 10.0,
    ) -> None:
        self.api = api.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.api, timeout=timeout_s, headers={"Authorization": f"Bearer {key}"}
        )
        self._rng = random.Random(None if seed is None else f"client:{seed}")
        self.max_attempts = max_attempts
        self.backoff_base_s, self.backoff_cap_s = backoff_base_s, backoff_cap_s
        self.stats = ClientStats()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        """The first answer that is not a 429/503; None after max_attempts without one.
        `kwargs` go to httpx as they are, so every attempt sends the same body."""
        headers: Mapping[str, str]
        for attempt in range(self.max_attempts):
            self.stats.requests += 1
            try:
                r = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                self.stats.transport_errors += 1
                status, headers = None, {}
                log.debug("%s %s: %s", method, path, e)
            else:
                if r.status_code not in RETRY_STATUSES:
                    return r
                status, headers = r.status_code, r.headers
                if r.status_code == 429:
                    self.stats.throttled += 1
                else:
                    self.stats.unavailable += 1
            if attempt + 1 == self.max_attempts:
                break
            delay = wait_s(
                status, headers, attempt, self.backoff_base_s, self.backoff_cap_s, self._rng
            )
            self.stats.retries += 1
            self.stats.waited_s += delay
            await asyncio.sleep(delay)
        self.stats.gave_up += 1
        log.warning("%s %s: gave up after %d attempts", method, path, self.max_attempts)
        return None

    @staticmethod
    def _check(r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200]
            raise ApiError(r.status_code, message)
        return r.json()

    async def complete(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """POST /v1/complete: `{"suggestion_id", "policy_version", "text", "shown", ...}`, or
        None when the service stayed unavailable. Raises ApiError when it refuses the request."""
        r = await self.request(
            "POST",
            "/v1/complete",
            content=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        return None if r is None else self._check(r)

    async def post_events(
        self, events: list[dict[str, Any]], gzip_min_bytes: int = 4096
    ) -> dict[str, Any] | None:
        """POST /v1/events with one batch, gzipped from `gzip_min_bytes` of JSON on: the
        service's 202 answer, or None when it stayed unavailable. Prefer EventSender."""
        body = orjson.dumps({"events": events})
        headers = {"Content-Type": "application/json"}
        if len(body) >= gzip_min_bytes:
            body = gzip.compress(body, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        r = await self.request("POST", "/v1/events", content=body, headers=headers)
        return None if r is None else self._check(r)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _event_type(batch: list[dict[str, Any]], refused: Any) -> str:
    """The type of the event a 202's `rejected` entry points at by index ("?" if it does not)."""
    index = refused.get("index") if isinstance(refused, dict) else None
    if isinstance(index, int) and 0 <= index < len(batch):
        return str(batch[index].get("type", "?"))
    return "?"


class EventSender:
    """Buffers feedback events and delivers them in batches, in the order they were added.

    `async with EventSender(client) as sender` flushes in the background while the block runs
    and delivers what is left when it ends (or call `start()` and `close()`); `flush()` sends
    what is queued now."""

    def __init__(
        self,
        client: Client,
        *,
        batch_size: int = 200,
        flush_interval_s: float = 0.25,
        gzip_min_bytes: int = 4096,
    ) -> None:
        assert batch_size >= 1 and flush_interval_s > 0
        self.client = client
        self.batch_size, self.flush_interval_s = batch_size, flush_interval_s
        self.gzip_min_bytes = gzip_min_bytes
        self.stats = EventStats()
        self._queue: deque[dict[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._refusals_logged_at = -math.inf  # monotonic time of the last refusal warning
        self._refusals_unlogged = 0  # refused since then
        self._task: asyncio.Task[None] | None = None

    def add(self, event: Mapping[str, Any]) -> str:
        """Queue one event (`{"type", "user_id", ...}` as /v1/events takes it) and return its
        `event_id`: the one it has, or a new UUID, kept for every delivery attempt. A missing
        `occurred_at` is now."""
        queued = {"event_id": str(uuid.uuid4()), "occurred_at": utc_now(), **event}
        self._queue.append(queued)
        self.stats.queued += 1
        if len(self._queue) >= self.batch_size:
            self._wake.set()
        return str(queued["event_id"])

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def flush(self) -> bool:
        """Send what is queued; False when a batch could not be delivered (it stays queued).
        Raises ApiError on 401/403: the key will not do."""
        async with self._lock:
            while self._queue:
                batch = [self._queue[i] for i in range(min(self.batch_size, len(self._queue)))]
                try:
                    result = await self.client.post_events(batch, self.gzip_min_bytes)
                except ApiError as e:
                    if e.status == 413 and len(batch) > 1:  # too large: smaller batches
                        self.batch_size = max(1, len(batch) // 2)
                        continue
                    if e.status in (401, 403):  # the key: nothing later will succeed either
                        raise
                    log.error("the service refused a batch of %d events: %s", len(batch), e)
                    for _ in batch:
                        self._queue.popleft()
                    self.stats.dropped += len(batch)
                    continue
                if result is None:
                    return False
                for _ in batch:
                    self._queue.popleft()
                self.stats.batches += 1
                self.stats.sent += len(batch)
                self.stats.accepted += int(result.get("accepted", 0))
                self.stats.duplicates += int(result.get("duplicates", 0))
                refused = result.get("rejected") or []
                self.stats.rejected += len(refused)
                for item in refused:
                    kind = _event_type(batch, item)
                    self.stats.rejected_by_type[kind] = self.stats.rejected_by_type.get(kind, 0) + 1
                if refused:
                    self._log_refused(len(refused), refused[0])
            return True

    def _log_refused(self, n: int, example: Any) -> None:
        """A warning for refused events, at most one per REFUSAL_LOG_INTERVAL_S with the count
        since the last (a client sending refused feedback all day logs once a minute)."""
        self._refusals_unlogged += n
        now = time.monotonic()
        if now - self._refusals_logged_at >= REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "the service refused %d event(s) (stats.rejected_by_type has them all), e.g. %s",
                self._refusals_unlogged,
                example,
            )
            self._refusals_logged_at, self._refusals_unlogged = now, 0

    async def run(self, stop: asyncio.Event) -> None:
        """Flush every flush_interval_s (sooner when a batch is full) until `stop`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            self._wake.clear()
            await self.flush()

    async def drain(self, timeout_s: float) -> bool:
        """Flush until nothing is queued or timeout_s passes; True when all was delivered."""
        deadline = time.monotonic() + timeout_s
        while self._queue and time.monotonic() < deadline:
            if not await self.flush():
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        return not self._queue

    def start(self) -> None:
        """Flush in the background (`run`) until `close()`."""
        if self._task is None:
            self._stop.clear()
            self._task = asyncio.get_running_loop().create_task(self.run(self._stop))

    async def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the background flushing and deliver what is queued, for at most timeout_s;
        True when nothing is left. The client stays open."""
        if self._task is not None:
            self._stop.set()
            self._wake.set()
            task, self._task = self._task, None
            await task
        return await self.drain(timeout_s)

    async def __aenter__(self) -> EventSender:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not await self.close():
            log.error("%d events could not be delivered", self.pending)

    def summary(self) -> dict[str, Any]:
        return {**asdict(self.stats), "pending": self.pending}
