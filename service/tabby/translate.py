"""Tabby requests as tabloop's own: a completion is a rollout, an event a native feedback event.

A Tabby event names a completion, not a person: the rollout it names gives the user and the
suggestion. It is then ingested exactly as `POST /v1/events` ingests one (validation,
idempotency, outbox). Its event id is derived from what it says, so a client that sends the
same event again is counted once; an event that cannot be attributed is dead-lettered.
"""

from __future__ import annotations

import logging
import os
import platform
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import sqlalchemy as sa
import torch
from pydantic import ValidationError

from service.completions.rollout import Served
from service.completions.schemas import MAX_SNIPPETS, CompleteRequest
from service.deps import AppContext
from service.errors import Unprocessable
from service.events.ingest import ingest_events
from service.events.schemas import IngestResult, RejectedEvent
from service.metrics import INGEST_EVENTS
from service.tabby.schemas import (
    COMPLETION_ID_PREFIX,
    TABBY_API_VERSION,
    Choice,
    TabbyCompletionRequest,
    TabbyCompletionResponse,
    TabbyEvent,
    TabbyHealth,
    TabbyVersion,
)
from tabloop.core.keys import ApiKey
from tabloop.core.tables import dead_letters, rollouts, utcnow

log = logging.getLogger(__name__)

# Tabby event type -> native event type
NATIVE_TYPE = {"view": "view", "select": "accept", "dismiss": "reject"}
# Namespace of the event ids derived from Tabby events (uuid5): fixed forever, or a repeat sent
# across a release would be counted twice.
EVENT_NAMESPACE = uuid.UUID("3b9e6f0c-5a1d-4e27-9c4b-7d2f8a6e1b30")
DEAD_LETTER_SOURCE = "tabby"


def complete_request(req: TabbyCompletionRequest, key: ApiKey) -> CompleteRequest:
    """The native request for a Tabby one. Tabby clients report views, so the rollout says so
    (a shown suggestion they never report viewed is then no reject)."""
    seg = req.segments
    try:
        return CompleteRequest.model_validate(
            {
                "user_id": req.user or key.name,  # tabby-agent sends no user with a token
                "language": req.language,
                "file_path": seg.filepath,
                "workspace_id": seg.git_url,
                "prefix": seg.prefix,
                "suffix": seg.suffix or "",
                "snippets": [
                    *(s.model_dump() for s in seg.declarations or ()),
                    *(s.model_dump() for s in seg.relevant_snippets_from_changed_files or ()),
                    *([{"filepath": None, "body": seg.clipboard}] if seg.clipboard else ()),
                ][:MAX_SNIPPETS],
                "reports_views": True,
            }
        )
    except ValidationError as e:  # the key's name as a user id, should one ever not fit
        raise Unprocessable(f"cannot serve this request: {e.errors()[0]['msg']}") from None


def completion_response(served: Served) -> TabbyCompletionResponse:
    choices = [Choice(index=0, text=served.text)] if served.shown else []
    return TabbyCompletionResponse(id=COMPLETION_ID_PREFIX + served.suggestion_id, choices=choices)


def suggestion_id_of(completion_id: str) -> str | None:
    """The suggestion a completion id names (`cmpl-<uuid>`, or the bare uuid); None if none."""
    try:
        return str(uuid.UUID(completion_id.removeprefix(COMPLETION_ID_PREFIX)))
    except ValueError:
        return None


def event_id(suggestion_id: str, ev: TabbyEvent, select_kind: str | None) -> str:
    """The same Tabby event, sent again, gets the same id (and is then a duplicate)."""
    name = "|".join(
        (suggestion_id, ev.type, str(ev.choice_index), ev.view_id or "", select_kind or "")
    )
    return str(uuid.uuid5(EVENT_NAMESPACE, name))


@dataclass(frozen=True)
class Shown:
    """What the events of a completion need of its rollout."""

    user_id: str
    shown: bool
    line_chars: int  # characters in the suggestion's first line


def find_rollout(engine: sa.Engine, suggestion_id: str) -> Shown | None:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(
                rollouts.c.user_id, rollouts.c.shown, rollouts.c.text, rollouts.c.text_chars
            ).where(rollouts.c.suggestion_id == suggestion_id)
        ).first()
    if row is None:
        return None
    # A suggestion is one line (sampling stops at the newline): without its text (privacy mode,
    # code retention) its length is the first line's.
    blank = not row.text and row.text_chars is not None
    return Shown(
        row.user_id, bool(row.shown), row.text_chars if blank else len(row.text.split("\n", 1)[0])
    )


