"""Languages and the suffix at serving: a request in a language the routed policy was not
trained on abstains without a model call and is still a recorded rollout; a checkpoint trained
for fill-in-the-middle reads the suffix, and its logged rollouts rescore exactly."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import torch
from prometheus_client import REGISTRY

from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import load_checkpoint, save_checkpoint
from tabloop.core.policy.context import SUFFIX_SHARE, following_lines
from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.sampling import DEFAULT_MAX_CONTEXT_TOKENS, STOP_LANGUAGE
from tabloop.core.policy.scoring import score_actions
from tabloop.core.registry import bootstrap
from tabloop.core.stream.topics import ROLLOUTS
from tabloop.core.tables import outbox, rollouts, utcnow
from trainer.pretrain import PretrainConfig, pretrain

PREFIX = "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.re"
SUFFIX = "ad()  # the rest of this line\n\n\ndef write(path, text):\n    pass\n"


def _client(svc: Any, key_factory: Any) -> httpx.Client:
    token = key_factory("ingest")
    return httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.fixture
def api(served: Any, key_factory: Any) -> Iterator[httpx.Client]:
    with _client(served, key_factory) as c:
        yield c


def complete(c: httpx.Client, **over: Any) -> dict[str, Any]:
    body = {
        "user_id": "u-1",
        "language": "python",
        "file_path": "pkg/mod.py",
        "prefix": PREFIX,
        "suffix": SUFFIX,
        "max_new_tokens": 12,
        **over,
    }
    r = c.post("/v1/complete", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _rows(settings: Any) -> dict[str, Any]:
    engine = make_engine(settings)
    with engine.connect() as conn:
        rows = {r.suggestion_id: r for r in conn.execute(sa.select(rollouts)).all()}
    engine.dispose()
    return rows


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_another_language_abstains_without_a_model_call_and_is_recorded(
    api: httpx.Client, served: Any
) -> None:
    inferences = _sample("tabloop_complete_inference_seconds_count")
    unsupported = {
        lang: _sample("tabloop_complete_unsupported_language_total", language=lang)
        for lang in ("rust", "plaintext", "other")
    }
    answers = {
        lang: complete(api, language=lang) for lang in ("rust", "plaintext", "Klingon-Script")
    }
    for r in answers.values():
        assert r["shown"] is False and r["text"] == ""
    assert _sample("tabloop_complete_inference_seconds_count") == inferences  # no model call
    for lang in unsupported:
        after = _sample("tabloop_complete_unsupported_language_total", language=lang)
        assert after == unsupported[lang] + 1, lang

    rows = _rows(served.settings)
    for lang, r in answers.items():
        row = rows[r["suggestion_id"]]
        assert row.stop_reason == STOP_LANGUAGE and row.language == lang and not row.shown
        assert row.token_ids == [] and row.context_token_ids == [] and row.text == ""
        assert row.logprob_total == 0.0 and row.decision_logprob == 0.0
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        published = conn.execute(sa.select(outbox.c.key).where(outbox.c.topic == ROLLOUTS)).all()
    engine.dispose()
    assert len(published) == len(answers)  # on the rollouts topic: its feedback joins

    # what the person wrote there is taken like any other suggestion's; a judgment of it is
    # refused: nothing was shown
    at = utcnow().isoformat()
    settled, reject = (
        {
            "event_id": str(uuid.uuid4()),
            "type": t,
            "user_id": "u-1",
            "suggestion_id": answers["rust"]["suggestion_id"],
            "occurred_at": at,
        }
        for t in ("code_settled", "reject")
    )
    resp = api.post(
        "/v1/events", json={"events": [{**settled, "after_seconds": 5, "text": "}"}, reject]}
    )
    assert resp.status_code == 202 and resp.json()["accepted"] == 1, resp.text
    assert resp.json()["rejected"][0]["error"].startswith("refused (not_shown)")


@pytest.mark.parametrize(
    ("language", "file_path"),
    [
        ("python", "pkg/mod.py"),
        ("Python", None),  # VS Code ids are lower case; a client's capitals are forgiven
        ("py", None),  # an extension for a name
        (None, None),  # nothing says: served
        (None, "pkg/mod.py"),  # the extension says python
        (None, "notes.unknownext"),  # an extension naming no language: served
        ("python", "src/main.rs"),  # the language field wins over the extension
    ],
)
def test_python_and_unknown_languages_are_served(
    api: httpx.Client, served: Any, language: str | None, file_path: str | None
) -> None:
    r = complete(api, language=language, file_path=file_path)
    row = _rows(served.settings)[r["suggestion_id"]]
    assert row.stop_reason != STOP_LANGUAGE and row.token_ids and row.context_token_ids


def test_without_a_language_the_file_extension_decides(api: httpx.Client, served: Any) -> None:
    r = complete(api, language=None, file_path="src/main.rs")
    assert _rows(served.settings)[r["suggestion_id"]].stop_reason == STOP_LANGUAGE


def _start(settings_factory: Any, service_factory: Any, checkpoint: Path) -> Any:
    settings = settings_factory(
        base_checkpoint=checkpoint, policy_poll_interval_s=0.2, stop_logprob=float("-inf")
    )
    engine = make_engine(settings)
    with engine.begin() as conn:
        assert bootstrap(conn, checkpoint) == 1
    engine.dispose()
    return service_factory(settings)


def test_a_policy_trained_on_rust_serves_rust_and_not_python(
    settings_factory: Any,
    service_factory: Any,
    key_factory: Any,
    tiny_tokenizer: Any,
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tiny_tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32
    )
    ckpt = save_checkpoint(
        tmp_path / "rust",
        GPT(cfg).eval(),
        tiny_tokenizer,
        version=0,
        parent=None,
        languages=["rust"],
    )
    svc = _start(settings_factory, service_factory, ckpt)
    with _client(svc, key_factory) as c:
        rust = complete(c, language="rust", file_path="src/main.rs")
        python = complete(c, language="python")
    rows = _rows(svc.settings)
    assert rows[rust["suggestion_id"]].stop_reason != STOP_LANGUAGE
    assert rows[python["suggestion_id"]].stop_reason == STOP_LANGUAGE


@pytest.fixture(scope="module")
def fim_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few seconds of FIM pretraining on a few standard-library files (the real code path)."""
    return pretrain(
        PretrainConfig(
            out_dir=tmp_path_factory.mktemp("fim") / "base",
            max_files=6,
            vocab_size=300,
            batch_size=4,
            max_iters=8,
            warmup_iters=2,
            eval_every=100,
            gate_examples=8,
            fim_rate=0.5,
            progress=False,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64),
        )
    )


