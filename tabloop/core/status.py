"""The trainer's status: what `tabloop train` writes to its `trainer_state` row every second and
`GET /admin/training` returns under `trainer` (and the dashboard shows). One type for both
sides, so the row is a schema, not a convention."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

State = Literal[
    "starting",  # not yet round the loop
    "collecting",  # finalizing rewards, waiting for a full batch
    "updating",  # the policy-gradient update
    "gating",  # the deploy check
    "canary",  # a candidate deployed to some users, being judged
    "paused",  # POST /admin/training/pause
    "retrying",  # the database, broker or API failed; restarting from what is durable
    "stopped",
]


class HistoryEntry(BaseModel):
    """One of the trainer's decisions (the last 50 are kept)."""

    at: str  # ISO 8601
    event: str  # canary, promote, rollback, gate_failed, skipped, update_failed
    version: int
    reason: str


class TrainerStatus(BaseModel):
    # rows written by another version may carry more or fewer fields: ignored, defaulted
    model_config = ConfigDict(extra="ignore")

    state: State = "starting"
    # the join (this process's partitions in full mode; GET /admin/training lists each member)
    pending: int = 0  # rollouts waiting for their reward to be final
    finalized: int = 0  # rewards this process wrote
    finalized_elsewhere: int = 0  # due here, but another member wrote them first
    late_events: int = 0  # feedback that came after its rollout's reward was final
    bad_records: int = 0  # log records that could not be read (skipped)
    join_lag_s: float = 0.0  # age of the oldest pending rollout
    reward_spec_version: int | None = None  # set when a new spec was picked up
    # training
    batch_fill: int = 0  # rewards ready for the next update
    batch_size: int | None = None  # the update's batch size
    last_update: dict[str, Any] | None = None  # the last candidate's training summary
    last_gate: dict[str, Any] | None = None  # the last deploy check's result
    canary: dict[str, Any] | None = None  # the canary being judged: both arms' statistics
    history: list[HistoryEntry] = Field(default_factory=list)
    capped: list[dict[str, Any]] = Field(default_factory=list)  # who was capped, per batch
