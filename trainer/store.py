"""What the trainer reads from and writes to the database, besides the join (trainer/join.py):
the rollouts an update trains on, the earlier ones it replays, the stamps that make a reward
used once, a canary arm's rewards and the policies' lineage. The loop (trainer/loop.py) decides;
these functions only query.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tabloop.core.retention import with_code
from tabloop.core.reward import UNVIEWED
from tabloop.core.reward_store import kept_chars, trainable_reward
from tabloop.core.settled import CODE_SETTLED
from tabloop.core.tables import deployments, events, policies, rewards, rollouts, utcnow

STAMP_CHUNK = 1000  # suggestion ids per UPDATE when stamping rewards

# a rollout with its finalized reward: what an update reads. A request in a language the policy
# was not trained on is left out: nothing was sampled and the policy made no choice, so it has
# nothing to teach (and its reward of 0 would only shift the baseline).
# An unviewed suggestion (shown to a client that reports views, never viewed) is left out too:
# nobody judged it, and its reward of 0 would teach the gate that showing is worth nothing.
# A rollout made in privacy mode (no_train) is never read: its code was not even stored.
ROLLOUT_ROWS = (
    sa.select(
        rollouts.c.suggestion_id,
        rollouts.c.context_token_ids,
        rollouts.c.token_ids,
        rollouts.c.heal_text,
        rollouts.c.temperature,
        rollouts.c.top_p,
        rollouts.c.shown,
        rollouts.c.recall,
        rollouts.c.person,
        rollouts.c.extend,
        rollouts.c.logprob_total,
        rollouts.c.token_logprobs,
        rollouts.c.decision_logprob,
        rollouts.c.policy_version,
        rollouts.c.user_id,  # whose and which key's: each one's share of a batch is capped
        rollouts.c.api_key_id,
        rollouts.c.workspace_id,  # where its document is (trainer/blocks.py)
        rollouts.c.file_path,
        rewards.c.value,
        kept_chars().label("kept_chars"),  # what the deploy check weighs besides the reward
    )
    .join(rewards, rewards.c.suggestion_id == rollouts.c.suggestion_id)
    .where(trainable_reward())
)


def code_kept(cutoff: datetime | None) -> list[Any]:
    """SQL conditions: the rollout's code is still stored (TABLOOP_CODE_RETENTION_DAYS blanks
    it in rollouts older than `cutoff`: tabloop/core/retention.code_cutoff)."""
    return [] if cutoff is None else [rollouts.c.created_at >= cutoff]


def untrained_rows(
    engine: sa.Engine, staleness: int, final_before: datetime, limit: int, *where: Any
) -> list[sa.Row]:
    """A batch: rewards not yet trained on, of the versions live or in canary in the last
    `staleness` deployments, of rollouts made before `final_before`, newest first."""
    with engine.connect() as conn:
        recent = conn.execute(
            sa.select(deployments.c.live_version, deployments.c.canary_version)
            .order_by(deployments.c.id.desc())
            .limit(staleness)
        ).all()
        versions = {v for r in recent for v in r if v is not None}
        return with_code(
            conn.execute(
                ROLLOUT_ROWS.where(
                    rewards.c.trained_at.is_(None),
                    rewards.c.policy_version.in_(versions),
                    # only rollouts old enough that all of their time's rewards are final:
                    # abstentions finalize at once, shown ones later, and a batch drawn by
                    # finalization time would under-represent what was shown
                    rewards.c.rollout_created_at <= final_before,
                    *where,
                )
                # newest first: what waited during a canary is used, not left to go stale
                .order_by(rewards.c.rollout_created_at.desc())
                .limit(limit)
            ).all()
        )


def trained_rows(engine: sa.Engine, limit: int, *where: Any) -> list[sa.Row]:
    """Rollouts already trained on (rewards.trained_at set) that match `where`, newest first,
    at most `limit`: what the gate's fit and the settled-text term read again."""
    with engine.connect() as conn:
        return with_code(
            conn.execute(
                ROLLOUT_ROWS.where(rewards.c.trained_at.is_not(None), *where)
                .order_by(rewards.c.rollout_created_at.desc())
                .limit(limit)
            ).all()
        )


def shown() -> Any:
    """SQL condition: the rollout was shown."""
    return rollouts.c.shown.is_(True)


def has_settled_text() -> Any:
    """SQL condition: the rollout's person reported the text they settled on."""
    return rollouts.c.suggestion_id.in_(
        sa.select(events.c.suggestion_id).where(events.c.type == CODE_SETTLED)
    )


def stamp_trained(engine: sa.Engine, ids: list[str], version: int | None) -> None:
    """Stamp rewards as used (trained_at), or with `version` as trained into that candidate; a
    stamped reward is never reused."""
    values: dict[str, Any] = {"trained_into": version} if version else {"trained_at": utcnow()}
    with engine.begin() as conn:
        for i in range(0, len(ids), STAMP_CHUNK):
            conn.execute(
                rewards.update()
                .where(rewards.c.suggestion_id.in_(ids[i : i + STAMP_CHUNK]))
                .values(**values)
            )


def arm_rows(conn: sa.Connection, version: int, since: datetime) -> list[sa.Row]:
    """A canary arm: the viewed rewards of `version`'s rollouts made since `since`, with whose
    and which key's they are (value, outcome, user_id, api_key_id, kept_chars)."""
    rows = conn.execute(
        sa.select(
            rewards.c.value,
            rewards.c.outcome,
            rewards.c.user_id,
            rollouts.c.api_key_id,
            kept_chars().label("kept_chars"),
        )
        .select_from(rewards.join(rollouts, rollouts.c.suggestion_id == rewards.c.suggestion_id))
        .where(
            rewards.c.policy_version == version,
            rewards.c.rollout_created_at >= since,
            rewards.c.outcome != UNVIEWED,  # nobody saw it: no evidence either way
        )
    ).all()
    return list(rows)


def parents(engine: sa.Engine) -> dict[int, int | None]:
    """Every registered policy version -> its parent (None for a pretrained base)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(policies.c.version, policies.c.parent)).all()
    return {version: parent for version, parent in rows}