def native_event(
    ev: TabbyEvent, suggestion_id: str, rollout: Shown, select_kind: str | None
) -> dict[str, Any]:
    """The native event: view -> view, select -> accept (of the first line only with
    select_kind "line"), dismiss -> reject; stamped with the server's time."""
    out: dict[str, Any] = {
        "event_id": event_id(suggestion_id, ev, select_kind),
        "type": NATIVE_TYPE[ev.type],
        "user_id": rollout.user_id,
        "suggestion_id": suggestion_id,
        "occurred_at": utcnow().isoformat().replace("+00:00", "Z"),
    }
    if ev.type == "select" and select_kind == "line":
        out["accepted_chars"] = rollout.line_chars
    return out


def _unattributable(ev: TabbyEvent, rollout: Shown | None, suggestion_id: str | None) -> str:
    """Why the event cannot be about a suggestion that was shown; "" when it can."""
    if suggestion_id is None or rollout is None:
        return f"completion_id {ev.completion_id!r}: no such completion"
    if not rollout.shown:
        return f"completion_id {ev.completion_id!r}: it offered no choice (the policy abstained)"
    if ev.choice_index != 0:
        return f"choice_index {ev.choice_index}: the completion has one choice, 0"
    return ""


def dead_letter(engine: sa.Engine, raw: dict[str, Any], error: str, api_key_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            dead_letters.insert().values(
                received_at=utcnow(),
                source=DEAD_LETTER_SOURCE,
                api_key_id=api_key_id,
                raw=orjson.dumps(raw).decode(),
                error=error,
            )
        )


def ingest_tabby_event(
    ctx: AppContext, ev: TabbyEvent, select_kind: str | None, key: ApiKey
) -> IngestResult:
    """Record one Tabby event as its native event; one that names no shown suggestion is kept
    in dead_letters with the reason, and reported like a rejected native event. The native
    event then passes the checks every feedback event passes (service/events/trust.py): a
    completion served to another key is refused."""
    select_kind = select_kind or ev.select_kind
    suggestion_id = suggestion_id_of(ev.completion_id)
    rollout = find_rollout(ctx.engine, suggestion_id) if suggestion_id else None
    error = _unattributable(ev, rollout, suggestion_id)
    if error or rollout is None or suggestion_id is None:
        raw = ev.model_dump(exclude_none=True)
        if select_kind:
            raw["select_kind"] = select_kind
        dead_letter(ctx.engine, raw, error, key.id)
        INGEST_EVENTS.labels(type=NATIVE_TYPE[ev.type], outcome="rejected").inc()
        log.info("tabby event dead-lettered: %s", error)
        rejected = [RejectedEvent(index=0, error=error)]
        return IngestResult(accepted=0, duplicates=0, rejected=rejected)
    return ingest_events(
        ctx.engine,
        [native_event(ev, suggestion_id, rollout, select_kind)],
        api_key_id=key.id,
        max_event_bytes=ctx.settings.max_event_bytes,
        embedded=ctx.settings.embedded,
        profile=ctx.settings.profile,
        source=DEAD_LETTER_SOURCE,
        no_train=key.no_train,
    )


def health(ctx: AppContext) -> TabbyHealth:
    """A Tabby server's health, as a Tabby client reads it: it needs `model`, `device` and a
    version to go on and fetch the server setting."""
    routing = ctx.policies.routing
    machine = platform.machine() or "unknown"
    device = ctx.policies.device  # TABLOOP_DEVICE, resolved
    gpus = range(torch.cuda.device_count()) if device.type == "cuda" else range(0)
    return TabbyHealth(
        model=f"tabloop policy v{routing.live.version}" if routing else "tabloop (no policy yet)",
        device=device.type,
        arch=machine,
        cpu_info=platform.processor() or machine,
        cpu_count=os.cpu_count() or 1,
        cuda_devices=[torch.cuda.get_device_name(i) for i in gpus],
        version=TabbyVersion(
            build_date="", build_timestamp="", git_sha="", git_describe=TABBY_API_VERSION
        ),
    )
