"""Response bodies of GET /admin/audit."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

_DEPLOY: JsonDict = {
    "id": 412,
    "at": "2026-11-29T12:00:05Z",
    "key_id": "5d1e9a7c3b2f4e60",
    "key_name": "trainer",
    "action": "deploy",
    "target": "7",
    "request_id": "0b6f1c1e8a4e4c3b9d8e2f1a3b4c5d6e",
    "outcome": "ok",
    "detail": {
        "canary_fraction": 0.1,
        "reason": "trainer: gate passed; canary",
        "deployment_id": 12,
        "live_version": 6,
        "canary_version": 7,
    },
}
_REFUSED: JsonDict = {
    "id": 411,
    "at": "2026-11-29T11:58:40Z",
    "key_id": "9f2c4e1a0b3d5c7e",
    "key_name": "ops",
    "action": "promote",
    "target": "6",
    "request_id": "7c2d0e4f9a8b4c1d8e3f2a1b0c9d8e7f",
    "outcome": "409",
    "detail": {"error": {"code": "conflict", "message": "version 6 is not the current canary"}},
}


class AuditEntryOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [_DEPLOY]})

    id: int = Field(description="Increasing; the `before` cursor of the next page")
    at: datetime
    key_id: str | None = Field(
        description="The acting key's public id; null for `cli` and `service`"
    )
    key_name: str | None = Field(
        description="The key's name, or `cli` (tabloop keys ...) or "
        "`service` (the service by itself)"
    )
    action: str = Field(
        description="key.create, key.revoke, policy.register, bootstrap, deploy, "
        "promote, rollback, training.pause, training.resume, "
        "reward_spec.update, replay, purge"
    )
    target: str | None = Field(
        description="What it acted on: a policy or reward-spec version, a key id, a user id"
    )
    request_id: str | None = Field(
        description="The request's X-Request-ID, as in the access log (its first 64 characters)"
    )
    outcome: str = Field(
        description="`ok`, or the HTTP status of the refusal (`403`, `404`, `409`, `422`, ...)"
    )
    detail: dict[str, Any] | None = Field(
        description="Parameters and result; a refusal's `error` code and message"
    )


class AuditPage(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"entries": [_DEPLOY, _REFUSED], "next_before": 411}]}
    )

    entries: list[AuditEntryOut] = Field(description="Newest first")
    next_before: int | None = Field(
        description="Pass as `before` for the next (older) page; null on the last page"
    )
