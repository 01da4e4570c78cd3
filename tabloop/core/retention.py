"""Code retention: code text older than TABLOOP_CODE_RETENTION_DAYS is blanked; the rows stay.

What is blanked is what service/privacy.py calls code text, with the same functions privacy mode
uses: a rollout's `context_token_ids`, `heal_text`, `token_ids` and `text` (its `text_chars` is
kept: the reward's size, the metrics' characters), a `code_settled` event's `text` (its length
and `"text_withheld": "retention"` instead), the same fields in the `outbox` copies of those
messages (the log itself in embedded mode; published rows only, so the relay never sends a row
that differs from what it may already have sent), and a top-level `text` in `dead_letters`.
Rewards, outcomes, counts, log-probs, ids and times stay, so metrics, replays and the purge work
on old rows as on new ones.

Each API process runs the job (the background monitor starts it): soon after start, then
hourly, in batches of a few hundred rows, each batch one transaction. How far each table has
been walked is kept in `trainer_state` (the row `code-retention`), so a run reads only rows
written since the last one; each batch locks the row, and a process that finds it locked leaves
the run to the one holding it.

The trainer needs a rollout's code until its reward is final and a batch holds it: the cutoff is
never less than twice the reward horizon (a warning says so when that lengthens the retention),
and the trainer reads no rollout older than the cutoff (trainer/loop.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from tabloop.core.config import Settings
from tabloop.core.db import AnyRow
from tabloop.core.memory import expire as expire_memory
from tabloop.core.privacy import (
    SETTLED,
    raw_without_text,
    rollout_code_blank,
    rollout_without_code,
    settled_without_text,
)
from tabloop.core.reward_store import default_spec
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
from tabloop.core.tables import (
    dead_letters,
    events,
    outbox,
    reward_specs,
    rollouts,
    trainer_state,
    utcnow,
)

log = logging.getLogger(__name__)

STATE_NAME = "code-retention"  # its trainer_state row: how far each table has been walked
FIRST_RUN_S = 10.0  # after the process starts
RUN_EVERY_S = 3600.0
BATCH_ROWS = 500  # rows per transaction: short write locks (SQLite has one writer)
TABLES = ("rollouts", "events", "dead_letters", "outbox")


def retention_cutoff(
    days: int | None, horizon_s: float, now: datetime
) -> tuple[datetime | None, bool]:
    """(cutoff, lengthened): code text written before the cutoff is blanked (None: retention is
    off). The cutoff keeps at least twice the reward horizon: a rollout's code is read until its
    reward is final and a batch takes it; `lengthened` says that this overrode `days`."""
    if days is None:
        return None, False
    keep = timedelta(days=days)
    floor = timedelta(seconds=2 * horizon_s)
    return now - max(keep, floor), floor > keep


def code_cutoff(settings: Settings, horizon_s: float, now: datetime) -> datetime | None:
    """Rollouts created before this may have lost their code (None: retention is off)."""
    return retention_cutoff(settings.code_retention_days, horizon_s, now)[0]


def with_code(rows: Sequence[AnyRow]) -> list[AnyRow]:
    """The rollout rows that still hold their code: a blanked one (privacy mode, retention)
    has no context, and an update cannot score it."""
    return [r for r in rows if r.context_token_ids]


def _has_code() -> sa.ColumnElement[bool]:
    """SQL: a rollout row still holds code text (so a repeated pass counts nothing)."""
    return sa.or_(
        rollouts.c.text != "",
        rollouts.c.heal_text != "",
        sa.cast(rollouts.c.context_token_ids, sa.Text) != "[]",
        sa.cast(rollouts.c.token_ids, sa.Text) != "[]",
    )


# -- one batch per table: read past the mark, blank, move the mark -----------------------------


def _rewrite(
    conn: sa.Connection, table: sa.Table, key: str, column: str, changed: list[dict[str, Any]]
) -> None:
    """Set `column` to each row's "b_value" where `key` is its "b_id" (one executemany)."""
    if changed:
        conn.execute(
            table.update()
            .where(table.c[key] == sa.bindparam("b_id"))
            .values({column: sa.bindparam("b_value")}),
            changed,
        )


def _after(time_col: Any, id_col: Any, mark: list[str] | None) -> list[Any]:
    if mark is None:
        return []
    at = datetime.fromisoformat(mark[0])
    return [sa.or_(time_col > at, sa.and_(time_col == at, id_col > mark[1]))]


