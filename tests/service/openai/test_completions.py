"""POST /openai/v1/completions through the official `openai` SDK, over real sockets: each call is
a rollout of the live policy, its id the suggestion id native feedback events name."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import sqlalchemy as sa
import torch

from tabloop.client import Client, EventSender
from tabloop.core.db import make_engine
from tabloop.core.policy.actions import bytes_to_text, completion_bytes
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.scoring import score_actions
from tabloop.core.reward_store import current_spec, reward_from_db, rollout_info
from tabloop.core.tables import events, rollouts

PREFIX = "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.re"
# Characters an untrained model's random tokens are all but sure to hold: a stop cuts them.
COMMON = [" ", "e", "t", "a", "o", "i", "n", "s", "r", "(", ".", "_", ":", "l", "d", "c"]


@pytest.fixture
def served_overrides(showing_checkpoint: Path) -> dict[str, Any]:
    return {"base_checkpoint": showing_checkpoint}


@pytest.fixture
def token(key_factory: Any) -> str:
    return key_factory("ingest", name="vscode-alice")  # type: ignore[no-any-return]


@pytest.fixture
def sdk(served: Any, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/openai/v1", api_key=token, max_retries=0)


def rollout_rows(served: Any) -> dict[str, Any]:
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        rows = {r.suggestion_id: r for r in conn.execute(sa.select(rollouts)).all()}
    engine.dispose()
    return rows


def sampled_text(served: Any, row: Any) -> str:
    """The whole sampled rest of the line, recomputed from the rollout's tokens, with a NUL
    byte stored as U+FFFD as the service stores it (PostgreSQL text refuses NUL)."""
    _model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    text = bytes_to_text(completion_bytes(tokenizer, row.token_ids, row.heal_text.encode()))
    return text.replace("\x00", "\ufffd")


def test_sdk_completion_then_native_feedback_joins_the_rollout(served: Any, token: str) -> None:
    """The snippets of docs/EDITORS.md, as written there (HOST and the key filled in)."""
    client = openai.OpenAI(base_url=served.url + "/openai/v1", api_key=token)
    for _ in range(5):  # this policy shows every suggestion, unless its first token ends the line
        completion = client.completions.create(
            model="tabloop",
            prompt="def add(a, b):\n    return a",
            suffix="\n",
            max_tokens=16,
            stop=["\n\n"],
            user="u-42",
        )
        text = completion.choices[0].text  # "" when the policy abstains
        if text:
            break
    assert text
    assert str(uuid.UUID(completion.id)) == completion.id
    assert completion.object == "text_completion" and completion.model == "tabloop-v1"
    assert completion.created > 0 and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.index == 0 and choice.logprobs is None
    assert choice.finish_reason in ("stop", "length")
    row = rollout_rows(served)[completion.id]
    assert row.user_id == "u-42" and row.shown and row.text == text
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(row.context_token_ids)
    assert completion.usage.completion_tokens == len(row.token_ids) <= 16
    assert completion.usage.total_tokens == len(row.context_token_ids) + len(row.token_ids)

    async def accept(suggestion_id: str) -> None:
        # the sender delivers what is queued when the block ends
        async with Client(served.url, token) as tabloop, EventSender(tabloop) as sender:
            sender.add({"type": "accept", "user_id": "u-42", "suggestion_id": suggestion_id})

    asyncio.run(accept(completion.id))

    engine = make_engine(served.settings)
    with engine.begin() as conn:
        joined = conn.execute(
            sa.select(events.c.type, events.c.user_id, rollouts.c.user_id)
            .join(rollouts, rollouts.c.suggestion_id == events.c.suggestion_id)
            .where(events.c.suggestion_id == completion.id)
        ).all()
        assert [tuple(j) for j in joined] == [("accept", "u-42", "u-42")]
        _version, spec = current_spec(conn, served.settings.profile)
        reward = reward_from_db(conn, rollout_info(row), spec)
    engine.dispose()
    assert reward.outcome == "accepted" and reward.value > 0


def test_the_person_is_user_or_else_the_key_name(sdk: openai.OpenAI, served: Any) -> None:
    named = sdk.completions.create(model="tabloop", prompt=PREFIX, user="bob")
    unnamed = sdk.completions.create(model="tabloop", prompt=PREFIX)
    rows = rollout_rows(served)
    assert rows[named.id].user_id == "bob"
    assert rows[unnamed.id].user_id == "vscode-alice"


def test_a_client_that_reports_views_says_so(sdk: openai.OpenAI, served: Any) -> None:
    """tabloop's own `reports_views`, sent as an extra field (Continue: extraBodyProperties)."""
    viewing = sdk.completions.create(
        model="tabloop", prompt=PREFIX, extra_body={"reports_views": True}
    )
    plain = sdk.completions.create(model="tabloop", prompt=PREFIX)
    rows = rollout_rows(served)
    assert rows[viewing.id].reports_views is True and not rows[plain.id].reports_views


