"""GET /admin/audit: the audit log, newest first, a page at a time. Nothing edits or deletes it."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from service.admin.audit.schemas import AuditEntryOut, AuditPage
from service.deps import AdminKey, CtxDep
from service.errors import Unprocessable
from tabloop.core import audit as store

router = APIRouter(prefix="/admin", tags=["admin: audit"])

MAX_LIMIT = 1000
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})?")


def _parse_since(since: str | None) -> datetime | None:
    """RFC 3339 only (pydantic would also take a number as a Unix time); no zone means UTC."""
    if since is None:
        return None
    try:
        if not _RFC3339.fullmatch(since):
            raise ValueError
        at = datetime.fromisoformat(since.replace("z", "Z"))
    except ValueError:
        raise Unprocessable(f"since must be an RFC 3339 date-time, got {since[:64]!r}") from None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at


@router.get("/audit", response_model=AuditPage)
def get_audit(
    _key: AdminKey,
    ctx: CtxDep,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="entries per page")] = 100,
    before: Annotated[
        int | None,
        Query(
            ge=1,
            le=2**63 - 1,
            description="only entries with a lower id: the previous page's `next_before`",
        ),
    ] = None,
    action: Annotated[
        str | None,
        Query(min_length=1, max_length=32, examples=["deploy"], description="only this action"),
    ] = None,
    key_id: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=32,
            examples=["9f2c4e1a0b3d5c7e"],
            description="only the actions of this key (its public id)",
        ),
    ] = None,
    since: Annotated[
        str | None,
        Query(
            description="only entries at or after this time (RFC 3339)",
            json_schema_extra={"format": "date-time"},
            examples=["2026-11-29T00:00:00Z"],
        ),
    ] = None,
) -> AuditPage:
    """Every admin and deploy action — key created or revoked, policy registered, deployed,
    promoted or rolled back, training paused or resumed, reward spec changed, replay, purge —
    with who did it, its target, the request id and the outcome (`ok` or the refusal's status).
    Newest first; filters combine."""
    after = _parse_since(since)
    with ctx.engine.connect() as conn:
        rows = store.entries(
            conn, limit=limit + 1, before=before, action=action, key_id=key_id, since=after
        )
    page = rows[:limit]
    return AuditPage(
        entries=[AuditEntryOut(**row.__dict__) for row in page],
        next_before=page[-1].id if len(rows) > limit else None,
    )
