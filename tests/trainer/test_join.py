"""The reward join and purged users: a `user_purged` tombstone drops that user's pending
rollouts and early feedback, no reward is ever written for a purged rollout, and another
user's rewards are untouched."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from service.admin.users.purge import purge_user
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.stream.consumer import Record
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS, encode, user_purged
from tabloop.core.tables import rewards, rollouts, utcnow
from tabloop.testing.factories import event
from trainer.join import Join

LATER = timedelta(hours=1)  # past every window of the default spec


def _rollout(engine: sa.Engine, user: str) -> dict[str, Any]:
    """A shown rollout row in the database, and its message as the trainer reads it."""
    row = {
        "suggestion_id": str(uuid.uuid4()),
        "user_id": user,
        "policy_version": 1,
        "created_at": utcnow(),
        "context_token_ids": [1],
        "heal_text": "",
        "token_ids": [2],
        "token_logprobs": [-0.1],
        "text": "return x",
        "shown": True,
        "gate_prob_show": 0.9,
        "decision_logprob": -0.1,
        "logprob_total": -0.2,
        "temperature": 0.7,
        "top_p": 0.95,
        "stop_reason": "eol",
        "latency_ms": 1.0,
    }
    with engine.begin() as conn:
        conn.execute(rollouts.insert().values(**row))
    return {**row, "created_at": row["created_at"].isoformat()}


_offsets = iter(range(1, 1_000_000))


def rec(topic: str, key: str, value: dict[str, Any]) -> Record:
    import orjson

    return Record(topic, 0, next(_offsets), key, orjson.loads(encode(value)))


def _rewarded(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(rewards.c.suggestion_id, rewards.c.user_id)).all())


def test_tombstone_drops_pending_rollouts_and_early_feedback_of_that_user_only(
    engine: sa.Engine,
) -> None:
    join = Join(engine, RewardSpec(), 1)
    gone = [_rollout(engine, "u-gone") for _ in range(2)]
    kept = [_rollout(engine, "u-kept") for _ in range(2)]
    early = event("reject", user_id="u-gone", suggestion_id=str(uuid.uuid4()))
    join.add([rec(ROLLOUTS, r["user_id"], r) for r in gone + kept])
    join.add([rec(FEEDBACK, "u-gone", early)])
    assert len(join.pending) == 4 and early["suggestion_id"] in join.early

    purge = purge_user(engine, "u-gone", embedded=True)
    stone = user_purged("u-gone", purge.purged_at)
    # on both topics, as the purge sends it; the second finds nothing left and must not crash
    join.add([rec(ROLLOUTS, "u-gone", stone), rec(FEEDBACK, "u-gone", stone)])

    assert {p.rollout.user_id for p in join.pending.values()} == {"u-kept"}
    assert join.early == {} and join.stats.purged == 2
    assert join.finalize_due(now=utcnow() + LATER) == 2
    assert _rewarded(engine) == {r["suggestion_id"]: "u-kept" for r in kept}


def test_no_reward_for_a_rollout_purged_before_its_tombstone_arrives(engine: sa.Engine) -> None:
    """The purge commits, the join still holds the rollout (tombstone not read yet): the
    rollout's row is gone, so finalize writes nothing for it."""
    join = Join(engine, RewardSpec(), 1)
    gone, kept = _rollout(engine, "u-gone"), _rollout(engine, "u-kept")
    join.add([rec(ROLLOUTS, r["user_id"], r) for r in (gone, kept)])
    purge_user(engine, "u-gone", embedded=True)
    assert join.finalize_due(now=utcnow() + LATER) == 1
    assert _rewarded(engine) == {kept["suggestion_id"]: "u-kept"}
    assert join.pending == {}


def test_tombstone_removes_a_reward_written_while_the_purge_committed(engine: sa.Engine) -> None:
    """PostgreSQL read committed: the join may see the rollout, then insert its reward just
    after the purge deleted the user's rewards. The tombstone, read later, removes it (and
    leaves the rewards of rollouts the user made after the purge)."""
    join = Join(engine, RewardSpec(), 1)
    gone = _rollout(engine, "u-gone")
    join.add([rec(ROLLOUTS, "u-gone", gone)])
    join.finalize_due(now=utcnow() + LATER)  # rewarded before the purge ...
    with engine.begin() as conn:  # ... and the purge's rollout delete only, as if interleaved
        conn.execute(rollouts.delete().where(rollouts.c.user_id == "u-gone"))
    after = _rollout(engine, "u-gone")  # the person uses the product again after the purge
    join.add([rec(ROLLOUTS, "u-gone", user_purged("u-gone", "2026-01-01T00:00:00Z"))])
    join.add([rec(ROLLOUTS, "u-gone", after)])
    assert _rewarded(engine) == {}
    assert join.finalize_due(now=utcnow() + LATER) == 1
    assert _rewarded(engine) == {after["suggestion_id"]: "u-gone"}


