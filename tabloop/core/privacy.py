"""Code text, and privacy mode (`no_train`): what of a request is code, and how it is withheld.

Code text is anything from which a person's code can be read back:
- a rollout's `context_token_ids` (the prefix and suffix the policy saw, tokenized), its
  `heal_text` (the end of the prefix), its `text` (the suggestion: model output conditioned on
  the code, which copies names and literals from it) and its `token_ids` (the suggestion's
  tokens, which decode to `heal_text` + `text`);
- a `code_settled` event's `text`.
Everything else a rollout or event holds is numbers, flags, times and ids (the log-probs, the
show/abstain decision, the reward) or metadata the request named (user, language, file path,
workspace): kept, since the reward, the metrics and the purge need them.

A request is in privacy mode when its key was made with `no_train`, its body says
`"no_train": true` (`/v1/complete`, `/openai/v1/completions`), or it carries the header
`X-Tabloop-No-Train: 1`. Its rollout is recorded (feedback joins it, its reward counts in the
metrics) with every code field blank and `text_chars` in place of the text, in the table and in
the `tabloop.rollouts` message alike, and the trainer never reads it. A `code_settled` event
about such a rollout, or sent with a `no_train` key, is stored and published without its text
(`text_withheld`, `text_chars` instead). The code retention job (tabloop/core/retention.py) blanks
old rows with the same functions.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any, Literal

import orjson
import sqlalchemy as sa

from tabloop.core.db import json_array, json_rows
from tabloop.core.tables import rollouts

NO_TRAIN_HEADER = "X-Tabloop-No-Train"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Why a text is not stored: the request was in privacy mode, or it outlived the code retention.
Withheld = Literal["no_train", "retention"]
SETTLED = "code_settled"


def rollout_code_blank() -> dict[str, Any]:
    """A rollout's code fields, blank (new lists each time: a record may be changed later).
    `text_chars` keeps what the reward needs of the text."""
    return {"context_token_ids": [], "heal_text": "", "token_ids": [], "text": "", "recall": None}


def parse_no_train(value: str | None) -> bool:
    """The header's value: 1/true/yes/on or 0/false/no/off (any case); absent is false.
    ValueError otherwise: a misspelt opt-out of training must not be read as consent."""
    if value is None:
        return False
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{NO_TRAIN_HEADER} must be one of {', '.join(_TRUE + _FALSE)}")


def rollout_without_code(record: dict[str, Any]) -> dict[str, Any]:
    """A rollout record (row or message) with its code fields blank and `text_chars` kept, and
    nothing of the person (a privacy-mode request's decisions read none: tabloop.core.person)."""
    chars = record.get("text_chars")
    return {
        **record,
        **rollout_code_blank(),
        "person": None,
        "text_chars": chars if chars is not None else len(record.get("text") or ""),
    }


def _without_text(event: dict[str, Any], why: Withheld) -> dict[str, Any]:
    out = {k: v for k, v in event.items() if k != "text"}
    text = event["text"]
    if isinstance(text, str):
        out["text_chars"] = len(text)
    out["text_withheld"] = why
    return out


def settled_without_text(event: dict[str, Any], why: Withheld) -> dict[str, Any]:
    """A code_settled event (payload or message) without its text: its length and why instead.
    Any other event is returned as it is."""
    if event.get("type") != SETTLED or "text" not in event:
        return event
    return _without_text(event, why)


def _load(raw: str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:  # written by json.dumps: a lone surrogate, a huge integer
        return json.loads(raw)


def _dump(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        return json.dumps(value)


def raw_without_text(raw: str, why: Withheld) -> str:
    """A dead letter's raw event (JSON text) without a top-level `text`, whatever its type: a
    refused event may be a code_settled under a misspelt type. Other raw text is kept."""
    if '"text"' not in raw:
        return raw
    try:
        value = _load(raw)
    except ValueError:
        return raw
    if not isinstance(value, dict) or "text" not in value:
        return raw
    return _dump(_without_text(value, why))


@functools.cache
def _private_query(dialect: str) -> sa.Select[Any]:
    ids = json_rows(dialect, "suggestion_ids")
    return sa.select(rollouts.c.suggestion_id).where(
        rollouts.c.suggestion_id.in_(sa.select(ids.c.value)), rollouts.c.no_train.is_(True)
    )


def private_rollouts(conn: sa.Connection, suggestion_ids: Iterable[str]) -> set[str]:
    """The ids among `suggestion_ids` whose rollout was made in privacy mode (one statement)."""
    ids = list(dict.fromkeys(suggestion_ids))
    if not ids:
        return set()
    query = _private_query(conn.dialect.name)
    return set(conn.execute(query, {"suggestion_ids": json_array(ids)}).scalars())


def _suggestion_of(raw: str) -> str | None:
    try:
        value = _load(raw)
    except ValueError:
        return None
    sid = value.get("suggestion_id") if isinstance(value, dict) else None
    return sid if isinstance(sid, str) else None


def withhold_settled_texts(
    conn: sa.Connection,
    valid: list[dict[str, Any]],
    dead: list[dict[str, Any]],
    *,
    key_no_train: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Ingestion's last step before storing: the code_settled events of a `no_train` key, or
    about a rollout made in privacy mode, lose their text, in `events` and on the topic alike;
    so do the dead letters (`raw`) of such events. Returns (valid, dead)."""
    settled = [e["suggestion_id"] for e in valid if e["type"] == SETTLED]
    dead_about = {i: _suggestion_of(d["raw"]) for i, d in enumerate(dead) if '"text"' in d["raw"]}
    if not settled and not dead_about:
        return valid, dead
    private: set[str] = set()
    if not key_no_train:
        private = private_rollouts(conn, [*settled, *(s for s in dead_about.values() if s)])
        if not private:
            return valid, dead

    def withheld(sid: str | None) -> bool:
        return key_no_train or sid in private

    valid = [
        settled_without_text(e, "no_train")
        if e["type"] == SETTLED and withheld(e["suggestion_id"])
        else e
        for e in valid
    ]
    dead = [
        {**d, "raw": raw_without_text(d["raw"], "no_train")}
        if i in dead_about and withheld(dead_about[i])
        else d
        for i, d in enumerate(dead)
    ]
    return valid, dead


def trainable() -> sa.ColumnElement[bool]:
    """SQL: the rollout may be trained on (privacy mode off; NULL, older rows, is off)."""
    return sa.or_(rollouts.c.no_train.is_(None), rollouts.c.no_train.is_(False))