def _rollouts_batch(
    conn: sa.Connection, state: dict[str, Any], cutoff: datetime, limit: int
) -> tuple[int, bool]:
    c = rollouts.c
    rows = conn.execute(
        sa.select(c.created_at, c.suggestion_id)
        .where(c.created_at < cutoff, *_after(c.created_at, c.suggestion_id, state["rollouts"]))
        .order_by(c.created_at, c.suggestion_id)
        .limit(limit)
    ).all()
    if not rows:
        return 0, True
    blanked = conn.execute(
        rollouts.update()
        .where(c.suggestion_id.in_([r.suggestion_id for r in rows]), _has_code())
        .values(
            **rollout_code_blank(),
            text_chars=sa.func.coalesce(c.text_chars, sa.func.length(c.text)),
        )
    ).rowcount
    state["rollouts"] = [rows[-1].created_at.isoformat(), rows[-1].suggestion_id]
    return blanked, len(rows) < limit


def _events_batch(
    conn: sa.Connection, state: dict[str, Any], cutoff: datetime, limit: int
) -> tuple[int, bool]:
    c = events.c
    rows = conn.execute(
        sa.select(c.received_at, c.event_id, c.payload)
        .where(
            c.type == SETTLED,
            c.received_at < cutoff,
            *_after(c.received_at, c.event_id, state["events"]),
        )
        .order_by(c.received_at, c.event_id)
        .limit(limit)
    ).all()
    if not rows:
        return 0, True
    changed = [
        {"b_id": r.event_id, "b_value": settled_without_text(r.payload, "retention")}
        for r in rows
        if "text" in r.payload
    ]
    _rewrite(conn, events, "event_id", "payload", changed)
    state["events"] = [rows[-1].received_at.isoformat(), rows[-1].event_id]
    return len(changed), len(rows) < limit


def _by_id(
    conn: sa.Connection,
    table: sa.Table,
    text_col: str,
    time_col: str,
    mark: int,
    cutoff: datetime,
    limit: int,
    keep: Callable[[Any], bool],
    rewrite: Callable[[Any], str],
) -> tuple[list[dict[str, Any]], int, bool]:
    """Rows of a table walked by id (ids grow with time), up to the first one at or after the
    cutoff or not `keep`-able: (changed rows, the new mark, done)."""
    rows = conn.execute(
        sa.select(table).where(table.c.id > mark).order_by(table.c.id).limit(limit)
    ).all()
    changed: list[dict[str, Any]] = []
    for r in rows:
        if getattr(r, time_col) >= cutoff or not keep(r):
            return changed, mark, True
        new = rewrite(r)
        if new != getattr(r, text_col):
            changed.append({"b_id": r.id, "b_value": new})
        mark = r.id
    return changed, mark, len(rows) < limit


def _dead_letters_batch(
    conn: sa.Connection, state: dict[str, Any], cutoff: datetime, limit: int
) -> tuple[int, bool]:
    changed, state["dead_letters"], done = _by_id(
        conn,
        dead_letters,
        "raw",
        "received_at",
        state["dead_letters"],
        cutoff,
        limit,
        keep=lambda r: True,
        rewrite=lambda r: raw_without_text(r.raw, "retention"),
    )
    _rewrite(conn, dead_letters, "id", "raw", changed)
    return len(changed), done


def _message_without_code(row: Any) -> str:
    """An outbox row's message without its code text (unchanged when it holds none)."""
    payload: str = row.payload
    if row.topic not in (ROLLOUTS, FEEDBACK):
        return payload
    value = orjson.loads(payload)
    if row.topic == ROLLOUTS and "context_token_ids" in value:
        if all(value.get(k) == v for k, v in rollout_code_blank().items()):
            return payload  # already without code (privacy mode)
        return orjson.dumps(rollout_without_code(value)).decode()
    if row.topic == FEEDBACK and value.get("type") == SETTLED and "text" in value:
        return orjson.dumps(settled_without_text(value, "retention")).decode()
    return payload


def _outbox_batch(
    conn: sa.Connection, state: dict[str, Any], cutoff: datetime, limit: int
) -> tuple[int, bool]:
    # An unpublished row stops the walk: the relay may have sent it before a crash, and it
    # reconciles by comparing values, so it must not change under it.
    changed, state["outbox"], done = _by_id(
        conn,
        outbox,
        "payload",
        "created_at",
        state["outbox"],
        cutoff,
        limit,
        keep=lambda r: r.published_at is not None,
        rewrite=_message_without_code,
    )
    _rewrite(conn, outbox, "id", "payload", changed)
    return len(changed), done


_BATCHES = {
    "rollouts": _rollouts_batch,
    "events": _events_batch,
    "dead_letters": _dead_letters_batch,
    "outbox": _outbox_batch,
}


# -- the walk's state -----------------------------------------------------------------------------