def test_a_fim_policy_reads_the_suffix_and_its_rollouts_rescore_exactly(
    settings_factory: Any, service_factory: Any, key_factory: Any, fim_checkpoint: Path
) -> None:
    model, tokenizer, manifest = load_checkpoint(fim_checkpoint)
    assert manifest.fim and tokenizer.fim_ids is not None
    pre, suf, mid = tokenizer.fim_ids
    svc = _start(settings_factory, service_factory, fim_checkpoint)
    suffixes = [SUFFIX, "", "\n" * 3 + "x = 1\n" * 40, ")\n    return data\n"]
    requests = [(s, 4 + i) for i, s in enumerate(suffixes * 3)]
    with _client(svc, key_factory) as c:
        answers = [
            complete(c, user_id=f"u-{i}", suffix=s, max_new_tokens=n)
            for i, (s, n) in enumerate(requests)
        ]
    rows = _rows(svc.settings)
    for r, (suffix, n) in zip(answers, requests, strict=True):
        budget = min(DEFAULT_MAX_CONTEXT_TOKENS, model.config.block_size - n)
        ctx = rows[r["suggestion_id"]].context_token_ids
        assert len(ctx) <= budget
        assert ctx[0] == pre and ctx[-1] == mid and ctx.count(suf) == 1
        read = ctx[ctx.index(suf) + 1 : -1]
        assert len(read) <= budget // SUFFIX_SHARE
        # the head of the lines after the cursor's line, never the rest of that line
        assert read == tokenizer.encode(following_lines(suffix))[: len(read)]
        assert bool(read) == bool(following_lines(suffix))

    # the logged behaviour log-probs, recomputed from the stored ids alone
    logged = list(rows.values())
    with torch.no_grad():
        scores = score_actions(model, tokenizer, logged)
    for row, total in zip(logged, scores.total.tolist(), strict=True):
        assert abs(total - row.logprob_total) <= 1e-4 * max(1.0, abs(row.logprob_total))
