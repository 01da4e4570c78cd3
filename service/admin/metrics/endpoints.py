"""GET /admin/metrics: per policy version and time bucket, from rollouts and their rewards."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from service.admin.metrics import queries
from service.admin.metrics.schemas import MetricsOut
from service.deps import AdminKey, CtxDep
from service.errors import Unprocessable

router = APIRouter(prefix="/admin", tags=["admin: metrics"])

RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})?")


def _parse_end(to: str | None) -> datetime | None:
    """RFC 3339 only (pydantic would also take a number as a Unix time, which the schema's
    date-time does not promise)."""
    if to is None:
        return None
    try:
        if not RFC3339.fullmatch(to):
            raise ValueError
        return datetime.fromisoformat(to.replace("z", "Z"))
    except ValueError:
        raise Unprocessable(f"to must be an RFC 3339 date-time, got {to[:64]!r}") from None


@router.get("/metrics", response_model=MetricsOut)
def get_metrics(
    _key: AdminKey,
    ctx: CtxDep,
    window: Annotated[
        str | None,
        Query(
            description="seconds or a duration (90s, 15m, 1h, 24h, 7d); default 1h, at most 30d",
            examples=["1h"],
        ),
    ] = None,
    bucket: Annotated[
        str | None,
        Query(
            description="bucket size, same format; default window/30 (at least 10 s); at most "
            f"{queries.MAX_BUCKETS} buckets per window",
            examples=["2m"],
        ),
    ] = None,
    to: Annotated[
        str | None,
        Query(
            description="end of the window (RFC 3339); default now",
            json_schema_extra={"format": "date-time"},
            examples=["2026-11-29T12:00:00Z"],
        ),
    ] = None,
) -> MetricsOut:
    """Suggestions, shown and accept rates, retention, characters per request, mean reward and
    latency percentiles per policy version, over the window and per bucket (docs/METRICS.md)."""
    window_s, bucket_s = queries.resolve_window(window=window, bucket=bucket)
    end = queries.resolve_end(_parse_end(to))
    with ctx.engine.connect() as conn:
        return queries.metrics(conn, window_s=window_s, bucket_s=bucket_s, end=end)
