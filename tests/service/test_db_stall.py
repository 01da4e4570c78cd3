"""A database that takes connections but answers nothing (SIGSTOPped, an I/O stall): requests get
503 with Retry-After instead of hanging with it, and the service recovers by itself."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.deps import DB_STALL_S, Health
from tabloop.core.db import make_engine, upgrade
from tabloop.core.keys import create_key
from tabloop.testing.factories import event
from tabloop.testing.postgres import PostgresServer
from tests.service.conftest import RunningService, make_settings


@pytest.mark.parametrize(
    ("started", "now", "stalled"),
    [
        (None, 100.0, False),  # no check in progress
        (100.0, 100.0 + DB_STALL_S / 2, False),  # a check under way
        (100.0, 100.0 + DB_STALL_S + 0.1, True),  # a check that never came back
    ],
)
def test_db_stalled(started: float | None, now: float, stalled: bool) -> None:
    assert Health(db_ok=True, db_check_started=started).db_stalled(now) is stalled


def post(url: str, token: str, n: int) -> httpx.Response:
    batch = {"events": [event() for _ in range(n)]}
    return httpx.post(
        f"{url}/v1/events", json=batch, timeout=8, headers={"Authorization": f"Bearer {token}"}
    )


@pytest.mark.integration  # its own PostgreSQL, the app on a socket
def test_stalled_database_gets_503_with_retry_after(tmp_path: Path, kafka_broker: Any) -> None:
    base = Path(tempfile.mkdtemp(prefix="tabloop-pg-stall-"))  # reachable by `postgres`
    pg = PostgresServer(base, fast=True).start()
    svc = None
    try:
        settings = make_settings(
            tmp_path, pg_url=pg.create_database("stall"), bootstrap=kafka_broker.bootstrap
        )
        upgrade(settings)
        engine = make_engine(settings)
        with engine.begin() as conn:
            token = create_key(conn, name="t", scopes=frozenset({"ingest"}))[1]
        engine.dispose()
        svc = RunningService(settings).start()
        assert post(svc.url, token, 5).status_code == 202
        pg.pause()
        deadline = time.monotonic() + 30
        while not svc.health.db_stalled():
            assert time.monotonic() < deadline, "the monitor never saw the stall"
            time.sleep(0.1)
        r = post(svc.url, token, 5)  # the key is no longer cached: the lookup would hang
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        assert httpx.get(f"{svc.url}/readyz").status_code == 503
        pg.pause(False)
        deadline = time.monotonic() + 30
        while (r := post(svc.url, token, 5)).status_code != 202:
            assert r.status_code == 503, r.text
            assert time.monotonic() < deadline, "no recovery after the database came back"
            time.sleep(0.2)
    finally:
        pg.pause(False)
        if svc is not None:
            svc.stop()
        pg.close()
        shutil.rmtree(base, ignore_errors=True)
