"""Whose feedback was refused or capped over a window: the people and keys to look at.

- Refused: dead letters whose error is a refusal (service/events/trust.py) received in the
  window, grouped by the event's `user_id` and by the sending key. Only the newest SCAN dead
  letters are read (a bounded range of ids: the table grows with every refused event, and this
  runs on every dashboard refresh), so a window holding more counts the newest of them.
- Capped: the trainer keeps, for its last batches, the people and keys whose rows it weighted
  down (trainer/caps.py; `trainer_state.info.capped`). Those of batches trained in the window
  are summed: weight removed (in rows: a person with 90 of 100 rows held to a quarter of the
  weight lost 65) and the largest share of rows held in one batch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime
from typing import Any

import orjson
import sqlalchemy as sa

from service.admin.metrics.schemas import CappedGroup, FeedbackTrust, RefusedGroup
from service.events.trust import refusal_reason
from tabloop.core.tables import TRAINER_STATE_NAME, api_keys, dead_letters, trainer_state

SCAN = 20_000  # newest dead letters read
TOP = 10  # people and keys listed, each list


def _refused(
    conn: sa.Connection, start: datetime, end: datetime
) -> list[tuple[str, str | None, str]]:
    """(reason, key id, user id) of each refused event received in [start, end)."""
    newest = conn.execute(sa.select(sa.func.max(dead_letters.c.id))).scalar()
    if newest is None:
        return []
    rows = conn.execute(
        sa.select(dead_letters.c.error, dead_letters.c.api_key_id, dead_letters.c.raw).where(
            dead_letters.c.id > newest - SCAN,
            dead_letters.c.received_at >= start,
            dead_letters.c.received_at < end,
            dead_letters.c.error.like("refused (%"),
        )
    )
    out = []
    for error, key_id, raw in rows:
        reason = refusal_reason(error)
        if reason is None:
            continue
        try:
            user = orjson.loads(raw).get("user_id")
        except (orjson.JSONDecodeError, AttributeError):
            user = None
        out.append((reason, key_id, user if isinstance(user, str) else "?"))
    return out


def _top_refused(pairs: list[tuple[str | None, str]], names: dict[str, str]) -> list[RefusedGroup]:
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for who, reason in pairs:
        if who is not None:
            by[who][reason] += 1
    ranked = sorted(by.items(), key=lambda kv: (-kv[1].total(), kv[0]))[:TOP]
    return [
        RefusedGroup(id=who, name=names.get(who), refused=c.total(), reasons=dict(c))
        for who, c in ranked
    ]


def _capped(conn: sa.Connection, start: datetime, end: datetime) -> tuple[int, dict[str, Any]]:
    """(batches trained in the window, {"users": {...}, "keys": {...}} summed over them)."""
    info = conn.execute(
        sa.select(trainer_state.c.info).where(trainer_state.c.name == TRAINER_STATE_NAME)
    ).scalar()
    entries = info.get("capped") or [] if isinstance(info, dict) else []
    sums: dict[str, dict[str, dict[str, float]]] = {"users": {}, "keys": {}}
    batches = 0
    for entry in entries:
        try:
            at = datetime.fromisoformat(str(entry["at"]))
        except (KeyError, TypeError, ValueError):
            continue
        if not start <= at < end:
            continue
        batches += 1
        for kind in ("users", "keys"):
            for c in entry.get(kind) or []:
                s = sums[kind].setdefault(
                    str(c["id"]), {"batches": 0, "rows": 0, "weight_removed": 0.0, "share": 0.0}
                )
                s["batches"] += 1
                s["rows"] += int(c.get("rows", 0))
                s["weight_removed"] += float(c.get("weight_removed", 0.0))
                s["share"] = max(s["share"], float(c.get("share", 0.0)))
    return batches, sums


def _top_capped(sums: dict[str, dict[str, float]], names: dict[str, str]) -> list[CappedGroup]:
    ranked = sorted(sums.items(), key=lambda kv: (-kv[1]["weight_removed"], kv[0]))[:TOP]
    return [
        CappedGroup(
            id=who,
            name=names.get(who),
            batches=int(s["batches"]),
            rows=int(s["rows"]),
            weight_removed=round(s["weight_removed"], 3),
            max_share=s["share"],
        )
        for who, s in ranked
    ]


def feedback_trust(conn: sa.Connection, *, start: datetime, end: datetime) -> FeedbackTrust:
    refused = _refused(conn, start, end)
    batches, capped = _capped(conn, start, end)
    key_ids = {k for _, k, _ in refused if k} | set(capped["keys"])
    names: dict[str, str] = {}
    if key_ids:
        rows = conn.execute(
            sa.select(api_keys.c.id, api_keys.c.name).where(api_keys.c.id.in_(sorted(key_ids)))
        )
        names = {r.id: r.name for r in rows}
    return FeedbackTrust(
        refused=len(refused),
        refused_by_reason=dict(Counter(reason for reason, _, _ in refused)),
        refused_users=_top_refused([(user, reason) for reason, _, user in refused], {}),
        refused_keys=_top_refused([(key, reason) for reason, key, _ in refused], names),
        batches=batches,
        capped_users=_top_capped(capped["users"], {}),
        capped_keys=_top_capped(capped["keys"], names),
    )
