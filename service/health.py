"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from pydantic import BaseModel

from service.deps import CtxDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


class Readiness(BaseModel):
    status: str  # "ready" or "not_ready"
    checks: dict[str, bool]
    outbox_backlog: int


@router.get(
    "/readyz",
    response_model=None,
    responses={
        200: {"model": Readiness, "description": "Ready"},
        503: {"model": Readiness, "description": "A dependency is not answering"},
    },
)
def readyz(ctx: CtxDep) -> Response:
    """Ready when the database answers and, in full mode, the broker does too."""
    h = ctx.health
    checks = {"database": h.db_usable()}
    if not ctx.settings.embedded:
        checks["broker"] = bool(h.broker_ok)
    ready = all(checks.values())
    body = {
        "status": "ready" if ready else "not_ready",
        "checks": checks,
        "outbox_backlog": h.backlog_rows,
    }
    headers = None if ready else {"Retry-After": str(ctx.settings.retry_after_s)}
    return JSONResponse(body, status_code=200 if ready else 503, headers=headers)


@router.get("/metrics", response_class=Response)
def metrics() -> Response:
    """Prometheus text format. Under `tabloop serve --workers N` (PROMETHEUS_MULTIPROC_DIR set):
    the samples of every worker, summed (tabloop/cli.py `_multiprocess_metrics`)."""
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
