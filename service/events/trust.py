"""Which feedback counts: the suggestion's own key and person, and plausible timing.

A suggestion belongs to the API key that asked for it (`rollouts.api_key_id`) and to the person
it was served to. An event that names a suggestion is refused when it comes through another key
or names another person, when it judges a suggestion that was never shown, when it says it
happened before the suggestion was served, or when it arrives long after the suggestion's reward
horizon. A refused event is kept in `dead_letters` with the reason and reported by index, like
an invalid one, and never reaches the events table, the feedback topic or a reward.

What is not refused:
- an event about a suggestion the service does not know (it is stored, as before; it can never
  count: a reward is only computed for a rollout that exists, and suggestion ids are random);
- for a rollout recorded without a key (`api_key_id` NULL: rows from before keys were recorded),
  or an event ingested without one (an internal caller), the key check: the other checks apply;
- a `model_switch` or `churn` (which name a person, not a suggestion) through a key that has
  served that person, or about a person the service has served nothing yet. Through a key that
  has not, while others have, it is refused as `wrong_key`: such events lower the reward of the
  person's recent suggestions, so only a key that serves the person may send them.

A batch costs one statement, whatever the number of people or suggestions in it (`lookup`): it
reads the rollouts the batch names with the current reward spec, and answers for every person a
`model_switch` or `churn` names. The ids travel as two JSON arrays, so its text never changes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from tabloop.core.db import json_array, json_rows
from tabloop.core.reward import CLOCK_SKEW_S
from tabloop.core.reward_store import default_spec
from tabloop.core.tables import reward_specs, rollouts

# wrong_key: another key's suggestion; wrong_user: another person's; not_shown: a judgment of
# an abstention; before_served: stamped before the suggestion existed (beyond the clock skew);
# late: received more than a horizon after the suggestion's reward horizon
REASONS = ("wrong_key", "wrong_user", "not_shown", "before_served", "late")
# events that judge what was displayed: about an abstention they cannot be true. code_settled
# is sent for any request, shown or not (what the person finally wrote there).
JUDGE_SHOWN = ("view", "accept", "reject", "typed_through", "code_retained")
# never read by the reward, so never late: what the person wrote may be reported at any time
NEVER_LATE = ("code_settled",)
# an event received this many horizons after its rollout was served is refused as late:
# the reward is final one horizon in; a retry or a slow delivery in the next one is stored and
# counted late by the trainer (rewards.late_events), anything after that is refused
LATE_AFTER_HORIZONS = 2.0
_ERROR = re.compile(r"refused \((\w+)\): ")


@dataclass(frozen=True)
class Owned:
    """What the checks need of a rollout."""

    suggestion_id: str
    user_id: str
    api_key_id: str | None  # None: recorded before keys were (not checked)
    created_at: datetime
    shown: bool


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of REASONS
    message: str

    @property
    def error(self) -> str:
        """The text reported in `rejected` and kept in dead_letters.error."""
        return f"refused ({self.reason}): {self.message}"


def refusal_reason(error: str) -> str | None:
    """The reason of a dead letter's error text written for a refusal; None for another error."""
    match = _ERROR.match(error)
    return match[1] if match and match[1] in REASONS else None


@dataclass(frozen=True)
class Known:
    """What the database knows of a batch: the rollouts it names, by suggestion id; for the people
    its model_switch and churn events name, whether the sending key served them (people with no
    rollout are left out); and the current reward spec (None before one is stored, or when the
    batch names no known rollout)."""

    rollouts: dict[str, Owned]
    served: dict[str, bool]
    spec: Any


@functools.cache
def _lookup(dialect: str) -> sa.CompoundSelect[Any]:
    """The one statement `lookup` runs, in `dialect`: the named rollouts (each row carrying the
    current reward spec), then one row per person with a rollout. Built once, so that every
    batch runs the same text."""
    spec = sa.select(reward_specs.c.spec).order_by(reward_specs.c.version.desc()).limit(1)
    ids = json_rows(dialect, "suggestion_ids")
    named = sa.select(
        sa.literal_column("0").label("person"),
        rollouts.c.suggestion_id.label("id"),
        rollouts.c.user_id,
        rollouts.c.api_key_id,
        rollouts.c.created_at,
        rollouts.c.shown,
        sa.null().label("served"),
        spec.scalar_subquery().label("spec"),
    ).where(rollouts.c.suggestion_id.in_(sa.select(ids.c.value)))

    person = json_rows(dialect, "user_ids")
    theirs = rollouts.c.user_id == person.c.value
    key = rollouts.c.api_key_id

    def found(*where: sa.ColumnElement[bool]) -> sa.ColumnElement[bool]:
        # a scalar subquery with LIMIT 1, not EXISTS: PostgreSQL may run an EXISTS as one hashed
        # scan of the whole table; this stays one probe per person in
        # ix_rollouts_user_id_api_key_id, whatever the person's history
        return sa.select(rollouts.c.user_id).where(*where).limit(1).scalar_subquery().is_not(None)

    mine = sa.or_(
        found(theirs, key == sa.bindparam("api_key_id", type_=sa.String)),
        found(theirs, key.is_(None)),  # recorded before keys were: any key may speak for it
    )
    people = sa.select(
        sa.literal_column("1"),
        person.c.value,
        sa.null(),
        sa.null(),
        sa.null(),
        sa.null(),
        mine,
        sa.null(),
    ).where(found(theirs))
    return sa.union_all(named, people)


