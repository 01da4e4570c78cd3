"""Rewards computed from the database for a batch of rollouts (the join finalizes hundreds at a
time) are each the reward of that rollout alone: batching never mixes one person's events, or
one rollout's window, into another's."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from service.events.ingest import ingest_events
from tabloop.core.reward import UNREWARDED_EVENTS, Feedback, Reward, RolloutInfo, compute_reward
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.reward_store import (
    MIN_RETENTION_REPORTS,
    ROLLOUT_COLUMNS,
    measured_retention,
    rewards_from_db,
    rollout_info,
)
from tabloop.core.tables import events, rewards, rollouts
from tabloop.testing.factories import event, rollout_row


def one_by_one(conn: sa.Connection, r: RolloutInfo, spec: RewardSpec) -> Reward:
    """The reward with each window asked of the database for this rollout alone (the oracle)."""
    horizon = timedelta(seconds=spec.horizon_s)
    own = conn.execute(
        sa.select(events.c.payload).where(
            events.c.suggestion_id == r.suggestion_id, events.c.type.not_in(UNREWARDED_EVENTS)
        )
    ).scalars()
    user_level = list(
        conn.execute(
            sa.select(events.c.payload).where(
                events.c.user_id == r.user_id,
                events.c.type.in_(("model_switch", "churn")),
                events.c.occurred_at >= r.created_at,
                events.c.occurred_at <= r.created_at + horizon,
            )
        ).scalars()
    )
    neighbours = [r]
    if user_level:
        neighbours = [
            rollout_info(n)
            for n in conn.execute(
                sa.select(*ROLLOUT_COLUMNS).where(
                    rollouts.c.user_id == r.user_id,
                    rollouts.c.created_at >= r.created_at - horizon,
                    rollouts.c.created_at <= r.created_at + 2 * horizon,
                )
            )
        ]
    feedback = [Feedback.from_event(e) for e in (*own, *user_level)]
    return compute_reward(r, feedback, neighbours, spec)


def test_a_batch_gets_the_rewards_each_rollout_gets_alone(engine: sa.Engine) -> None:
    spec = RewardSpec.sim()
    rng = random.Random(3)
    start = datetime.now(UTC) - timedelta(minutes=5)
    rows, evs = [], []
    for i in range(120):
        at = start + timedelta(seconds=rng.uniform(0, 120))
        row = rollout_row(
            user_id=f"u{i % 7}", created_at=at, shown=rng.random() < 0.7, text="abcdef"[: i % 6]
        )
        rows.append(row)
        later = (at + timedelta(seconds=rng.uniform(0.5, 3))).isoformat()
        kind = rng.choice(["accept", "reject", None, None])
        if kind and row["shown"]:
            evs.append(
                event(
                    kind,
                    user_id=row["user_id"],
                    suggestion_id=row["suggestion_id"],
                    occurred_at=later,
                )
            )
        if rng.random() < 0.08:  # switch and churn penalties spread over the user's rollouts
            penalty = rng.choice(["model_switch", "churn"])
            evs.append(event(penalty, user_id=row["user_id"], occurred_at=later))
    with engine.begin() as conn:
        conn.execute(rollouts.insert(), rows)
    ingest_events(engine, evs, api_key_id=None, max_event_bytes=10_000, embedded=True)
    with engine.connect() as conn:
        infos = [rollout_info(r) for r in conn.execute(sa.select(rollouts)).all()]
        together = rewards_from_db(conn, infos, spec)
        alone = [one_by_one(conn, r, spec) for r in infos]
    assert together == alone
    outcomes = {r.outcome for r in together}
    assert {"abstained", "accepted", "rejected"} <= outcomes, outcomes
    assert any(r.components.get("switch") or r.components.get("churn") for r in together)


def _finalized(
    conn: sa.Connection, n: int, language: str, retention: float, reported: bool
) -> None:
    """`n` accepted rollouts in `language` with finalized rewards at `retention` (a report, or
    provisional)."""
    now = datetime.now(UTC)
    rows = [rollout_row(language=language, created_at=now) for _ in range(n)]
    conn.execute(rollouts.insert(), rows)
    conn.execute(
        rewards.insert(),
        [
            {
                "suggestion_id": r["suggestion_id"],
                "user_id": r["user_id"],
                "policy_version": 1,
                "rollout_created_at": now,
                "value": 0.1,
                "outcome": "accepted",
                "components": {"retention": retention, "provisional": 0.0 if reported else 1.0},
                "spec_version": 1,
                "finalized_at": now,
            }
            for r in rows
        ],
    )


def test_an_accept_without_a_report_counts_at_the_retention_measured_where_it_is_reported(
    engine: sa.Engine,
) -> None:
    """Clients that report retention keep 60% of accepted Python and 90% of accepted Go; an
    accept from a client that never reports counts at its language's measure, at every
    language's for a language with too few reports, at the spec's weight before any."""
    spec = RewardSpec()
    start = datetime.now(UTC) - timedelta(minutes=5)
    accepts = {}
    with engine.begin() as conn:
        for language in ("python", "go", "rust"):
            row = rollout_row(language=language, created_at=start, text="x" * 20)
            conn.execute(rollouts.insert(), [row])
            accepts[language] = row
    ingest_events(
        engine,
        [
            event(
                "accept",
                user_id="u-1",
                suggestion_id=r["suggestion_id"],
                occurred_at=(start + timedelta(seconds=2)).isoformat(),
            )
            for r in accepts.values()
        ],
        api_key_id=None,
        max_event_bytes=10_000,
        embedded=True,
    )

    def retention() -> dict[str, float]:
        with engine.connect() as conn:
            infos = {
                rollout_info(r).language: rollout_info(r)
                for r in conn.execute(
                    sa.select(*ROLLOUT_COLUMNS).where(
                        rollouts.c.suggestion_id.in_([a["suggestion_id"] for a in accepts.values()])
                    )
                )
            }
            got = rewards_from_db(conn, list(infos.values()), spec)
        assert all(r.outcome == "accepted" and r.components["provisional"] == 1.0 for r in got)
        return {lang: r.components["retention"] for lang, r in zip(infos, got, strict=True)}

    assert retention() == {"python": 1.0, "go": 1.0, "rust": 1.0}  # nothing measured yet
    with engine.begin() as conn:
        _finalized(conn, MIN_RETENTION_REPORTS, "python", 0.6, reported=True)
        _finalized(conn, MIN_RETENTION_REPORTS, "go", 0.9, reported=True)
        _finalized(conn, 200, "rust", 0.1, reported=False)  # provisional ones measure nothing
        _finalized(conn, MIN_RETENTION_REPORTS - 1, "rust", 0.2, reported=True)  # too few
    every = (50 * 0.6 + 50 * 0.9 + 49 * 0.2) / 149  # every language's reports
    assert retention() == pytest.approx({"python": 0.6, "go": 0.9, "rust": every})
    with engine.connect() as conn:
        assert measured_retention(conn, "python") == pytest.approx(0.6)
        assert measured_retention(conn, "rust") is None
