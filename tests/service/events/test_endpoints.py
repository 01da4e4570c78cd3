"""POST /v1/events over a real socket, in embedded (SQLite) and full (PostgreSQL) mode."""

from __future__ import annotations

import gzip
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from service.events.schemas import EVENT_TYPES
from tabloop.core.stream.topics import FEEDBACK
from tabloop.core.tables import dead_letters, events, outbox
from tabloop.testing.factories import event


def post(client: httpx.Client, evs: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/events", json={"events": evs})


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]), body
    if code:
        assert body["error"]["code"] == code, body
    return body["error"]  # type: ignore[no-any-return]


def count(engine: sa.Engine, table: sa.Table, *where: Any) -> int:
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(table).where(*where)
        return conn.execute(query).scalar_one()


def test_every_type_is_recorded_with_its_outbox_row(
    client: httpx.Client, engine: sa.Engine
) -> None:
    evs = [event(t) for t in EVENT_TYPES]
    r = post(client, evs)
    assert r.status_code == 202, r.text
    assert r.json() == {"accepted": len(EVENT_TYPES), "duplicates": 0, "rejected": []}
    ids = [e["event_id"] for e in evs]
    assert count(engine, events, events.c.event_id.in_(ids)) == len(EVENT_TYPES)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(outbox).where(outbox.c.topic == FEEDBACK)).all()
    payloads = [orjson.loads(r.payload) for r in rows]
    assert sorted(p["event_id"] for p in payloads) == sorted(ids)
    assert all(p["schema_version"] == 1 for p in payloads)
    assert {r.key for r in rows} == {"u-1"}


def test_partial_success_reports_bad_events_by_index_and_dead_letters_them(
    client: httpx.Client, engine: sa.Engine
) -> None:
    bad_fraction = event("code_retained", retained_fraction=2.0)
    bad_type = {"type": "teleport", "user_id": "u-1"}
    batch = [event("accept"), event("reject"), bad_fraction, event("churn"), "nonsense", bad_type]
    r = post(client, batch)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["accepted"] == 3 and body["duplicates"] == 0
    assert [x["index"] for x in body["rejected"]] == [2, 4, 5]
    assert "retained_fraction" in body["rejected"][0]["error"]
    assert "JSON object" in body["rejected"][1]["error"]
    assert "type: must be one of" in body["rejected"][2]["error"]
    with engine.connect() as conn:
        dead = conn.execute(sa.select(dead_letters).order_by(dead_letters.c.id)).all()
    assert [orjson.loads(d.raw) for d in dead] == [bad_fraction, "nonsense", bad_type]
    assert all(d.error and d.source == "events" for d in dead)
    assert count(engine, events) == 3


def test_code_settled_is_stored_and_queued_with_its_text(
    client: httpx.Client, engine: sa.Engine
) -> None:
    """For any suggestion (the service does not check that it was shown or accepted); after_seconds
    may be an integer; an empty text is a report too."""
    settled = event("code_settled", after_seconds=30, text="total / count  # avg")
    emptied = event("code_settled", after_seconds=2.5, text="")
    r = post(client, [settled, emptied])
    assert r.json() == {"accepted": 2, "duplicates": 0, "rejected": []}
    with engine.connect() as conn:
        row = conn.execute(sa.select(events).where(events.c.event_id == settled["event_id"])).one()
        queued = conn.execute(sa.select(outbox.c.topic, outbox.c.key, outbox.c.payload)).all()
    assert row.type == "code_settled" and row.suggestion_id == settled["suggestion_id"]
    assert row.payload["text"] == "total / count  # avg" and row.payload["after_seconds"] == 30
    messages = {
        orjson.loads(q.payload)["event_id"]: (q.topic, q.key, orjson.loads(q.payload))
        for q in queued
    }
    topic, key, message = messages[settled["event_id"]]
    assert (topic, key) == (FEEDBACK, "u-1")
    assert message == {"schema_version": 1, **settled, "after_seconds": 30.0}
    assert messages[emptied["event_id"]][2]["text"] == ""


def test_bad_code_settled_events_are_rejected_by_index_naming_the_field(
    client: httpx.Client, engine: sa.Engine
) -> None:
    """A batch of only bad code_settled events is still a 202 (the batch contract): each one is
    reported by index with the field named, and dead-lettered; nothing is recorded."""
    batch = [
        event("code_settled", text="x" * 1001),
        event("code_settled", after_seconds=-1),
        event("code_settled", suggestion_id=None),
        event("code_settled", text=17),
        event("code_settled", text="a\x00b"),
    ]
    r = post(client, batch)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["accepted"] == 0 and body["duplicates"] == 0
    assert [x["index"] for x in body["rejected"]] == [0, 1, 2, 3, 4]
    named = [x["error"].split(":")[0] for x in body["rejected"]]
    assert named == ["text", "after_seconds", "suggestion_id", "text", "text"]
    assert count(engine, events) == 0 and count(engine, outbox) == 0
    assert count(engine, dead_letters) == 5


