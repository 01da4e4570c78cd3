"""The Tabby server API under /tabby: a Tabby client's endpoint is http://HOST:PORT/tabby.

tabby-agent (and the editor plugins built on it: vim-tabby, the VS Code and IntelliJ
extensions) appends /v1/... to its endpoint and sends its token as a bearer token: a tabloop key
with the ingest scope. docs/EDITORS.md says how to connect each editor.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from service.completions.rollout import serve
from service.deps import CtxDep, IngestKey
from service.events.ingest import check_admission
from service.events.schemas import IngestResult
from service.openapi import error_responses
from service.privacy import NoTrainHeader, in_privacy_mode
from service.tabby import translate
from service.tabby.schemas import (
    ServerSetting,
    TabbyCompletionRequest,
    TabbyCompletionResponse,
    TabbyEvent,
    TabbyHealth,
)

router = APIRouter(prefix="/tabby", tags=["tabby"])


@router.get("/v1/health", response_model=TabbyHealth)
def get_health(_key: IngestKey, ctx: CtxDep) -> TabbyHealth:
    """The service as a Tabby server describes itself (tabby-agent checks the key with it)."""
    return translate.health(ctx)


@router.post("/v1/health", response_model=TabbyHealth)
def post_health(_key: IngestKey, ctx: CtxDep) -> TabbyHealth:
    """The same as GET (older Tabby clients POST it)."""
    return translate.health(ctx)


@router.get("/v1beta/server_setting", response_model=ServerSetting)
def server_setting(_key: IngestKey) -> ServerSetting:
    """What a Tabby server tells its clients to do: nothing is asked of them here."""
    return ServerSetting(disable_client_side_telemetry=False)


@router.post(
    "/v1/completions",
    response_model=TabbyCompletionResponse,
    responses={503: {"description": "No policy deployed yet, or the database is down"}},
)
async def post_completions(
    req: TabbyCompletionRequest, key: IngestKey, ctx: CtxDep, no_train: NoTrainHeader
) -> TabbyCompletionResponse:
    """A rollout of the live (or canary) policy, exactly as `POST /v1/complete`: one choice,
    or none when the policy abstains. The person is `user`, or the key's name without it.
    Privacy mode: a `no_train` key, or the `X-Tabloop-No-Train: 1` header (tabby-agent's
    `server.requestHeaders`)."""
    native = in_privacy_mode(translate.complete_request(req, key), key, no_train)
    served = await serve(ctx, native, api_key_id=key.id, workspace=key.workspace)
    return translate.completion_response(served)


@router.post(
    "/v1/events",
    status_code=202,
    response_model=IngestResult,
    responses=error_responses(422),
)
def post_events(
    ev: TabbyEvent,
    key: IngestKey,
    ctx: CtxDep,
    select_kind: Annotated[
        Literal["line"] | None, Query(description='"line": only the first line was accepted')
    ] = None,
) -> IngestResult:
    """A view, select (an accept) or dismiss (a reject) of a completion, recorded as its native
    event: validated, counted once however often it is sent, published like any feedback. An
    event about no shown completion is kept in dead_letters and reported in `rejected` (still a
    2xx: the client can do nothing about it)."""
    check_admission(ctx)
    return translate.ingest_tabby_event(ctx, ev, select_kind, key)