def _ensure_state(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
        conn.execute(
            insert(trainer_state)
            .values(name=STATE_NAME, info={}, updated_at=utcnow())
            .on_conflict_do_nothing(index_elements=["name"])
        )


def _lock_state(conn: sa.Connection) -> dict[str, Any] | None:
    """The walk's marks, the row locked until the transaction ends; None when another process
    holds it (it is doing the work)."""
    row = conn.execute(
        sa.select(trainer_state.c.info)
        .where(trainer_state.c.name == STATE_NAME)
        .with_for_update(skip_locked=True)
    ).first()
    if row is None:
        return None
    info = dict(row.info or {})
    return {
        "rollouts": info.get("rollouts"),
        "events": info.get("events"),
        "dead_letters": int(info.get("dead_letters") or 0),
        "outbox": int(info.get("outbox") or 0),
        "last_run": info.get("last_run"),
    }


def _save_state(conn: sa.Connection, state: dict[str, Any]) -> None:
    conn.execute(
        trainer_state.update()
        .where(trainer_state.c.name == STATE_NAME)
        .values(info=state, updated_at=utcnow())
    )


def expire_code(
    engine: sa.Engine,
    cutoff: datetime,
    *,
    batch_rows: int = BATCH_ROWS,
    stop: threading.Event | None = None,
) -> dict[str, int] | None:
    """Blank the code text written before `cutoff`, table by table, `batch_rows` per
    transaction (`stop` ends it between two), then delete the workspace memory's documents not
    written since. Returns the rows blanked (deleted) per table, or None when another process
    holds the walk (it is running the job)."""
    _ensure_state(engine)
    counts = dict.fromkeys(TABLES, 0)
    for name in TABLES:
        done = False
        while not done:
            if stop is not None and stop.is_set():
                return counts
            with engine.begin() as conn:
                state = _lock_state(conn)
                if state is None:
                    return None
                n, done = _BATCHES[name](conn, state, cutoff, batch_rows)
                if done and name == TABLES[-1]:
                    state["last_run"] = {
                        "at": utcnow().isoformat(),
                        "cutoff": cutoff.isoformat(),
                        "blanked": {**counts, name: counts[name] + n},
                    }
                _save_state(conn, state)
            counts[name] += n
    with engine.begin() as conn:  # the workspace memory's documents not written since
        counts["workspace_code"] = expire_memory(conn, cutoff)
    return counts


def _horizon_s(engine: sa.Engine, profile: str) -> float:
    with engine.connect() as conn:
        spec = conn.execute(
            sa.select(reward_specs.c.spec).order_by(reward_specs.c.version.desc()).limit(1)
        ).scalar()
    return float(spec["horizon_s"]) if spec else default_spec(profile).horizon_s


def _truncate_wal(engine: sa.Engine) -> None:
    """SQLite: copy the write-ahead log into the database and empty it, so that the page
    images it holds from before the blanking leave the disk too (secure_delete zeroes the
    database file's freed space: tabloop/core/db.py). Outside a transaction: on the raw
    connection."""
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        row = cursor.fetchone()
        if row is not None and row[0]:  # (busy, log frames, frames checkpointed)
            log.warning(
                "code retention: the write-ahead log could not be emptied (readers "
                "busy); SQLite empties it at a later checkpoint"
            )
    finally:
        raw.close()


def run_retention(
    settings: Settings,
    engine: sa.Engine,
    now: datetime | None = None,
    stop: threading.Event | None = None,
) -> dict[str, int] | None:
    """One pass of the job under the current reward spec; logs what it blanked."""
    days = settings.code_retention_days
    horizon_s = _horizon_s(engine, settings.profile)
    cutoff, lengthened = retention_cutoff(days, horizon_s, now or utcnow())
    if cutoff is None:
        return None
    if lengthened:
        log.warning(
            "TABLOOP_CODE_RETENTION_DAYS=%s is shorter than twice the reward horizon (%g s): "
            "code text is kept %g days instead, until the trainer is done with it",
            days,
            horizon_s,
            2 * horizon_s / 86400,
        )
    counts = expire_code(engine, cutoff, stop=stop)
    if counts and any(counts.values()) and engine.dialect.name == "sqlite":
        _truncate_wal(engine)
    if counts is None:
        log.info("code retention: another process is running it")
        return None
    log.info(
        "code retention: blanked code text written before %s: %d rollouts, %d settled events, "
        "%d dead letters, %d outbox messages; deleted %d workspace memory documents",
        cutoff.isoformat(),
        counts["rollouts"],
        counts["events"],
        counts["dead_letters"],
        counts["outbox"],
        counts["workspace_code"],
        extra={"cutoff": cutoff.isoformat(), "blanked": counts},
    )
    return counts


class RetentionJob:
    """Runs `run_retention` in a thread of its own: soon after start, then every RUN_EVERY_S.
    A database error is logged and the next run tries again (it resumes where it stopped)."""

    def __init__(self, settings: Settings, engine: sa.Engine) -> None:
        self.settings, self.engine = settings, engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tabloop-retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        wait = FIRST_RUN_S
        while not self._stop.wait(wait):
            wait = RUN_EVERY_S
            try:
                run_retention(self.settings, self.engine, stop=self._stop)
            except sa.exc.SQLAlchemyError as e:
                log.warning(
                    "code retention failed, retried in %.0f s: %s", wait, str(e).split("\n")[0]
                )

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
