"""POST /openai/v1/completions: OpenAI's completions API over the live policy.

For OpenAI SDKs and editors that speak it (Continue): the base URL is `http://HOST:PORT/openai/v1`,
the API key a tabloop ingest key. Each call is a rollout like `POST /v1/complete`; the answer's
`id` is the suggestion id that feedback events (`POST /v1/events`) name.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from service.completions.rollout import serve
from service.deps import CtxDep, IngestKey
from service.openai.errors import OpenAIRoute
from service.openai.schemas import CompletionRequest, CompletionResponse, OpenAIErrorBody
from service.openai.translate import answer, event_stream, native_request
from service.privacy import NoTrainHeader, in_privacy_mode

router = APIRouter(prefix="/openai/v1", tags=["openai"], route_class=OpenAIRoute)

_ERROR = {"model": OpenAIErrorBody}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "Invalid request (`param` names the field), or not JSON"},
    401: {**_ERROR, "description": "No or unknown API key"},
    403: {**_ERROR, "description": "The key lacks the ingest scope"},
    429: {**_ERROR, "description": "Rate limited; see Retry-After"},
    503: {**_ERROR, "description": "No policy deployed yet, or the database is down"},
}


# One server-sent event (OpenAPI 3.1 describes a stream by its events).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "id": {"type": "string"},
        "data": {
            "type": "string",
            "description": "A chunk: the answer as JSON (the usage chunk has no choices), "
            "then `[DONE]`",
        },
    },
}


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={
        200: {
            "description": "The suggestion; with `stream: true`, as server-sent events",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
        **ERRORS,
    },
)
async def post_completions(
    req: CompletionRequest, key: IngestKey, ctx: CtxDep, no_train: NoTrainHeader
) -> Any:
    """One suggestion, sampled and recorded as a rollout of the policy routed for the person
    (`user`, or the key's name). An abstention is one choice with empty text and finish_reason
    "stop". Privacy mode: a `no_train` key, `"no_train": true`, or `X-Tabloop-No-Train: 1`."""
    native = in_privacy_mode(native_request(req, key, ctx.settings), key, no_train)
    served = await serve(
        ctx, native, stop=req.stop or (), api_key_id=key.id, workspace=key.workspace
    )
    response = answer(served)
    if not req.stream:
        return response
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Response(
        event_stream(response, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
