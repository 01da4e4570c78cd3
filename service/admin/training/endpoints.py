"""Admin API for the trainer: its state, what the recent policy versions gave people, and
pause/resume (a flag it reads every second)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter
from pydantic import ValidationError

from service.admin.audit.recorder import AuditEntry
from service.admin.metrics.queries import DEFAULT_WINDOW_S, recent_versions
from service.deps import ADMIN, AdminKey, CtxDep, audited
from tabloop.core.reward_store import trainable_reward
from tabloop.core.status import TrainerStatus
from tabloop.core.tables import TRAINER_MEMBER_PREFIX as MEMBER_PREFIX
from tabloop.core.tables import TRAINER_STATE_NAME as STATE_NAME
from tabloop.core.tables import rewards, rollouts, trainer_state, utcnow

_ALIVE = timedelta(seconds=15)  # a heartbeat older than this: the process is gone
router = APIRouter(prefix="/admin/training", tags=["admin: training"])

_STATUS_EXAMPLE = {
    "paused": False,
    "alive": True,
    "heartbeat_at": "2026-11-29T12:00:00Z",
    "rewards_finalized": 48210,
    "rewards_untrained": 1904,
    "late_events": 3,
    "trainer": {
        "state": "collecting",
        "batch_fill": 1904,
        "batch_size": 4096,
        "pending": 611,
        "join_lag_s": 598.2,
        "bad_records": 0,
        "history": [],
    },
    "members": [
        {
            "member": "trainer-0:4121",
            "heartbeat_at": "2026-11-29T12:00:00Z",
            "leader": True,
            "partitions": [0, 1, 2],
            "pending": 301,
            "finalized": 24102,
        }
    ],
    "recent_versions": {
        "window_s": 3600,
        "versions": [
            {
                "policy_version": 7,
                "requests": 1200,
                "shown": 420,
                "shown_finalized": 400,
                "accepted": 126,
                "rewards_finalized": 1150,
                "kept_chars_per_100": 156.0,
                "accept_rate_of_shown": 0.315,
                "not_taken_per_request": 0.238,
            }
        ],
    },
}
_STATUS: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {"example": _STATUS_EXAMPLE}}}
}


def _status(conn: sa.Connection) -> dict[str, Any]:
    row = conn.execute(sa.select(trainer_state).where(trainer_state.c.name == STATE_NAME)).first()
    untrained = conn.execute(  # rewards the trainer may still use (trainable_reward)
        sa.select(sa.func.count())
        .select_from(rewards.join(rollouts, rollouts.c.suggestion_id == rewards.c.suggestion_id))
        .where(rewards.c.trained_at.is_(None), trainable_reward())
    ).scalar_one()
    finalized = conn.execute(sa.select(sa.func.count()).select_from(rewards)).scalar_one()
    late = conn.execute(
        sa.select(sa.func.coalesce(sa.func.sum(rewards.c.late_events), 0))
    ).scalar_one()
    alive = bool(row and row.heartbeat_at and utcnow() - row.heartbeat_at < _ALIVE)
    return {
        "paused": bool(row.paused) if row else False,
        "alive": alive,
        "heartbeat_at": row.heartbeat_at if row else None,
        "rewards_finalized": finalized,
        "rewards_untrained": untrained,
        "late_events": int(late),
        "trainer": _trainer(row.info) if row and row.info else {},
        "members": _members(conn),
        "recent_versions": {
            "window_s": DEFAULT_WINDOW_S,
            "versions": recent_versions(conn, end=utcnow(), window_s=DEFAULT_WINDOW_S),
        },
    }


def _trainer(info: dict[str, Any]) -> dict[str, Any]:
    """The trainer's row read through its own type (tabloop/core/status.py), so missing
    fields get their defaults; a row this version cannot read (a newer trainer's) as it is."""
    try:
        return TrainerStatus.model_validate(info).model_dump(mode="json")
    except ValidationError:
        return info


def _members(conn: sa.Connection) -> list[dict[str, Any]]:
    """The join's live consumer-group members (full mode; each writes its row every second),
    by name: which partitions each joins, its pending rollouts and the rewards it wrote."""
    rows = conn.execute(
        sa.select(trainer_state.c.name, trainer_state.c.heartbeat_at, trainer_state.c.info)
        .where(
            trainer_state.c.name.startswith(MEMBER_PREFIX),
            trainer_state.c.heartbeat_at >= utcnow() - _ALIVE,
        )
        .order_by(trainer_state.c.name)
    ).all()
    keys = ("leader", "partitions", "pending", "finalized")
    return [
        {
            "member": r.name.removeprefix(MEMBER_PREFIX),
            "heartbeat_at": r.heartbeat_at,
            **{k: (r.info or {}).get(k) for k in keys},
        }
        for r in rows
    ]


@router.get("", responses=_STATUS)
def get_training(_key: AdminKey, ctx: CtxDep) -> dict[str, Any]:
    """State (collecting, updating, gating, canary, paused), batch fill, last update and gate
    result, canary progress, join lag and pending rollouts; per recent policy version (the
    newest 10 that served in the last hour), kept characters per 100 requests, the accept rate
    of shown and shown-but-not-taken per request."""
    with ctx.engine.connect() as conn:
        return _status(conn)


def _set_paused(ctx: Any, audit: AuditEntry, paused: bool) -> dict[str, Any]:
    now = utcnow()
    with ctx.engine.begin() as conn:
        was = conn.execute(
            sa.select(trainer_state.c.paused).where(trainer_state.c.name == STATE_NAME)
        ).scalar()
        updated = conn.execute(
            trainer_state.update()
            .where(trainer_state.c.name == STATE_NAME)
            .values(paused=paused, updated_at=now)
        ).rowcount
        if not updated:
            conn.execute(
                trainer_state.insert().values(
                    name=STATE_NAME, paused=paused, updated_at=now, info={}
                )
            )
        audit.record(conn, detail={"was_paused": bool(was)})
        return _status(conn)


@router.post("/pause", responses=_STATUS)
def pause(
    audit: Annotated[AuditEntry, audited("training.pause", *ADMIN)], ctx: CtxDep
) -> dict[str, Any]:
    """Stop taking updates and deploying (the join keeps finalizing rewards)."""
    return _set_paused(ctx, audit, True)


@router.post("/resume", responses=_STATUS)
def resume(
    audit: Annotated[AuditEntry, audited("training.resume", *ADMIN)], ctx: CtxDep
) -> dict[str, Any]:
    """Take updates and deploy candidates again."""
    return _set_paused(ctx, audit, False)
