"""Training status and pause/resume through the admin API."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import httpx
import sqlalchemy as sa

from tabloop.core.tables import (
    TRAINER_MEMBER_PREFIX,
    TRAINER_STATE_NAME,
    rewards,
    rollouts,
    trainer_state,
)
from tabloop.testing.factories import rollout_row


def test_pause_and_resume(client: httpx.Client) -> None:
    status = client.get("/admin/training").json()
    assert status["paused"] is False and status["alive"] is False  # no trainer in this test
    assert status["rewards_finalized"] == 0
    assert client.post("/admin/training/pause").json()["paused"] is True
    assert client.get("/admin/training").json()["paused"] is True
    assert client.post("/admin/training/resume").json()["paused"] is False


def test_training_needs_admin(service: object, key_factory: object) -> None:
    token = key_factory("deploy")  # type: ignore[operator]
    r = httpx.get(
        service.url + "/admin/training",  # type: ignore[attr-defined]
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 403


def test_untrained_counts_only_what_the_trainer_may_use(
    client: httpx.Client, engine: sa.Engine
) -> None:
    """`rewards_untrained` leaves out the rewards the trainer never trains on: a suggestion
    nobody viewed, a request in a language the policy was not trained on, privacy mode."""
    now = datetime.now(UTC)
    cases = {  # suggestion -> (stop_reason, outcome, no_train, trained)
        "usable": ("newline", "accepted", False, False),
        "trained": ("newline", "rejected", False, True),
        "unviewed": ("newline", "unviewed", False, False),
        "language": ("language", "abstained", False, False),
        "private": ("newline", "rejected", True, False),
    }
    with engine.begin() as conn:
        for name, (stop, outcome, no_train, trained) in cases.items():
            sid = str(uuid.uuid5(uuid.NAMESPACE_URL, name))
            conn.execute(
                rollouts.insert().values(
                    **rollout_row(
                        sid,
                        created_at=now,
                        shown=outcome != "abstained",
                        stop_reason=stop,
                        no_train=no_train,
                    )
                )
            )
            conn.execute(
                rewards.insert().values(
                    suggestion_id=sid,
                    user_id="u-1",
                    policy_version=1,
                    rollout_created_at=now,
                    value=0.5,
                    outcome=outcome,
                    components={},
                    spec_version=1,
                    finalized_at=now,
                    trained_at=now if trained else None,
                )
            )
    status = client.get("/admin/training").json()
    assert status["rewards_finalized"] == 5
    assert status["rewards_untrained"] == 1


def test_the_trainer_row_is_read_through_its_type(client: httpx.Client, engine: sa.Engine) -> None:
    """`trainer` is the trainer's TrainerStatus: fields a row lacks get their defaults, fields
    it has that this version does not know are dropped, and a row this version cannot read
    (a newer trainer's state name) is returned as stored rather than failing the request; the
    join's live members are listed."""
    now = datetime.now(UTC)
    old = {"state": "collecting", "pending": 3, "history": [], "from_the_future": 1}
    with engine.begin() as conn:
        conn.execute(
            trainer_state.insert(),
            [
                {"name": TRAINER_STATE_NAME, "heartbeat_at": now, "info": old, "updated_at": now},
                {
                    "name": TRAINER_MEMBER_PREFIX + "host-a:7",
                    "heartbeat_at": now,
                    "info": {"leader": True, "partitions": [0, 1], "pending": 3, "finalized": 9},
                    "updated_at": now,
                },
            ],
        )
    status = client.get("/admin/training").json()
    trainer = status["trainer"]
    assert trainer["state"] == "collecting" and trainer["pending"] == 3
    assert trainer["batch_fill"] == 0 and "from_the_future" not in trainer
    assert status["members"] == [
        {
            "member": "host-a:7",
            "heartbeat_at": status["members"][0]["heartbeat_at"],
            "leader": True,
            "partitions": [0, 1],
            "pending": 3,
            "finalized": 9,
        }
    ]
    newer = {**old, "state": "sharding"}
    with engine.begin() as conn:
        conn.execute(
            trainer_state.update()
            .where(trainer_state.c.name == TRAINER_STATE_NAME)
            .values(info=newer)
        )
    r = client.get("/admin/training")
    assert r.status_code == 200 and r.json()["trainer"] == newer
