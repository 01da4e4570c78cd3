"""Typed through: a person's next request in a file shows what they typed after the cursor, and
a shown suggestion they typed themselves becomes a `typed_through` event (docs/REWARD.md)."""

from __future__ import annotations

import functools
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine
from tabloop.core.memory import TYPED_ANCHOR_CHARS, typed_chars, typed_since
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.reward_store import ROLLOUT_COLUMNS, rewards_from_db, rollout_info
from tabloop.core.tables import events, rollouts


@pytest.mark.parametrize(
    ("before", "now", "typed"),
    [
        pytest.param("def f(", "def f(x):", "x):", id="continues"),
        pytest.param("def f(", "def f(", "", id="same-place"),
        pytest.param("def f(", "def g(x):", None, id="edited-above"),
        pytest.param("", "import os", "import os", id="empty-file"),
        # both prefixes cut to their last characters: the earlier one's tail is found in the next
        pytest.param("y" * 900 + "a = 1\n", "y" * 400 + "a = 1\nb = 2", "b = 2", id="cut"),
        pytest.param("y" * 900 + "a = 1\n", "y" * 300 + "c = 1\nb = 2", None, id="cut-no-tail"),
    ],
)
def test_what_was_typed_since_the_last_request(before: str, now: str, typed: str | None) -> None:
    assert TYPED_ANCHOR_CHARS < 900
    assert typed_since(before, now) == typed
    # the memory keeps only the end of the earlier prefix (prefix_tail): the same answer
    assert typed_since(before[-(TYPED_ANCHOR_CHARS + 1) :], now) == typed


@pytest.mark.parametrize(
    ("suggestion", "typed", "chars"),
    [
        pytest.param("self.name", "self.name\n    def", 9, id="typed-all-then-went-on"),
        pytest.param("self.name", "self.name", 9, id="typed-exactly"),
        pytest.param("self.name", "self.", 5, id="typed-over-half"),
        pytest.param("self.name", "self", 0, id="typed-under-half"),
        pytest.param("self.name", "self.value", 0, id="typed-something-else"),
        pytest.param("self.name\nreturn", "self.name\n", 9, id="first-line-only"),
        pytest.param("self.name", "", 0, id="typed-nothing"),
        pytest.param("", "x", 0, id="empty-suggestion"),
    ],
)
def test_how_much_of_the_suggestion_was_typed(suggestion: str, typed: str, chars: int) -> None:
    assert typed_chars(suggestion, typed) == chars


PREFIX = "def area(w, h):\n    return "


def shown_as(settings: Any, suggestion_id: str, text: str) -> None:
    """As if the policy had shown `text` (the base policy samples whether to show)."""
    engine = make_engine(settings)
    with engine.begin() as conn:
        conn.execute(
            rollouts.update()
            .where(rollouts.c.suggestion_id == suggestion_id)
            .values(shown=True, text=text, text_chars=len(text))
        )
    engine.dispose()


def typed_events(settings: Any) -> list[Any]:
    engine = make_engine(settings)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(events).where(events.c.type == "typed_through")).all()
    engine.dispose()
    return rows


def reward_of(settings: Any, suggestion_id: str) -> Any:
    engine = make_engine(settings)
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(*ROLLOUT_COLUMNS).where(rollouts.c.suggestion_id == suggestion_id)
        ).one()
        (reward,) = rewards_from_db(conn, [rollout_info(row)], RewardSpec())
    engine.dispose()
    return reward


def test_a_suggestion_typed_through_is_recorded_and_is_no_reject(
    served: Any, key_factory: Any
) -> None:
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {key_factory('ingest')}"}
    ) as c:
        ask = functools.partial(complete, c, user="ann", file_path="geo.py")
        typed = ask(PREFIX)
        shown_as(served.settings, typed, "w * h")
        ask(PREFIX + "w * h\n\n\ndef perimeter(w, h):\n    return ")  # typed it all, went on
        other = ask(PREFIX, file_path="other.py")
        shown_as(served.settings, other, "w + h")
        ask(PREFIX + "2 * (w + h)\n", file_path="other.py")  # wrote something else
        private = ask(PREFIX, file_path="private.py")
        shown_as(served.settings, private, "w * h")
        ask(PREFIX + "w * h\n", file_path="private.py", no_train=True)  # privacy mode: no memory
        (event,) = typed_events(served.settings)
        assert event.suggestion_id == typed and event.user_id == "ann"
        assert event.payload["typed_chars"] == len("w * h")
        # the same request again: the row now holds the newer request, nothing more is recorded
        ask(PREFIX + "w * h\n\n\ndef perimeter(w, h):\n    return ")
        assert len(typed_events(served.settings)) == 1
    assert reward_of(served.settings, typed).outcome == "typed_through"
    # a read that saved nothing: less than an ignored suggestion costs
    assert reward_of(served.settings, typed).value == -0.05
    assert reward_of(served.settings, other).outcome == "ignored"
    assert reward_of(served.settings, other).value == -0.1


def complete(c: httpx.Client, prefix: str, *, user: str, **extra: Any) -> str:
    r = c.post(
        "/v1/complete", json={"user_id": user, "prefix": prefix, "max_new_tokens": 8, **extra}
    )
    assert r.status_code == 200, r.text
    return str(r.json()["suggestion_id"])
