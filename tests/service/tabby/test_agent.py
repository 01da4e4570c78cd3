"""tabby-agent 1.5.0, the real Tabby client, against the /tabby API.

Its JSON-lines mode (what vim-tabby runs) asks for completions and reports view, select and
dismiss; its LSP mode (`--lsp --stdio`, for Helix, Neovim, Emacs) asks for completions and
reports nothing. What each sends must land where native requests land: rollouts and events in
the database and on the log (the outbox, or Kafka through the relay in full mode), and rewards
of an accept and a reject once the reward windows have closed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from service.relay import Relay
from tabloop.core.config import Settings
from tabloop.core.db import make_engine
from tabloop.core.memory import typed_chars
from tabloop.core.reward_spec import RewardSpec, size_scale
from tabloop.core.stream.consumer import open_consumer
from tabloop.core.stream.kafka import ensure_topics
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
from tabloop.core.tables import events, rewards, rollouts, utcnow
from tests.service.tabby.conftest import (
    PREFIX_ADD,
    PREFIX_MUL,
    JsonLinesAgent,
    LspAgent,
)
from trainer.join import Join

pytestmark = pytest.mark.integration  # tabby-agent under node

KEY_NAME = "vim-tabby"  # the key's name is the person: tabby-agent sends no user with a token


@contextmanager
def relay_if_full(settings: Settings) -> Iterator[None]:
    """Full mode: the relay publishes the outbox to Kafka while the block runs."""
    if settings.embedded:
        yield
        return
    ensure_topics(settings)  # before the test's consumer subscribes to them
    stop = threading.Event()
    thread = threading.Thread(
        target=Relay(settings, make_engine(settings)).run, args=(stop,), name="relay", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the relay did not stop"


def join_from_the_log(
    settings: Settings,
    engine: sa.Engine,
    suggestion_ids: set[str],
    event_ids: set[str],
    timeout_s: float = 90,
) -> Join:
    """A reward join (sim reward windows) fed from the log, as the trainer reads it, until every
    one of these rollouts and events has come through."""
    join = Join(engine, RewardSpec.sim(), 1)
    consumer = open_consumer(
        settings, engine, f"tabby-test-{uuid.uuid4().hex[:8]}", [ROLLOUTS, FEEDBACK]
    )
    seen_rollouts: set[str] = set()
    seen_events: set[str] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while seen_rollouts != suggestion_ids or seen_events != event_ids:
            assert time.monotonic() < deadline, (
                f"not on the log after {timeout_s} s: rollouts {suggestion_ids - seen_rollouts}, "
                f"events {event_ids - seen_events}"
            )
            records = consumer.poll(max_records=5000, timeout_s=0.5)
            # the broker outlives the test (others publish to it too): this test's records only
            ours = [r for r in records if r.value.get("suggestion_id") in suggestion_ids]
            seen_rollouts |= {r.value["suggestion_id"] for r in ours if r.topic == ROLLOUTS}
            seen_events |= {r.value["event_id"] for r in ours if r.topic == FEEDBACK}
            join.add(ours)
            consumer.commit(records)
    finally:
        consumer.close()
    return join


def stored(engine: sa.Engine, table: sa.Table, *where: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table).where(*where)).all())


def ready_agent(agent: JsonLinesAgent) -> None:
    assert agent.call("initialize", {}) is True, agent.diagnostics()
    status = agent.call("getStatus")
    assert status == "ready", f"tabby-agent is {status!r}, not ready\n{agent.diagnostics()}"


def completion(agent: JsonLinesAgent, home: Path, prefix: str) -> dict[str, Any]:
    """provideCompletions as an editor asks it (manually: no debounce), the cursor at the end of
    the file being written (tabby-agent drops a suggestion that repeats what follows it)."""
    answer = agent.call(
        "provideCompletions",
        {
            "filepath": str(home / "project" / "calc.py"),
            "workspace": str(home / "project"),
            "language": "python",
            "text": prefix + "\n",
            "position": len(prefix),
            "manually": True,
        },
    )
    assert isinstance(answer, dict) and answer.get("choices"), (
        f"no suggestion reached the editor: {answer}\n{agent.diagnostics()}"
    )
    return answer


def test_tabby_agent_completions_and_events_become_rollouts_feedback_and_rewards(
    served: Any, key_factory: Any, agent_home: Path
) -> None:
    token = key_factory("ingest", name=KEY_NAME)
    engine = make_engine(served.settings)
    agent = JsonLinesAgent(agent_home, served.url + "/tabby", token)
    try:
        ready_agent(agent)
        health = agent.call("getServerHealthState")
        assert health["version"]["git_describe"] and health["device"] == "cpu", health

        first = completion(agent, agent_home, PREFIX_ADD)
        choice = first["choices"][0]
        view = {
            "type": "view",
            "completion_id": first["id"],
            "choice_index": choice["index"],
            "view_id": "view-1",
        }
        assert agent.call("postEvent", view) is True, agent.diagnostics()
        assert agent.call("postEvent", {**view, "type": "select", "elapsed": 850}) is True

        second = completion(agent, agent_home, PREFIX_MUL)
        dismiss = {
            "type": "dismiss",
            "completion_id": second["id"],
            "choice_index": second["choices"][0]["index"],
            "view_id": "view-2",
        }
        assert agent.call("postEvent", dismiss) is True, agent.diagnostics()
        assert agent.outbound_attempts() == [], agent.diagnostics()
    finally:
        agent.close()

    accepted_id = first["id"].removeprefix("cmpl-")
    rejected_id = second["id"].removeprefix("cmpl-")
    rows = {r.suggestion_id: r for r in stored(engine, rollouts)}
    assert set(rows) == {accepted_id, rejected_id}
    for answer, sid in ((first, accepted_id), (second, rejected_id)):
        row = rows[sid]
        # the editor got the suggestion the rollout recorded (tabby-agent trims whitespace)
        assert answer["choices"][0]["text"].strip() == row.text.strip() != "", (answer, row.text)
        assert row.shown and row.reports_views and row.user_id == KEY_NAME
        assert row.language == "python" and row.file_path == "calc.py"
    kinds = {(e.suggestion_id, e.type): e for e in stored(engine, events)}
    # the second request's prefix continues the first: when the first suggestion was what came
    # next, the service records that it was typed through (the select still decides its reward)
    typed = typed_chars(rows[accepted_id].text, PREFIX_MUL.removeprefix(PREFIX_ADD))
    assert set(kinds) == {
        (accepted_id, "view"),
        (accepted_id, "accept"),
        (rejected_id, "reject"),
        *([(accepted_id, "typed_through")] if typed else []),
    }
    assert all(e.user_id == KEY_NAME for e in kinds.values())
    assert "accepted_chars" not in kinds[(accepted_id, "accept")].payload  # a whole accept

    with relay_if_full(served.settings):
        join = join_from_the_log(
            served.settings,
            engine,
            {accepted_id, rejected_id},
            {e.event_id for e in kinds.values()},
        )
    spec = join.spec
    # past the reward horizon of every rollout: all final
    assert join.finalize_due(now=utcnow() + timedelta(seconds=spec.horizon_s + 1)) == 2
    got = {r.suggestion_id: r for r in stored(engine, rewards)}
    assert got[accepted_id].outcome == "accepted"
    whole = len(rows[accepted_id].text)  # accepted in full, no retention report: provisional
    expected = spec.accept_reward * size_scale(whole, spec) * spec.provisional_accept_weight
    assert got[accepted_id].value == pytest.approx(expected)
    assert got[rejected_id].outcome == "rejected"
    assert got[rejected_id].value == pytest.approx(-spec.reject_penalty)
    engine.dispose()


@pytest.mark.parametrize("mode", ["embedded"])
def test_tabby_agent_lsp_mode_gets_completions_and_its_silence_is_no_reject(
    served: Any, key_factory: Any, agent_home: Path
) -> None:
    """--lsp sends no events at all: its suggestions are rollouts like any, and their rewards
    say "unviewed" (no training signal), not a reject the person never made."""
    token = key_factory("ingest", name=KEY_NAME)
    engine = make_engine(served.settings)
    agent = LspAgent(agent_home, served.url + "/tabby", token)
    uri = (agent_home / "project" / "calc.py").as_uri()
    try:
        init = agent.request(
            "initialize",
            {
                "processId": None,
                "rootUri": None,
                "capabilities": {},
                "clientInfo": {"name": "tests"},
            },
        )
        assert init["serverInfo"]["name"] == "tabby-agent", init
        agent.notify("initialized", {})
        agent.notify(
            "textDocument/didOpen",
            {
                "textDocument": {
                    "uri": uri,
                    "languageId": "python",
                    "version": 1,
                    "text": PREFIX_ADD + "\n",
                }
            },
        )
        line, character = PREFIX_ADD.count("\n"), len(PREFIX_ADD.rsplit("\n", 1)[1])
        result = agent.request(
            "textDocument/completion",
            {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}},
        )
        assert agent.outbound_attempts() == [], agent.diagnostics()
    finally:
        agent.close()

    items = result["items"]
    assert items, f"no completion item: {result}"
    (row,) = stored(engine, rollouts)
    assert items[0]["data"]["completionId"] == "cmpl-" + row.suggestion_id
    assert items[0]["textEdit"]["newText"].endswith(row.text.strip()), (items[0], row.text)
    assert row.reports_views and row.user_id == KEY_NAME
    assert stored(engine, events) == []

    join = join_from_the_log(served.settings, engine, {row.suggestion_id}, set())
    assert join.finalize_due(now=utcnow() + timedelta(seconds=join.spec.horizon_s + 1)) == 1
    (reward,) = stored(engine, rewards)
    assert (reward.outcome, reward.value) == ("unviewed", 0.0)
    engine.dispose()


@pytest.mark.parametrize("mode", ["embedded"])
def test_tabby_agent_sends_the_privacy_header_from_its_config(
    served: Any, key_factory: Any, agent_home: Path
) -> None:
    """docs/EDITORS.md: `requestHeaders` in tabby-agent's [server] puts every completion in
    privacy mode: served, recorded without code (docs/PRIVACY.md)."""
    token = key_factory("ingest", name=KEY_NAME)
    engine = make_engine(served.settings)
    agent = JsonLinesAgent(
        agent_home,
        served.url + "/tabby",
        token,
        extra_config='\n[server.requestHeaders]\n"X-Tabloop-No-Train" = "1"\n',
    )
    try:
        ready_agent(agent)
        answer = completion(agent, agent_home, PREFIX_ADD)
        assert agent.outbound_attempts() == [], agent.diagnostics()
    finally:
        agent.close()
    (row,) = stored(engine, rollouts)
    engine.dispose()
    assert row.suggestion_id == answer["id"].removeprefix("cmpl-")
    assert row.no_train is True and row.context_token_ids == [] and row.text == ""
    # the length of what was shown stands in for it (tabby-agent trims whitespace)
    assert row.text_chars >= len(answer["choices"][0]["text"].strip()) > 0
