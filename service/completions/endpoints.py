"""POST /v1/complete: a suggestion from the live (or canary) policy, logged as a rollout."""

from __future__ import annotations

from fastapi import APIRouter

from service.completions.rollout import serve
from service.completions.schemas import CompleteRequest, CompleteResponse
from service.deps import CtxDep, IngestKey
from service.privacy import NoTrainHeader, in_privacy_mode

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
async def post_complete(
    req: CompleteRequest, key: IngestKey, ctx: CtxDep, no_train: NoTrainHeader
) -> CompleteResponse:
    """Sample the rest of the line (or abstain: `shown` false, `text` empty). Every call is a
    rollout, recorded before the answer with the behaviour log-probabilities (in privacy mode
    without its code: docs/PRIVACY.md)."""
    served = await serve(
        ctx, in_privacy_mode(req, key, no_train), api_key_id=key.id, workspace=key.workspace
    )
    return CompleteResponse(
        suggestion_id=served.suggestion_id,
        policy_version=served.policy_version,
        text=served.text,
        shown=served.shown,
        latency_ms=round(served.latency_ms, 2),
    )