def test_stop_cuts_the_text_shown_and_the_rollout_stored(sdk: openai.OpenAI, served: Any) -> None:
    answers = [
        sdk.completions.create(model="tabloop", prompt=PREFIX, stop=COMMON, user=f"u{i}")
        for i in range(8)
    ]
    rows = rollout_rows(served)
    model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    cut = 0
    for a in answers:
        row, text = rows[a.id], a.choices[0].text
        assert not any(s in text for s in COMMON), text
        assert text == (row.text if row.shown else "")
        assert a.choices[0].finish_reason == "stop"
        whole = sampled_text(served, row)
        assert whole.startswith(row.text)
        if whole != row.text:  # cut before the first stop string in what was sampled
            cut += 1
            assert min(whole.find(s) for s in COMMON if s in whole) == len(row.text)
    assert cut >= 1, "no completion held a stop string"
    # the tokens are recorded whole: the behaviour log-probs still reproduce
    with torch.no_grad():
        scores = score_actions(model, tokenizer, [rows[a.id] for a in answers])
    for a, total in zip(answers, scores.total.tolist(), strict=True):
        logged = rows[a.id].logprob_total
        assert abs(total - logged) <= 1e-4 * max(1.0, abs(logged))


def test_sampling_knobs_are_validated_then_the_policy_samples_its_own_way(
    sdk: openai.OpenAI, served: Any
) -> None:
    a = sdk.completions.create(
        model="tabloop",
        prompt=PREFIX,
        temperature=0.01,
        top_p=0.1,
        presence_penalty=1.0,
        frequency_penalty=-1.0,
        seed=7,
    )
    row = rollout_rows(served)[a.id]
    assert row.temperature == served.settings.temperature and row.top_p == served.settings.top_p


def test_max_tokens_is_bounded_by_the_server_limit(sdk: openai.OpenAI, served: Any) -> None:
    a = sdk.completions.create(model="tabloop", prompt="x = [" + "1, " * 5, max_tokens=100_000)
    assert len(rollout_rows(served)[a.id].token_ids) <= served.settings.max_new_tokens_limit


def test_a_fill_in_the_middle_prompt_is_read_as_prefix_and_suffix(
    sdk: openai.OpenAI, served: Any
) -> None:
    """What Continue sends by default: the policy reads the prefix, not the markers."""
    prefix = "def add(a, b):\n    return a"
    a = sdk.completions.create(
        model="tabloop", prompt=f"<fim_prefix>{prefix}<fim_suffix>\n\nprint(1)<fim_middle>"
    )
    row = rollout_rows(served)[a.id]
    _model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    seen = [t for t in row.context_token_ids if t != tokenizer.eof_id]
    assert tokenizer.decode_bytes(seen).decode() + row.heal_text == prefix


