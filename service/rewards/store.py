"""Reward specs by version, and rewards computed from what the database holds.

The streaming join (trainer) and the replay (admin API) both call `reward_from_db`, so the same
function of (rollout, events, spec) serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from service.policy.defaults import STOP_LANGUAGE
from service.privacy import trainable
from service.rewards.core import (
    UNREWARDED_EVENTS,
    UNVIEWED,
    Feedback,
    Reward,
    RewardSpec,
    RolloutInfo,
    compute_reward,
)
from service.tables import events, reward_specs, rewards, rollouts, utcnow


def trainable_reward() -> sa.ColumnElement[bool]:
    """SQL over `rewards` joined with `rollouts`: a reward the trainer may train on. Not a
    request in a language the policy was not trained on (the policy had no choice), not a
    suggestion nobody viewed (no evidence either way), not a rollout in privacy mode."""
    return sa.and_(
        rollouts.c.stop_reason != STOP_LANGUAGE, rewards.c.outcome != UNVIEWED, trainable()
    )


def default_spec(profile: str) -> RewardSpec:
    return RewardSpec.sim() if profile == "sim" else RewardSpec()


def current_spec(engine_or_conn: sa.Engine | sa.Connection, profile: str) -> tuple[int, RewardSpec]:
    """The newest spec version; version 1 (the profile's default) is stored on first use."""

    def run(conn: sa.Connection) -> tuple[int, RewardSpec]:
        row = conn.execute(
            sa.select(reward_specs).order_by(reward_specs.c.version.desc()).limit(1)
        ).first()
        if row is not None:
            return row.version, RewardSpec.from_dict(row.spec)
        spec = default_spec(profile)
        conn.execute(
            reward_specs.insert().values(version=1, spec=spec.to_dict(), created_at=utcnow())
        )
        return 1, spec

    if isinstance(engine_or_conn, sa.Engine):
        with engine_or_conn.begin() as conn:
            return run(conn)
    return run(engine_or_conn)


def spec_version(conn: sa.Connection, version: int) -> RewardSpec | None:
    row = conn.execute(
        sa.select(reward_specs.c.spec).where(reward_specs.c.version == version)
    ).first()
    return RewardSpec.from_dict(row.spec) if row is not None else None


def put_spec(conn: sa.Connection, spec: RewardSpec, api_key_id: str | None) -> int:
    latest = conn.execute(sa.select(sa.func.max(reward_specs.c.version))).scalar() or 0
    conn.execute(
        reward_specs.insert().values(
            version=latest + 1, spec=spec.to_dict(), created_at=utcnow(), api_key_id=api_key_id
        )
    )
    return latest + 1


def rollout_info(row: Any) -> RolloutInfo:
    """From a rollouts row, or a rollout message (dict) of the `tabloop.rollouts` topic."""
    get: Callable[[str], Any] = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
    created = get("created_at")
    # text_chars: absent or NULL in older rows and messages, whose text is whole
    chars = row.get("text_chars") if isinstance(row, dict) else getattr(row, "text_chars", None)
    if isinstance(created, str):
        created = datetime.fromisoformat(created.replace("Z", "+00:00"))
    return RolloutInfo(
        suggestion_id=get("suggestion_id"),
        user_id=get("user_id"),
        created_at=created,
        shown=bool(get("shown")),
        text_chars=chars if chars is not None else len(get("text") or ""),
        reports_views=bool(get("reports_views")),  # NULL or absent (older rows): False
    )


ROLLOUT_COLUMNS = (
    rollouts.c.suggestion_id,
    rollouts.c.user_id,
    rollouts.c.created_at,
    rollouts.c.shown,
    rollouts.c.text,
    rollouts.c.text_chars,
    rollouts.c.reports_views,
)


def reward_from_db(conn: sa.Connection, rollout: RolloutInfo, spec: RewardSpec) -> Reward:
    """The reward of one rollout from the events stored about it and its user."""
    horizon = timedelta(seconds=spec.horizon_s)
    own = (
        conn.execute(
            sa.select(events.c.payload).where(
                events.c.suggestion_id == rollout.suggestion_id,
                # the reward never reads them (compute_reward would skip them): code text stays
                # in the table
                events.c.type.not_in(UNREWARDED_EVENTS),
            )
        )
        .scalars()
        .all()
    )
    user_level = (
        conn.execute(
            sa.select(events.c.payload).where(
                events.c.user_id == rollout.user_id,
                events.c.type.in_(("model_switch", "churn")),
                events.c.occurred_at >= rollout.created_at,
                events.c.occurred_at <= rollout.created_at + horizon,
            )
        )
        .scalars()
        .all()
    )
    feedback = [Feedback.from_event(e) for e in (*own, *user_level)]
    neighbours = [rollout]
    if user_level:  # the user's rollouts that share switch and churn penalties with this one
        rows = conn.execute(
            sa.select(*ROLLOUT_COLUMNS).where(
                rollouts.c.user_id == rollout.user_id,
                rollouts.c.created_at >= rollout.created_at - horizon,
                rollouts.c.created_at <= rollout.created_at + 2 * horizon,
            )
        ).all()
        neighbours = [rollout_info(r) for r in rows]
    return compute_reward(rollout, feedback, neighbours, spec)


def replay(
    conn: sa.Connection, start: datetime, end: datetime, spec: RewardSpec, limit: int = 100_000
) -> dict[str, Any]:
    """Recompute the rewards of rollouts created in [start, end) under `spec`. Stored rewards
    are not changed (a trained policy may have used them); the summary compares the two."""
    from service.tables import rewards

    rows = conn.execute(
        sa.select(*ROLLOUT_COLUMNS, rewards.c.value.label("stored"))
        .outerjoin(rewards, rewards.c.suggestion_id == rollouts.c.suggestion_id)
        .where(rollouts.c.created_at >= start, rollouts.c.created_at < end)
        .order_by(rollouts.c.created_at)
        .limit(limit)
    ).all()
    outcomes: dict[str, int] = {}
    total = changed = 0.0
    stored_n = 0
    for r in rows:
        reward = reward_from_db(conn, rollout_info(r), spec)
        outcomes[reward.outcome] = outcomes.get(reward.outcome, 0) + 1
        total += reward.value
        if r.stored is not None:
            stored_n += 1
            changed += abs(reward.value - r.stored) > 1e-9
    return {
        "rollouts": len(rows),
        "mean_reward": total / len(rows) if rows else None,
        "outcomes": outcomes,
        "finalized_before": stored_n,
        "differ_from_stored": int(changed),
    }
