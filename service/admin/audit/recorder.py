"""Exactly one audit row per admin or deploy request, whatever its outcome.

A mutating admin route takes its key through `service.deps.audited(action, ...)`, which opens an
`AuditEntry` for the request once the key is authenticated (before its scope is checked: a key
refused for lacking the scope is an attempt worth recording). Then:

- an action that writes the database calls `entry.record(conn, ...)` inside its own
  transaction, as its last statement: the row commits with the action or not at all;
- `AuditMiddleware` settles every entry still open when the response starts: `ok` for a success
  that wrote no row itself (a replay reads only), otherwise the status of the refusal (403, 404,
  409, 422, 500, ...) with the error's code and message, in a transaction of its own.

An unauthenticated request opens no entry (it is no admin action), nor does a key over its rate
limit (so a refused key cannot write rows faster than its limit).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import sqlalchemy as sa
from starlette.concurrency import run_in_threadpool

from tabloop.core import audit as store
from tabloop.core.audit import Actor

log = logging.getLogger(__name__)

SCOPE_KEY = "tabloop.audit"  # the request's AuditSlot in the ASGI scope
AUDITED_PREFIX = "/admin/"  # every audited route lives here; other requests pass straight by
_UNSET: Any = object()


@dataclass
class AuditEntry:
    """The audit row of one request, written once: by the route in its transaction, or by the
    middleware when the response starts."""

    actor: Actor
    action: str
    target: str | None = None
    detail: dict[str, Any] | None = None
    request_id: str | None = None
    settled: bool = field(default=False, init=False)
    _recorded: bool = field(default=False, init=False, repr=False)

    def record(
        self,
        conn: sa.Connection,
        *,
        target: str | None = _UNSET,
        detail: dict[str, Any] | None = _UNSET,
    ) -> None:
        """Write the `ok` row in the action's transaction (call it last in that transaction).
        The entry counts as settled once the transaction commits; if it rolls back, the
        middleware records the refusal instead. (The commit event fires as the commit starts:
        a commit the database then fails leaves neither the action nor a row, and a 503.)"""
        assert not self._recorded, f"{self.action}: the audit row is already written"
        if target is not _UNSET:
            self.target = target
        if detail is not _UNSET:
            self.detail = detail
        self._write(conn, store.OK)
        self._recorded = True
        sa.event.listen(conn, "commit", self._committed)

    def _committed(self, _conn: sa.Connection) -> None:
        self.settled = True

    def _write(self, conn: sa.Connection, outcome: str) -> None:
        store.record(
            conn,
            actor=self.actor,
            action=self.action,
            target=self.target,
            outcome=outcome,
            request_id=self.request_id,
            detail=self.detail,
        )

    def settle(self, engine: sa.Engine, outcome: str, error: dict[str, Any] | None) -> None:
        """The row of a request that wrote none in its own transaction: in a new one."""
        if self.settled:
            return
        if error is not None:
            self.detail = {**(self.detail or {}), "error": error}
        with engine.begin() as conn:
            self._write(conn, outcome)
        self.settled = True


@dataclass
class AuditSlot:
    """Where the route's dependency leaves the request's entry for the middleware to see."""

    entry: AuditEntry | None = None


def open_entry(scope: MutableMapping[str, Any], entry: AuditEntry) -> AuditEntry:
    slot = scope.get(SCOPE_KEY)
    assert isinstance(slot, AuditSlot), (
        f"audited route outside {AUDITED_PREFIX} or without AuditMiddleware: {scope.get('path')}"
    )
    assert slot.entry is None, "one audited action per request"
    slot.entry = entry
    return entry


def _error_of(body: bytes) -> dict[str, Any] | None:
    """The `{"error": {"code", "message"}}` of an error response, if that is what it is."""
    try:
        error = orjson.loads(body).get("error")
        return {"code": str(error["code"]), "message": str(error["message"])}
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        return None


class AuditMiddleware:
    """Settles the request's audit entry when its response starts (pure ASGI). A refusal's
    response start is held until its body (one small message) is seen, so the row carries the
    error's code, and the row is written before the client has the answer."""

    def __init__(self, app: Any, engine: sa.Engine) -> None:
        self.app, self.engine = app, engine

    async def _settle(self, entry: AuditEntry, outcome: str, error: dict[str, Any] | None) -> None:
        try:
            await run_in_threadpool(entry.settle, self.engine, outcome, error)
        except Exception:
            # Logged, not raised: the answer is decided already, and the action either did not
            # commit (a refusal) or wrote nothing (a read such as a replay).
            log.exception("could not write the audit row of %s (outcome %s)", entry.action, outcome)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(AUDITED_PREFIX):
            await self.app(scope, receive, send)
            return
        slot = AuditSlot()
        scope[SCOPE_KEY] = slot
        held: dict[str, Any] | None = None  # a refusal's response start, until its body

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal held
            entry = slot.entry
            if entry is not None and not entry.settled:
                if message["type"] == "http.response.start":
                    if message["status"] >= 400:
                        held = message
                        return
                    await self._settle(entry, store.OK, None)
                elif message["type"] == "http.response.body" and held is not None:
                    error = _error_of(message.get("body", b""))
                    await self._settle(entry, str(held["status"]), error)
            if held is not None:
                start, held = held, None
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            # Escaped every handler: the server answers 500, outside this middleware.
            entry = slot.entry
            if entry is not None and not entry.settled:
                await self._settle(entry, str(held["status"]) if held else "500", None)
            raise
