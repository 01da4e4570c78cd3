"""The audit log: one append-only row per admin or deploy action, and the reads behind
GET /admin/audit.

Nothing here updates or deletes a row. A row names who acted (the key's public id and name, or
`cli` / `service` for what the command line or the service itself did), the action and its
target, the request id of the access log, and the outcome (`ok`, or the refusal's HTTP status).
It never holds a token or a secret (anything shaped like a token is masked) nor code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tabloop.core.keys import PREFIX, ApiKey
from tabloop.core.tables import audit_log, utcnow

OK = "ok"
MAX_TARGET_CHARS = 300  # a user id is at most 256
MAX_TEXT_CHARS = 2000  # a deploy reason is at most 2000; error messages are cut there
REQUEST_ID_CHARS = 64  # the column's width (a client's X-Request-ID may be up to 128)

# A token pasted where an id belongs (a path, a reason) keeps its public id, never its secret.
_TOKEN = re.compile(re.escape(PREFIX) + r"([0-9A-Za-z]{1,32})_[0-9A-Za-z_-]+")


@dataclass(frozen=True)
class Actor:
    """Who did it: a key (its public id and name), or the command line or service itself."""

    key_id: str | None
    name: str


CLI = Actor(None, "cli")  # `tabloop keys create|revoke`, run with database access, no key
SERVICE = Actor(None, "service")  # what the service does by itself (first start)


def key_actor(key: ApiKey) -> Actor:
    return Actor(key.id, key.name)


def key_detail(key: ApiKey) -> dict[str, Any]:
    """What a key.create or key.revoke row says of the key: never its token or hash."""
    return {
        "name": key.name,
        "scopes": sorted(key.scopes),
        "no_train": key.no_train,
        "workspace": key.workspace,
    }


def record_key(conn: sa.Connection, actor: Actor, action: str, key: ApiKey) -> None:
    """A key made or revoked outside the API (the command line, the service at start)."""
    record(conn, actor=actor, action=action, target=key.id, detail=key_detail(key))


@dataclass(frozen=True)
class AuditRow:
    id: int
    at: datetime
    key_id: str | None
    key_name: str | None
    action: str
    target: str | None
    request_id: str | None
    outcome: str
    detail: dict[str, Any] | None


def clean_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """Masks token secrets, drops NUL and lone surrogates (which no database text holds) and
    bounds the length."""
    text = text.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    text = _TOKEN.sub(lambda m: f"{PREFIX}{m[1]}_***", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(str(k), 100): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def record(
    conn: sa.Connection,
    *,
    actor: Actor,
    action: str,
    target: str | None = None,
    outcome: str = OK,
    request_id: str | None = None,
    detail: dict[str, Any] | None = None,
) -> int:
    """Append one row on `conn`: inside the action's own transaction when the action writes the
    database, so the two commit or roll back together. Returns its id."""
    result = conn.execute(
        audit_log.insert().values(
            at=utcnow(),
            key_id=actor.key_id,
            key_name=actor.name,
            action=action,
            target=clean_text(target, MAX_TARGET_CHARS) if target is not None else None,
            request_id=None if request_id is None else clean_text(request_id)[:REQUEST_ID_CHARS],
            outcome=outcome,
            detail=_clean(detail) if detail is not None else None,
        )
    )
    (row_id,) = result.inserted_primary_key or (None,)
    assert row_id is not None
    return int(row_id)


def entries(
    conn: sa.Connection,
    *,
    limit: int,
    before: int | None = None,
    action: str | None = None,
    key_id: str | None = None,
    since: datetime | None = None,
) -> list[AuditRow]:
    """Newest first: at most `limit` rows with an id below `before`, matching every filter."""
    query = sa.select(audit_log).order_by(audit_log.c.id.desc()).limit(limit)
    if before is not None:
        query = query.where(audit_log.c.id < before)
    if action is not None:
        query = query.where(audit_log.c.action == action)
    if key_id is not None:
        query = query.where(audit_log.c.key_id == key_id)
    if since is not None:
        query = query.where(audit_log.c.at >= since)
    return [AuditRow(**row._mapping) for row in conn.execute(query)]
