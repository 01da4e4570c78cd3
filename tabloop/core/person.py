"""The person and the moment, as the policy's decisions read them.

Real completion filters read more than the suggestion: Copilot's contextual filter weighs whether
the previous suggestion was taken (+1 log-odds), the time since it, the last character before
the cursor, text after the cursor and the position in the file; others read the person's own
accept rate and the suggestion's length (docs/MODEL.md, "The person and the moment"). The gate
and the copy head read the same here, as `PERSON_INPUTS`, with weights that start at 0 (so a
policy that never learned them decides as before).

What a decision reads comes from the service's own records, never from the client's claim: the
person's recent suggestions under the same key (`read_history`: shown or not, how long, whether
an `accept` event came for them), and the request's own text. No code text is kept for it: the
features are numbers, logged with the rollout (`rollouts.person`) so that the trainer recomputes
the decision's probability exactly. A privacy-mode request reads and logs none, and privacy-mode
rollouts are never read; purging a person deletes the rollouts and events it is read from.

`features` is pure and tested with tables (tests/tabloop/core/test_person.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tabloop.core.tables import events, rollouts

# the inputs, in order; 0 everywhere is "nothing known" (no history, no context)
PERSON_INPUTS = (
    "history",  # how much is known of the person: min(shown, HISTORY) / HISTORY
    "prev_accepted",  # their last shown suggestion: +1 taken, -1 not, 0 none yet
    "accept_rate",  # their recent accept rate of shown, smoothed, as log-odds against the prior
    "length_rate",  # the same over their shown suggestions of this one's length bucket
    "short",  # this suggestion has at most SHORT_CHARS characters
    "short_rate",  # short x length_rate: what this person does with short ones
    "gap",  # time since their last suggestion, log1p(seconds) / log1p(an hour), at most 1
    "follows",  # text follows the cursor on its line
    "end_word",  # the character before the cursor is part of a word
    "end_space",  # ... is a space after text on the line
    "end_open",  # ... opens or continues an expression: ( [ { , = : .
    "at_indent",  # the line before the cursor is only indentation
    "comment",  # the cursor's line is a comment
    "position",  # lines above the cursor, log1p(n) / log1p(10,000), at most 1
    "more_lines",  # lines of the suggestion after its first (0 for a rest-of-line one)
)
HISTORY = 20  # the newest shown suggestions a history holds
SHORT_CHARS = 5  # telemetry: suggestions this short are almost never taken
LENGTH_BUCKETS = (5, 20, 60)  # bucket edges (characters, inclusive): <=5, 6-20, 21-60, >60
PRIOR_RATE, PRIOR_WEIGHT = 0.3, 2.0  # the smoothing of an accept rate: 2 suggestions at 0.3
_GAP_CAP = math.log1p(3600.0)
_POSITION_CAP = math.log1p(10_000.0)
_OPEN = frozenset("([{,=:.")
_COMMENT = ("#", "//", "--", "/*", "*")


@dataclass(frozen=True)
class History:
    """What the service recorded of a person's recent suggestions under one key."""

    outcomes: tuple[tuple[int, bool], ...] = ()  # (shown characters, taken), newest first
    since_s: float | None = None  # seconds since their last suggestion (shown or not)

    def to_dict(self) -> dict[str, Any]:
        return {"outcomes": [list(o) for o in self.outcomes], "since_s": self.since_s}


@dataclass(frozen=True)
class Moment:
    """The request's cursor, as the features read it (no code is kept)."""

    last_char: str  # the character before the cursor ("" at the start of the file)
    line_before: str  # the cursor's line up to the cursor
    follows: bool  # non-blank text after the cursor on its line
    lines_above: int


@dataclass(frozen=True)
class PersonContext:
    """Everything a request's decisions read of the person and the moment. `known` is the
    History, or a Future of it: the service reads it from the database while the model reads the
    prompt, and the decisions wait for it only when they are drawn."""

    known: History | Future[History]
    moment: Moment

    @property
    def history(self) -> History:
        return self.known.result() if isinstance(self.known, Future) else self.known

    def inputs(self, text: str) -> list[float]:
        """The features for a suggestion `text` (the gate's: the sampled completion; the copy
        head's: the proposal)."""
        return features(self.history, self.moment, text)


def moment_of(prefix: str, suffix: str) -> Moment:
    line_before = prefix.rsplit("\n", 1)[-1]
    return Moment(
        last_char=prefix[-1:],
        line_before=line_before,
        follows=bool(suffix.split("\n", 1)[0].strip()),
        lines_above=prefix.count("\n"),
    )


