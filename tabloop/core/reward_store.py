"""Reward specs by version, and rewards computed from what the database holds.

The streaming join (trainer) and the replay (admin API) both call `rewards_from_db`, so the same
function of (rollout, events, spec) serves both.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from tabloop.core.policy.defaults import STOP_LANGUAGE
from tabloop.core.privacy import trainable
from tabloop.core.reward import (
    UNREWARDED_EVENTS,
    UNVIEWED,
    Feedback,
    Reward,
    RolloutInfo,
    compute_reward,
)
from tabloop.core.reward_spec import REWARD_SPECS, RewardSpec
from tabloop.core.tables import events, reward_specs, rewards, rollouts, utcnow


def trainable_reward() -> sa.ColumnElement[bool]:
    """SQL over `rewards` joined with `rollouts`: a reward the trainer may train on. Not a
    request in a language the policy was not trained on (the policy had no choice), not a
    suggestion nobody viewed (no evidence either way), not a rollout in privacy mode."""
    return sa.and_(
        rollouts.c.stop_reason != STOP_LANGUAGE, rewards.c.outcome != UNVIEWED, trainable()
    )


def accepted_chars() -> sa.ColumnElement[Any]:
    """SQL over `rewards` joined with `rollouts`: the characters an accept took (share x the
    suggestion's length, kept in text_chars also where its text is not: docs/PRIVACY.md); 0 for
    every other outcome."""
    length = sa.func.coalesce(rollouts.c.text_chars, sa.func.length(rollouts.c.text))
    chars = sa.func.round(rewards.c.components["share"].as_float() * length)
    return sa.func.coalesce(sa.case((rewards.c.outcome == "accepted", chars), else_=0), 0)


def kept_chars() -> sa.ColumnElement[Any]:
    """SQL, as `accepted_chars`: the accepted characters times the retention the reward counted
    (its last report, or provisional_accept_weight without one)."""
    return accepted_chars() * sa.func.coalesce(rewards.c.components["retention"].as_float(), 0.0)


def default_spec(profile: str) -> RewardSpec:
    return REWARD_SPECS[profile]


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
        language=row.get("language") if isinstance(row, dict) else getattr(row, "language", None),
    )


ROLLOUT_COLUMNS = (
    rollouts.c.suggestion_id,
    rollouts.c.user_id,
    rollouts.c.created_at,
    rollouts.c.shown,
    rollouts.c.text,
    rollouts.c.text_chars,
    rollouts.c.reports_views,
    rollouts.c.language,
)


RETENTION_REPORTS = 2000  # the newest reported accepts a retention estimate averages
MIN_RETENTION_REPORTS = 50  # ... and the fewest it needs


def measured_retention(conn: sa.Connection, language: str | None) -> float | None:
    """The mean retained fraction of the newest RETENTION_REPORTS accepts whose client reported
    retention, in `language` (None: in every language); None with fewer than
    MIN_RETENTION_REPORTS of them."""
    retention = rewards.c.components["retention"].as_float()
    query = (
        sa.select(retention)
        .select_from(rewards.join(rollouts, rollouts.c.suggestion_id == rewards.c.suggestion_id))
        .where(
            rewards.c.outcome == "accepted",
            rewards.c.components["provisional"].as_float() == 0.0,
        )
        .order_by(rewards.c.finalized_at.desc())
        .limit(RETENTION_REPORTS)
    )
    if language is not None:
        query = query.where(rollouts.c.language == language)
    values = [float(v) for v in conn.scalars(query) if v is not None]
    return sum(values) / len(values) if len(values) >= MIN_RETENTION_REPORTS else None


class MeasuredRetention:
    """What an accept without a retention report counts at (docs/REWARD.md, Accepts without a
    retention report): the retention measured on the clients that do report it, in the
    rollout's language, else in every language, else (too few reports yet) the spec's
    provisional_accept_weight. Each figure is read at most every `ttl_s` seconds."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._cache: dict[str | None, tuple[float, float | None]] = {}

    def __call__(self, conn: sa.Connection, language: str | None) -> float | None:
        now = time.monotonic()
        hit = self._cache.get(language)
        if hit is None or now - hit[0] > self.ttl_s:
            hit = (now, measured_retention(conn, language))
            self._cache[language] = hit
        if hit[1] is None and language is not None:
            return self(conn, None)
        return hit[1]


BATCH = 1000  # rollouts per rewards_from_db call (bounds the IN lists)


def reward_from_db(conn: sa.Connection, rollout: RolloutInfo, spec: RewardSpec) -> Reward:
    """The reward of one rollout from the events stored about it and its user."""
    return rewards_from_db(conn, [rollout], spec)[0]


def rewards_from_db(
    conn: sa.Connection,
    batch: Sequence[RolloutInfo],
    spec: RewardSpec,
    retention: MeasuredRetention | None = None,
) -> list[Reward]:
    """The rewards of `batch`, in order, from the events stored about each rollout and its
    user: three queries for the whole batch (the rollouts' own events; their users' switch and
    churn events; with those, the users' rollouts that share the penalties) instead of two or
    three per rollout. An accept without a retention report counts at `retention`'s measure
    (None: a fresh one)."""
    retention = retention or MeasuredRetention()
    if not batch:
        return []
    horizon = timedelta(seconds=spec.horizon_s)
    own: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sid, payload in conn.execute(
        sa.select(events.c.suggestion_id, events.c.payload).where(
            events.c.suggestion_id.in_({r.suggestion_id for r in batch}),
            # the reward never reads them (compute_reward would skip them): code text stays
            # in the table
            events.c.type.not_in(UNREWARDED_EVENTS),
        )
    ):
        own[sid].append(payload)
    first = min(r.created_at for r in batch)
    last = max(r.created_at for r in batch)
    users = {r.user_id for r in batch}
    penalties: dict[str, list[tuple[datetime, dict[str, Any]]]] = defaultdict(list)
    for user_id, occurred_at, payload in conn.execute(
        sa.select(events.c.user_id, events.c.occurred_at, events.c.payload).where(
            events.c.user_id.in_(users),
            events.c.type.in_(("model_switch", "churn")),
            events.c.occurred_at >= first,
            events.c.occurred_at <= last + horizon,
        )
    ):
        penalties[user_id].append((occurred_at, payload))
    shared: dict[str, list[RolloutInfo]] = defaultdict(list)
    if penalties:  # the users' rollouts that share switch and churn penalties
        for row in conn.execute(
            sa.select(*ROLLOUT_COLUMNS).where(
                rollouts.c.user_id.in_(set(penalties)),
                rollouts.c.created_at >= first - horizon,
                rollouts.c.created_at <= last + 2 * horizon,
            )
        ):
            shared[row.user_id].append(rollout_info(row))
    out = []
    for r in batch:
        user_level = [
            e
            for at, e in penalties.get(r.user_id, ())
            if r.created_at <= at <= r.created_at + horizon
        ]
        feedback = [Feedback.from_event(e) for e in (*own.get(r.suggestion_id, ()), *user_level)]
        neighbours = [r]
        if user_level:
            neighbours = [
                n
                for n in shared[r.user_id]
                if r.created_at - horizon <= n.created_at <= r.created_at + 2 * horizon
            ]
        provisional = retention(conn, r.language) if r.shown else None
        out.append(compute_reward(r, feedback, neighbours, spec, provisional))
    return out


def replay(
    conn: sa.Connection, start: datetime, end: datetime, spec: RewardSpec, limit: int = 100_000
) -> dict[str, Any]:
    """Recompute the rewards of rollouts created in [start, end) under `spec`. Stored rewards
    are not changed (a trained policy may have used them); the summary compares the two."""
    from tabloop.core.tables import rewards

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
    retention = MeasuredRetention()  # one measure for the whole replay
    computed = [
        reward
        for i in range(0, len(rows), BATCH)
        for reward in rewards_from_db(
            conn, [rollout_info(r) for r in rows[i : i + BATCH]], spec, retention
        )
    ]
    for r, reward in zip(rows, computed, strict=True):
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
