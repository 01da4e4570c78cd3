"""GET /admin/metrics `feedback`: whose feedback was refused (dead letters with a refusal's
reason) and whose rows the trainer capped (its state), over the window, in both modes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import sqlalchemy as sa

from tabloop.core.tables import TRAINER_STATE_NAME, api_keys, rollouts, trainer_state
from tabloop.testing.factories import event, rollout_row


def z(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def rollout(engine: sa.Engine, *, user: str, key: str | None, shown: bool) -> str:
    sid = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            rollouts.insert().values(
                **rollout_row(
                    sid, user_id=user, text="x" if shown else "", shown=shown, api_key_id=key
                )
            )
        )
    return sid


def capped_entry(at: datetime, users: list[dict[str, Any]]) -> dict[str, Any]:
    return {"at": at.isoformat(), "rollouts": 100, "max_share": 0.25, "users": users, "keys": []}


def test_refused_and_capped_people_and_keys(client: httpx.Client, engine: sa.Engine) -> None:
    now = datetime.now(UTC)
    theirs = rollout(engine, user="u-victim", key="elsewhere", shown=True)
    silent = rollout(engine, user="u-liar", key=None, shown=False)
    evs = [
        event("accept", user_id="u-victim", suggestion_id=theirs, occurred_at=z(now))
        for _ in range(3)
    ]
    evs += [
        event("accept", user_id="u-liar", suggestion_id=silent, occurred_at=z(now)),
        event("churn", user_id="u-liar", occurred_at=z(now)),  # taken
        {"type": "teleport"},
    ]  # invalid: a dead letter, not a refusal
    r = client.post("/v1/events", json={"events": evs})
    assert r.status_code == 202 and len(r.json()["rejected"]) == 5, r.text
    loud = {"id": "u-loud", "rows": 90, "share": 0.9, "weight_share": 0.25, "weight_removed": 65.0}
    with engine.begin() as conn:
        conn.execute(
            trainer_state.insert().values(
                name=TRAINER_STATE_NAME,
                updated_at=now,
                info={
                    "capped": [
                        capped_entry(now - timedelta(hours=4), [loud]),  # before either window
                        capped_entry(now - timedelta(minutes=20), [loud]),
                        capped_entry(
                            now - timedelta(minutes=10),
                            [
                                {**loud, "rows": 50, "share": 0.5, "weight_removed": 25.0},
                                {
                                    "id": "u-busy",
                                    "rows": 30,
                                    "share": 0.3,
                                    "weight_share": 0.25,
                                    "weight_removed": 5.0,
                                },
                            ],
                        ),
                    ]
                },
            )
        )
        key_id, key_name = conn.execute(sa.select(api_keys.c.id, api_keys.c.name)).one()

    r = client.get("/admin/metrics", params={"window": "1h"})
    assert r.status_code == 200, r.text
    trust = r.json()["feedback"]
    assert trust["refused"] == 4
    assert trust["refused_by_reason"] == {"wrong_key": 3, "not_shown": 1}
    assert trust["refused_users"] == [
        {"id": "u-victim", "name": None, "refused": 3, "reasons": {"wrong_key": 3}},
        {"id": "u-liar", "name": None, "refused": 1, "reasons": {"not_shown": 1}},
    ]
    assert trust["refused_keys"] == [
        {"id": key_id, "name": key_name, "refused": 4, "reasons": {"wrong_key": 3, "not_shown": 1}}
    ]
    assert trust["batches"] == 2
    assert trust["capped_users"] == [
        {
            "id": "u-loud",
            "name": None,
            "batches": 2,
            "rows": 140,
            "weight_removed": 90.0,
            "max_share": 0.9,
        },
        {
            "id": "u-busy",
            "name": None,
            "batches": 1,
            "rows": 30,
            "weight_removed": 5.0,
            "max_share": 0.3,
        },
    ]
    assert trust["capped_keys"] == []

    # an earlier window holds none of it
    r = client.get("/admin/metrics", params={"window": "1h", "to": z(now - timedelta(hours=2))})
    empty = r.json()["feedback"]
    assert (empty["refused"], empty["refused_users"], empty["batches"]) == (0, [], 0)
