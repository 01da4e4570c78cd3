"""Logs: one JSON object per line, the request id from X-Request-ID (or made) in the response
header and on every line of the request, one access line each, and no secrets or code in them."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.logs import RequestLog, _current, request_id_from, setup_logging

SECRET_PREFIX = "def leak_me_not(password):\n    return 'hunter2-"
SECRET_SUFFIX = "-do-not-log-this-suffix')\n"


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """Logging as `tabloop serve` sets it up (JSON), into a buffer; restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    setup_logging("INFO", "json", stream=buf)
    yield buf
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


def parsed(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_a_line_is_one_json_object_with_request_id_and_extras(log_lines: io.StringIO) -> None:
    log = logging.getLogger("tabloop.test")
    log.info("outside")
    token = _current.set(RequestLog("req-1"))
    try:
        log.warning("inside %s", "a request", extra={"rows": 3})
    finally:
        _current.reset(token)
    outside, inside = parsed(log_lines)
    assert set(outside) == {"time", "level", "logger", "message"}
    assert outside["logger"] == "tabloop.test" and outside["level"] == "INFO"
    assert inside["message"] == "inside a request" and inside["level"] == "WARNING"
    assert inside["request_id"] == "req-1" and inside["rows"] == 3
    assert inside["time"].startswith("20")  # ISO 8601


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("abc-123", True),
        ("0b6f1c1e-8a4e-4c3b-9d8e-2f1a3b4c5d6e", True),
        ("has space", False),
        ("line\nbreak", False),
        ("x" * 129, False),  # too long to echo and log
        ("", False),
        (None, False),
    ],
)
def test_request_id_is_the_clients_only_when_sane(sent: str | None, kept: bool) -> None:
    got = request_id_from(sent)
    assert (got == sent) is kept
    assert 1 <= len(got) <= 128


@pytest.mark.parametrize("mode", ["embedded"])
def test_requests_are_logged_with_their_id_and_never_the_token_or_code(
    served: Any, key_factory: Any, log_lines: io.StringIO
) -> None:
    token = key_factory("ingest")
    key_id = token.split("_")[1]
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.post(
            "/v1/complete?debug=1",
            headers={**auth, "X-Request-ID": "req-abc-123"},
            json={"user_id": "u-1", "prefix": SECRET_PREFIX, "suffix": SECRET_SUFFIX},
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-abc-123"
        made = c.post(
            "/v1/complete",
            headers={**auth, "X-Request-ID": "bad id <x>"},
            json={"user_id": "u-1", "prefix": SECRET_PREFIX},
        )
        made_id = made.headers["x-request-id"]
        assert made_id and made_id != "bad id <x>"
        unauth = c.get("/admin/keys", headers={"Authorization": "Bearer tlk_nope_wrong-secret"})
        assert unauth.status_code == 401 and unauth.headers["x-request-id"]

    lines = parsed(log_lines)  # every line parses as JSON
    access = {ln["request_id"]: ln for ln in lines if ln["logger"] == "tabloop.access"}
    first = access["req-abc-123"]
    assert first["method"] == "POST" and first["path"] == "/v1/complete"  # no query string
    assert first["status"] == 200 and first["duration_ms"] > 0 and first["key_id"] == key_id
    assert access[made_id]["status"] == 200
    failed = access[unauth.headers["x-request-id"]]
    assert failed["status"] == 401 and "key_id" not in failed

    text = log_lines.getvalue()
    secret = token.split("_", 2)[2]
    for leak in (token, secret, "wrong-secret", "leak_me_not", "hunter2", "do-not-log-this"):
        assert leak not in text, f"{leak!r} appeared in the logs"


SETTLED_MARKER = "settled_code_never_logged_7f3a"


@pytest.mark.parametrize("mode", ["embedded"])
def test_settled_text_is_never_logged(
    client: httpx.Client, engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """code_settled text, accepted or refused for any reason, reaches no log line (nor a
    rejected event's error): not from ingestion, the error handlers, the trainer's join (which
    logs records it cannot read) or the purge."""
    import orjson
    import sqlalchemy as sa

    from tabloop.core.reward_spec import RewardSpec
    from tabloop.core.stream.consumer import Record
    from tabloop.core.tables import outbox
    from tabloop.testing.factories import event
    from trainer.join import Join

    text = f"return {SETTLED_MARKER}(x)"
    caplog.set_level(logging.DEBUG)
    bad = [
        event("code_settled", text=text + "x" * 1000),  # too long
        event("code_settled", text=text + "\x00"),
        event("code_settled", text=text, after_seconds=-1),
        event("code_settled", text=text, suggestion_id=None),
        event("code_settled", text=text, note=text),  # unknown field, its value the code
        event("code_settled", text=text) | {"type": "code_setled"},
        event("accept", text=text),
    ]
    r = client.post("/v1/events", json={"events": [event("code_settled", text=text), *bad]})
    assert r.status_code == 202 and r.json()["accepted"] == 1, r.text
    assert len(r.json()["rejected"]) == len(bad)
    surrogate = orjson.dumps(event("code_settled", text=text + "SURROGATE")).decode()
    body = '{"events": [' + surrogate.replace("SURROGATE", "\\ud800") + "]}"
    r2 = client.post(
        "/v1/events", content=body.encode(), headers={"Content-Type": "application/json"}
    )
    assert r2.status_code == 202 and len(r2.json()["rejected"]) == 1, r2.text
    whole = client.post("/v1/events", json={"events": [], "settled": text})  # not a batch
    assert whole.status_code == 422 and "settled" in whole.json()["error"]["message"]
    for answer in (r, r2, whole):
        assert SETTLED_MARKER not in answer.text

    with engine.connect() as conn:
        published = conn.execute(sa.select(outbox.c.key, outbox.c.payload)).all()
    records = [
        Record("tabloop.feedback", 0, i, row.key, orjson.loads(row.payload))
        for i, row in enumerate(published)
    ]
    unreadable = {k: v for k, v in records[0].value.items() if k != "event_id"}
    records.append(Record("tabloop.feedback", 0, len(records), "u-1", unreadable))
    join = Join(engine, RewardSpec(), 1)
    join.add(records)
    assert join.stats.bad_records == 1  # logged as a warning, without the record's text
    assert client.delete("/admin/users/u-1").status_code == 200

    assert any(rec.name == "tabloop.access" for rec in caplog.records), "nothing was captured"
    assert any(rec.name == "trainer.join" and rec.levelname == "WARNING" for rec in caplog.records)
    for rec in caplog.records:
        assert SETTLED_MARKER not in rec.getMessage(), rec.name
        assert SETTLED_MARKER not in repr(vars(rec)), rec.name
    assert SETTLED_MARKER not in caplog.text
