"""The reward join: rollouts meet their feedback inside the reward windows.

Rollouts and events arrive on the log in any order (feedback can come before its rollout).
The join keeps each rollout pending until its reward is final (tabloop.core.reward.finalize_at),
then computes the rewards from the database — the source of truth for events, so nothing that
arrived out of order is missed — and writes it once (`rewards` keyed by suggestion id).
Pending state is rebuilt from the database after a restart, so consumer offsets can be
committed as soon as a poll is processed.

With Kafka, trainer processes form one consumer group and each joins the people whose
partitions it holds (both topics are keyed by user id): on a rebalance a member drops what it
held of the partitions taken from it (`drop`) and rebuilds the pending rollouts of those it is
given from the database (`recover`). The `rewards` primary key makes a reward final once, even
if a member evicted mid-round still finalizes a rollout that its successor also holds.

A `user_purged` tombstone (DELETE /admin/users/{id}) drops everything held of that user, and
no reward is written for a rollout whose row is gone: the purge may commit before its tombstone
is read, so `finalize_due` checks, and the tombstone removes a reward that slipped in between.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

# What the join holds per rollout (SUGGESTION_EVENTS). code_settled is not among them: the reward
# never reads it, so it neither moves a rollout's due time nor counts as late (docs/REWARD.md). A
# view is: arriving after the reward is final, it would have turned an unviewed rollout into an
# ignored one.
from tabloop.core.reward import SUGGESTION_EVENTS, Feedback, Reward, RolloutInfo, finalize_at
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.reward_store import (
    BATCH,
    ROLLOUT_COLUMNS,
    MeasuredRetention,
    rewards_from_db,
    rollout_info,
)
from tabloop.core.stream.consumer import Record
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS, is_user_purged
from tabloop.core.tables import rewards, rollouts, utcnow
from trainer.metrics import BAD_RECORDS, LATE_EVENTS, PURGED_ROLLOUTS, REWARDS_FINALIZED

log = logging.getLogger(__name__)


@dataclass
class Pending:
    rollout: RolloutInfo
    policy_version: int
    events: list[Feedback] = field(default_factory=list)  # what the stream has shown us so far
    due: datetime | None = None


@dataclass
class JoinStats:
    finalized: int = 0
    finalized_elsewhere: int = 0  # due here, but another member wrote the reward first
    late_events: int = 0
    orphan_events: int = 0  # feedback about a suggestion never seen (yet)
    purged: int = 0  # pending rollouts dropped because their user was purged
    bad_records: int = 0  # records skipped because they could not be read


class Join:
    def __init__(self, engine: sa.Engine, spec: RewardSpec, spec_version: int) -> None:
        self.engine, self.spec, self.spec_version = engine, spec, spec_version
        self.retention = MeasuredRetention()  # what an accept without a retention report counts at
        self.pending: dict[str, Pending] = {}
        self.early: dict[str, list[Feedback]] = {}  # feedback that came before its rollout
        self.stats = JoinStats()

    def set_spec(self, spec: RewardSpec, spec_version: int) -> None:
        """A new reward spec (PUT /admin/reward-spec): every reward finalized from now on uses
        it, the pending rollouts' included, and their due times follow its windows."""
        self.spec, self.spec_version = spec, spec_version
        for p in self.pending.values():
            p.due = finalize_at(p.rollout, p.events, spec)

    # -- input ---------------------------------------------------------------------------

    def recover(self, owned: Callable[[str], bool] | None = None) -> int:
        """After a (re)start or a rebalance: every rollout without a reward is pending again,
        or with `owned`, those of the people `owned(user_id)` says this member joins."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(*ROLLOUT_COLUMNS, rollouts.c.policy_version)
                .outerjoin(rewards, rewards.c.suggestion_id == rollouts.c.suggestion_id)
                .where(rewards.c.suggestion_id.is_(None))
            ).all()
        if owned is not None:
            rows = [r for r in rows if owned(r.user_id)]
        for r in rows:
            self._add(rollout_info(r), r.policy_version)
        return len(rows)

    def drop(self, owned: Callable[[str], bool]) -> int:
        """Forget the pending rollouts and early feedback of the people `owned(user_id)` names
        (their partitions went to another member, which rebuilds them from the database);
        returns the pending rollouts dropped."""
        gone = [sid for sid, p in self.pending.items() if owned(p.rollout.user_id)]
        for sid in gone:
            del self.pending[sid]
        for sid, fbs in list(self.early.items()):
            if all(owned(f.user_id) for f in fbs):
                del self.early[sid]
        return len(gone)

    def add(self, records: Iterable[Record]) -> None:
        for rec in records:
            try:
                self._add_record(rec)
            except (ValueError, KeyError, TypeError) as e:
                # Not ours or not readable (another producer on the topic, a schema this trainer
                # does not know): skipped and counted. Raising would stop the join for good:
                # the restarted loop would read the same record again.
                self.stats.bad_records += 1
                BAD_RECORDS.inc()
                log.warning(
                    "skipping an unreadable record at %s[%d] offset %d: %r",
                    rec.topic,
                    rec.partition,
                    rec.offset,
                    e,
                )

    def _add_record(self, rec: Record) -> None:
        if is_user_purged(rec.value):
            self.purge_user(str(rec.value.get("user_id") or rec.key))
        elif rec.topic == ROLLOUTS:
            self._add(rollout_info(rec.value), int(rec.value["policy_version"]))
        elif rec.topic == FEEDBACK:
            self._feedback(Feedback.from_event(rec.value))

    def _add(self, info: RolloutInfo, version: int) -> None:
        if info.suggestion_id in self.pending:
            return
        p = Pending(info, version, self.early.pop(info.suggestion_id, []))
        p.due = finalize_at(p.rollout, p.events, self.spec)
        self.pending[info.suggestion_id] = p

    def purge_user(self, user_id: str) -> int:
        """Forget the user's pending rollouts and early feedback, and delete any reward of theirs
        whose rollout the purge removed; returns the pending rollouts dropped."""
        dropped = [sid for sid, p in self.pending.items() if p.rollout.user_id == user_id]
        for sid in dropped:
            del self.pending[sid]
        for sid, fbs in list(self.early.items()):
            kept = [f for f in fbs if f.user_id != user_id]
            if kept:
                self.early[sid] = kept
            else:
                del self.early[sid]
        with self.engine.begin() as conn:
            gone = ~sa.exists().where(rollouts.c.suggestion_id == rewards.c.suggestion_id)
            conn.execute(rewards.delete().where(rewards.c.user_id == user_id, gone))
        self.stats.purged += len(dropped)
        PURGED_ROLLOUTS.inc(len(dropped))
        log.info("user purged: dropped %d pending rollouts of theirs", len(dropped))
        return len(dropped)

    def _feedback(self, fb: Feedback) -> None:
        if fb.type not in SUGGESTION_EVENTS or fb.suggestion_id is None:
            # switch and churn are read from the database when a reward is computed; code_settled
            # never is
            return
        p = self.pending.get(fb.suggestion_id)
        if p is not None:
            p.events.append(fb)
            p.due = finalize_at(p.rollout, p.events, self.spec)
        else:
            self.early.setdefault(fb.suggestion_id, []).append(fb)

    # -- output --------------------------------------------------------------------------

    def finalize_due(self, now: datetime | None = None, limit: int = 5000) -> int:
        """Compute and store the rewards that are final by `now`; returns how many."""
        now = now or utcnow()
        due = [p for p in self.pending.values() if p.due is not None and p.due <= now][:limit]
        rows: list[dict[str, Any]] = []
        written: set[str] = set()
        if due:
            with self.engine.begin() as conn:
                # a rollout purged before its tombstone reached us gets no reward
                ids = [p.rollout.suggestion_id for p in due]
                present = set(
                    conn.execute(
                        sa.select(rollouts.c.suggestion_id).where(rollouts.c.suggestion_id.in_(ids))
                    ).scalars()
                )
                kept = [p for p in due if p.rollout.suggestion_id in present]
                rows = [
                    self._reward_row(p, reward, now)
                    for i in range(0, len(kept), BATCH)
                    for p, reward in zip(
                        kept[i : i + BATCH],
                        rewards_from_db(
                            conn,
                            [p.rollout for p in kept[i : i + BATCH]],
                            self.spec,
                            self.retention,
                        ),
                        strict=True,
                    )
                ]
                insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
                if rows:
                    written = set(
                        conn.execute(
                            insert(rewards)
                            .on_conflict_do_nothing(index_elements=["suggestion_id"])
                            .returning(rewards.c.suggestion_id),
                            rows,
                        ).scalars()
                    )
            for p in due:
                del self.pending[p.rollout.suggestion_id]
            for row in rows:
                if row["suggestion_id"] in written:
                    REWARDS_FINALIZED.labels(outcome=row["outcome"]).inc()
            self.stats.finalized += len(written)
            self.stats.finalized_elsewhere += len(rows) - len(written)
        self._settle_early(now)
        return len(written)

    def _reward_row(self, p: Pending, reward: Reward, now: datetime) -> dict[str, Any]:
        r = p.rollout
        return {
            "suggestion_id": r.suggestion_id,
            "user_id": r.user_id,
            "policy_version": p.policy_version,
            "rollout_created_at": r.created_at,
            "value": reward.value,
            "outcome": reward.outcome,
            "components": reward.components,
            "spec_version": self.spec_version,
            "finalized_at": now,
        }

    def _settle_early(self, now: datetime) -> None:
        """Feedback whose rollout is already final is late; it stays stored, counted here."""
        if not self.early:
            return
        ids = list(self.early)
        with self.engine.begin() as conn:
            final = set(
                conn.execute(
                    sa.select(rewards.c.suggestion_id).where(rewards.c.suggestion_id.in_(ids))
                ).scalars()
            )
            for sid in final:
                n = len(self.early.pop(sid))
                conn.execute(
                    rewards.update()
                    .where(rewards.c.suggestion_id == sid)
                    .values(late_events=rewards.c.late_events + n)
                )
                self.stats.late_events += n
                LATE_EVENTS.inc(n)
        # Feedback for rollouts never seen: drop from memory once past any window (still stored).
        cutoff = now - timedelta(seconds=self.spec.horizon_s * 2)
        for sid, fbs in list(self.early.items()):
            if all(f.occurred_at < cutoff for f in fbs):
                self.stats.orphan_events += len(fbs)
                del self.early[sid]
