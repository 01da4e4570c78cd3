"""Rollouts of requests in a language the policy was not trained on: their feedback is joined
and rewarded like any other's, and no batch ever holds one (the policy had no choice)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.completions.rollout import record_rollout, rollout_record
from service.completions.schemas import CompleteRequest
from tabloop.core.db import make_engine, upgrade
from tabloop.core.policy.actions import Completion
from tabloop.core.policy.sampling import STOP_LANGUAGE, unsupported_language
from tabloop.core.registry import bootstrap, current_deployment
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.tables import rewards, utcnow
from tests.service.conftest import make_settings
from trainer import store
from trainer.client import ServiceClient
from trainer.join import Join
from trainer.loop import Trainer, TrainerConfig

LATER = timedelta(hours=1)  # past every window of the default spec


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Trainer]:
    settings = make_settings(tmp_path)
    upgrade(settings)
    engine = make_engine(settings)
    with engine.begin() as conn:
        bootstrap(conn, settings.base_checkpoint)  # v1 live: the versions a batch draws from
    # the client is never called here: nothing is registered or deployed
    yield Trainer(
        settings, engine, ServiceClient("http://127.0.0.1:9", "unused"), TrainerConfig(batch_size=8)
    )
    engine.dispose()


def _sampled(shown: bool) -> Completion:
    """A completion the policy chose (its numbers need not come from a model here)."""
    return Completion(
        text="x)",
        token_ids=[5, 6],
        token_logprobs=[-0.2, -0.3],
        context_token_ids=[1, 2, 3],
        heal_text="",
        temperature=0.7,
        top_p=0.95,
        gate_prob_show=0.6,
        shown=shown,
        decision_logprob=-0.5 if shown else -0.9,
        logprob_total=-1.0 if shown else -1.4,
        stop_reason="newline",
    )


def _record(trainer: Trainer, c: Completion, language: str) -> str:
    sid = str(uuid.uuid4())
    req = CompleteRequest.model_validate(
        {"user_id": "u-1", "language": language, "prefix": "fn main() {"}
    )
    record_rollout(trainer.engine, rollout_record(sid, req, 1, c, 0.1), embedded=True)
    return sid


def test_language_rollouts_are_rewarded_but_never_batched(trainer: Trainer) -> None:
    chosen = [_record(trainer, _sampled(shown=i % 2 == 0), "python") for i in range(4)]
    skipped = [_record(trainer, unsupported_language(0.7, 0.95), "rust") for _ in range(3)]

    join = Join(trainer.engine, RewardSpec(), 1)
    assert join.recover() == 7
    assert join.finalize_due(now=utcnow() + LATER) == 7
    with trainer.engine.connect() as conn:
        outcomes = dict(conn.execute(sa.select(rewards.c.suggestion_id, rewards.c.outcome)).all())
    assert set(outcomes) == set(chosen) | set(skipped)  # every rollout's reward is final
    assert all(outcomes[s] == "abstained" for s in skipped)

    with trainer.engine.connect() as conn:
        dep = current_deployment(conn)
    assert dep is not None
    batch = trainer._batch_rows()
    assert sorted(r.suggestion_id for r in batch) == sorted(chosen)

    # once trained on, the replays (the gate's fit, settled text) read them again: still none
    with trainer.engine.begin() as conn:
        conn.execute(rewards.update().values(trained_at=utcnow()))
    assert {r.suggestion_id for r in store.trained_rows(trainer.engine, 100)} == set(chosen)


def test_an_unsupported_language_rollout_is_a_deterministic_abstention() -> None:
    c = unsupported_language(0.7, 0.95)
    assert c.stop_reason == STOP_LANGUAGE and not c.shown and c.shown_text == ""
    assert c.token_ids == [] and c.context_token_ids == [] and c.token_logprobs == []
    # no choice was sampled: the decision and the action have log-probability 0, as for an
    # empty completion, so nothing in it could carry a gradient
    assert c.decision_logprob == 0.0 and c.logprob_total == 0.0 and c.gate_prob_show == 0.0
