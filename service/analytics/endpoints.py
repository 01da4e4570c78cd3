"""GET /admin/metrics: per policy version and time bucket, from rollouts and their rewards."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from service.analytics import service
from service.analytics.schemas import MetricsOut
from service.deps import AdminKey, CtxDep

router = APIRouter(prefix="/admin", tags=["admin: metrics"])


@router.get("/metrics", response_model=MetricsOut)
def get_metrics(
    _key: AdminKey,
    ctx: CtxDep,
    window: Annotated[
        str | None,
        Query(description="seconds or a duration (90s, 15m, 1h, 24h, 7d); default 1h, at most 30d",
              examples=["1h"]),
    ] = None,
    bucket: Annotated[
        str | None,
        Query(description="bucket size, same format; default window/30 (at least 10 s); at most "
                          f"{service.MAX_BUCKETS} buckets per window", examples=["2m"]),
    ] = None,
    to: Annotated[
        datetime | None, Query(description="end of the window (RFC 3339); default now")
    ] = None,
) -> MetricsOut:
    """Suggestions, shown and accept rates, retention, characters per request, mean reward and
    latency percentiles per policy version, over the window and per bucket (docs/METRICS.md)."""
    window_s, bucket_s = service.resolve_window(window=window, bucket=bucket)
    end = service.resolve_end(to)
    with ctx.engine.connect() as conn:
        return service.metrics(conn, window_s=window_s, bucket_s=bucket_s, end=end)
