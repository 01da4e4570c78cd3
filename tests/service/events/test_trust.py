"""Feedback that counts: a suggestion's own key and person, and plausible timing
(service/events/trust.py), over real sockets through the native and OpenAI-style APIs.

A refused event is answered in `rejected` by index with its reason, kept in dead_letters, never
stored as an event or queued for the trainer, never part of a reward, and counted in
tabloop_feedback_refused_total{reason}.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY

from service.events.trust import refusal_reason
from tabloop.core.db import make_engine
from tabloop.core.reward import CLOCK_SKEW_S
from tabloop.core.reward_store import current_spec, reward_from_db, rollout_info
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
from tabloop.core.tables import dead_letters, events, outbox, rollouts
from tabloop.testing.factories import event, rollout_row

PREFIX = "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.re"
SUGGESTION_TYPES = ("view", "accept", "reject", "code_retained", "code_settled")


@pytest.fixture
def served_overrides(showing_checkpoint: Path) -> dict[str, Any]:
    return {"base_checkpoint": showing_checkpoint}


@pytest.fixture
def clients(served: Any, key_factory: Any) -> Any:
    """(alice, bob, admin): two ingest keys and an admin one, on the running service."""
    made = []
    for scopes, name in ((("ingest",), "alice"), (("ingest",), "bob"), (("admin",), "ops")):
        token = key_factory(*scopes, name=name)
        made.append(
            httpx.Client(
                base_url=served.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
            )
        )
    yield tuple(made)
    for c in made:
        c.close()


def now_z(delta_s: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=delta_s)).isoformat().replace("+00:00", "Z")


def shown_suggestion(c: httpx.Client, user: str = "u-1") -> str:
    for _ in range(10):  # shown unless the first token ends the line
        r = c.post("/v1/complete", json={"user_id": user, "prefix": PREFIX, "max_new_tokens": 8})
        assert r.status_code == 200, r.text
        if r.json()["shown"]:
            return r.json()["suggestion_id"]  # type: ignore[no-any-return]
    raise AssertionError("the policy showed nothing in 10 tries")


def abstained_suggestion(c: httpx.Client, user: str = "u-1") -> str:
    """A request in a language the policy was not trained on: recorded, nothing shown."""
    r = c.post("/v1/complete", json={"user_id": user, "prefix": "fn main() {", "language": "rust"})
    assert r.status_code == 200 and not r.json()["shown"], r.text
    return r.json()["suggestion_id"]  # type: ignore[no-any-return]


def feedback(type_: str, sid: str, user: str = "u-1", **fields: Any) -> dict[str, Any]:
    return event(type_, user_id=user, suggestion_id=sid, **{"occurred_at": now_z(), **fields})


def post(c: httpx.Client, evs: list[dict[str, Any]]) -> dict[str, Any]:
    r = c.post("/v1/events", json={"events": evs})
    assert r.status_code == 202, r.text
    return r.json()  # type: ignore[no-any-return]


def refused(reason: str) -> float:
    value = REGISTRY.get_sample_value("tabloop_feedback_refused_total", {"reason": reason})
    return value or 0.0


class Db:
    def __init__(self, served: Any) -> None:
        self.engine = make_engine(served.settings)
        self.profile = served.settings.profile

    def stored(self, *event_ids: str) -> set[str]:
        with self.engine.connect() as conn:
            ids = set(
                conn.execute(
                    sa.select(events.c.event_id).where(events.c.event_id.in_(event_ids))
                ).scalars()
            )
            queued = {
                orjson.loads(p)["event_id"]
                for p in conn.execute(
                    sa.select(outbox.c.payload).where(outbox.c.topic == FEEDBACK)
                ).scalars()
            }
        assert ids == queued & set(event_ids), "an event is stored and queued, or neither"
        return ids

    def dead(self) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.select(dead_letters).order_by(dead_letters.c.id)).all())

    def execute(self, statement: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(statement)

    def reward(self, sid: str) -> Any:
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(rollouts).where(rollouts.c.suggestion_id == sid)).one()
            _version, spec = current_spec(conn, self.profile)
            return reward_from_db(conn, rollout_info(row), spec)


@pytest.fixture
def db(served: Any) -> Any:
    d = Db(served)
    yield d
    d.engine.dispose()


def test_the_rollout_records_the_key_that_asked(clients: Any, db: Db, served: Any) -> None:
    alice, bob, _ = clients
    sid = shown_suggestion(alice)
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(rollouts).where(rollouts.c.suggestion_id == sid)).one()
        keys = dict(conn.execute(sa.text("SELECT name, id FROM api_keys")).all())
        message = next(
            orjson.loads(p)
            for p in conn.execute(
                sa.select(outbox.c.payload).where(outbox.c.topic == ROLLOUTS)
            ).scalars()
            if orjson.loads(p)["suggestion_id"] == sid
        )
    assert row.api_key_id == keys["alice"]
    assert message["api_key_id"] == keys["alice"]  # the rollout message carries it too


def test_feedback_about_a_suggestion_counts_only_through_its_key(clients: Any, db: Db) -> None:
    """Every event type that names a suggestion, from another key: refused by index, dead-lettered
    with the reason, never stored, queued or joined. The same events from the owner count."""
    alice, bob, _ = clients
    sid = shown_suggestion(alice)
    evs = [feedback(t, sid) for t in SUGGESTION_TYPES]
    before = refused("wrong_key")
    body = post(bob, [event("churn", user_id="u-9"), *evs])
    assert body["accepted"] == 1 and body["duplicates"] == 0
    assert [r["index"] for r in body["rejected"]] == [1, 2, 3, 4, 5]
    assert all(r["error"].startswith("refused (wrong_key): ") for r in body["rejected"])
    assert refused("wrong_key") - before == len(SUGGESTION_TYPES)
    assert not db.stored(*[e["event_id"] for e in evs])
    dead = db.dead()
    assert [orjson.loads(d.raw) for d in dead] == evs
    assert all(d.source == "events" and d.error.startswith("refused (wrong_key)") for d in dead)
    assert db.reward(sid).outcome == "ignored"  # bob's accept is not part of the reward

    body = post(alice, evs)  # the same events (same ids) through the owner's key
    assert body == {"accepted": len(evs), "duplicates": 0, "rejected": []}
    assert db.stored(*[e["event_id"] for e in evs]) == {e["event_id"] for e in evs}


def test_a_persons_events_count_only_through_a_key_that_served_them(clients: Any, db: Db) -> None:
    """model_switch and churn name a person, not a suggestion: refused through a key that never
    served the person while another did; taken through one that did, and about a person no key
    has served yet. A model_switch naming a suggestion is not a valid event for any key. An
    unknown suggestion id is stored (it can count for no reward)."""
    alice, bob, _ = clients
    sid = shown_suggestion(alice, user="u-1")
    person = [
        event("model_switch", user_id="u-1", occurred_at=now_z()),
        event("churn", user_id="u-1", occurred_at=now_z()),
    ]
    before = refused("wrong_key")
    body = post(bob, person)
    assert body["accepted"] == 0 and [r["index"] for r in body["rejected"]] == [0, 1]
    assert all(
        r["error"].startswith("refused (wrong_key): user_id u-1 was served only")
        for r in body["rejected"]
    )
    assert refused("wrong_key") - before == 2
    assert not db.stored(*[e["event_id"] for e in person])
    assert post(alice, person) == {"accepted": 2, "duplicates": 0, "rejected": []}

    strangers = [
        event("model_switch", user_id="u-new", occurred_at=now_z()),
        event("churn", user_id="u-new", occurred_at=now_z()),
        feedback("accept", str(uuid.uuid4()), user="u-new"),
    ]
    assert post(bob, strangers) == {"accepted": 3, "duplicates": 0, "rejected": []}
    for c in (alice, bob):
        body = post(c, [event("model_switch", suggestion_id=sid, occurred_at=now_z())])
        assert body["accepted"] == 0
        assert body["rejected"][0]["error"] == "suggestion_id: unknown field"


def test_a_rollout_without_a_recorded_key_takes_feedback_from_any_key(clients: Any, db: Db) -> None:
    """Rows from before keys were recorded (api_key_id NULL): the other checks still apply."""
    alice, bob, _ = clients
    sid = shown_suggestion(alice)
    db.execute(rollouts.update().where(rollouts.c.suggestion_id == sid).values(api_key_id=None))
    ok, early = feedback("accept", sid), feedback("reject", sid, occurred_at=now_z(-3600))
    body = post(bob, [ok, early])
    assert body["accepted"] == 1
    assert [r["index"] for r in body["rejected"]] == [1]
    assert body["rejected"][0]["error"].startswith("refused (before_served)")
    assert db.reward(sid).outcome == "accepted"


def test_implausible_feedback_is_refused_with_its_reason(clients: Any, db: Db) -> None:
    alice, _bob, _ = clients
    sid, old, silent = shown_suggestion(alice), shown_suggestion(alice), abstained_suggestion(alice)
    # served an hour ago: past twice the (prod) 10-minute horizon
    db.execute(
        rollouts.update()
        .where(rollouts.c.suggestion_id == old)
        .values(created_at=datetime.now(UTC) - timedelta(hours=1))
    )
    cases = [  # (event, reason or None: counts)
        (feedback("accept", sid, user="u-2"), "wrong_user"),
        (feedback("accept", sid, occurred_at=now_z(-60)), "before_served"),
        (feedback("reject", sid, occurred_at=now_z(-CLOCK_SKEW_S + 2)), None),  # within skew
        (feedback("accept", silent), "not_shown"),
        (feedback("view", silent), "not_shown"),
        (feedback("reject", silent), "not_shown"),
        (feedback("code_retained", silent), "not_shown"),
        (feedback("code_settled", silent), None),  # for any request, shown or not
        (feedback("accept", old), "late"),
        (feedback("code_retained", old), "late"),
        (feedback("code_settled", old), None),  # never read by the reward: never late
    ]
    before = {r: refused(r) for r in ("wrong_user", "before_served", "not_shown", "late")}
    body = post(alice, [e for e, _ in cases])
    expected = [(i, reason) for i, (_, reason) in enumerate(cases) if reason]
    got = [(r["index"], refusal_reason(r["error"])) for r in body["rejected"]]
    assert got == expected, body["rejected"]
    assert body["accepted"] == len(cases) - len(expected)
    for reason in before:
        assert refused(reason) - before[reason] == sum(r == reason for _, r in expected)
    kept = {e["event_id"] for e, reason in cases if reason is None}
    assert db.stored(*[e["event_id"] for e, _ in cases]) == kept
    assert [orjson.loads(d.raw) for d in db.dead()] == [cases[i][0] for i, _ in expected]
    assert db.reward(sid).outcome == "rejected"  # the early accept and u-2's did not count


def test_an_openai_completion_takes_native_feedback_only_from_its_key(clients: Any, db: Db) -> None:
    alice, bob, _ = clients
    for _ in range(10):
        r = alice.post(
            "/openai/v1/completions", json={"prompt": PREFIX, "max_tokens": 8, "user": "u-42"}
        )
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["text"]:
            break
    sid = r.json()["id"]
    accept = feedback("accept", sid, user="u-42")
    body = post(bob, [accept])
    assert body["accepted"] == 0 and body["rejected"][0]["error"].startswith("refused (wrong_key)")
    assert db.reward(sid).outcome == "ignored"
    assert post(alice, [accept]) == {"accepted": 1, "duplicates": 0, "rejected": []}
    assert db.reward(sid).outcome == "accepted"


# what one batch may cost in SQL statements, whatever the number of people in it. SQLite: BEGIN
# IMMEDIATE, the trust checks' lookup, the privacy check of settled text, then the events, the
# outbox rows and the dead letters. PostgreSQL: the lookup, the privacy check, and one statement
# that writes events, outbox rows and dead letters in autocommit mode (service/events/). Both:
# with accepts or settled reports in the batch, the workspace memory's lookup of the documents
# they are about (tabloop/core/memory.py: settle), and its update when there are some.
BATCH_STATEMENTS = {"sqlite": 8, "postgresql": 5}


def test_a_batch_from_many_people_costs_a_bounded_number_of_statements(
    clients: Any, db: Db, served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One POST /v1/events of 100 events from 100 people, every verdict among them: people served
    through the sending key, through another key only, through none yet, and suggestions of the
    sender's own. The checks answer as one person at a time would, in a fixed number of SQL
    statements (counted on the API's engine, in the thread that ingests the batch)."""
    import threading

    import service.events.endpoints as endpoints

    alice, bob, _ = clients
    shown_suggestion(alice, user="warm-up")  # the keys' first lookups are cached before counting
    post(bob, [event("churn", user_id="warm-up", occurred_at=now_z())])
    with db.engine.connect() as conn:
        keys = dict(conn.execute(sa.text("SELECT name, id FROM api_keys")).all())
    own = [str(uuid.uuid4()) for _ in range(20)]
    db.execute(
        rollouts.insert().values(
            [
                *(rollout_row(user_id=f"p-{i}", api_key_id=keys["alice"]) for i in range(30)),
                *(rollout_row(user_id=f"p-{i}", api_key_id=keys["bob"]) for i in range(30, 60)),
                *(
                    rollout_row(sid, user_id=f"p-{80 + n}", api_key_id=keys["alice"])
                    for n, sid in enumerate(own)
                ),
            ]
        )
    )
    kinds = ("model_switch", "churn")
    evs = [event(kinds[i % 2], user_id=f"p-{i}", occurred_at=now_z()) for i in range(80)]
    evs += [feedback("reject", sid, user=f"p-{80 + n}") for n, sid in enumerate(own[:-1])]
    evs.append(feedback("code_settled", own[-1], user="p-99"))  # privacy mode's check of its text

    counting = threading.local()
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if getattr(counting, "on", False):
            statements.append(statement)

    def ingest_counted(*args: Any, **kwargs: Any) -> Any:
        counting.on = True
        try:
            return ingest(*args, **kwargs)
        finally:
            counting.on = False

    engine = served.app.state.ctx.engine
    ingest = endpoints.ingest_events
    monkeypatch.setattr(endpoints, "ingest_events", ingest_counted)
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        body = post(alice, evs)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert [r["index"] for r in body["rejected"]] == list(range(30, 60))
    assert all(
        r["error"].startswith(f"refused (wrong_key): user_id p-{r['index']} was served only")
        for r in body["rejected"]
    )
    assert body["accepted"] == 70
    assert 0 < len(statements) <= BATCH_STATEMENTS[engine.dialect.name], statements