def test_duplicates_within_and_across_batches_are_stored_once(
    client: httpx.Client, engine: sa.Engine
) -> None:
    first = event("accept")
    r1 = post(client, [first, first, event("reject")])
    assert r1.json() == {"accepted": 2, "duplicates": 1, "rejected": []}
    upper = dict(first, event_id=first["event_id"].upper())  # the same UUID, spelled differently
    r2 = post(client, [upper, event("churn")])
    assert r2.json() == {"accepted": 1, "duplicates": 1, "rejected": []}
    r3 = post(client, [first])
    assert r3.json() == {"accepted": 0, "duplicates": 1, "rejected": []}
    assert count(engine, events, events.c.event_id == first["event_id"]) == 1
    assert count(engine, events) == 3
    assert count(engine, outbox) == 3


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"[1, 2]", 422),
        (b'{"events": 5}', 422),
        (b"{}", 422),
        (b"null", 422),
        (b"this is not json", 400),
        (b'{"events": [', 400),
        (b"\xff\xfe\xfa", 400),
    ],
)
def test_not_a_batch(client: httpx.Client, body: bytes, status: int) -> None:
    r = client.post("/v1/events", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, status)


def test_empty_batch_is_fine(client: httpx.Client) -> None:
    assert post(client, []).json() == {"accepted": 0, "duplicates": 0, "rejected": []}


