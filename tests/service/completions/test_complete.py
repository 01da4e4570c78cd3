"""POST /v1/complete: a suggestion per call, each logged as a rollout with its log-probs."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa
import torch

from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.scoring import score_actions
from tabloop.core.stream.topics import ROLLOUTS
from tabloop.core.tables import outbox, rollouts

PREFIX = "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.re"


@pytest.fixture
def api(served: Any, key_factory: Any) -> Any:
    token = key_factory("ingest")
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as c:
        yield c


def complete(c: httpx.Client, **over: Any) -> httpx.Response:
    body = {
        "user_id": "u-1",
        "session_id": "s-1",
        "workspace_id": "w-1",
        "language": "python",
        "file_path": "pkg/mod.py",
        "prefix": PREFIX,
        "suffix": "\n",
        "max_new_tokens": 16,
    }
    body.update(over)
    return c.post("/v1/complete", json={k: v for k, v in body.items() if v is not None})


def test_complete_logs_a_rollout_that_the_policy_reproduces(api: httpx.Client, served: Any) -> None:
    responses = [complete(api, user_id=f"u-{i}").json() for i in range(12)]
    for r in responses:
        assert set(r) == {"suggestion_id", "policy_version", "text", "shown", "latency_ms"}
        assert r["policy_version"] == 1 and r["latency_ms"] > 0
        assert r["shown"] or r["text"] == ""
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        rows = {r.suggestion_id: r for r in conn.execute(sa.select(rollouts)).all()}
        messages = conn.execute(sa.select(outbox).where(outbox.c.topic == ROLLOUTS)).all()
    engine.dispose()
    assert set(rows) == {r["suggestion_id"] for r in responses}
    assert all(row.token_ids for row in rows.values()), "whole lines: every rollout has tokens"
    assert {orjson.loads(m.payload)["suggestion_id"] for m in messages} == set(rows)
    for r in responses:
        row = rows[r["suggestion_id"]]
        assert row.shown == r["shown"] and (row.text if row.shown else "") == r["text"]
        assert abs(row.logprob_total - (sum(row.token_logprobs) + row.decision_logprob)) < 1e-6

    # The behaviour log-probs, recomputed from the stored rollout by a fresh forward pass.
    model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    with torch.no_grad():
        scores = score_actions(model, tokenizer, list(rows.values()))
    # float32 sums differ by order (a cached token-by-token decode against one batched pass):
    # a relative tolerance; a wrong temperature, mask or token would be off by whole nats.
    for row, total in zip(rows.values(), scores.total.tolist(), strict=True):
        assert abs(total - row.logprob_total) <= 1e-4 * max(1.0, abs(row.logprob_total))


def _rollouts(settings: Any) -> list[Any]:
    engine = make_engine(settings)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(rollouts)).all()
    engine.dispose()
    return list(rows)


@pytest.mark.parametrize("served_overrides", [{"stop_logprob": -1.0}])  # the service default
def test_the_confidence_stop_is_applied(api: httpx.Client, served: Any) -> None:
    """TABLOOP_STOP_LOGPROB reaches the sampler: an untrained model is sure of no token, so
    under the default bar every completion stops at the first token it is free to choose: it
    keeps at most the tokens that re-cover the healed end of the prefix (`served` turns the
    stop off, and there every rollout runs on), unless the extend head drew to go on there
    (about one in eight for a checkpoint made before it): that draw is logged either way."""
    responses = [complete(api, user_id=f"u-{i}").json() for i in range(12)]
    rows = _rollouts(served.settings)
    assert {row.suggestion_id for row in rows} == {r["suggestion_id"] for r in responses}
    for row in rows:
        assert row.extend is not None and row.extend["at"] <= len(row.heal_text), row.extend
        if row.extend["extended"]:
            assert row.stop_reason != "confidence", row.stop_reason
        else:
            assert row.stop_reason == "confidence", row.stop_reason
            assert len(row.token_ids) <= len(row.heal_text), (row.token_ids, row.heal_text)
    assert sum(not row.extend["extended"] for row in rows) >= 6  # p(go on) = 0.12


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"prefix": None}, "prefix"),
        ({"user_id": ""}, "user_id"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 10_000}, "max_new_tokens"),
        ({"max_new_tokens": "8"}, "max_new_tokens"),
        ({"prefix": 42}, "prefix"),
        ({"temperature": 2.0}, "temperature"),
    ],
)
def test_bad_requests_get_422(api: httpx.Client, override: dict, needle: str) -> None:
    r = complete(api, **override)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]


def test_long_context_is_capped_not_refused(api: httpx.Client) -> None:
    r = complete(api, prefix="x = 1\n" * 20_000 + "y = ", suffix="z\n" * 5000)
    assert r.status_code == 200, r.text


def test_needs_an_ingest_key(served: Any, key_factory: Any) -> None:
    body = {"user_id": "u", "prefix": "x"}
    assert httpx.post(served.url + "/v1/complete", json=body).status_code == 401
    admin = key_factory("admin")
    r = httpx.post(
        served.url + "/v1/complete", json=body, headers={"Authorization": f"Bearer {admin}"}
    )
    assert r.status_code == 403


def test_no_policy_deployed_is_503(service: Any, key_factory: Any) -> None:
    token = key_factory("ingest")
    r = httpx.post(
        service.url + "/v1/complete",
        json={"user_id": "u", "prefix": "x"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 503 and "Retry-After" in r.headers


SNIPPET = "def connect(host, *, port=5432, timeout=10.0, retries=3):\n    ...\n"


def test_the_policy_copies_from_the_whole_request_and_the_rollout_says_so(
    api: httpx.Client, served: Any
) -> None:
    """A proposal from text far beyond what the model reads (the start of a long prefix) and
    from the request's snippets; the rollout logs it, and its log-prob is recomputed exactly."""
    head = "def load(path):\n    with open(path, encoding='utf-8', errors='replace') as f:\n"
    filler = "".join(f"value_{i} = {i}\n" for i in range(400))  # ~6 KB: past the model's context
    cases = [
        (head + filler + "def save(path):\n    with open(path, encoding='utf-8', err", [], "ors="),
        ("x = connect(host, *, port", [{"filepath": "db.py", "body": SNIPPET}], "=5432, timeout="),
    ]
    ids: dict[str, str] = {}
    for prefix, snippets, start in cases:
        for i in range(8):
            r = complete(api, user_id=f"u-{i}", prefix=prefix, suffix="", snippets=snippets)
            assert r.status_code == 200, r.text
            ids[r.json()["suggestion_id"]] = start
    rows = {row.suggestion_id: row for row in _rollouts(served.settings)}
    copied = 0
    for sid, start in ids.items():
        row = rows[sid]
        assert row.recall is not None and row.recall["text"].startswith(start), row.recall
        if row.recall["copied"]:
            copied += 1
            more = (row.recall.get("lines") or {}).get("more")  # the lines after, when drawn
            want = row.recall["text"] + ("\n" + row.recall["more"] if more else "")
            assert row.shown and row.text == want
    assert copied, "a long exact match is copied more often than not"
    model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    with torch.no_grad():
        scores = score_actions(model, tokenizer, [rows[sid] for sid in ids])
    for sid, total in zip(ids, scores.total.tolist(), strict=True):
        assert abs(total - rows[sid].logprob_total) <= 1e-4 * max(1.0, abs(rows[sid].logprob_total))


@pytest.mark.parametrize(
    ("snippets", "needle"),
    [
        ("def f(): pass", "snippets"),
        ([{"filepath": "a.py"}], "snippets.0.body"),
        ([{"body": 42}], "snippets.0.body"),
        ([{"body": "x"}] * 65, "snippets"),
    ],
)
def test_snippets_of_the_wrong_type_get_422_naming_the_field(
    api: httpx.Client, snippets: Any, needle: str
) -> None:
    r = complete(api, snippets=snippets)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]


def test_oversized_snippets_are_cut_and_an_oversized_body_is_413(api: httpx.Client) -> None:
    # within the body limit (2 MB): served, the proposal reading TABLOOP_MAX_RECALL_CHARS of them
    big = [{"filepath": f"{i}.py", "body": "x = 1\n" * 50_000} for i in range(3)]  # 900 KB
    r = complete(api, snippets=big)
    assert r.status_code == 200, r.text
    # past it: refused whole before it is parsed
    r = complete(api, snippets=[{"body": "y" * 900_000}] * 3)
    assert r.status_code == 413, r.text
