"""Code retention (TABLOOP_CODE_RETENTION_DAYS): code text older than the retention is blanked
in every table that holds it; the rows, the rewards and what they are computed from stay; the
trainer reads no rollout that lost its code, or soon will."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tabloop.core.config import Settings, load_settings
from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.registry import current_deployment
from tabloop.core.retention import (
    STATE_NAME,
    expire_code,
    retention_cutoff,
    run_retention,
)
from tabloop.core.reward_store import current_spec, replay, rollout_info
from tabloop.core.settled import settled_texts
from tabloop.core.stream.kafka import topic_configs
from tabloop.core.stream.topics import FEEDBACK, POLICIES, ROLLOUTS
from tabloop.core.tables import (
    dead_letters,
    events,
    outbox,
    rewards,
    rollouts,
    trainer_state,
    utcnow,
)
from tests.service.codescan import (
    Markers,
    client_for,
    complete_everywhere,
    in_database,
    in_files,
    publish,
    send_feedback,
    showing_checkpoint,
)
from trainer.client import ServiceClient
from trainer.join import Join
from trainer.loop import Trainer, TrainerConfig

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


@pytest.mark.parametrize(
    ("days", "horizon_s", "cutoff", "lengthened"),
    [
        (None, 600, None, False),  # unset: code is kept
        (1, 600, NOW - DAY, False),
        (30, 16, NOW - 30 * DAY, False),
        (1, 86_400, NOW - 2 * DAY, True),  # a day-long reward horizon: kept two
        (2, 86_400, NOW - 2 * DAY, False),  # exactly twice the horizon: as asked
    ],
)
def test_the_cutoff_never_comes_before_the_trainer_is_done(
    days: int | None, horizon_s: float, cutoff: datetime | None, lengthened: bool
) -> None:
    assert retention_cutoff(days, horizon_s, NOW) == (cutoff, lengthened)


@pytest.mark.parametrize("days", [0, -3])
def test_a_retention_under_a_day_is_refused_at_start(days: int) -> None:
    with pytest.raises(SystemExit, match="TABLOOP_CODE_RETENTION_DAYS: .*at least 1"):
        load_settings(code_retention_days=days)


def test_topics_that_carry_code_are_created_with_the_retention(tmp_path: Any) -> None:
    kept = Settings(data_dir=tmp_path, code_retention_days=3)
    assert (
        topic_configs(kept, ROLLOUTS)
        == topic_configs(kept, FEEDBACK)
        == {"retention.ms": str(3 * 86_400_000)}
    )
    assert topic_configs(kept, POLICIES) == {}  # versions and hashes: no code
    assert topic_configs(Settings(data_dir=tmp_path), ROLLOUTS) == {}  # the broker's default


# --- end to end ----------------------------------------------------------------------------


@pytest.fixture
def served_overrides(
    tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """`served` with a policy that shows its suggestions, and a retention of one day."""
    return {
        "base_checkpoint": showing_checkpoint(tiny_tokenizer, tmp_path_factory.mktemp("showing")),
        "code_retention_days": 1,
    }


def _traffic(served: Any, token: str, m: Markers, user: str) -> set[str]:
    """Completions through every API, each accepted, with settled text (one too long)."""
    with client_for(served, token) as c:
        made = complete_everywhere(c, user, m)
        send_feedback(c, user, m, made)
    return {sid for _api, sid, _text in made}


def _rewards(engine: sa.Engine) -> dict[str, tuple[float, str]]:
    with engine.connect() as conn:
        return {r.suggestion_id: (r.value, r.outcome) for r in conn.execute(sa.select(rewards))}


def _state(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return dict(
            conn.execute(
                sa.select(trainer_state.c.info).where(trainer_state.c.name == STATE_NAME)
            ).scalar_one()
        )


def test_retention_blanks_old_code_everywhere_and_keeps_rows_and_rewards(
    served: Any, key_factory: Any, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = served.settings
    _model, tokenizer, _ = load_checkpoint(settings.base_checkpoint)
    old, new = Markers("old"), Markers("new")
    user = f"u-{uuid.uuid4().hex[:8]}"
    token = key_factory("ingest")
    old_ids = _traffic(served, token, old, user)
    engine = make_engine(settings)
    try:
        if mode == "full":
            publish(settings, engine)
        spec_version, spec = current_spec(engine, settings.profile)
        join = Join(engine, spec, spec_version)
        join.recover()
        join.finalize_due(now=utcnow() + timedelta(hours=1))
        before = _rewards(engine)
        assert set(before) == old_ids
        with engine.connect() as conn:
            chars = {
                r.suggestion_id: rollout_info(r).text_chars
                for r in conn.execute(sa.select(rollouts))
            }
        markers = old.all + new.all
        assert in_database(engine, markers, tokenizer)  # stored, before

        # a pass a day and a second later: everything so far is past the retention
        caplog.set_level(logging.INFO, logger="tabloop.core.retention")
        counts = run_retention(settings, engine, now=utcnow() + DAY + timedelta(seconds=1))
        # 3 rollout + 3 settled messages; the one document the person's requests left in the
        # workspace memory is deleted
        assert counts == {
            "rollouts": 3,
            "events": 3,
            "dead_letters": 3,
            "outbox": 6,
            "workspace_code": 1,
        }, counts
        line = next(r for r in caplog.records if r.name == "tabloop.core.retention")
        assert (
            "3 rollouts, 3 settled events, 3 dead letters, 6 outbox messages; deleted 1 workspace"
            in line.getMessage()
        )

        assert in_database(engine, markers, tokenizer) == {}  # no code text left anywhere
        if mode == "embedded":  # zeroed in the file, and gone from the write-ahead log
            assert in_files(settings.data_dir, markers) == set()
        with engine.connect() as conn:
            rows = {r.suggestion_id: r for r in conn.execute(sa.select(rollouts))}
            settled = [
                r.payload
                for r in conn.execute(sa.select(events).where(events.c.type == "code_settled"))
            ]
            n_dead = conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one()
            n_outbox = conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar_one()
        assert set(rows) == old_ids and n_dead == 3 and n_outbox >= 6  # every row stays
        for sid, row in rows.items():
            assert (row.context_token_ids, row.token_ids, row.heal_text, row.text) == (
                [],
                [],
                "",
                "",
            )
            assert row.text_chars == chars[sid] and row.token_logprobs  # numbers stay
        assert all("text" not in p and p["text_withheld"] == "retention" for p in settled)
        assert settled_texts(engine, suggestion_ids=old_ids) == {}

        # the rewards are untouched, and a replay computes the same ones without the code
        assert _rewards(engine) == before
        with engine.connect() as conn:
            again = replay(conn, utcnow() - DAY, utcnow() + DAY, spec)
        assert again["rollouts"] == 3 and again["differ_from_stored"] == 0, again

        # the next pass has nothing left to do; newer code is left alone until its time
        new_ids = _traffic(served, token, new, user)
        if mode == "full":
            publish(settings, engine)
        assert run_retention(settings, engine, now=utcnow()) == dict.fromkeys(
            ("rollouts", "events", "dead_letters", "outbox", "workspace_code"), 0
        )
        assert in_database(engine, new.all, tokenizer)
        assert expire_code(engine, utcnow() + timedelta(seconds=1)) == {
            "rollouts": 3,
            "events": 3,
            "dead_letters": 3,
            "outbox": 6,
            "workspace_code": 1,
        }
        assert in_database(engine, markers, tokenizer) == {}
        assert _state(engine)["last_run"]["blanked"]["rollouts"] == 3
        with engine.connect() as conn:
            assert (
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(rollouts)
                    .where(rollouts.c.suggestion_id.in_(new_ids))
                ).scalar_one()
                == 3
            )
    finally:
        engine.dispose()
    for rec in caplog.records:
        assert not any(m in rec.getMessage() for m in markers), rec.name


@pytest.mark.parametrize("mode", ["full"])
def test_an_unpublished_outbox_row_is_left_to_the_relay(served: Any, key_factory: Any) -> None:
    """The relay reconciles unpublished rows by value: one changed under it could be sent
    twice. The walk stops before the first one, and goes on once it is published."""
    settings = served.settings
    m = Markers("unpub")
    _traffic(served, key_factory("ingest"), m, f"u-{uuid.uuid4().hex[:8]}")
    engine = make_engine(settings)
    try:
        later = utcnow() + timedelta(seconds=1)
        assert expire_code(engine, later)["outbox"] == 0  # type: ignore[index]
        with engine.connect() as conn:
            assert (
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(outbox)
                    .where(outbox.c.published_at.is_(None))
                ).scalar_one()
                > 0
            )
        publish(settings, engine)
        assert expire_code(engine, later)["outbox"] == 6  # type: ignore[index]
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["embedded"])
def test_the_trainer_reads_no_rollout_past_the_retention_or_without_code(
    served: Any, key_factory: Any
) -> None:
    settings = served.settings
    token = key_factory("ingest")
    user = f"u-{uuid.uuid4().hex[:8]}"
    ids = _traffic(served, token, Markers("tr"), user)
    engine = make_engine(settings)
    try:
        spec_version, spec = current_spec(engine, settings.profile)
        join = Join(engine, spec, spec_version)
        join.recover()
        join.finalize_due(now=utcnow() + timedelta(hours=1))
        trainer = Trainer(
            settings,
            engine,
            ServiceClient("http://127.0.0.1:9", "unused"),
            TrainerConfig(batch_size=8),
        )
        with engine.connect() as conn:
            dep = current_deployment(conn)
        assert dep is not None
        assert {r.suggestion_id for r in trainer._batch_rows()} == ids

        # rows older than the retention are not read, blanked yet or not
        aged, blanked, fresh = sorted(ids)
        with engine.begin() as conn:
            conn.execute(
                rollouts.update()
                .where(rollouts.c.suggestion_id == aged)
                .values(created_at=utcnow() - DAY - timedelta(minutes=1))
            )
            # a row blanked (say under an earlier, shorter retention) is skipped, not scored
            conn.execute(
                rollouts.update()
                .where(rollouts.c.suggestion_id == blanked)
                .values(context_token_ids=[], token_ids=[], heal_text="", text="")
            )
        assert {r.suggestion_id for r in trainer._batch_rows()} == {fresh}
        with engine.begin() as conn:
            conn.execute(rewards.update().values(trained_at=utcnow()))
            # the gate fit replays shown ones only: an empty suggestion was not shown
            conn.execute(rollouts.update().values(shown=True))
        trainer.cfg.update.gate_fit, trainer.cfg.update.gate_fit_replay = True, 100
        trainer.cfg.update.settled_epochs, trainer.cfg.update.settled_replay = 1, 100
        for read in (trainer._replay_rows(), trainer._settled_replay_rows()):
            assert {r.suggestion_id for r in read} == {fresh}
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["embedded"])
def test_the_service_runs_the_job_in_the_background(
    settings_factory: Any, service_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tabloop.core.retention.FIRST_RUN_S", 0.05)
    settings = settings_factory(code_retention_days=1)
    service_factory(settings)
    engine = make_engine(settings)
    try:
        deadline = time.monotonic() + 30
        while True:
            with engine.connect() as conn:
                info = conn.execute(
                    sa.select(trainer_state.c.info).where(trainer_state.c.name == STATE_NAME)
                ).scalar()
            if info and info.get("last_run"):
                break
            assert time.monotonic() < deadline, "the retention job did not run"
            time.sleep(0.05)
        assert info["last_run"]["blanked"] == dict.fromkeys(
            ("rollouts", "events", "dead_letters", "outbox"), 0
        )
    finally:
        engine.dispose()
