"""Feedback events as DESIGN.md defines them: seven types, each validated on its own."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from tabloop.core.events import EVENT_TYPES

SCHEMA_VERSION = 1


# The form clients almost always send, which is already canonical: checking it is ~7x cheaper
# than parsing it (and the ingest hot path checks two per event).
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _canonical_uuid(value: str) -> str:
    if _CANONICAL_UUID.fullmatch(value):
        return value
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ValueError("must be a UUID, e.g. 9f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f") from None


def _rfc3339(value: str) -> str:
    """RFC 3339 with a zone (Z or +hh:mm), returned normalized to UTC with a Z."""
    if len(value) > 40 or ("T" not in value and "t" not in value and " " not in value):
        raise ValueError("must be an RFC 3339 date-time, e.g. 2026-11-29T12:00:00Z")
    try:
        parsed = datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        raise ValueError("must be an RFC 3339 date-time, e.g. 2026-11-29T12:00:00Z") from None
    if parsed.tzinfo is None:
        raise ValueError("must carry a time zone (Z or +hh:mm)")
    try:
        utc = parsed.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00:00+01:00 is in year 0 in UTC
        raise ValueError("is out of range once converted to UTC") from None
    return utc.isoformat().replace("+00:00", "Z")


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


UUIDStr = Annotated[StrictStr, Field(max_length=64), AfterValidator(_canonical_uuid)]
Timestamp = Annotated[StrictStr, AfterValidator(_rfc3339)]


NO_NUL_PATTERN = "^[^\\u0000]*$"  # the OpenAPI schema's word for "no NUL characters"


class _NoNul:
    """Client text that is stored: PostgreSQL refuses NUL in text and JSONB, so it is refused
    here, and the OpenAPI schema says so (a pattern), so that schema-valid input is accepted."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(_no_nul, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = handler(schema)
        out["pattern"] = NO_NUL_PATTERN
        return out


NoNul = _NoNul()
UserId = Annotated[StrictStr, Field(min_length=1, max_length=256), NoNul]
ModelName = Annotated[StrictStr, Field(min_length=1, max_length=200), NoNul]
SETTLED_TEXT_MAX_CHARS = 1000


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_id: UUIDStr
    user_id: UserId
    occurred_at: Timestamp


class ViewEvent(_Event):
    """The editor displayed the suggestion. It matters for rollouts whose client said it reports
    views (`reports_views` on the request): there a shown suggestion never viewed is no reject."""

    type: Literal["view"]
    suggestion_id: UUIDStr


class AcceptEvent(_Event):
    type: Literal["accept"]
    suggestion_id: UUIDStr
    accepted_chars: StrictInt | None = Field(None, ge=0, le=1_000_000)


class RejectEvent(_Event):
    type: Literal["reject"]
    suggestion_id: UUIDStr


class TypedThroughEvent(_Event):
    """The person typed the shown suggestion themselves instead of accepting it: no rejection.
    The service records it when a person's next request in the same file continues with the
    suggestion's text (docs/REWARD.md, Typed through); a client that sees it may send it too."""

    type: Literal["typed_through"]
    suggestion_id: UUIDStr
    typed_chars: StrictInt = Field(ge=1, le=1_000_000)


class CodeRetainedEvent(_Event):
    type: Literal["code_retained"]
    suggestion_id: UUIDStr
    after_seconds: StrictFloat = Field(ge=0, le=30 * 24 * 3600)
    retained_fraction: StrictFloat = Field(ge=0, le=1)


class CodeSettledEvent(_Event):
    """What finally stands from the request's cursor to the end of that line, `after_seconds`
    after the request: code text, kept like a rollout's prefix and never logged. Not a reward
    signal (docs/REWARD.md); the trainer reads it as evidence of what should have been suggested."""

    type: Literal["code_settled"]
    suggestion_id: UUIDStr
    # an int (30) is a JSON number like 30.0: strict mode takes ints for floats, never bools
    after_seconds: StrictFloat = Field(ge=0, le=30 * 24 * 3600)
    text: Annotated[StrictStr, Field(max_length=SETTLED_TEXT_MAX_CHARS), NoNul]


