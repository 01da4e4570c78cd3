"""DELETE /admin/users/{id}: one person's rows go, another's stay, and a tombstone is sent."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import orjson
import sqlalchemy as sa

from tabloop.core.db import make_engine
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS, USER_PURGED
from tabloop.core.tables import dead_letters, events, outbox, rewards, rollouts, utcnow
from tabloop.testing.factories import event
from tabloop.testing.kafka import consume_all
from tests.service.codescan import publish

TABLES = {"rollouts": rollouts, "events": events, "rewards": rewards}


def _make_data(c: httpx.Client, engine: sa.Engine, user: str) -> list[str]:
    """Two rollouts with feedback and a reward each, plus a rejected event, for `user`."""
    sids = []
    for _ in range(2):
        r = c.post("/v1/complete", json={"user_id": user, "prefix": "def f(x):\n    return "})
        assert r.status_code == 200, r.text
        sids.append(r.json()["suggestion_id"])
    # code_settled: taken for any rollout, shown or not (this policy mostly abstains)
    batch = [
        event("code_settled", user_id=user, suggestion_id=s, occurred_at=utcnow().isoformat())
        for s in sids
    ]
    batch += [event("churn", user_id=user), {"type": "teleport", "user_id": user}]
    r = c.post("/v1/events", json={"events": batch})
    assert r.status_code == 202 and r.json()["accepted"] == 3, r.text
    with engine.begin() as conn:
        for s in sids:
            conn.execute(
                rewards.insert().values(
                    suggestion_id=s,
                    user_id=user,
                    policy_version=1,
                    rollout_created_at=utcnow(),
                    value=-0.25,
                    outcome="rejected",
                    components={},
                    spec_version=1,
                    finalized_at=utcnow(),
                )
            )
    return sids


def _counts(engine: sa.Engine, user: str) -> dict[str, int]:
    with engine.connect() as conn:
        out = {
            name: conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.user_id == user)
            ).scalar_one()
            for name, t in TABLES.items()
        }
        payloads = (
            conn.execute(sa.select(outbox.c.payload).where(outbox.c.key == user)).scalars().all()
        )
        out["outbox"] = sum(orjson.loads(p).get("type") != USER_PURGED for p in payloads)
        out["tombstones"] = len(payloads) - out["outbox"]
        raws = conn.execute(sa.select(dead_letters.c.raw)).scalars().all()
        out["dead_letters"] = sum(orjson.loads(r).get("user_id") == user for r in raws)
    return out


def test_purge_removes_one_user_only_and_sends_a_tombstone(
    served: Any, key_factory: Any, mode: str
) -> None:
    engine = make_engine(served.settings)
    gone, kept = f"u-gone/{uuid.uuid4().hex[:8]}", f"u-kept-{uuid.uuid4().hex[:8]}"
    token = key_factory("ingest", "admin")
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as c:
        _make_data(c, engine, gone)
        _make_data(c, engine, kept)
        before = _counts(engine, kept)
        assert before == {
            "rollouts": 2,
            "events": 3,
            "rewards": 2,
            "outbox": 5,
            "dead_letters": 1,
            "tombstones": 0,
        }
        assert _counts(engine, gone) == before

        r = c.delete(f"/admin/users/{gone}")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["user_id"] == gone and body["purged_at"].endswith("Z")
        assert body["removed"] == {
            "rollouts": 2,
            "events": 3,
            "rewards": 2,
            "outbox": 5,
            "dead_letters": 1,
            "workspace_code": 1,  # the document the person's requests left in the memory
        }
        assert _counts(engine, gone) == {
            "rollouts": 0,
            "events": 0,
            "rewards": 0,
            "outbox": 0,
            "dead_letters": 0,
            "tombstones": 2,
        }
        assert _counts(engine, kept) == before

        again = c.delete(f"/admin/users/{gone}")  # idempotent: nothing left, still 200
        assert again.status_code == 200
        assert set(again.json()["removed"].values()) == {0}
        unknown = c.delete("/admin/users/nobody-ever")
        assert unknown.status_code == 200 and set(unknown.json()["removed"].values()) == {0}

        ingest_only = key_factory("ingest")
        refused = c.delete(
            f"/admin/users/{kept}", headers={"Authorization": f"Bearer {ingest_only}"}
        )
        assert refused.status_code == 403
    assert _counts(engine, kept) == before

    with engine.connect() as conn:
        stones = conn.execute(
            sa.select(outbox.c.topic, outbox.c.payload, outbox.c.published_at)
            .where(outbox.c.key == gone)
            .order_by(outbox.c.id)  # the first purge's first: a table scan has no order
        ).all()
    assert sorted(s.topic for s in stones) == sorted([ROLLOUTS, FEEDBACK] * 2)
    first = orjson.loads(stones[0].payload)
    assert first == {
        "schema_version": 1,
        "type": USER_PURGED,
        "user_id": gone,
        "purged_at": body["purged_at"],
    }
    if mode == "embedded":
        assert all(s.published_at is not None for s in stones)  # the table is the log
    else:
        _assert_topics_after_relay(served.settings, engine, gone, kept)
    engine.dispose()


def _assert_topics_after_relay(settings: Any, engine: sa.Engine, gone: str, kept: str) -> None:
    """Nothing was published before the purge: the relay now sends the kept user's messages
    and the tombstones, and none of the purged user's data."""
    publish(settings, engine)
    for topic, kept_n in ((ROLLOUTS, 2), (FEEDBACK, 3)):
        records = consume_all(settings.kafka_bootstrap_servers, topic, timeout_s=30)
        of_gone = [orjson.loads(r.value) for r in records if r.key.decode() == gone]
        assert [v["type"] for v in of_gone] == [USER_PURGED, USER_PURGED]  # one per purge
        assert sum(r.key.decode() == kept for r in records) == kept_n


