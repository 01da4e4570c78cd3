"""Property tests of event parsing and the batch endpoint: any JSON (or bytes) at all ends in a
parsed event or a ValueError, and over HTTP in a 202 with every event accounted for, or a 4xx;
never a 500."""

from __future__ import annotations

import json
import string
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service.events.schemas import EVENT_TYPES, parse_event
from tabloop.core.tables import dead_letters, events
from tabloop.testing.factories import event

FUZZ = settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

# Text with everything JSON can carry: lone surrogates, NUL, control characters.
any_text = st.text(st.characters(exclude_categories=()), max_size=40)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(10**400), 10**400)
    | st.floats()
    | any_text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
extreme_times = st.builds(
    lambda dt, minutes: dt.replace(tzinfo=timezone(timedelta(minutes=minutes))).isoformat(),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59)),
    st.integers(-23 * 60 - 59, 23 * 60 + 59),
)
YEAR_ZERO = "0001-01-01T00:00:00+01:00"  # in year 0 once in UTC: was an OverflowError, a 500
FIELDS = (
    "event_id",
    "type",
    "user_id",
    "occurred_at",
    "suggestion_id",
    "accepted_chars",
    "after_seconds",
    "retained_fraction",
    "text",
    "from_model",
    "to_model",
    "reason",
    "extra",
)


@st.composite
def mutated_events(draw: Any) -> Any:
    """A valid event with some fields replaced, removed or added."""
    ev = event(draw(st.sampled_from(EVENT_TYPES)))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(FIELDS))
        choice = draw(st.integers(0, 3))
        if choice == 0:
            ev.pop(name, None)
        elif choice == 1:
            ev[name] = draw(extreme_times | st.text(string.printable, max_size=30))
        else:
            ev[name] = draw(json_values)
    return ev


def check_parse(raw: Any) -> None:
    try:
        parsed = parse_event(raw)
    except ValueError as e:
        assert str(e), "a refusal must say why"
        return
    assert parsed["type"] in EVENT_TYPES
    assert parse_event(parsed) == parsed  # normalized output parses to itself
    assert parsed["occurred_at"].endswith("Z")


@FUZZ
@given(raw=json_values)
def test_parse_event_any_json(raw: Any) -> None:
    check_parse(raw)


@FUZZ
@given(raw=mutated_events())
@example(raw=event(occurred_at=YEAR_ZERO))
@example(raw=event(occurred_at="9999-12-31T23:59:59-01:00"))  # year 10000 in UTC
@example(raw=event("code_retained", retained_fraction=float("nan")))
@example(raw=event("accept", accepted_chars=10**1000))
def test_parse_event_mutated_events(raw: Any) -> None:
    check_parse(raw)


@pytest.mark.parametrize("mode", ["embedded"])
def test_batch_endpoint_any_body(service: Any, key_factory: Any, engine: sa.Engine) -> None:
    """Arbitrary bodies, batches of arbitrary values and of mutated events: a 202 accounts for
    every event (accepted + duplicates + rejected) and dead-letters exactly the rejected ones;
    anything else is a 4xx that stores nothing."""
    token = key_factory("ingest")
    bodies = (
        st.binary(max_size=200)
        | json_values.map(lambda v: json.dumps(v).encode())
        | st.lists(json_values | mutated_events(), max_size=6).map(
            lambda evs: json.dumps({"events": evs}).encode()
        )
    )

    def stored() -> tuple[int, int]:
        with engine.connect() as conn:
            return (
                conn.execute(sa.select(sa.func.count()).select_from(events)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one(),
            )

    with httpx.Client(
        base_url=service.url,
        timeout=30,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    ) as c:

        @settings(FUZZ, max_examples=150)
        @given(body=bodies)
        @example(body=json.dumps({"events": [event(occurred_at=YEAR_ZERO)]}).encode())
        def run(body: bytes) -> None:
            before = stored()
            r = c.post("/v1/events", content=body)
            after = stored()
            assert r.status_code in (202, 400, 413, 422), (r.status_code, r.text, body[:300])
            if r.status_code != 202:
                assert set(r.json()["error"]) == {"code", "message"}
                assert after == before, "a refused body stored something"
                return
            sent = json.loads(body)["events"]
            result = r.json()
            assert result["accepted"] + result["duplicates"] + len(result["rejected"]) == len(sent)
            assert after[0] - before[0] == result["accepted"]
            assert after[1] - before[1] == len(result["rejected"])

        run()