def length_bucket(chars: int) -> int:
    return sum(chars > edge for edge in LENGTH_BUCKETS)


def _rate_logit(taken: int, n: int) -> float:
    """Log-odds of the smoothed rate against the prior's: 0 with no evidence."""
    p = (taken + PRIOR_RATE * PRIOR_WEIGHT) / (n + PRIOR_WEIGHT)
    return math.log(p / (1 - p)) - math.log(PRIOR_RATE / (1 - PRIOR_RATE))


def features(history: History, moment: Moment, text: str) -> list[float]:
    """PERSON_INPUTS for a suggestion `text` at `moment` to a person with `history`."""
    first_line = text.split("\n", 1)[0]
    chars = len(first_line.rstrip())
    shown = history.outcomes[:HISTORY]
    taken = sum(t for _, t in shown)
    bucket = length_bucket(chars)
    same = [t for c, t in shown if length_bucket(c) == bucket]
    length_rate = _rate_logit(sum(same), len(same))
    short = float(0 < chars <= SHORT_CHARS)
    stripped = moment.line_before.strip()
    last = moment.last_char
    return [
        len(shown) / HISTORY,
        0.0 if not shown else (1.0 if shown[0][1] else -1.0),
        _rate_logit(taken, len(shown)),
        length_rate,
        short,
        short * length_rate,
        0.0
        if history.since_s is None
        else min(math.log1p(max(history.since_s, 0.0)), _GAP_CAP) / _GAP_CAP,
        float(moment.follows),
        float(last.isalnum() or last == "_"),
        float(last in (" ", "\t") and bool(stripped)),
        float(last in _OPEN),
        float(not stripped),
        float(stripped.startswith(_COMMENT)),
        min(math.log1p(moment.lines_above), _POSITION_CAP) / _POSITION_CAP,
        float(text.count("\n")),
    ]


def history_of(rows: Sequence[Any], now: datetime, pending_s: float) -> History:
    """A History from rows (created_at, shown, text_chars, taken, judged), newest first: a shown
    suggestion with no accept or reject yet and younger than `pending_s` (the person may still
    take it) is left out of the outcomes."""
    outcomes: list[tuple[int, bool]] = []
    for r in rows:
        if not r.shown:
            continue
        age = (now - r.created_at).total_seconds()
        if not r.judged and age < pending_s:
            continue
        outcomes.append((int(r.text_chars or 0), bool(r.taken)))
    since = None if not rows else max(0.0, (now - rows[0].created_at).total_seconds())
    return History(tuple(outcomes[:HISTORY]), since)


def _event_exists(*types: str) -> sa.ColumnElement[bool]:
    return (
        sa.select(events.c.event_id)
        .where(events.c.suggestion_id == rollouts.c.suggestion_id, events.c.type.in_(types))
        .exists()
    )


def _history_query(keyed: bool) -> sa.Select[Any]:
    """The newest 2 * HISTORY rollouts of `:user_id` under `:api_key_id` (or under no key), built
    once: building a select costs more than SQLite takes to run it."""
    key = rollouts.c.api_key_id == sa.bindparam("api_key_id") if keyed else None
    return (
        sa.select(
            rollouts.c.created_at,
            rollouts.c.shown,
            rollouts.c.text_chars,
            _event_exists("accept").label("taken"),
            _event_exists("accept", "reject").label("judged"),
        )
        .where(
            rollouts.c.user_id == sa.bindparam("user_id"),
            rollouts.c.api_key_id.is_(None) if key is None else key,
            rollouts.c.no_train.is_not(True),
        )
        .order_by(rollouts.c.created_at.desc())
        .limit(2 * HISTORY)
    )


_HISTORY_KEYED, _HISTORY_UNKEYED = _history_query(True), _history_query(False)


def read_history(
    conn: sa.Connection, *, user_id: str, api_key_id: str | None, now: datetime, pending_s: float
) -> History:
    """The person's newest suggestions under this key (privacy-mode ones never read): one
    indexed query of at most 2 * HISTORY rows."""
    if api_key_id is None:
        rows = conn.execute(_HISTORY_UNKEYED, {"user_id": user_id}).all()
    else:
        rows = conn.execute(_HISTORY_KEYED, {"user_id": user_id, "api_key_id": api_key_id}).all()
    return history_of(rows, now, pending_s)
