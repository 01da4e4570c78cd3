"""API keys: made once, stored hashed, checked in constant time, limited per key.

A token reads `tlk_<id>_<secret>`. The id is public and finds the row; only the SHA-256 of
the secret is stored, and it is compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from tabloop.core.db import AnyRow
from tabloop.core.tables import api_keys, utcnow

SCOPES = ("ingest", "deploy", "admin")
PREFIX = "tlk_"


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    scopes: frozenset[str]
    created_at: datetime
    revoked_at: datetime | None = None
    no_train: bool = False  # privacy mode for every request it makes (service/privacy.py)
    workspace_name: str | None = None  # as made; None: the key's own

    @property
    def workspace(self) -> str:
        """The workspace whose memory the key's requests read and feed: named at creation, or
        the key's own (its id). Nothing crosses workspaces (tabloop/core/memory.py)."""
        return self.workspace_name or self.id


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def parse_scopes(values: Sequence[str] | str) -> frozenset[str]:
    """Accepts ["ingest", "admin"] or "ingest,admin"; raises ValueError on unknown scopes."""
    if isinstance(values, str):
        items = values.split(",")
    else:
        items = [p for v in values for p in v.split(",")]
    scopes = frozenset(s.strip() for s in items if s.strip())
    unknown = scopes - set(SCOPES)
    if unknown or not scopes:
        raise ValueError(
            f"scopes must be among {', '.join(SCOPES)}; got {sorted(unknown) or 'none'}"
        )
    return scopes


def create_key(
    conn: sa.Connection,
    *,
    name: str,
    scopes: frozenset[str],
    no_train: bool = False,
    workspace: str | None = None,
) -> tuple[ApiKey, str]:
    """Insert a key and return it with its token; the token is not recoverable afterwards.
    `no_train`: every request made with it is in privacy mode (its code is never stored or
    trained on); `workspace`: the workspace it belongs to (None: its own); both set for good
    at creation."""
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    now = utcnow()
    conn.execute(
        api_keys.insert().values(
            id=key_id,
            name=name,
            scopes=",".join(sorted(scopes)),
            secret_sha256=_sha256(secret),
            created_at=now,
            no_train=no_train,
            workspace=workspace,
        )
    )
    key = ApiKey(key_id, name, scopes, now, no_train=no_train, workspace_name=workspace)
    return key, f"{PREFIX}{key_id}_{secret}"


def authenticate(conn: sa.Connection, token: str) -> ApiKey | None:
    """The live key for a token, or None for a malformed, unknown, wrong or revoked one."""
    if not token.startswith(PREFIX):
        return None
    key_id, sep, secret = token[len(PREFIX) :].partition("_")
    if not sep or not key_id or not secret or len(key_id) > 32:
        return None
    row = conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id)).first()
    # Hash and compare even when the id is unknown, so timing says nothing about which part failed.
    expected = row.secret_sha256 if row is not None else "0" * 64
    ok = hmac.compare_digest(_sha256(secret), expected)
    if row is None or not ok or row.revoked_at is not None:
        return None
    return _to_key(row)


def _to_key(row: AnyRow) -> ApiKey:
    return ApiKey(
        row.id,
        row.name,
        frozenset(row.scopes.split(",")),
        row.created_at,
        row.revoked_at,
        no_train=bool(row.no_train),  # NULL (older keys): false
        workspace_name=row.workspace,
    )


def list_keys(conn: sa.Connection) -> list[ApiKey]:
    rows = conn.execute(sa.select(api_keys).order_by(api_keys.c.created_at)).all()
    return [_to_key(r) for r in rows]


def revoke_key(conn: sa.Connection, key_id: str) -> ApiKey | None:
    """Revoke a key (idempotent); None when no such key exists."""
    conn.execute(
        api_keys.update()
        .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    row = conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id)).first()
    return _to_key(row) if row is not None else None


def has_any_key(conn: sa.Connection, scope: str | None = None) -> bool:
    rows = conn.execute(sa.select(api_keys.c.scopes).where(api_keys.c.revoked_at.is_(None))).all()
    return any(scope is None or scope in r.scopes.split(",") for r in rows)


class KeyCache:
    """Keys that authenticated in the last `ttl_s` seconds, so a client's every request does not
    cost a database round trip. Only successes are kept (a new key works at once, an unknown
    token always asks the database), under the SHA-256 of the token (no secret is held).

    Revocation: `invalidate` drops a key in this process at once (the admin API calls it after
    the commit); other processes (workers, hosts) stop accepting it within `ttl_s`. A ttl of 0
    turns the cache off.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: dict[bytes, tuple[ApiKey, float]] = {}  # token hash -> (key, expiry)
        self._lock = threading.Lock()
        # Bumped by every invalidation: a lookup that read the database before a revocation
        # committed must not cache what it read (see `put`).
        self.generation = 0

    @staticmethod
    def _slot(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def get(self, token: str, now: float | None = None) -> ApiKey | None:
        if self.ttl_s <= 0:
            return None
        hit = self._entries.get(self._slot(token))
        if hit is None:
            return None
        key, expiry = hit
        return key if (time.monotonic() if now is None else now) < expiry else None

    def put(self, token: str, key: ApiKey, generation: int, now: float | None = None) -> None:
        """Cache `key`, read from the database when `self.generation` was `generation`."""
        if self.ttl_s <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if generation != self.generation:
                return
            if len(self._entries) >= self.max_entries:  # many tokens: keep the live ones only
                self._entries = {s: e for s, e in self._entries.items() if e[1] > now}
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
            self._entries[self._slot(token)] = (key, now + self.ttl_s)

    def invalidate(self, key_id: str) -> None:
        with self._lock:
            self.generation += 1
            self._entries = {s: e for s, e in self._entries.items() if e[0].id != key_id}


class RateLimiter:
    """Token bucket per key, in this process: `rate` requests/s sustained, `burst` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, last refill)
        self._lock = threading.Lock()

    def acquire(self, key_id: str, now: float | None = None) -> float:
        """Take one token; returns 0.0 if allowed, else the seconds until one is available."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(key_id, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key_id] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key_id] = (tokens, now)
            return (1.0 - tokens) / self.rate
