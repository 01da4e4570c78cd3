"""POST /v1/events: feedback about suggestions, recorded exactly once."""

from __future__ import annotations

from fastapi import APIRouter

from service.deps import CtxDep, IngestKey
from service.errors import PayloadTooLarge, Unavailable
from service.events.schemas import EventBatch, IngestResult
from service.events.service import ingest_events

router = APIRouter(prefix="/v1", tags=["ingest"])

ERRORS = {
    400: {"description": "Not JSON, or a broken gzip body"},
    401: {"description": "No or unknown API key"},
    403: {"description": "The key lacks the ingest scope"},
    413: {"description": "Too many events, or a body over the size limit (after gzip too)"},
    422: {"description": "The body is not an event batch"},
    429: {"description": "Rate limited; see Retry-After"},
    503: {"description": "Database down or relay backlog full; see Retry-After"},
}


@router.post("/events", status_code=202, response_model=IngestResult, responses=ERRORS)  # type: ignore[arg-type]
def post_events(batch: EventBatch, key: IngestKey, ctx: CtxDep) -> IngestResult:
    """Record a batch of feedback events. Each event is validated on its own: bad ones are
    reported by index and dead-lettered, repeats of an `event_id` are counted as duplicates and
    never stored twice. The 202 comes after the database commit."""
    settings = ctx.settings
    if len(batch.events) > settings.max_events_per_batch:
        raise PayloadTooLarge(
            f"{len(batch.events)} events in one batch; the limit is {settings.max_events_per_batch}"
        )
    retry = {"Retry-After": str(settings.retry_after_s)}
    if not ctx.health.db_ok:
        raise Unavailable("the database is unavailable", headers=retry)
    if not settings.embedded and ctx.health.backlog_rows >= settings.outbox_backlog_limit:
        raise Unavailable(
            f"{ctx.health.backlog_rows} events wait for the broker; try again shortly", headers=retry
        )
    return ingest_events(
        ctx.engine,
        batch.events,
        api_key_id=key.id,
        max_event_bytes=settings.max_event_bytes,
        embedded=settings.embedded,
    )