def test_streaming_answers_server_sent_events(sdk: openai.OpenAI, served: Any, token: str) -> None:
    chunks = list(
        sdk.completions.create(
            model="tabloop", prompt=PREFIX, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    row = rollout_rows(served)[ids.pop()]
    assert text == (row.text if row.shown else "")
    assert chunks[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(row.token_ids)

    raw = httpx.post(
        served.url + "/openai/v1/completions",
        timeout=30,
        json={"model": "tabloop", "prompt": PREFIX, "stream": True},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    frames = raw.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    first = orjson.loads(frames[0].removeprefix("data: "))
    assert first["object"] == "text_completion" and "usage" not in first


@pytest.mark.parametrize("served_overrides", [{}])  # the tiny policy, which abstains
def test_an_abstention_is_one_choice_with_empty_text(sdk: openai.OpenAI, served: Any) -> None:
    a = sdk.completions.create(model="tabloop", prompt=PREFIX, max_tokens=4)
    row = rollout_rows(served)[a.id]
    assert not row.shown  # sampled (and recorded), then withheld
    assert [(c.text, c.finish_reason) for c in a.choices] == [("", "stop")]
    assert a.usage is not None and a.usage.completion_tokens == len(row.token_ids) > 0


def test_what_continue_sends_for_autocomplete(served: Any, token: str) -> None:
    """Continue's autocomplete request to an `openai` provider with a model name it maps to no
    family: its default fill-in-the-middle template, ten stop strings, temperature 0.01, a large
    max_tokens, streamed; read as Continue reads the stream (each `data:` line's
    choices[0].text)."""
    prefix = "# Path: util.py\n# def helper(): ...\n\ndef add(a, b):\n    return a"
    body = {
        "model": "tabloop",
        "max_tokens": 4096,
        "temperature": 0.01,
        "stream": True,
        "stop": [
            "<fim_prefix>",
            "<fim_suffix>",
            "<fim_middle>",
            "<file_sep>",
            "<|endoftext|>",
            "</fim_middle>",
            "</code>",
            "/src/",
            "#- coding: utf-8",
            "```",
        ],
        "prompt": f"<fim_prefix>{prefix}<fim_suffix>\n<fim_middle>",
    }
    r = httpx.post(
        served.url + "/openai/v1/completions",
        json=body,
        timeout=30,
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 200, r.text
    chunks = [
        orjson.loads(line.removeprefix("data:"))
        for line in r.text.split("\n")
        if line.startswith("data:") and line != "data: [DONE]"
    ]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    row = rollout_rows(served)[chunks[0]["id"]]
    assert text == (row.text if row.shown else "") and row.user_id == "vscode-alice"
    assert row.temperature == served.settings.temperature
    _model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    seen = [t for t in row.context_token_ids if t != tokenizer.eof_id]
    assert (tokenizer.decode_bytes(seen).decode() + row.heal_text).endswith("    return a")


def test_n_other_than_1_is_a_bad_request(sdk: openai.OpenAI, served: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="tabloop", prompt=PREFIX, n=2)
    assert e.value.status_code == 400 and e.value.param == "n"
    assert e.value.type == "invalid_request_error"
    assert "n: only 1 is supported" in e.value.message
    assert rollout_rows(served) == {}  # refused before any rollout


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": 42}, "prompt", "list of exactly one string"),
        ({"prompt": ["a", "b"]}, "prompt", "list of exactly one string"),
        ({"prompt": [[1, 2]]}, "prompt", "list of exactly one string"),
        ({"prompt": []}, "prompt", "list of exactly one string"),
        ({"prompt": "a\x00b"}, "prompt", "NUL"),
        ({}, "prompt", "prompt: required"),
        ({"prompt": "x", "stop": 5}, "stop", "a string or a list of strings"),
        ({"prompt": "x", "stop": [""]}, "stop", "at least 1 character"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop", "at most 16"),
        ({"prompt": "x", "max_tokens": "8"}, "max_tokens", "integer"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "number"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ({"prompt": "x", "n": True}, "n", "only 1"),
        ({"prompt": "x", "best_of": 3}, "best_of", "only 1"),
        ({"prompt": "x", "echo": True}, "echo", "not echoed"),
        ({"prompt": "x", "echo": 0}, "echo", "not echoed"),
        ({"prompt": "x", "logprobs": 1}, "logprobs", "not returned"),
        ({"prompt": "x", "logit_bias": {"50256": -100}}, "logit_bias", "not supported"),
        ({"prompt": "x", "user": ""}, "user", "user"),
        ({"prompt": "x", "user": 5}, "user", "string"),
        ({"prompt": "x", "stream": "yes"}, "stream", "boolean"),
        ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options", "boolean"),
        ({"prompt": "x", "model": ["m"]}, "model", "string"),
        ({"prompt": "<fim_prefix>a<fim_suffix>b<fim_middle>", "suffix": "c"}, "suffix", "twice"),
        ({"prompt": "<fim_prefix>a<fim_middle>"}, "prompt", "exactly once"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(
    served: Any, token: str, body: dict[str, Any], param: str, needle: str
) -> None:
    r = httpx.post(
        served.url + "/openai/v1/completions",
        json=body,
        timeout=30,
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert needle in error["message"], error["message"]


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"not json", None),
        (b"[1, 2]", None),
        (b'"prompt"', None),
        (b"{", None),
        (b"", None),
        (b"[" * 100_000, None),
        (b'{"prompt": "\xc3\x28"}', None),  # not UTF-8
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
        (b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "def f(\\ud800"}', "prompt"),  # a lone surrogate
    ],
)
def test_a_body_that_is_no_request_gets_a_400(
    served: Any, token: str, content: bytes, param: str | None
) -> None:
    r = httpx.post(
        served.url + "/openai/v1/completions",
        content=content,
        timeout=30,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert rollout_rows(served) == {}


def test_unknown_fields_are_ignored(served: Any, token: str) -> None:
    body = {"model": "tabloop", "prompt": PREFIX, "metadata": {"a": 1}, "service_tier": "auto"}
    r = httpx.post(
        served.url + "/openai/v1/completions",
        json=body,
        timeout=30,
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 200, r.text


def test_keys(served: Any, key_factory: Any) -> None:
    base = served.url + "/openai/v1"
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=base, api_key="tlk_nope_nope", max_retries=0).completions.create(
            model="tabloop", prompt=PREFIX
        )
    assert e.value.status_code == 401 and e.value.code == "unauthorized"
    assert e.value.type == "authentication_error"
    r = httpx.post(base + "/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.PermissionDeniedError) as p:
        openai.OpenAI(
            base_url=base, api_key=key_factory("admin"), max_retries=0
        ).completions.create(model="tabloop", prompt=PREFIX)
    assert p.value.status_code == 403 and "ingest" in p.value.message


def test_no_policy_deployed_is_503_with_retry_after(service: Any, key_factory: Any) -> None:
    r = httpx.post(
        service.url + "/openai/v1/completions",
        json={"prompt": "x"},
        timeout=30,
        headers={"Authorization": f"Bearer {key_factory('ingest')}"},
    )
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert r.json()["error"]["type"] == "service_unavailable_error"