class ModelSwitchEvent(_Event):
    type: Literal["model_switch"]
    from_model: ModelName
    to_model: ModelName


class ChurnEvent(_Event):
    type: Literal["churn"]
    reason: Annotated[StrictStr, Field(max_length=500), NoNul] | None = None


Event = Annotated[
    ViewEvent
    | AcceptEvent
    | RejectEvent
    | TypedThroughEvent
    | CodeRetainedEvent
    | CodeSettledEvent
    | ModelSwitchEvent
    | ChurnEvent,
    Field(discriminator="type"),
]
_event_adapter: TypeAdapter[Event] = TypeAdapter(Event)


class EventBatch(BaseModel):
    """POST /v1/events body. Events are validated one by one, so one bad event is reported alone."""

    model_config = ConfigDict(extra="forbid")  # a misspelt or unknown top-level field is a 422

    events: list[Any] = Field(
        description="Feedback events (view, accept, reject, typed_through, code_retained, "
        "code_settled, model_switch, churn); each is validated on its own and a bad one is "
        "reported by index. A view says the editor displayed the suggestion; typed_through "
        "(`typed_chars`) that the person typed it themselves instead of accepting it. code_settled "
        "(from opted-in editors, for any suggestion) carries `after_seconds` and `text`: what "
        "finally stands from the request's cursor to the end of that line (at most 1,000 "
        "characters, may be empty); it is stored like a prefix and is not part of the reward.",
        json_schema_extra={
            "examples": [
                [
                    {
                        "event_id": "7c2e4a10-3b5d-4f6e-9a8b-1c2d3e4f5a6b",
                        "type": "view",
                        "user_id": "u-42",
                        "suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140",
                        "occurred_at": "2026-11-29T11:59:59Z",
                    },
                    {
                        "event_id": "0b6f1c1e-8a4e-4c3b-9d8e-2f1a3b4c5d6e",
                        "type": "accept",
                        "user_id": "u-42",
                        "suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140",
                        "occurred_at": "2026-11-29T12:00:00Z",
                        "accepted_chars": 14,
                    },
                    {
                        "event_id": "3e0d9c8b-7a6f-4e5d-8c4b-3a2f1e0d9c8b",
                        "type": "code_settled",
                        "user_id": "u-42",
                        "suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140",
                        "occurred_at": "2026-11-29T12:01:00Z",
                        "after_seconds": 60,
                        "text": "sum(xs) / len(xs)",
                    },
                ]
            ]
        },
    )


class RejectedEvent(BaseModel):
    index: int
    error: str


class IngestResult(BaseModel):
    accepted: int
    duplicates: int
    rejected: list[RejectedEvent]


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors(include_url=False)[:5]:
        loc = ".".join(str(p) for p in e["loc"][1:] if not isinstance(p, int)) or "event"
        if e["type"] == "union_tag_invalid":
            parts.append(f"type: must be one of {', '.join(EVENT_TYPES)}")
        elif e["type"] == "union_tag_not_found":
            parts.append("type: missing (one of " + ", ".join(EVENT_TYPES) + ")")
        elif e["type"] == "extra_forbidden":
            # the client's own key, escaped unless printable: NUL or a lone surrogate in the
            # error text would make the dead-letter row unstorable (and sink the whole batch)
            name = str(e["loc"][-1])
            parts.append(f"{name if name.isprintable() else json.dumps(name)}: unknown field")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_event(raw: Any) -> dict[str, Any]:
    """The validated, normalized event as a plain dict; raises ValueError with a readable reason."""
    if not isinstance(raw, dict):
        raise ValueError("an event must be a JSON object")
    try:
        event = _event_adapter.validate_python(raw)
    except ValidationError as e:
        raise ValueError(_describe(e)) from None
    return event.model_dump(exclude_none=True)
