"""Privacy mode (`no_train`): a key, a header or a body field; the request is served and
recorded, none of its code is stored anywhere, and no training read ever returns it.

The end-to-end test sends code holding distinctive markers through every completion API, with a
no_train key and with a plain key plus the header or body field, then feedback and settled
text about each, and a control request that is stored as usual. It then looks for the markers
(as text, and inside any token-id list, decoded) in every column of every table, the raw
SQLite files, both Kafka topics, and the logs; and it drives the trainer's batch builder."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.privacy import (
    parse_no_train,
    raw_without_text,
    rollout_without_code,
    settled_without_text,
)
from tabloop.core.registry import current_deployment
from tabloop.core.reward_store import current_spec, rollout_info
from tabloop.core.settled import settled_texts
from tabloop.core.tables import rewards, rollouts, utcnow
from tabloop.testing.factories import event
from tests.service.codescan import (
    Markers,
    client_for,
    complete_everywhere,
    in_database,
    in_files,
    in_topics,
    publish,
    send_feedback,
    showing_checkpoint,
)
from trainer import store
from trainer.client import ServiceClient
from trainer.join import Join
from trainer.loop import Trainer, TrainerConfig

# --- the pure parts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        ("1", True),
        ("true", True),
        ("Yes", True),
        (" on ", True),
        ("0", False),
        ("FALSE", False),
        ("no", False),
        ("off", False),
    ],
)
def test_the_header_value(value: str | None, expected: bool) -> None:
    assert parse_no_train(value) is expected


@pytest.mark.parametrize("value", ["", "2", "y", "please", "no-train"])
def test_a_header_value_that_says_neither_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="X-Tabloop-No-Train"):
        parse_no_train(value)


def test_a_rollout_without_code_keeps_everything_else() -> None:
    record = {
        "suggestion_id": "s",
        "user_id": "u",
        "context_token_ids": [1, 2],
        "heal_text": "re",
        "token_ids": [3, 4],
        "token_logprobs": [-0.1, -0.2],
        "text": "turn x",
        "shown": True,
        "recall": {"text": "turn x", "inputs": [0.0], "copied": True, "logprob": -0.1},
        "person": {"gate": [0.5], "copy": None, "history": {"outcomes": [], "since_s": 3.0}},
        "logprob_total": -0.3,
        "no_train": True,
    }
    blank = rollout_without_code(record)
    assert blank == {
        **record,
        "context_token_ids": [],
        "heal_text": "",
        "token_ids": [],
        "text": "",
        "recall": None,
        "person": None,
        "text_chars": 6,
    }
    assert rollout_without_code(blank) == blank  # the length survives a second pass


def test_settled_text_is_replaced_by_its_length_and_why() -> None:
    settled = event("code_settled", text="x = 1")
    out = settled_without_text(settled, "retention")
    assert "text" not in out and out["text_chars"] == 5 and out["text_withheld"] == "retention"
    assert {k: v for k, v in out.items() if k not in ("text_chars", "text_withheld")} == {
        k: v for k, v in settled.items() if k != "text"
    }
    accept = event("accept")
    assert settled_without_text(accept, "no_train") is accept
    # a dead letter's raw event, whatever its type claims; other raw text is kept as it was
    raw = orjson.dumps(event("code_settled", text="secret()") | {"type": "code_setled"}).decode()
    assert "secret" not in raw_without_text(raw, "no_train")
    assert raw_without_text("not json", "no_train") == "not json"
    assert raw_without_text('["text"]', "no_train") == '["text"]'


# --- end to end ----------------------------------------------------------------------------


@pytest.fixture
def served_overrides(
    tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """`served` with a policy that shows its suggestions (feedback can judge them)."""
    return {
        "base_checkpoint": showing_checkpoint(tiny_tokenizer, tmp_path_factory.mktemp("showing"))
    }


@pytest.fixture
def admin(served: Any, key_factory: Any) -> Iterator[httpx.Client]:
    with client_for(served, key_factory("admin")) as c:
        yield c


def test_no_train_stores_no_code_in_any_table_topic_file_or_log_and_is_never_trained(
    served: Any,
    admin: httpx.Client,
    key_factory: Any,
    mode: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.WARNING, logger="kafka")  # as setup_logging sets it: its debug
    # lines print whole messages (the control's code), not ours
    settings = served.settings
    _model, tokenizer, _ = load_checkpoint(settings.base_checkpoint)
    private, control = Markers("priv"), Markers("ctl")
    user = f"u-{uuid.uuid4().hex[:8]}"

    # a no_train key, made through the admin API; and a plain one
    r = admin.post(
        "/admin/keys", json={"name": "private-laptop", "scopes": ["ingest"], "no_train": True}
    )
    assert r.status_code == 201 and r.json()["no_train"] is True, r.text
    private_token = r.json()["token"]
    listed = {k["id"]: k for k in admin.get("/admin/keys").json()}
    assert listed[r.json()["id"]]["no_train"] is True
    plain_token = key_factory("ingest")

    made: list[tuple[str, str, str]] = []  # private rollouts: (api, id, text shown)
    with client_for(served, private_token) as c:  # the key
        got = complete_everywhere(c, user, private)
        send_feedback(c, user, private, got)
        made += got
    with client_for(served, plain_token, **{"X-Tabloop-No-Train": "1"}) as c:  # the header
        got = complete_everywhere(c, user, private)
        send_feedback(c, user, private, got)
        made += got
    with client_for(served, plain_token) as c:  # the body field, then the control
        # Tabby's body has no such field
        got = complete_everywhere(c, user, private, tabby=False, no_train=True)
        send_feedback(c, user, private, got)
        made += got
        kept = complete_everywhere(c, user, control)
        send_feedback(c, user, control, kept)
    private_ids = {sid for _api, sid, _text in made}
    kept_ids = {sid for _api, sid, _text in kept}
    assert len(private_ids) == 8 and len(kept_ids) == 3

    engine = make_engine(settings)
    try:
        if mode == "full":
            publish(settings, engine)

        # recorded, without code: the length of what was shown stands in for it
        with engine.connect() as conn:
            rows = {
                r.suggestion_id: r
                for r in conn.execute(sa.select(rollouts).where(rollouts.c.user_id == user))
            }
        assert set(rows) == private_ids | kept_ids
        for _api, sid, text in made:
            row = rows[sid]
            assert row.no_train is True and row.api_key_id is not None
            assert (row.context_token_ids, row.token_ids, row.heal_text, row.text) == (
                [],
                [],
                "",
                "",
            )
            assert row.text_chars == len(text) and rollout_info(row).text_chars == len(text)
        for sid in kept_ids:
            assert not rows[sid].no_train and rows[sid].context_token_ids

        # the markers: the control's everywhere it is kept, the private ones nowhere
        everything = private.all + control.all
        tables = in_database(engine, everything, tokenizer)
        assert set().union(*tables.values()).isdisjoint(private.all), tables
        assert {control.prefix, control.settled} <= tables["rollouts.context_token_ids"] | tables[
            "events.payload"
        ], tables  # the scan sees what is stored
        assert control.prefix in tables["rollouts.context_token_ids"]  # through the token ids
        assert control.settled in tables["dead_letters.raw"]
        if mode == "embedded":
            assert control.prefix in tables["outbox.payload"]
            files = in_files(settings.data_dir, everything)
            assert files.isdisjoint(private.all) and control.settled in files
        else:
            topics = in_topics(settings, everything, tokenizer)
            assert set().union(*topics.values()).isdisjoint(private.all), topics
            assert {control.prefix, control.settled} <= set().union(*topics.values())

        # feedback joins and is rewarded, for the metrics; the trainer never reads it
        spec_version, spec = current_spec(engine, settings.profile)
        join = Join(engine, spec, spec_version)
        join.recover()
        join.finalize_due(now=utcnow() + timedelta(hours=1))
        with engine.connect() as conn:
            outcome = dict(
                conn.execute(
                    sa.select(rewards.c.suggestion_id, rewards.c.outcome).where(
                        rewards.c.user_id == user
                    )
                ).all()
            )
            value = dict(
                conn.execute(
                    sa.select(rewards.c.suggestion_id, rewards.c.value).where(
                        rewards.c.user_id == user
                    )
                ).all()
            )
        assert set(outcome) == private_ids | kept_ids
        for _api, sid, text in made:
            if text:  # an accepted suggestion is worth its size, known without its text
                assert outcome[sid] == "accepted" and value[sid] > 0, (sid, outcome[sid])

        trainer = Trainer(
            settings,
            engine,
            ServiceClient("http://127.0.0.1:9", "unused"),
            TrainerConfig(batch_size=8),
        )
        trainer.cfg.update.gate_fit, trainer.cfg.update.gate_fit_replay = True, 1000
        trainer.cfg.update.settled_epochs, trainer.cfg.update.settled_replay = 1, 1000
        with engine.connect() as conn:
            dep = current_deployment(conn)
        assert dep is not None
        batch = trainer._batch_rows()
        assert {r.suggestion_id for r in batch} & (private_ids | kept_ids) == kept_ids
        with engine.begin() as conn:
            conn.execute(
                rewards.update().where(rewards.c.user_id == user).values(trained_at=utcnow())
            )
        shown = {sid for sid in kept_ids if rows[sid].shown}  # the gate's fit replays these
        for read, expected in (
            (trainer._replay_rows(), shown),
            (trainer._settled_replay_rows(), kept_ids),
            (store.trained_rows(trainer.engine, 1000), kept_ids),
        ):
            assert {r.suggestion_id for r in read} & (private_ids | kept_ids) == expected
        texts = settled_texts(engine, suggestion_ids=private_ids | kept_ids)
        assert set(texts) == kept_ids  # a withheld text is no settled text
    finally:
        engine.dispose()

    for rec in caplog.records:
        assert not any(m in repr(vars(rec)) for m in everything), rec.name


@pytest.mark.parametrize("mode", ["embedded"])
def test_a_header_that_says_neither_is_refused_on_every_api(served: Any, key_factory: Any) -> None:
    with client_for(served, key_factory("ingest"), **{"X-Tabloop-No-Train": "maybe"}) as c:
        native = c.post("/v1/complete", json={"user_id": "u-1", "prefix": "x = "})
        tabby = c.post("/tabby/v1/completions", json={"segments": {"prefix": "x = "}})
        oa = c.post("/openai/v1/completions", json={"prompt": "x = "})
    assert native.status_code == 422 and tabby.status_code == 422, (native.text, tabby.text)
    assert oa.status_code == 400 and oa.json()["error"]["type"] == "invalid_request_error"
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(rollouts)).scalar_one() == 0
    engine.dispose()


@pytest.mark.parametrize("mode", ["embedded"])
def test_a_no_train_key_cannot_be_talked_out_of_it(served: Any, admin: httpx.Client) -> None:
    token = admin.post(
        "/admin/keys", json={"name": "p", "scopes": ["ingest"], "no_train": True}
    ).json()["token"]
    with client_for(served, token, **{"X-Tabloop-No-Train": "0"}) as c:
        r = c.post("/v1/complete", json={"user_id": "u-1", "prefix": "x = ", "no_train": False})
    assert r.status_code == 200, r.text
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        row = conn.execute(sa.select(rollouts.c.no_train, rollouts.c.context_token_ids)).one()
    engine.dispose()
    assert row.no_train is True and row.context_token_ids == []


def test_a_database_error_never_carries_the_values(settings: Any) -> None:
    """An unexpected database error is logged with its traceback (the 500 handler): its
    message must not hold the statement's values, which can be code."""
    engine = make_engine(settings)
    row = {
        "suggestion_id": str(uuid.uuid4()),
        "user_id": "u-1",
        "policy_version": 1,
        "created_at": utcnow(),
        "context_token_ids": [1],
        "heal_text": "",
        "token_ids": [2],
        "token_logprobs": [-0.1],
        "text": "secret_code_4c1e()",
        "shown": True,
        "gate_prob_show": 0.9,
        "decision_logprob": -0.1,
        "logprob_total": -0.2,
        "temperature": 0.7,
        "top_p": 0.95,
        "stop_reason": "newline",
        "latency_ms": 1.0,
    }
    try:
        with engine.begin() as conn:
            conn.execute(rollouts.insert().values(**row))
        with pytest.raises(sa.exc.IntegrityError) as raised, engine.begin() as conn:
            conn.execute(rollouts.insert().values(**row))  # the same id again
    finally:
        engine.dispose()
    assert "secret_code_4c1e" not in str(raised.value)
    assert "hidden due to hide_parameters" in str(raised.value)
