"""The Tabby API over HTTP: every endpoint, and what a client may get wrong.

A completion is a rollout like `POST /v1/complete`'s; an event becomes its native event, counted
once however often it is sent; an event that names no shown completion is dead-lettered and
still answered with a 2xx; nothing a client sends gets a 500.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
from tabloop.core.tables import dead_letters, events, outbox, rollouts
from tests.service.tabby.conftest import PREFIX_ADD, PREFIX_MUL


def complete(c: httpx.Client, prefix: str = PREFIX_ADD, **body: Any) -> dict[str, Any]:
    r = c.post(
        "/v1/completions",
        json={"language": "python", "segments": {"prefix": prefix, "suffix": "\n"}, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def rows(settings: Any, table: sa.Table, *where: Any) -> list[Any]:
    engine = make_engine(settings)
    with engine.connect() as conn:
        out = list(conn.execute(sa.select(table).where(*where)).all())
    engine.dispose()
    return out


def post_event(c: httpx.Client, completion_id: str, type_: str, **fields: Any) -> httpx.Response:
    params = fields.pop("params", None)
    return c.post(
        "/v1/events",
        params=params,
        json={"type": type_, "completion_id": completion_id, "choice_index": 0, **fields},
    )


def test_health_and_server_setting_as_tabby_agent_reads_them(tabby: httpx.Client) -> None:
    for method in ("GET", "POST"):
        r = tabby.request(method, "/v1/health")
        assert r.status_code == 200, r.text
        body = r.json()
        # with `model` and `device`, tabby-agent reads version.git_describe (and crashes without)
        assert body["model"] == "tabloop policy v1" and body["device"] == "cpu"
        assert body["version"]["git_describe"].startswith("v0.")
        assert isinstance(body["cpu_count"], int) and body["cuda_devices"] == []
    r = tabby.get("/v1beta/server_setting")
    assert r.status_code == 200 and r.json() == {"disable_client_side_telemetry": False}


@pytest.mark.parametrize("mode", ["embedded"])
def test_every_tabby_route_needs_an_ingest_key(served: Any, key_factory: Any) -> None:
    admin = key_factory("admin")
    routes = [
        ("GET", "/v1/health"),
        ("POST", "/v1/health"),
        ("GET", "/v1beta/server_setting"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/events"),
    ]
    for method, path in routes:
        url = served.url + "/tabby" + path
        assert httpx.request(method, url).status_code == 401, path
        r = httpx.request(method, url, headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 403, (path, r.text)


def test_a_completion_is_a_rollout_of_the_live_policy(tabby: httpx.Client, served: Any) -> None:
    answer = complete(
        tabby,
        segments={
            "prefix": PREFIX_ADD,
            "suffix": "\n",
            "filepath": "pkg/calc.py",
            "git_url": "https://git.example/pkg.git",
            "declarations": [{"filepath": "x.py", "body": "x = 1"}],
            "clipboard": "y",
            "new_field": 1,
        },
        temperature=0.3,
        seed=1,
        debug_options={"raw_prompt": "x"},
    )
    assert set(answer) == {"id", "choices"} and answer["id"].startswith("cmpl-")
    suggestion_id = answer["id"].removeprefix("cmpl-")
    (choice,) = answer["choices"]  # the snippet policy always shows
    assert choice["index"] == 0 and choice["text"]
    (row,) = rows(served.settings, rollouts)
    assert row.suggestion_id == suggestion_id and row.shown and row.text == choice["text"]
    assert row.user_id == "tabby-user"  # no `user`: the key's name
    assert (row.language, row.file_path, row.workspace_id) == (
        "python",
        "pkg/calc.py",
        "https://git.example/pkg.git",
    )
    assert row.reports_views is True and row.policy_version == 1
    (message,) = rows(served.settings, outbox, outbox.c.topic == ROLLOUTS)
    assert orjson.loads(message.payload)["suggestion_id"] == suggestion_id

    answer = complete(tabby, user="alice")
    (row,) = rows(
        served.settings, rollouts, rollouts.c.suggestion_id == answer["id"].removeprefix("cmpl-")
    )
    assert row.user_id == "alice"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"language": "python"}, "segments"),
        ({"segments": {"suffix": "\n"}}, "prefix"),
        ({"segments": {"prefix": 42}}, "prefix"),
        ({"segments": {"prefix": "x\x00y"}}, "prefix"),
        ({"segments": None}, "segments"),
        ({"segments": {"prefix": "x"}, "language": "p" * 65}, "language"),
        ({"segments": {"prefix": "x"}, "user": 7}, "user"),
        ({"segments": {"prefix": "x", "declarations": "def f(): ..."}}, "declarations"),
        ({"segments": {"prefix": "x", "declarations": [{"body": 1}]}}, "declarations.0.body"),
        (
            {"segments": {"prefix": "x", "relevant_snippets_from_changed_files": [{"score": 1}]}},
            "relevant_snippets_from_changed_files.0.body",
        ),
        ({"segments": {"prefix": "x", "clipboard": ["y"]}}, "clipboard"),
    ],
)
def test_bad_completion_requests_get_422(tabby: httpx.Client, body: dict, needle: str) -> None:
    r = tabby.post("/v1/completions", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]


def test_the_editors_snippets_and_clipboard_are_copied_from(
    tabby: httpx.Client, served: Any
) -> None:
    """Tabby's `declarations`, `relevant_snippets_from_changed_files` and `clipboard` feed the
    copy proposals (tabloop.core.recall) as the prefix and the suffix do."""
    snippets = {
        "declarations": [{"filepath": "a.py", "body": "def area(width, height, *, unit='cm'):"}],
        "relevant_snippets_from_changed_files": [
            {"filepath": "b.py", "body": "total = compute_total(items, tax_rate=0.2)", "score": 1}
        ],
        "clipboard": "logger.warning('retrying %s after %.1f s', url, delay)",
    }
    cases = {
        "x = area(width, height, *, un": "it='cm'):",
        "y = compute_total(items, tax_r": "ate=0.2)",
        "    logger.warning('retrying %s af": "ter %.1f s', url, delay)",
    }
    answers = {}
    for prefix, want in cases.items():
        r = tabby.post(
            "/v1/completions",
            json={"language": "python", "segments": {"prefix": prefix, **snippets}},
        )
        assert r.status_code == 200, r.text
        answers[r.json()["id"].removeprefix("cmpl-")] = want
    for row in rows(served.settings, rollouts, rollouts.c.suggestion_id.in_(answers)):
        assert row.recall is not None and row.recall["text"] == answers[row.suggestion_id]


def test_not_json_is_400(tabby: httpx.Client) -> None:
    for path in ("/v1/completions", "/v1/events"):
        r = tabby.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)


def test_a_huge_prefix_is_cut_to_its_end(tabby: httpx.Client, served: Any) -> None:
    prefix = "x = 1\n" * 150_000 + PREFIX_ADD  # 900,000 characters
    answer = complete(tabby, prefix=prefix)
    (row,) = rows(served.settings, rollouts)
    assert row.suggestion_id == answer["id"].removeprefix("cmpl-")
    _, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    seen = tokenizer.decode(row.context_token_ids) + row.heal_text
    assert seen and prefix.endswith(seen)
    assert len(seen) <= served.settings.max_prefix_chars


def test_view_select_dismiss_are_native_events(tabby: httpx.Client, served: Any) -> None:
    shown = complete(tabby)
    # another file: its prefix, which continues the first, is not what was typed after it
    other = complete(tabby, segments={"prefix": PREFIX_MUL, "suffix": "\n", "filepath": "mul.py"})
    for completion_id, type_ in (
        (shown["id"], "view"),
        (shown["id"], "select"),
        (other["id"], "dismiss"),
    ):
        r = post_event(tabby, completion_id, type_, view_id="v-1", elapsed=120)
        assert r.status_code == 202, r.text
        assert r.json() == {"accepted": 1, "duplicates": 0, "rejected": []}
    got = {(e.suggestion_id, e.type): e for e in rows(served.settings, events)}
    sid, other_sid = shown["id"].removeprefix("cmpl-"), other["id"].removeprefix("cmpl-")
    assert set(got) == {(sid, "view"), (sid, "accept"), (other_sid, "reject")}
    for e in got.values():
        assert e.user_id == "tabby-user" and e.payload["user_id"] == "tabby-user"
        assert "accepted_chars" not in e.payload  # a select is the whole suggestion
    published = [
        orjson.loads(m.payload) for m in rows(served.settings, outbox, outbox.c.topic == FEEDBACK)
    ]
    assert sorted(m["event_id"] for m in published) == sorted(e.event_id for e in got.values())


def test_a_repeated_event_is_counted_once(tabby: httpx.Client, served: Any) -> None:
    answer = complete(tabby)
    bare = answer["id"].removeprefix("cmpl-")
    first = post_event(tabby, answer["id"], "view", view_id="v-7")
    assert first.json()["accepted"] == 1
    for completion_id in (answer["id"], bare, bare.upper()):  # the same completion, spelt so
        r = post_event(tabby, completion_id, "view", view_id="v-7", elapsed=999)
        assert r.status_code == 202
        assert r.json() == {"accepted": 0, "duplicates": 1, "rejected": []}
    # another display of the same suggestion is another view
    assert post_event(tabby, answer["id"], "view", view_id="v-8").json()["accepted"] == 1
    assert len(rows(served.settings, events)) == 2
    assert len(rows(served.settings, outbox, outbox.c.topic == FEEDBACK)) == 2


def test_select_kind_line_accepts_the_first_line(tabby: httpx.Client, served: Any) -> None:
    answer = complete(tabby)
    r = post_event(tabby, answer["id"], "select", view_id="v-1", params={"select_kind": "line"})
    assert r.status_code == 202 and r.json()["accepted"] == 1, r.text
    # the same select with select_kind in the body (as tabby-agent also sends it): a repeat
    r = post_event(tabby, answer["id"], "select", view_id="v-1", select_kind="line")
    assert r.json() == {"accepted": 0, "duplicates": 1, "rejected": []}
    (row,) = rows(served.settings, rollouts)
    (accept,) = rows(served.settings, events)
    assert accept.type == "accept"
    assert accept.payload["accepted_chars"] == len(row.text.split("\n")[0])


@pytest.mark.parametrize(
    "completion_id",
    [
        "cmpl-3f2b8c1e-6d4a-4f0e-9b7c-2a1d5e8f9c03",  # ids of no completion ever served
        "934420a4-c3cd-470f-bea0-6dc01c8be294",
        "cmpl-not-a-uuid",
        "agent-1234",
    ],
)
def test_an_event_about_no_completion_is_dead_lettered_with_a_2xx(
    tabby: httpx.Client, served: Any, completion_id: str
) -> None:
    r = post_event(tabby, completion_id, "select", params={"select_kind": "line"})
    assert r.status_code == 202, r.text
    (rejected,) = r.json()["rejected"]
    assert "no such completion" in rejected["error"] and r.json()["accepted"] == 0
    assert rows(served.settings, events) == []
    (dead,) = rows(served.settings, dead_letters)
    assert dead.source == "tabby" and "no such completion" in dead.error
    assert orjson.loads(dead.raw) == {
        "type": "select",
        "completion_id": completion_id,
        "choice_index": 0,
        "select_kind": "line",
    }


def test_an_event_about_no_shown_choice_is_dead_lettered(tabby: httpx.Client, served: Any) -> None:
    answer = complete(tabby)
    r = tabby.post(
        "/v1/events", json={"type": "view", "completion_id": answer["id"], "choice_index": 1}
    )
    assert r.status_code == 202 and "one choice" in r.json()["rejected"][0]["error"]
    engine = make_engine(served.settings)
    with engine.begin() as conn:  # as if the policy had abstained: "choices": []
        conn.execute(rollouts.update().values(shown=False))
    engine.dispose()
    r = post_event(tabby, answer["id"], "view")
    assert r.status_code == 202 and "offered no choice" in r.json()["rejected"][0]["error"]
    assert rows(served.settings, events) == []
    assert len(rows(served.settings, dead_letters)) == 2


@pytest.mark.parametrize(
    ("body", "params", "needle"),
    [
        ({"type": "accept", "completion_id": "cmpl-x"}, None, "type"),
        ({"type": "view"}, None, "completion_id"),
        ({"type": "view", "completion_id": ""}, None, "completion_id"),
        ({"type": "view", "completion_id": "c", "choice_index": -1}, None, "choice_index"),
        ({"type": "view", "completion_id": "c", "choice_index": "0"}, None, "choice_index"),
        ({"type": "select", "completion_id": "c", "select_kind": "word"}, None, "select_kind"),
        ({"type": "select", "completion_id": "c"}, {"select_kind": "word"}, "select_kind"),
        ({"type": "view", "completion_id": "c", "view_id": 5}, None, "view_id"),
    ],
)
def test_malformed_events_get_422(
    tabby: httpx.Client, served: Any, body: dict, params: dict | None, needle: str
) -> None:
    r = tabby.post("/v1/events", json=body, params=params)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]
    assert rows(served.settings, events) == []
