"""FastAPI dependencies: the process context and API-key authentication by scope."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.admin.audit.recorder import AuditEntry, open_entry
from service.completions.batching import Batcher
from service.completions.serving import PolicyServer
from service.errors import Forbidden, RateLimited, Unauthorized, Unavailable
from service.logs import current_request
from tabloop.core.audit import key_actor
from tabloop.core.config import Settings
from tabloop.core.keys import ApiKey, KeyCache, RateLimiter, authenticate
from tabloop.core.memory import WorkspaceMemory
from tabloop.core.reward_store import MeasuredRetention

# Longer than the pool's checkout wait (db_pool_timeout_s, 2 s by default), so a busy pool is
# never taken for a stalled database; a healthy check takes milliseconds.
DB_STALL_S = 3.0


@dataclass
class Health:
    """What the background monitor last saw; read by /readyz and by ingestion backpressure."""

    db_ok: bool = False
    broker_ok: bool | None = None  # None in embedded mode
    backlog_rows: int = 0
    backlog_age_s: float = 0.0
    detail: dict[str, str] = field(default_factory=dict)
    db_check_started: float | None = None  # monotonic start of the database check in progress

    def db_stalled(self, now: float | None = None) -> bool:
        """The monitor's database check has hung for DB_STALL_S: the database takes connections
        but answers nothing (stopped, I/O stall). A request would hang with it, so shed it."""
        started = self.db_check_started
        now = time.monotonic() if now is None else now
        return started is not None and now - started > DB_STALL_S

    def db_usable(self) -> bool:
        return self.db_ok and not self.db_stalled()


@dataclass
class AppContext:
    settings: Settings
    engine: sa.Engine
    limiter: RateLimiter
    health: Health
    policies: PolicyServer
    inference: Batcher  # runs the model off the event loop and off ingestion's pool, batched
    keys: KeyCache  # recently authenticated keys (see KeyCache for how revocation stays prompt)
    memory: WorkspaceMemory  # the workspaces' code the policy copies from
    # the retention an accept without a report counts at, read at most once a minute (the
    # dashboard asks for it with the reward spec on every poll)
    retention: MeasuredRetention = field(default_factory=MeasuredRetention)
    # reads what the service recorded of a person while the model reads the prompt
    # (service/completions/rollout.py, person_history)
    people: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="person-history")
    )


async def get_ctx(request: Request) -> AppContext:
    # async: FastAPI runs a plain `def` dependency in the thread pool, a hop per request for a
    # field read
    return request.app.state.ctx


CtxDep = Annotated[AppContext, Depends(get_ctx)]


def _lookup(ctx: AppContext, token: str) -> ApiKey | None:
    generation = ctx.keys.generation
    with ctx.engine.connect() as conn:
        key = authenticate(conn, token)
    if key is not None:
        ctx.keys.put(token, key, generation)
    return key


# Declares the bearer scheme in the OpenAPI schema (the docs' Authorize button, and what a
# client generator or schemathesis reads); the header is checked below, not by it.
_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="An API key: `Authorization: Bearer tlk_<id>_<secret>`",
)
BearerDoc = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def _authenticate(request: Request, ctx: AppContext) -> ApiKey:
    """The live key of the request's bearer token (401 without one, 503 with the database away)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("send an API key as 'Authorization: Bearer <token>'", headers=challenge)
    # async, so a cache hit costs no trip through the thread pool; a miss asks the database
    # from the pool, off the event loop
    key = ctx.keys.get(token)
    if key is None:
        # Not while the database is away: every request would wait for the lookup to fail
        # (the pool's checkout timeout, or a hang on a stalled server), none would be cached.
        if not ctx.health.db_usable():
            raise Unavailable(
                "the database is unavailable",
                headers={"Retry-After": str(ctx.settings.retry_after_s)},
            )
        key = await run_in_threadpool(_lookup, ctx, token)
    if key is None:
        raise Unauthorized("unknown or revoked API key", headers=challenge)
    logged = current_request()
    if logged is not None:  # the access line names the key (its public id, never the token)
        logged.key_id = key.id
    return key


def _check_scope(key: ApiKey, scopes: tuple[str, ...]) -> None:
    if not key.scopes.intersection(scopes):
        raise Forbidden(f"this key lacks the {' or '.join(repr(s) for s in scopes)} scope")


def _check_rate(ctx: AppContext, key: ApiKey) -> None:
    wait = ctx.limiter.acquire(key.id)
    if wait > 0:
        raise RateLimited(
            "rate limit exceeded for this key", headers={"Retry-After": str(math.ceil(wait))}
        )


def require_scope(*scopes: str) -> Callable[..., Awaitable[ApiKey]]:
    """A dependency admitting a live key holding any of `scopes`, within its rate limit."""

    async def dependency(request: Request, ctx: CtxDep, _documented: BearerDoc) -> ApiKey:
        key = await _authenticate(request, ctx)
        _check_scope(key, scopes)
        _check_rate(ctx, key)
        return key

    # Read by the route x scope test (tests/service/auth/test_route_matrix.py) to classify routes.
    dependency.scopes = frozenset(scopes)  # type: ignore[attr-defined]
    return dependency


def audited(action: str, *scopes: str, target: str | None = None) -> Any:
    """`require_scope(*scopes)` for a route that acts, opening its audit entry (an
    `AuditEntry`, service/admin/audit/recorder.py) whose `actor` is the key (`actor.key_id`).
    `target` names the path parameter the action is about (its default target).

    The rate limit is taken before the scope check here, and the entry opened between the two:
    a key refused for lacking the scope is recorded (403), a key over its limit is not.
    Use: `audit: Annotated[AuditEntry, audited("deploy", *DEPLOY, target="version")]`.
    """

    async def dependency(request: Request, ctx: CtxDep, _documented: BearerDoc) -> AuditEntry:
        key = await _authenticate(request, ctx)
        _check_rate(ctx, key)
        logged = current_request()
        value = request.path_params.get(target) if target is not None else None
        entry = open_entry(
            request.scope,
            AuditEntry(
                actor=key_actor(key),
                action=action,
                target=str(value) if value is not None else None,
                request_id=logged.request_id if logged is not None else None,
            ),
        )
        _check_scope(key, scopes)
        return entry

    dependency.scopes = frozenset(scopes)  # type: ignore[attr-defined]
    return Depends(dependency)


ADMIN = ("admin",)
DEPLOY = ("deploy", "admin")  # the policy routes: the trainer's deploy key, or an operator's

IngestKey = Annotated[ApiKey, Depends(require_scope("ingest"))]
DeployKey = Annotated[ApiKey, Depends(require_scope(*DEPLOY))]
AdminKey = Annotated[ApiKey, Depends(require_scope(*ADMIN))]
