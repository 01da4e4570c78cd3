"""A Tabby completion belongs to the key that asked for it: its events count only through that
key (service/events/trust.py), whichever API served it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine
from tabloop.core.tables import dead_letters, events
from tests.service.tabby.conftest import PREFIX_ADD


@pytest.fixture
def bob(served: Any, key_factory: Any) -> Iterator[httpx.Client]:
    """Another ingest key on the same service (the Tabby API and the native one)."""
    token = key_factory("ingest", name="bob")
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as c:
        yield c


def tabby_complete(c: httpx.Client) -> str:
    r = c.post(
        "/v1/completions",
        json={"language": "python", "segments": {"prefix": PREFIX_ADD, "suffix": "\n"}},
    )
    assert r.status_code == 200 and r.json()["choices"], r.text
    return r.json()["id"]  # type: ignore[no-any-return]


def tabby_event(c: httpx.Client, path: str, completion_id: str, type_: str) -> dict[str, Any]:
    r = c.post(path, json={"type": type_, "completion_id": completion_id, "choice_index": 0})
    assert r.status_code == 202, r.text
    return r.json()  # type: ignore[no-any-return]


def stored(served: Any) -> tuple[list[Any], list[Any]]:
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        evs = list(conn.execute(sa.select(events)).all())
        dead = list(conn.execute(sa.select(dead_letters).order_by(dead_letters.c.id)).all())
    engine.dispose()
    return evs, dead


def test_events_about_a_completion_count_only_through_its_key(
    tabby: httpx.Client, bob: httpx.Client, served: Any
) -> None:
    completion_id = tabby_complete(tabby)
    for type_ in ("view", "select", "dismiss"):
        body = tabby_event(bob, "/tabby/v1/events", completion_id, type_)
        assert body["accepted"] == 0, body
        assert body["rejected"][0]["error"].startswith("refused (wrong_key): "), body
    evs, dead = stored(served)
    assert evs == [] and len(dead) == 3
    assert all(d.source == "tabby" and d.error.startswith("refused (wrong_key)") for d in dead)
    assert [orjson.loads(d.raw)["type"] for d in dead] == ["view", "accept", "reject"]

    for type_ in ("view", "select"):  # the owner's own events
        assert tabby_event(tabby, "/v1/events", completion_id, type_)["accepted"] == 1
    evs, _ = stored(served)
    assert sorted(e.type for e in evs) == ["accept", "view"]


def test_a_native_completion_takes_no_tabby_event_from_another_key(
    tabby: httpx.Client, bob: httpx.Client, served: Any
) -> None:
    """Served by /v1/complete to bob's key: a Tabby event about it from another key is refused."""
    r = bob.post("/v1/complete", json={"user_id": "u-1", "prefix": PREFIX_ADD})
    assert r.status_code == 200 and r.json()["shown"], r.text
    completion_id = r.json()["suggestion_id"]
    body = tabby_event(tabby, "/v1/events", completion_id, "select")
    assert body["rejected"][0]["error"].startswith("refused (wrong_key)")
    assert tabby_event(bob, "/tabby/v1/events", completion_id, "select")["accepted"] == 1
