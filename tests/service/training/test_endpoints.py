"""Training status and pause/resume through the admin API."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.tables import (
    TRAINER_MEMBER_PREFIX,
    TRAINER_STATE_NAME,
    rewards,
    rollouts,
    trainer_state,
)
from tabloop.testing.factories import rollout_row
from tests.service.analytics.test_metrics import reward, rollout


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


def test_recent_versions_lead_with_kept_characters(client: httpx.Client, engine: sa.Engine) -> None:
    """Per policy version that served in the last hour, newest first: kept characters per 100
    requests, the accept rate of shown and what was shown but not taken per request, over the
    rollouts with a finalized reward (/admin/metrics' sums)."""
    assert client.get("/admin/training").json()["recent_versions"] == {
        "window_s": 3600,
        "versions": [],
    }
    now = datetime.now(UTC)
    when = now - timedelta(minutes=5)
    r = {
        "a": rollout("a", 1, when, shown=True, text="abcdefghij", latency=1),
        "b": rollout("b", 1, when, shown=True, text="xyz", latency=1),
        "c": rollout("c", 1, when, shown=False, text="", latency=1),
        "e": rollout("e", 1, when, shown=True, text="pending", latency=1),  # no reward yet
        "u": rollout("u", 1, when, shown=True, text="never seen", latency=1),
        "f": rollout("f", 2, when, shown=True, text="12345678", latency=1),
        "old": rollout("old", 1, now - timedelta(hours=2), shown=True, text="zz", latency=1),
    }
    with engine.begin() as conn:
        conn.execute(rollouts.insert(), list(r.values()))
        conn.execute(
            rewards.insert(),
            [
                reward(r["a"], 0.4, "accepted", share=1.0, retention=0.5),  # 5 chars kept
                reward(r["b"], -0.25, "rejected"),
                reward(r["c"], 0.0, "abstained"),
                reward(r["u"], 0.0, "unviewed"),  # in no accept rate, a request all the same
                reward(r["f"], 0.1, "accepted", share=0.25, retention=0.0),  # 2 chars, none kept
                reward(r["old"], 1.0, "accepted", share=1.0, retention=1.0),  # outside the hour
            ],
        )
    status = client.get("/admin/training").json()
    assert status["rewards_finalized"] == 6  # the keys that were there stay as they were
    assert status["recent_versions"]["versions"] == [
        {
            "policy_version": 2,
            "requests": 1,
            "shown": 1,
            "shown_finalized": 1,
            "accepted": 1,
            "rewards_finalized": 1,
            "kept_chars_per_100": 0.0,
            "accept_rate_of_shown": 1.0,
            "not_taken_per_request": 0.0,
        },
        {
            "policy_version": 1,
            "requests": 5,
            "shown": 4,
            "shown_finalized": 2,
            "accepted": 1,
            "rewards_finalized": 4,
            "kept_chars_per_100": pytest.approx(100 * 5 / 4),
            "accept_rate_of_shown": 0.5,
            "not_taken_per_request": pytest.approx(1 / 4),
        },
    ]


def test_recent_versions_are_the_newest_ten(client: httpx.Client, engine: sa.Engine) -> None:
    """Only abstentions, none final yet: no rates; twelve versions served, the newest ten
    listed."""
    when = datetime.now(UTC) - timedelta(minutes=1)
    with engine.begin() as conn:
        conn.execute(
            rollouts.insert(),
            [rollout(f"s{v}", v, when, shown=False, text="", latency=1) for v in range(1, 13)],
        )
    versions = client.get("/admin/training").json()["recent_versions"]["versions"]
    assert [v["policy_version"] for v in versions] == list(range(12, 2, -1))
    assert versions[0] == {
        "policy_version": 12,
        "requests": 1,
        "shown": 0,
        "shown_finalized": 0,
        "accepted": 0,
        "rewards_finalized": 0,
        "kept_chars_per_100": None,
        "accept_rate_of_shown": None,
        "not_taken_per_request": None,
    }
