"""POST /v1/complete: a suggestion from the live (or canary) policy, logged as a rollout."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from service.completions.schemas import CompleteRequest, CompleteResponse
from service.completions.service import record_rollout, rollout_record, sample
from service.deps import CtxDep, IngestKey
from service.errors import Unavailable, Unprocessable

router = APIRouter(prefix="/v1", tags=["complete"])


@router.post(
    "/complete",
    response_model=CompleteResponse,
    responses={
        401: {"description": "No or unknown API key"},
        403: {"description": "The key lacks the ingest scope"},
        422: {"description": "Invalid request"},
        429: {"description": "Rate limited; see Retry-After"},
        503: {"description": "No policy deployed yet, or the database is down"},
    },
)
async def post_complete(req: CompleteRequest, _key: IngestKey, ctx: CtxDep) -> CompleteResponse:
    """Sample the rest of the line (or abstain: `shown` false, `text` empty). Every call is a
    rollout, recorded before the answer with the behaviour log-probabilities."""
    settings = ctx.settings
    if req.max_new_tokens > settings.max_new_tokens_limit:
        raise Unprocessable(f"max_new_tokens: at most {settings.max_new_tokens_limit}")
    if not ctx.health.db_usable():
        raise Unavailable(
            "the database is unavailable", headers={"Retry-After": str(settings.retry_after_s)}
        )
    policy = ctx.policies.route(req.user_id)
    loop = asyncio.get_running_loop()
    completion, latency_ms = await loop.run_in_executor(
        ctx.inference, sample, policy, req, settings
    )
    suggestion_id = str(uuid.uuid4())
    record = rollout_record(suggestion_id, req, policy.version, completion, latency_ms)
    await run_in_threadpool(record_rollout, ctx.engine, record, embedded=settings.embedded)
    return CompleteResponse(
        suggestion_id=suggestion_id,
        policy_version=policy.version,
        text=record["text"] if completion.shown else "",
        shown=completion.shown,
        latency_ms=round(latency_ms, 2),
    )
