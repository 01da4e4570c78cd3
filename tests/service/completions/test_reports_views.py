"""POST /v1/complete `reports_views`: a client that sends `view` events says so, and its
rollouts record it (their never-viewed suggestions are then no reject: docs/REWARD.md)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine
from tabloop.core.tables import rollouts


@pytest.mark.parametrize("mode", ["embedded"])
def test_reports_views_is_recorded_with_the_rollout(served: Any, key_factory: Any) -> None:
    headers = {"Authorization": f"Bearer {key_factory('ingest')}"}
    body = {"user_id": "u-1", "prefix": "def f(x):\n    return "}
    ids = {}
    with httpx.Client(base_url=served.url, headers=headers, timeout=30) as c:
        for given in (True, False, None):
            extra = {} if given is None else {"reports_views": given}
            r = c.post("/v1/complete", json={**body, **extra})
            assert r.status_code == 200, r.text
            ids[r.json()["suggestion_id"]] = bool(given)
        for bad in ("yes", 1, None):
            r = c.post("/v1/complete", json={**body, "reports_views": bad})
            assert r.status_code == 422 and "reports_views" in r.json()["error"]["message"]
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        query = sa.select(rollouts.c.suggestion_id, rollouts.c.reports_views)
        got = dict(conn.execute(query).all())
    engine.dispose()
    assert got == ids