def test_unreadable_records_are_skipped_and_counted_not_fatal(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Another producer's record on our topics (seen in a fault run: `{"probe": 1}` killed the
    trainer, and its restart read the same record again) is skipped; the rest is joined."""
    from tabloop.core.stream.consumer import _decode

    join = Join(engine, RewardSpec(), 1)
    good = _rollout(engine, "u-1")
    feedback = event("reject", user_id="u-1", suggestion_id=good["suggestion_id"])
    bad = [
        rec(FEEDBACK, "x", {"probe": 1}),  # no type
        rec(FEEDBACK, "x", {**feedback, "type": "shrug"}),  # unknown type
        rec(ROLLOUTS, "x", {"suggestion_id": "s"}),  # a rollout missing its fields
        Record(FEEDBACK, 0, 9, "x", _decode(b"not json")),
        Record(FEEDBACK, 0, 10, "x", _decode(b"[1, 2]")),
        Record(FEEDBACK, 0, 11, "x", _decode(None)),
    ]
    with caplog.at_level("WARNING", logger="trainer.join"):
        join.add([bad[0], rec(ROLLOUTS, "u-1", good), *bad[1:], rec(FEEDBACK, "u-1", feedback)])
    assert join.stats.bad_records == len(bad)
    assert "skipping an unreadable record at tabloop.feedback[0]" in caplog.text
    assert list(join.pending) == [good["suggestion_id"]]
    assert join.finalize_due(now=utcnow() + LATER) == 1
    assert _rewarded(engine) == {good["suggestion_id"]: "u-1"}


def test_code_settled_is_neither_awaited_nor_late_and_changes_no_reward(
    engine: sa.Engine,
) -> None:
    """Two like rollouts, one with code_settled reports (before its rollout reached the join,
    while pending, and after its reward was final): same due time, same reward, no late event."""
    from service.events.ingest import ingest_events
    from service.events.schemas import parse_event

    join = Join(engine, RewardSpec(), 1)
    settled_one, plain = _rollout(engine, "u-1"), _rollout(engine, "u-1")

    def feedback(type_: str, r: dict[str, Any], after: float, **kw: Any) -> dict[str, Any]:
        at = datetime.fromisoformat(r["created_at"]) + timedelta(seconds=after)
        return parse_event(
            event(
                type_,
                user_id="u-1",
                suggestion_id=r["suggestion_id"],
                occurred_at=at.isoformat(),
                **kw,
            )
        )

    def deliver(evs: list[dict[str, Any]]) -> None:
        result = ingest_events(engine, evs, api_key_id=None, max_event_bytes=16384, embedded=True)
        assert result.accepted == len(evs), result
        join.add([rec(FEEDBACK, "u-1", e) for e in evs])

    deliver([feedback("code_settled", settled_one, 0.5, after_seconds=0.5, text="early")])
    assert join.early == {}
    join.add([rec(ROLLOUTS, "u-1", r) for r in (settled_one, plain)])
    for r in (settled_one, plain):
        deliver([feedback("accept", r, 1), feedback("code_retained", r, 31, retained_fraction=0.5)])
    deliver([feedback("code_settled", settled_one, 40, after_seconds=40, text="x = 1")])
    pending = [join.pending[r["suggestion_id"]] for r in (settled_one, plain)]
    assert [len(p.events) for p in pending] == [2, 2]
    waits = [p.due - p.rollout.created_at for p in pending if p.due is not None]
    assert len(waits) == 2 and waits[0] == waits[1]

    assert join.finalize_due(now=utcnow() + LATER) == 2
    deliver([feedback("code_settled", settled_one, 3000, after_seconds=3000, text="")])
    join.finalize_due(now=utcnow() + LATER)
    with engine.connect() as conn:
        rows = {r.suggestion_id: r for r in conn.execute(sa.select(rewards)).all()}
    got, want = rows[settled_one["suggestion_id"]], rows[plain["suggestion_id"]]
    assert (got.value, got.outcome, got.components) == (want.value, want.outcome, want.components)
    assert got.outcome == "accepted" and got.value > 0
    assert got.late_events == want.late_events == 0 and join.stats.late_events == 0
    assert join.early == {}
