"""Admin API for people: purge everything stored about one user."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from service.admin.audit.recorder import AuditEntry
from service.admin.users.purge import purge_user
from service.admin.users.schemas import PurgeOut, Removed
from service.deps import ADMIN, CtxDep, audited

router = APIRouter(prefix="/admin/users", tags=["admin: users"])

UserIdPath = Annotated[
    str, Path(min_length=1, max_length=256, description="The person's user_id", examples=["u-42"])
]


@router.delete("/{user_id:path}", response_model=PurgeOut, summary="Purge a user's data")
def delete_user(
    user_id: UserIdPath,
    audit: Annotated[AuditEntry, audited("purge", *ADMIN, target="user_id")],
    ctx: CtxDep,
) -> PurgeOut:
    """Delete the person's rollouts, feedback events, rewards, their messages in the outbox
    (never published afterwards) and the rejected events that name them, and send a
    `user_purged` tombstone on `tabloop.rollouts` and `tabloop.feedback` (key: the user id) so
    the trainer drops the rollouts it still holds of them and writes no reward for them.

    The answer counts the rows removed per table. Idempotent: a repeat, or a user never seen,
    answers 200 with zeros (and sends another tombstone, which changes nothing). Messages the
    relay already published stay in Kafka until its retention removes them. The audit log
    keeps the purge (`GET /admin/audit`, action `purge`, the user id as target): it is never
    purged, and holds no code."""
    result = purge_user(
        ctx.engine,
        user_id,
        embedded=ctx.settings.embedded,
        before_commit=lambda conn, r: audit.record(conn, detail={"removed": r.removed}),
    )
    return PurgeOut(
        user_id=result.user_id, purged_at=result.purged_at, removed=Removed(**result.removed)
    )