def _holding(engine: sa.Engine, marker: str) -> dict[str, int]:
    """Rows, per table, whose stored text holds `marker` anywhere."""
    with engine.connect() as conn:
        texts = {
            "events": [
                orjson.dumps(p).decode()
                for p in conn.execute(sa.select(events.c.payload)).scalars()
            ],
            "outbox": list(conn.execute(sa.select(outbox.c.payload)).scalars()),
            "dead_letters": list(conn.execute(sa.select(dead_letters.c.raw)).scalars()),
        }
    return {name: sum(marker in t for t in rows) for name, rows in texts.items()}


def test_purge_removes_settled_text_everywhere(client: httpx.Client, engine: sa.Engine) -> None:
    """code_settled text is code: after the purge no row holds the purged user's, whether it was
    recorded (events, outbox) or refused (dead_letters); another user's stays."""
    gone, kept = f"u-gone-{uuid.uuid4().hex[:8]}", f"u-kept-{uuid.uuid4().hex[:8]}"
    for user in (gone, kept):
        marker = f"settled-by-{user}"
        batch = [
            event("code_settled", user_id=user, text=f"return {marker}()"),
            event("code_settled", user_id=user, text=f"{marker} " + "x" * 1000),  # too long
        ]
        r = client.post("/v1/events", json={"events": batch})
        assert r.status_code == 202 and r.json()["accepted"] == 1, r.text
        assert _holding(engine, marker) == {"events": 1, "outbox": 1, "dead_letters": 1}

    r = client.delete(f"/admin/users/{gone}")
    assert r.status_code == 200, r.text
    assert r.json()["removed"] == {
        "rollouts": 0,
        "events": 1,
        "rewards": 0,
        "outbox": 1,
        "dead_letters": 1,
        "workspace_code": 0,
    }
    assert _holding(engine, f"settled-by-{gone}") == {"events": 0, "outbox": 0, "dead_letters": 0}
    assert _holding(engine, f"settled-by-{kept}") == {"events": 1, "outbox": 1, "dead_letters": 1}
