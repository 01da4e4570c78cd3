"""settled_texts: the latest code_settled text per suggestion, on a real database of each mode
(the `engine` of tests/service/conftest.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from service.events.ingest import ingest_events
from service.events.schemas import parse_event
from tabloop.core.settled import settled_texts
from tabloop.core.tables import events, rollouts
from tabloop.testing.factories import event

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def rollout(engine: sa.Engine, user: str = "u-1", *, shown: bool = True) -> str:
    sid = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            rollouts.insert().values(
                suggestion_id=sid,
                user_id=user,
                policy_version=1,
                created_at=T0,
                context_token_ids=[1],
                heal_text="",
                token_ids=[2] if shown else [],
                token_logprobs=[-0.1] if shown else [],
                text="return x" if shown else "",
                shown=shown,
                gate_prob_show=0.9 if shown else 0.1,
                decision_logprob=-0.1,
                logprob_total=-0.2,
                temperature=0.7,
                top_p=0.95,
                stop_reason="eol",
                latency_ms=1.0,
            )
        )
    return sid


def settle(
    engine: sa.Engine,
    sid: str,
    text: str,
    *,
    occurred: float,
    received: float,
    user: str = "u-1",
    event_id: str | None = None,
) -> None:
    """A stored code_settled report, `occurred` and `received` seconds after T0."""
    occurred_at = T0 + timedelta(seconds=occurred)
    ev = parse_event(
        event(
            "code_settled",
            user_id=user,
            suggestion_id=sid,
            text=text,
            after_seconds=occurred,
            occurred_at=occurred_at.isoformat(),
            event_id=event_id or str(uuid.uuid4()),
        )
    )
    with engine.begin() as conn:
        conn.execute(
            events.insert().values(
                event_id=ev["event_id"],
                type="code_settled",
                user_id=user,
                suggestion_id=sid,
                occurred_at=occurred_at,
                received_at=T0 + timedelta(seconds=received),
                payload=ev,
            )
        )


def test_latest_report_per_suggestion(engine: sa.Engine) -> None:
    by_time, tie, emptied, none_yet = (rollout(engine) for _ in range(4))
    abstained = rollout(engine, shown=False)  # a suggestion not shown has a settled line too
    settle(engine, by_time, "late in time", occurred=60, received=61)
    settle(engine, by_time, "early in time, received last", occurred=30, received=500)
    settle(engine, tie, "received first", occurred=30, received=31)
    settle(engine, tie, "received second", occurred=30, received=40)
    settle(engine, emptied, "x = 1", occurred=10, received=11)
    settle(engine, emptied, "", occurred=20, received=21)  # the rest of the line was deleted
    settle(engine, abstained, "y", occurred=5, received=6)

    asked = [by_time, tie, emptied, abstained, none_yet, str(uuid.uuid4())]
    assert settled_texts(engine, suggestion_ids=asked) == {
        by_time: "late in time",
        tie: "received second",
        emptied: "",
        abstained: "y",
    }
    with engine.connect() as conn:  # a connection does as well as an engine
        assert settled_texts(conn, suggestion_ids=iter([tie, tie])) == {tie: "received second"}


@pytest.mark.parametrize(
    "case", ["no ids", "other user's report", "no rollout", "only other event types"]
)
def test_nothing_to_return(engine: sa.Engine, case: str) -> None:
    sid = rollout(engine)
    if case == "other user's report":
        settle(engine, sid, "not theirs", occurred=5, received=6, user="u-2")
    elif case == "no rollout":
        orphan = str(uuid.uuid4())
        settle(engine, orphan, "orphan", occurred=5, received=6)
        sid = orphan
    elif case == "only other event types":
        now = datetime.now(UTC)  # served just now: its feedback is not late
        with engine.begin() as conn:
            conn.execute(
                rollouts.update().where(rollouts.c.suggestion_id == sid).values(created_at=now)
            )
        at = now.isoformat()
        ok = ingest_events(
            engine,
            [
                event("accept", suggestion_id=sid, occurred_at=at),
                event("code_retained", suggestion_id=sid, occurred_at=at),
            ],
            api_key_id=None,
            max_event_bytes=16384,
            embedded=True,
        )
        assert ok.accepted == 2
    ids = [] if case == "no ids" else [sid]
    assert settled_texts(engine, suggestion_ids=ids) == {}


def test_many_ids_are_read_in_chunks(engine: sa.Engine) -> None:
    reported = [rollout(engine) for _ in range(3)]
    for i, sid in enumerate(reported):
        settle(engine, sid, f"line {i}", occurred=i, received=i)
    asked = [str(uuid.uuid4()) for _ in range(2500)]
    asked[10], asked[1500], asked[2499] = reported
    assert settled_texts(engine, suggestion_ids=asked) == {
        sid: f"line {i}" for i, sid in enumerate(reported)
    }


def test_ingested_reports_are_read_back(engine: sa.Engine) -> None:
    """Through the ingestion path, as the API stores them."""
    sid = rollout(engine)
    text = "    return {k: v for k, v in items}  # ünïcode ✓"
    result = ingest_events(
        engine,
        [event("code_settled", suggestion_id=sid, text=text)],
        api_key_id=None,
        max_event_bytes=16384,
        embedded=True,
    )
    assert result.accepted == 1
    assert settled_texts(engine, suggestion_ids=[sid]) == {sid: text}
