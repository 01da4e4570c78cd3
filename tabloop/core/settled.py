"""Settled text: what finally stands after a rollout's cursor, read per suggestion for training.

A `code_settled` event carries it (DESIGN.md's event table). It is code text: it lives only in
the events table (purged with its user) and on the feedback topic, and is never logged, so this
module returns it and says nothing about it.
"""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from tabloop.core.tables import events, rollouts

CODE_SETTLED = "code_settled"
_CHUNK = 1000  # suggestion ids per query: well under SQLite's bound-parameter limit


def _read(conn: sa.Connection, ids: list[str]) -> dict[str, str]:
    texts: dict[str, str] = {}
    for i in range(0, len(ids), _CHUNK):
        rows = conn.execute(
            sa.select(events.c.suggestion_id, events.c.payload)
            # a report counts only from the rollout's own user, as feedback does for the reward
            .join(
                rollouts,
                sa.and_(
                    rollouts.c.suggestion_id == events.c.suggestion_id,
                    rollouts.c.user_id == events.c.user_id,
                ),
            )
            .where(events.c.type == CODE_SETTLED, events.c.suggestion_id.in_(ids[i : i + _CHUNK]))
            .order_by(
                events.c.suggestion_id,
                events.c.occurred_at,
                events.c.received_at,
                events.c.event_id,
            )
        )
        for row in rows:  # ascending, so the latest report of each suggestion is written last
            text = row.payload.get("text")
            if text is None:  # withheld (privacy mode, code retention): no text to learn from
                texts.pop(row.suggestion_id, None)
            else:
                texts[row.suggestion_id] = text
    return texts


def settled_texts(
    engine_or_conn: sa.Engine | sa.Connection, *, suggestion_ids: Iterable[str]
) -> dict[str, str]:
    """suggestion id -> the text of its latest code_settled report (by occurred_at, then
    received_at, then event_id), for the ids that have one from the rollout's own user.
    Ids without a report (or without a rollout) are left out, and so are those whose latest
    report's text was withheld (service/privacy.py); an empty text is a report."""
    ids = list(dict.fromkeys(suggestion_ids))
    if not ids:
        return {}
    if isinstance(engine_or_conn, sa.Engine):
        with engine_or_conn.connect() as conn:
            return _read(conn, ids)
    return _read(engine_or_conn, ids)