def lookup(
    conn: sa.Connection,
    suggestion_ids: Iterable[str],
    user_ids: Iterable[str],
    api_key_id: str | None,
) -> Known:
    """What the checks need of a batch, in one statement for any number of suggestions and
    people (their ids travel as two JSON arrays). `user_ids`: the people whose model_switch and
    churn are checked against `api_key_id`; without a key (an internal caller) none are."""
    ids = list(dict.fromkeys(suggestion_ids))
    users = list(dict.fromkeys(user_ids)) if api_key_id is not None else []
    named: dict[str, Owned] = {}
    served: dict[str, bool] = {}
    spec = None
    if ids or users:
        params = {"suggestion_ids": json_array(ids), "user_ids": json_array(users)}
        for r in conn.execute(_lookup(conn.dialect.name), {**params, "api_key_id": api_key_id}):
            if r.person:
                served[r.id] = bool(r.served)
            else:
                named[r.id] = Owned(r.id, r.user_id, r.api_key_id, r.created_at, bool(r.shown))
                spec = r.spec
    return Known(named, served, spec)


def horizon_s(spec: Any, profile: str) -> float:
    """The reward spec's horizon (the profile's default before any spec is stored)."""
    if isinstance(spec, Mapping) and isinstance(spec.get("horizon_s"), int | float):
        return float(spec["horizon_s"])
    return float(default_spec(profile).horizon_s)


def refusal(
    event: Mapping[str, Any],
    rollout: Owned,
    *,
    api_key_id: str | None,
    received_at: datetime,
    horizon: float,
) -> Refusal | None:
    """Why `event` (validated, naming `rollout`'s suggestion) must not count; None if it may.

    The checks in order: the key, the person, shown, before served, late. `horizon` is the reward
    spec's horizon_s; `received_at` the server's time."""
    sid, kind = rollout.suggestion_id, event["type"]
    if api_key_id is not None and rollout.api_key_id not in (None, api_key_id):
        return Refusal(
            "wrong_key",
            f"suggestion_id {sid} was not served to this API key; feedback about a suggestion "
            "counts only through the key that asked for it",
        )
    if event["user_id"] != rollout.user_id:
        return Refusal(
            "wrong_user",
            f"suggestion_id {sid} was served to another user_id; send the user it was served to",
        )
    if kind in JUDGE_SHOWN and not rollout.shown:
        return Refusal(
            "not_shown",
            f"suggestion_id {sid}: the policy abstained (nothing was shown), so there is "
            f"nothing to {kind.replace('_', ' ')}",
        )
    occurred = datetime.fromisoformat(event["occurred_at"])
    earliest = rollout.created_at - timedelta(seconds=CLOCK_SKEW_S)
    if occurred < earliest:
        return Refusal(
            "before_served",
            f"occurred_at {event['occurred_at']} is "
            f"{(rollout.created_at - occurred).total_seconds():.0f} s before suggestion_id {sid} "
            f"was served (clock skew allowed: {CLOCK_SKEW_S:g} s)",
        )
    limit = rollout.created_at + timedelta(seconds=LATE_AFTER_HORIZONS * horizon)
    if kind not in NEVER_LATE and received_at > limit:
        return Refusal(
            "late",
            f"received {(received_at - rollout.created_at).total_seconds():.0f} s after "
            f"suggestion_id {sid} was served; its reward was final after {horizon:g} s, and "
            f"feedback is taken up to {LATE_AFTER_HORIZONS * horizon:g} s",
        )
    return None


PERSON_EVENTS = ("model_switch", "churn")


def screen(
    conn: sa.Connection,
    events: list[dict[str, Any]],
    *,
    api_key_id: str | None,
    received_at: datetime,
    profile: str,
) -> dict[int, Refusal]:
    """Position in `events` -> why it is refused: the events naming a known suggestion, and
    a person's model_switch and churn through a key that never served them."""
    out: dict[int, Refusal] = {}
    person_events = [
        (i, e)
        for i, e in enumerate(events)
        if e["type"] in PERSON_EVENTS and api_key_id is not None
    ]
    known = lookup(
        conn,
        (e["suggestion_id"] for e in events if "suggestion_id" in e),
        (e["user_id"] for _, e in person_events),
        api_key_id,
    )
    for i, e in person_events:
        user = e["user_id"]
        if known.served.get(user) is False:
            out[i] = Refusal(
                "wrong_key",
                f"user_id {user} was served only through other API keys; a {e['type']} "
                "counts only through a key that served that person",
            )
    if not known.rollouts:
        return out
    horizon = horizon_s(known.spec, profile)
    for i, e in enumerate(events):
        rollout = known.rollouts.get(e.get("suggestion_id", ""))
        if rollout is None:
            continue
        why = refusal(e, rollout, api_key_id=api_key_id, received_at=received_at, horizon=horizon)
        if why is not None:
            out[i] = why
    return out
