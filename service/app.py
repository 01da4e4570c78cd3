"""The FastAPI application: routers, middleware, error handlers and the background monitor."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI

from service import health
from service.admin.audit import endpoints as audit_endpoints
from service.admin.audit.recorder import AuditMiddleware
from service.admin.dashboard import endpoints as dashboard
from service.admin.keys import endpoints as key_endpoints
from service.admin.metrics import endpoints as analytics_endpoints
from service.admin.policies import endpoints as policy_endpoints
from service.admin.rewards import endpoints as reward_endpoints
from service.admin.training import endpoints as training_endpoints
from service.admin.users import endpoints as user_endpoints
from service.body import BodyLimitMiddleware
from service.completions import endpoints as complete_endpoints
from service.completions.batching import Batcher, SamplingSettings
from service.completions.serving import PolicyServer
from service.deps import AppContext, Health
from service.errors import install_handlers
from service.events import endpoints as event_endpoints
from service.logs import RequestLogMiddleware, setup_logging
from service.memory import fix_mmap_threshold
from service.metrics import HTTP_REQUEST_SECONDS
from service.monitor import Monitor
from service.openai import endpoints as openai_endpoints
from service.openapi import install_openapi
from service.tabby import endpoints as tabby_endpoints
from tabloop.core.config import Settings, load_settings
from tabloop.core.db import make_engine
from tabloop.core.keys import KeyCache, RateLimiter
from tabloop.core.memory import WorkspaceMemory

try:  # the installed package's version (pyproject.toml), the one place it is written
    VERSION = importlib.metadata.version("tabloop")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0+unknown"


class RequestMetrics:
    """Records latency per route template (not raw path, so labels stay bounded)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", "unmatched")
            HTTP_REQUEST_SECONDS.labels(template, scope["method"], str(status)).observe(
                time.perf_counter() - start
            )


def create_app(settings: Settings, engine: sa.Engine | None = None) -> FastAPI:
    engine = engine or make_engine(settings)
    ctx = AppContext(
        settings=settings,
        engine=engine,
        limiter=RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst),
        health=Health(broker_ok=None),
        policies=PolicyServer(settings, engine),
        inference=Batcher(
            SamplingSettings(settings.temperature, settings.top_p, settings.stop_logprob),
            settings.inference_threads,
            settings.inference_batch_max,
            settings.inference_batch_wait_ms,
        ),
        keys=KeyCache(settings.auth_cache_ttl_s),
        memory=WorkspaceMemory(
            engine,
            refresh_s=settings.memory_refresh_s,
            person_bytes=settings.memory_person_bytes,
            workspace_bytes=settings.memory_workspace_bytes,
        ),
    )
    monitor = Monitor(settings, engine, ctx.health)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        monitor.start()
        ctx.policies.start()
        ctx.memory.start()
        try:
            yield
        finally:
            ctx.memory.close()
            ctx.policies.stop()
            monitor.stop()
            ctx.inference.close()
            ctx.people.shutdown(wait=True)
            engine.dispose()

    app = FastAPI(
        title="tabloop",
        version=VERSION,
        description="Online RL for Tab-style code completion. See DESIGN.md for the contract.",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    install_handlers(app, settings.retry_after_s)
    app.include_router(complete_endpoints.router)
    app.include_router(event_endpoints.router)
    app.include_router(openai_endpoints.router)
    app.include_router(policy_endpoints.router)
    app.include_router(training_endpoints.router)
    app.include_router(reward_endpoints.router)
    app.include_router(key_endpoints.router)
    app.include_router(user_endpoints.router)
    app.include_router(analytics_endpoints.router)
    app.include_router(audit_endpoints.router)
    app.include_router(tabby_endpoints.router)
    dashboard.install(app)
    app.include_router(health.router)
    install_openapi(app, settings)
    app.add_middleware(AuditMiddleware, engine=engine)  # inside the request id's middleware
    app.add_middleware(
        BodyLimitMiddleware,
        limit=settings.max_body_bytes,
        limits={"/admin/policies": 3 * settings.max_checkpoint_bytes + 65536},
    )
    app.add_middleware(RequestMetrics)
    app.add_middleware(RequestLogMiddleware)  # outermost: every request gets an id and a line
    return app


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory service.app:app_from_env` (one per worker process)."""
    settings = load_settings()
    setup_logging(settings.log_level, settings.log_format or "json")  # a fresh process
    fix_mmap_threshold()  # a fresh process: service/memory.py
    return create_app(settings)
