"""Request and response bodies of the users admin API."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Removed(BaseModel):
    rollouts: int = Field(description="Rollouts (suggestions served to the person)")
    events: int = Field(description="Feedback events")
    rewards: int = Field(description="Finalized rewards")
    outbox: int = Field(
        description="Outbox rows keyed by the user on tabloop.rollouts and tabloop.feedback "
        "(embedded mode: the log itself; full mode: including rows not yet published, "
        "which never will be)"
    )
    dead_letters: int = Field(description="Rejected events whose raw JSON names the user")
    workspace_code: int = Field(
        description="Documents the person's requests left in their workspaces' memory"
    )


class PurgeOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "user_id": "u-42",
                    "purged_at": "2026-11-29T12:00:00.123456Z",
                    "removed": {
                        "rollouts": 120,
                        "events": 87,
                        "rewards": 110,
                        "outbox": 207,
                        "dead_letters": 1,
                        "workspace_code": 3,
                    },
                }
            ]
        }
    )

    user_id: str
    purged_at: str = Field(description="RFC 3339; also in the user_purged tombstone")
    removed: Removed