def test_size_limits(settings_factory: Any, service_factory: Any, key_factory: Any) -> None:
    settings = settings_factory(max_events_per_batch=10, max_body_bytes=65536, max_event_bytes=1024)
    svc = service_factory(settings)
    token = key_factory("ingest")
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}) as c:
        assert_error(post(c, [event() for _ in range(11)]), 413, "too_large")
        assert_error(post(c, [event(pad="z" * 15000) for _ in range(5)]), 413, "too_large")
        oversized = event("churn", reason="x" * 400, user_id="y" * 256) | {"pad": "z" * 900}
        r = post(c, [event(), oversized])
        assert r.status_code == 202 and r.json()["rejected"][0]["index"] == 1
        assert "limit is 1024" in r.json()["rejected"][0]["error"]

        ok = gzip.compress(orjson.dumps({"events": [event(), event()]}))
        r = c.post(
            "/v1/events",
            content=ok,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert r.status_code == 202 and r.json()["accepted"] == 2
        bomb = gzip.compress(b'{"events": [' + b" " * 60_000_000 + b"]}")
        assert len(bomb) < 65536
        assert_error(
            c.post("/v1/events", content=bomb, headers={"Content-Encoding": "gzip"}),
            413,
            "too_large",
        )
        assert_error(
            c.post("/v1/events", content=b"garbage", headers={"Content-Encoding": "gzip"}),
            400,
            "bad_encoding",
        )
        assert_error(
            c.post("/v1/events", content=b"{}", headers={"Content-Encoding": "br"}),
            415,
            "unsupported_encoding",
        )


def test_auth_and_scopes(service: Any, key_factory: Any) -> None:
    ingest, deploy, admin = key_factory("ingest"), key_factory("deploy"), key_factory("admin")
    body = {"events": [event()]}

    def call(method: str, path: str, token: str | None, json: Any = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, service.url + path, headers=headers, json=json)

    assert_error(call("POST", "/v1/events", None, body), 401, "unauthorized")
    assert_error(call("POST", "/v1/events", "tlk_nope_nope", body), 401)
    assert_error(call("POST", "/v1/events", "garbage", body), 401)
    assert_error(call("POST", "/v1/events", ingest[:-2] + "xx", body), 401)
    basic = {"Authorization": "Basic " + ingest}
    r = httpx.post(service.url + "/v1/events", json=body, headers=basic)
    assert_error(r, 401)
    assert_error(call("POST", "/v1/events", deploy, body), 403, "forbidden")
    assert_error(call("POST", "/v1/events", admin, body), 403)
    assert call("POST", "/v1/events", ingest, body).status_code == 202

    assert_error(call("GET", "/admin/keys", ingest), 403)
    listed = call("GET", "/admin/keys", admin)
    assert listed.status_code == 200
    assert all("token" not in k and "secret_sha256" not in k for k in listed.json())
    made = call("POST", "/admin/keys", admin, {"name": "plugin", "scopes": ["ingest"]})
    assert made.status_code == 201
    new_token = made.json()["token"]
    assert call("POST", "/v1/events", new_token, {"events": [event()]}).status_code == 202
    assert call("DELETE", f"/admin/keys/{made.json()['id']}", admin).status_code == 200
    assert_error(call("POST", "/v1/events", new_token, {"events": [event()]}), 401)
    assert_error(call("DELETE", "/admin/keys/doesnotexist", admin), 404)
    assert_error(call("POST", "/admin/keys", admin, {"name": "x", "scopes": ["root"]}), 422)


def test_rate_limit_answers_429_with_retry_after(
    settings_factory: Any, service_factory: Any, key_factory: Any
) -> None:
    svc = service_factory(settings_factory(rate_limit_per_s=0.5, rate_limit_burst=3))
    token, other = key_factory("ingest"), key_factory("ingest")
    with httpx.Client(base_url=svc.url) as c:
        codes = [post_as(c, token).status_code for _ in range(5)]
        assert codes[:3] == [202, 202, 202] and codes[3:] == [429, 429]
        limited = post_as(c, token)
        assert_error(limited, 429, "rate_limited")
        assert int(limited.headers["Retry-After"]) >= 1
        assert post_as(c, other).status_code == 202  # limits are per key


def post_as(c: httpx.Client, token: str) -> httpx.Response:
    return c.post(
        "/v1/events", json={"events": [event()]}, headers={"Authorization": f"Bearer {token}"}
    )


def test_health_readiness_and_metrics(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    post(client, [event("reject"), {"bad": True}])
    text = client.get("/metrics").text
    assert 'tabloop_ingest_events_total{outcome="accepted",type="reject"}' in text
    assert 'tabloop_ingest_events_total{outcome="rejected",type="unknown"}' in text
    assert any(
        line.startswith("tabloop_http_request_duration_seconds_count{")
        and 'route="/v1/events"' in line
        and 'status="202"' in line
        for line in text.splitlines()
    )


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing"), 404, "not_found")
    assert_error(client.get("/v1/events"), 405)


def test_outbox_rows_follow_batch_order(client: httpx.Client, engine: sa.Engine) -> None:
    """The relay publishes by outbox id, so a user's events must be queued in the order sent."""
    stored = event("accept", user_id="u-order")
    assert post(client, [stored]).json()["accepted"] == 1
    batch = [event(t, user_id="u-order") for t in EVENT_TYPES * 6]
    batch.insert(7, stored)  # a repeat of a stored event: counted, not queued
    r = post(client, batch)
    assert r.json() == {"accepted": len(EVENT_TYPES) * 6, "duplicates": 1, "rejected": []}
    with engine.connect() as conn:
        rows = conn.execute(sa.select(outbox.c.payload).order_by(outbox.c.id)).all()
    queued = [orjson.loads(r.payload)["event_id"] for r in rows]
    assert queued == [stored["event_id"]] + [e["event_id"] for e in batch if e is not stored]


def test_events_json_text_cannot_hold_are_rejected_alone(client: httpx.Client) -> None:
    """A lone surrogate (legal in a JSON string escape, not storable as text) or NaN (accepted by
    Python's json) sinks its own event only; it never turns into a 500."""
    ok = orjson.dumps(event()).decode()
    surrogate = orjson.dumps(event(user_id="SURROGATE")).decode().replace("SURROGATE", "\\ud800")
    nan = orjson.dumps(event("code_retained")).decode().replace("0.75", "NaN")
    body = f'{{"events": [{surrogate}, {ok}, {nan}]}}'.encode()
    r = client.post("/v1/events", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 1
    assert [x["index"] for x in r.json()["rejected"]] == [0, 2]


def test_concurrent_batches_sharing_events_store_each_once(
    client: httpx.Client, engine: sa.Engine
) -> None:
    """Two clients retrying the same events in different orders at the same time: no deadlock
    (which would be a 503), every event stored and queued exactly once."""
    from concurrent.futures import ThreadPoolExecutor

    rounds = [
        [event(t, user_id=f"u-{i}") for i, t in enumerate(EVENT_TYPES * 4)] for _ in range(10)
    ]
    with ThreadPoolExecutor(2) as pool:
        for batch in rounds:
            a, b = pool.map(lambda evs: post(client, evs), [batch, batch[::-1]])
            assert a.status_code == b.status_code == 202, (a.text, b.text)
            assert a.json()["accepted"] + b.json()["accepted"] == len(batch)
    assert count(engine, events) == count(engine, outbox) == 10 * len(EVENT_TYPES) * 4
