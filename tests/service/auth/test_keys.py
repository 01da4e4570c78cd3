"""API key checks: the per-process cache of recently checked keys, and revocation through it."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import httpx

from tabloop.core.keys import ApiKey, KeyCache
from tabloop.testing.factories import event

KEY = ApiKey("k1", "plugin", frozenset({"ingest"}), datetime(2026, 1, 1, tzinfo=UTC))


def test_cache_keeps_a_key_for_its_ttl_only() -> None:
    cache = KeyCache(ttl_s=1.0)
    assert cache.get("tlk_k1_secret", now=0.0) is None
    cache.put("tlk_k1_secret", KEY, cache.generation, now=0.0)
    assert cache.get("tlk_k1_secret", now=0.5) == KEY
    assert cache.get("tlk_k1_secret", now=1.0) is None  # expired: ask the database again
    assert cache.get("tlk_k1_other", now=0.5) is None  # another token for the same id


def test_invalidate_drops_the_key_and_stale_lookups_are_not_cached() -> None:
    cache = KeyCache(ttl_s=1.0)
    cache.put("tlk_k1_secret", KEY, cache.generation, now=0.0)
    read_before_revoke = cache.generation  # a lookup that read the row before the revocation
    cache.invalidate("k1")
    assert cache.get("tlk_k1_secret", now=0.1) is None
    cache.put("tlk_k1_secret", KEY, read_before_revoke, now=0.2)
    assert cache.get("tlk_k1_secret", now=0.3) is None


def test_ttl_zero_disables_the_cache() -> None:
    cache = KeyCache(ttl_s=0)
    cache.put("tlk_k1_secret", KEY, cache.generation, now=0.0)
    assert cache.get("tlk_k1_secret", now=0.0) is None


def test_cache_stays_bounded() -> None:
    cache = KeyCache(ttl_s=1.0, max_entries=10)
    for i in range(25):
        cache.put(f"tlk_k1_{i}", KEY, cache.generation, now=0.0)
    assert len(cache._entries) <= 10
    assert cache.get("tlk_k1_24", now=0.0) == KEY


def test_revocation_reaches_every_api_process_within_the_ttl(
    settings_factory: Any, service_factory: Any, key_factory: Any
) -> None:
    """Two API processes on one database: the one serving the revocation refuses the key at
    once, the other (which had it cached) once its cache entry expires."""
    settings = settings_factory(auth_cache_ttl_s=0.5)
    a, b = service_factory(settings), service_factory(settings)
    admin = key_factory("admin")
    made = httpx.post(
        a.url + "/admin/keys",
        json={"name": "plugin", "scopes": ["ingest"]},
        headers={"Authorization": f"Bearer {admin}"},
    )
    token, key_id = made.json()["token"], made.json()["id"]

    def post(svc: Any) -> int:
        return httpx.post(
            svc.url + "/v1/events",
            json={"events": [event()]},
            headers={"Authorization": f"Bearer {token}"},
        ).status_code

    assert post(a) == 202 and post(b) == 202  # both have it cached now
    revoked = httpx.delete(
        f"{a.url}/admin/keys/{key_id}", headers={"Authorization": f"Bearer {admin}"}
    )
    assert revoked.status_code == 200
    assert post(a) == 401
    deadline = time.monotonic() + 0.5 + 2.0  # the ttl, plus slack for a loaded machine
    while post(b) != 401:
        assert time.monotonic() < deadline, "a revoked key kept working past the cache ttl"
        time.sleep(0.05)
