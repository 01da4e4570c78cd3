"""Unviewed suggestions carry no training signal: the join rewards them "unviewed", and no update
batch, gate replay or canary arm reads them (a reward of 0 for a shown suggestion would teach
the gate that showing is worth nothing)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from tabloop.core.config import Settings
from tabloop.core.db import make_engine, upgrade
from tabloop.core.registry import current_deployment
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.stream.consumer import Record
from tabloop.core.stream.topics import ROLLOUTS, encode
from tabloop.core.tables import deployments, rewards, rollouts, utcnow
from tests.service.conftest import make_settings
from trainer.client import ServiceClient
from trainer.join import Join
from trainer.loop import Trainer

OLD = timedelta(hours=1)  # every rollout is older than any reward horizon


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    s = make_settings(tmp_path, profile="sim")
    upgrade(s)
    return s


@pytest.fixture
def engine(settings: Settings) -> Iterator[sa.Engine]:
    e = make_engine(settings)
    with e.begin() as conn:
        conn.execute(
            deployments.insert().values(
                created_at=utcnow() - 2 * OLD, action="bootstrap", live_version=1
            )
        )
    yield e
    e.dispose()


def rollout(engine: sa.Engine, *, reports_views: bool | None) -> dict[str, Any]:
    created = utcnow() - OLD
    row: dict[str, Any] = {
        "suggestion_id": str(uuid.uuid4()),
        "user_id": "u1",
        "policy_version": 1,
        "created_at": created,
        "context_token_ids": [1],
        "heal_text": "",
        "token_ids": [2, 3],
        "token_logprobs": [-0.1, -0.2],
        "text": "x + 1)",
        "shown": True,
        "gate_prob_show": 0.9,
        "decision_logprob": -0.1,
        "logprob_total": -0.4,
        "temperature": 0.7,
        "top_p": 0.95,
        "stop_reason": "newline",
        "latency_ms": 1.0,
        "reports_views": reports_views,
    }
    with engine.begin() as conn:
        conn.execute(rollouts.insert().values(**row))
    return {**row, "created_at": created.isoformat()}


def test_the_join_rewards_a_never_viewed_suggestion_as_unviewed(engine: sa.Engine) -> None:
    silent = rollout(engine, reports_views=True)  # its client reports views; none came
    legacy = rollout(engine, reports_views=None)  # a row from before the column: no views
    join = Join(engine, RewardSpec.sim(), 1)
    join.add(
        [
            Record(ROLLOUTS, 0, i, "u1", orjson.loads(encode(r)))
            for i, r in enumerate((silent, legacy))
        ]
    )
    assert join.finalize_due(now=utcnow()) == 2
    with engine.connect() as conn:
        got = dict(conn.execute(sa.select(rewards.c.suggestion_id, rewards.c.outcome)).all())
    assert got == {silent["suggestion_id"]: "unviewed", legacy["suggestion_id"]: "ignored"}


def _reward(
    engine: sa.Engine, r: dict[str, Any], outcome: str, value: float, trained: bool = False
) -> None:
    with engine.begin() as conn:
        conn.execute(
            rewards.insert().values(
                suggestion_id=r["suggestion_id"],
                user_id="u1",
                policy_version=1,
                rollout_created_at=utcnow() - OLD,
                value=value,
                outcome=outcome,
                components={},
                spec_version=1,
                finalized_at=utcnow(),
                trained_at=utcnow() if trained else None,
            )
        )


def test_no_training_read_and_no_canary_arm_counts_an_unviewed_reward(
    settings: Settings, engine: sa.Engine
) -> None:
    trainer = Trainer(settings, engine, ServiceClient("http://127.0.0.1:9", "unused"))
    accepted, ignored, unviewed = (rollout(engine, reports_views=True) for _ in range(3))
    _reward(engine, accepted, "accepted", 0.4)
    _reward(engine, ignored, "ignored", -0.25)
    _reward(engine, unviewed, "unviewed", 0.0)
    with engine.connect() as conn:
        dep = current_deployment(conn)
        assert dep is not None
        arm = trainer._arm(conn, 1, utcnow() - 2 * OLD)
    batch = {r.suggestion_id for r in trainer._batch_rows()}
    assert batch == {accepted["suggestion_id"], ignored["suggestion_id"]}
    assert (arm.n, arm.shown, arm.accepted) == (2, 2, 1)

    # once trained on, rewards are read again by the gate's fit: still never the unviewed one
    seen, unseen = (rollout(engine, reports_views=True) for _ in range(2))
    _reward(engine, seen, "rejected", -0.25, trained=True)
    _reward(engine, unseen, "unviewed", 0.0, trained=True)
    trainer.cfg.update.gate_fit, trainer.cfg.update.gate_fit_replay = True, 100
    assert {r.suggestion_id for r in trainer._replay_rows()} == {seen["suggestion_id"]}
