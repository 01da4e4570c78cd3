"""Hostile and malformed requests over a real socket, in embedded and full mode: each gets its
status code, and nothing (or exactly the right thing) is stored. Complements the size, gzip and
not-a-batch cases in tests/service/events/test_endpoints.py."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from tabloop.core.tables import dead_letters, events, outbox, rollouts
from tabloop.testing.factories import event

JSON = {"Content-Type": "application/json"}


@pytest.fixture
def api(served: Any, key_factory: Any) -> Iterator[httpx.Client]:
    """A service with the tiny policy live (so /v1/complete answers), a small body limit."""
    token = key_factory("ingest")
    with httpx.Client(
        base_url=served.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
    ) as c:
        yield c


@pytest.fixture
def db(served: Any) -> Iterator[sa.Engine]:
    from tabloop.core.db import make_engine

    engine = make_engine(served.settings)
    yield engine
    engine.dispose()


def counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
            for t in (events, dead_letters, outbox, rollouts)
        }


def error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert set(r.json()) == {"error"}, r.text
    return r.json()["error"]["code"]  # type: ignore[no-any-return]


def batch_bytes(*evs: Any) -> bytes:
    return orjson.dumps({"events": list(evs)})


COMPLETE = {"user_id": "u-1", "prefix": "def f(x):\n    return "}

# (name, path, body, headers, status): refused outright, nothing stored
REFUSED = [
    ("deeply nested events", "/v1/events", b"[" * 100_000, JSON, 400),
    ("deeply nested complete", "/v1/complete", b'{"prefix": ' + b"[" * 100_000, JSON, 400),
    (
        "nested inside an event",
        "/v1/events",
        b'{"events": [' + b"[" * 50_000 + b"]" * 50_000 + b"]}",
        JSON,
        400,
    ),
    (
        "invalid UTF-8 in a string",
        "/v1/complete",
        b'{"user_id": "\xff\xfe", "prefix": "x"}',
        JSON,
        400,
    ),
    (
        "invalid UTF-8 in an event",
        "/v1/events",
        b'{"events": [{"user_id": "\xc3\x28"}]}',
        JSON,
        400,
    ),
    ("number past 4300 digits", "/v1/events", b'{"events": [' + b"9" * 5000 + b"]}", JSON, 400),
    (
        "huge max_new_tokens",
        "/v1/complete",
        orjson.dumps(COMPLETE)[:-1] + b', "max_new_tokens": 1' + b"0" * 1000 + b"}",
        JSON,
        422,
    ),
    (
        "1e400 max_new_tokens",
        "/v1/complete",
        orjson.dumps(COMPLETE)[:-1] + b', "max_new_tokens": 1e400}',
        JSON,
        422,
    ),
    ("NUL in prefix", "/v1/complete", orjson.dumps(dict(COMPLETE, prefix="a\x00b")), JSON, 422),
    ("NUL in user_id", "/v1/complete", orjson.dumps(dict(COMPLETE, user_id="u\x00")), JSON, 422),
    (
        "prefix over 1M characters",
        "/v1/complete",
        orjson.dumps(dict(COMPLETE, prefix="x" * 1_000_001)),
        JSON,
        422,
    ),
    ("unknown field in complete", "/v1/complete", orjson.dumps(dict(COMPLETE, top_k=5)), JSON, 422),
    (
        "unknown field beside events",
        "/v1/events",
        orjson.dumps({"events": [], "extra": 1}),
        JSON,
        422,
    ),
    (
        "form-encoded body",
        "/v1/events",
        b"events=1",
        {"Content-Type": "application/x-www-form-urlencoded"},
        422,
    ),
    (
        "text/plain body",
        "/v1/complete",
        orjson.dumps(COMPLETE),
        {"Content-Type": "text/plain"},
        422,
    ),
    (
        "gzip bomb to complete",
        "/v1/complete",
        gzip.compress(b'{"prefix": "' + b"x" * 50_000_000 + b'"}'),
        {**JSON, "Content-Encoding": "gzip"},
        413,
    ),
    (
        "gzip with trailing garbage",
        "/v1/events",
        gzip.compress(batch_bytes(event())) + b"garbage",
        {**JSON, "Content-Encoding": "gzip"},
        400,
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "headers", "status"), REFUSED, ids=[r[0] for r in REFUSED]
)
def test_refused_and_nothing_stored(
    api: httpx.Client,
    db: sa.Engine,
    name: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
) -> None:
    before = counts(db)
    r = api.post(path, content=body, headers=headers)
    error(r, status)
    assert counts(db) == before, name


def test_oversize_body_without_content_length(
    api: httpx.Client, db: sa.Engine, served: Any
) -> None:
    """Chunked upload, no Content-Length: stopped once the limit is read, not after."""
    limit = served.settings.max_body_bytes
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"events": ['
        while sent < 4 * limit:
            piece = orjson.dumps(event()) + b","
            sent += len(piece) * 100
            yield piece * 100
        yield b"{}]}"

    before = counts(db)
    try:
        r = api.post("/v1/events", content=chunks(), headers=JSON)
    except httpx.HTTPError:  # the server may close before the client finishes sending
        assert counts(db) == before
        return
    assert error(r, 413) == "too_large"
    assert counts(db) == before


def test_oversize_single_event_is_rejected_alone(
    api: httpx.Client, db: sa.Engine, served: Any
) -> None:
    big = event("churn", reason="x" * 500) | {"pad": "y" * served.settings.max_event_bytes}
    before = counts(db)
    r = api.post("/v1/events", content=batch_bytes(event(), big), headers=JSON)
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 1 and [x["index"] for x in r.json()["rejected"]] == [1]
    assert "limit is" in r.json()["rejected"][0]["error"]
    after = counts(db)
    assert after["events"] - before["events"] == 1
    assert after["dead_letters"] - before["dead_letters"] == 1


def test_huge_and_odd_numbers_in_events_are_rejected_alone(
    api: httpx.Client, db: sa.Engine
) -> None:
    """1e400 (infinity to Python's json), an integer of 1001 digits, NaN: each sinks only its own
    event, which is dead-lettered; the batch is a 202."""
    ok = orjson.dumps(event()).decode()
    inf = orjson.dumps(event("code_retained")).decode().replace("0.75", "1e400")
    big = orjson.dumps(event("accept")).decode().replace(":12", ":1" + "0" * 1000)
    assert "0" * 1000 in big
    nan = orjson.dumps(event("code_retained")).decode().replace("0.75", "NaN")
    body = f'{{"events": [{inf}, {ok}, {big}, {nan}]}}'.encode()
    before = counts(db)
    r = api.post("/v1/events", content=body, headers=JSON)
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 1
    assert [x["index"] for x in r.json()["rejected"]] == [0, 2, 3]
    after = counts(db)
    assert after["events"] - before["events"] == 1
    assert after["dead_letters"] - before["dead_letters"] == 3


def test_nul_and_surrogates_in_keys_and_values_are_rejected_alone(
    api: httpx.Client, db: sa.Engine
) -> None:
    """PostgreSQL text holds neither NUL nor a lone surrogate: such an event is rejected and
    dead-lettered (its error text escaped), and the rest of the batch is stored."""
    evs = [
        json.dumps(event(user_id="u\x00")),
        json.dumps(event() | {"k\x00": 1}),
        json.dumps(event() | {"SURROGATE": 1}).replace("SURROGATE", "\\udc80"),
        json.dumps(event()),
    ]
    before = counts(db)
    r = api.post(
        "/v1/events", content=('{"events": [' + ", ".join(evs) + "]}").encode(), headers=JSON
    )
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 1
    assert [x["index"] for x in r.json()["rejected"]] == [0, 1, 2]
    assert "unknown field" in r.json()["rejected"][1]["error"]
    after = counts(db)
    assert after["events"] - before["events"] == 1
    assert after["dead_letters"] - before["dead_letters"] == 3


def test_code_settled_text_is_stored_exactly_or_rejected_alone(
    api: httpx.Client, db: sa.Engine
) -> None:
    """Settled text is code: 1,000 characters of anything text can hold (4-byte characters,
    quotes, backslashes, control characters) are stored as sent; NUL, a lone surrogate, one
    character more, or a number where the text goes sink only their own event, naming `text`."""
    text = ('😀"\\\t\x01é' * 200)[:1000]
    ok = event("code_settled", text=text)
    evs = [
        json.dumps(ok),
        json.dumps(event("code_settled", text="a\x00b")),
        json.dumps(event("code_settled", text="SURROGATE")).replace("SURROGATE", "\\udc80"),
        json.dumps(event("code_settled", text=text + "x")),
        json.dumps(event("code_settled", text=1.5)),
    ]
    before = counts(db)
    r = api.post(
        "/v1/events", content=('{"events": [' + ", ".join(evs) + "]}").encode(), headers=JSON
    )
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 1
    rejected = r.json()["rejected"]
    assert [x["index"] for x in rejected] == [1, 2, 3, 4]
    assert all(x["error"].startswith("text: ") for x in (rejected[0], *rejected[2:])), rejected
    after = counts(db)
    assert after["events"] - before["events"] == 1
    assert after["dead_letters"] - before["dead_letters"] == 4
    with db.connect() as conn:
        stored = conn.execute(
            sa.select(events.c.payload).where(events.c.event_id == ok["event_id"])
        ).scalar_one()
    assert stored["text"] == text


def test_duplicate_json_keys_last_one_wins(api: httpx.Client, db: sa.Engine) -> None:
    """JSON objects with a repeated name (RFC 8259 leaves it to the parser): the last value is
    the one used, as by Python's json and orjson, at every level."""
    ev = event("reject", user_id="u-first")
    text = json.dumps(ev)[:-1] + ', "user_id": "u-last"}'
    body = f'{{"events": [{{"bogus": 1}}], "events": [{text}]}}'.encode()
    r = api.post("/v1/events", content=body, headers=JSON)
    assert r.status_code == 202 and r.json() == {"accepted": 1, "duplicates": 0, "rejected": []}
    with db.connect() as conn:
        stored = conn.execute(
            sa.select(events.c.user_id).where(events.c.event_id == ev["event_id"])
        ).scalar_one()
    assert stored == "u-last"

    body = orjson.dumps(COMPLETE)[:-1] + b', "user_id": "u-last"}'
    r = api.post("/v1/complete", content=body, headers=JSON)
    assert r.status_code == 200, r.text
    with db.connect() as conn:
        user = conn.execute(
            sa.select(rollouts.c.user_id).where(
                rollouts.c.suggestion_id == r.json()["suggestion_id"]
            )
        ).scalar_one()
    assert user == "u-last"


def test_context_beyond_the_caps_is_cut_and_stored_bounded(
    api: httpx.Client, db: sa.Engine, served: Any
) -> None:
    """A prefix and suffix past TABLOOP_MAX_PREFIX_CHARS/_SUFFIX_CHARS (up to 1M characters
    each) are cut, not refused: the rollout keeps a bounded context."""
    prefix = "x = 1\n" * 100_000 + "y = "
    r = api.post("/v1/complete", json=dict(COMPLETE, prefix=prefix, suffix="z\n" * 200_000))
    assert r.status_code == 200, r.text
    with db.connect() as conn:
        row = conn.execute(
            sa.select(rollouts).where(rollouts.c.suggestion_id == r.json()["suggestion_id"])
        ).one()
    # token ids of at most max_prefix_chars + max_suffix_chars characters
    assert len(row.context_token_ids) <= (
        served.settings.max_prefix_chars + served.settings.max_suffix_chars
    )
