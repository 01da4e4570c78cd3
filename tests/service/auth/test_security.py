"""Keys under pressure: rate limits under concurrency, constant-time checks of hashed secrets,
and tokens that never reach a log line. (Which route needs which scope: test_route_matrix.py.)"""

from __future__ import annotations

import hashlib
import inspect
import logging
import threading
from collections import Counter
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core import keys
from tabloop.core.tables import api_keys
from tabloop.testing.factories import event


@pytest.mark.parametrize("mode", ["embedded"])  # the limiter is per process, whatever the mode
def test_rate_limit_holds_under_concurrency(
    settings_factory: Any, service_factory: Any, key_factory: Any
) -> None:
    """N requests at once over a burst of B: exactly B admitted, N - B answered 429 with a
    Retry-After, whatever the interleaving (the bucket is taken under a lock)."""
    burst, n = 5, 40
    svc = service_factory(settings_factory(rate_limit_per_s=0.01, rate_limit_burst=burst))
    token, other = key_factory("ingest"), key_factory("ingest")
    statuses: Counter[int] = Counter()
    retry_after: list[str | None] = []
    start = threading.Barrier(n)
    lock = threading.Lock()

    def hit() -> None:
        with httpx.Client(
            base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
        ) as c:
            start.wait()
            r = c.post("/v1/events", json={"events": []})
        with lock:
            statuses[r.status_code] += 1
            if r.status_code == 429:
                retry_after.append(r.headers.get("Retry-After"))

    threads = [threading.Thread(target=hit) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert statuses == {202: burst, 429: n - burst}, statuses
    assert all(v is not None and int(v) >= 1 for v in retry_after), retry_after
    r = httpx.post(
        svc.url + "/v1/events",
        json={"events": [event()]},
        headers={"Authorization": f"Bearer {other}"},
    )
    assert r.status_code == 202  # another key's bucket is untouched


def test_secrets_are_stored_hashed_and_compared_in_constant_time(
    engine: sa.Engine, key_factory: Any
) -> None:
    token = key_factory("ingest")
    key_id, secret = token.removeprefix(keys.PREFIX).split("_", 1)
    with engine.connect() as conn:
        row = conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id)).one()
    assert row.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert all(secret not in str(v) for v in row)  # no column holds the secret itself
    # The row is found by the public id; the secret's hash is compared with
    # hmac.compare_digest, and compared even when no row matched.
    source = inspect.getsource(keys.authenticate)
    assert "hmac.compare_digest(" in source
    after = source.split("expected =", 1)[1]
    assert "==" not in after, "the secret's hash must not be compared with =="
    with engine.connect() as conn:
        assert keys.authenticate(conn, token) is not None
        assert keys.authenticate(conn, token[:-1] + ("A" if token[-1] != "A" else "B")) is None
        assert keys.authenticate(conn, f"{keys.PREFIX}{'0' * 16}_{secret}") is None


def test_tokens_never_reach_the_logs(
    service: Any, key_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole key life over HTTP, every logger at DEBUG: made, used, refused for scope, revoked,
    refused as revoked, a wrong secret, and a 500-free malformed body. No log line holds a
    token or its secret."""
    admin = key_factory("admin")
    # SQLAlchemy and uvicorn set their own loggers' levels: lower each, the SQL log included
    # (statements and their parameters)
    for name in (
        None,
        "sqlalchemy",
        "sqlalchemy.engine",
        "sqlalchemy.pool",
        "uvicorn",
        "uvicorn.error",
        "service",
        "fastapi",
    ):
        caplog.set_level(logging.DEBUG, logger=name)
    seen: list[str] = [admin]
    with httpx.Client(base_url=service.url, timeout=30) as c:
        made = c.post(
            "/admin/keys",
            json={"name": "plugin", "scopes": ["ingest"]},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert made.status_code == 201
        token = made.json()["token"]
        seen.append(token)
        auth = {"Authorization": f"Bearer {token}"}
        assert (
            c.post("/v1/events", json={"events": [event(), {"bad": 1}]}, headers=auth).status_code
            == 202
        )
        assert (
            c.post(
                "/v1/events",
                content=b"{not json",
                headers=auth | {"Content-Type": "application/json"},
            ).status_code
            == 400
        )
        assert c.get("/admin/keys", headers=auth).status_code == 403
        wrong = token[:-4] + "abcd"
        seen.append(wrong)
        assert (
            c.post(
                "/v1/events", json={"events": []}, headers={"Authorization": f"Bearer {wrong}"}
            ).status_code
            == 401
        )
        assert (
            c.delete(
                f"/admin/keys/{made.json()['id']}", headers={"Authorization": f"Bearer {admin}"}
            ).status_code
            == 200
        )
        assert c.post("/v1/events", json={"events": []}, headers=auth).status_code == 401
    # The test's own HTTP client logs nothing of headers either, but only the service is judged.
    records = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]
    names = {r.name for r in records}
    assert "sqlalchemy.engine.Engine" in names, f"the capture missed the SQL log: {names}"
    text = "\n".join(r.getMessage() + " " + str(r.args) + " " + (r.exc_text or "") for r in records)
    for t in seen:
        secret = t.removeprefix(keys.PREFIX).split("_", 1)[1]
        assert t not in text and secret not in text
