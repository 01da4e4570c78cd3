"""Response models of GET /admin/metrics."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_ROW_EXAMPLE: dict[str, Any] = {
    "policy_version": 3,
    "suggestions": 1200,
    "shown": 420,
    "shown_rate": 0.35,
    "shown_finalized": 400,
    "accepted": 126,
    "accept_rate": 0.3,
    "retained_fraction": 0.82,
    "accepted_chars_per_request": 1.9,
    "retained_chars_per_request": 1.56,
    "kept_chars_per_100": 156.0,
    "not_taken_per_request": 0.238,
    "mean_reward": 0.031,
    "rewards_finalized": 1150,
    "latency_ms_p50": 11.8,
    "latency_ms_p99": 42.0,
}


class Row(BaseModel):
    """Live-traffic figures of one policy version over a window or a bucket.

    Acceptance, retention, characters and reward come from finalized rewards and are rates over
    the rollouts that have one, so a bucket still inside the reward horizon (10 min by default)
    shows the part already decided instead of a false dip: see `rewards_finalized`.
    """

    model_config = ConfigDict(json_schema_extra={"example": _ROW_EXAMPLE})

    policy_version: int
    suggestions: int = Field(description="rollouts served (every /v1/complete call)")
    shown: int = Field(description="rollouts where the policy showed a suggestion")
    shown_rate: float = Field(description="shown / suggestions")
    shown_finalized: int = Field(
        description="shown rollouts with a finalized reward, unviewed ones (from a client that "
        "reports views, never viewed) left out"
    )
    accepted: int = Field(description="rollouts whose finalized reward says accepted")
    accept_rate: float | None = Field(
        description="accepted / shown_finalized; null when no shown rollout is final yet"
    )
    retained_fraction: float | None = Field(
        description="mean retention over accepted rollouts with a finalized reward (a provisional "
        "accept counts at the spec's provisional weight); null if none"
    )
    accepted_chars_per_request: float | None = Field(
        description="accepted characters / rewards_finalized; null if none"
    )
    retained_chars_per_request: float | None = Field(
        description="accepted characters x retention / rewards_finalized; null if none"
    )
    kept_chars_per_100: float | None = Field(
        description="kept characters (accepted characters x retention) per 100 requests with a "
        "finalized reward: 100 x retained_chars_per_request; null if none",
    )
    not_taken_per_request: float | None = Field(
        description="shown but not taken, (shown_finalized - accepted) / rewards_finalized; null "
        "if none",
    )
    mean_reward: float | None = Field(description="mean over finalized rewards; null if none")
    rewards_finalized: int = Field(description="rollouts with a finalized reward")
    latency_ms_p50: float | None = Field(description="median serving latency; null if no rollout")
    latency_ms_p99: float | None


class BucketRow(Row):
    """A Row for one time bucket: only (bucket, version) pairs with rollouts are listed."""

    model_config = ConfigDict(
        json_schema_extra={"example": {"start": "2026-11-29T12:00:00Z", **_ROW_EXAMPLE}}
    )

    start: datetime = Field(description="start of the bucket (buckets are aligned to bucket_s)")


class RefusedGroup(BaseModel):
    """A person (user_id) or API key whose feedback events were refused."""

    id: str = Field(description="the user_id, or the API key's public id")
    name: str | None = Field(None, description="the key's name (keys only)")
    refused: int = Field(description="refused events in the window")
    reasons: dict[str, int] = Field(
        description="by reason: wrong_key, wrong_user, not_shown, before_served, late"
    )


class CappedGroup(BaseModel):
    """A person or API key whose rows the trainer weighted down in batches of the window."""

    id: str = Field(description="the user_id, or the API key's public id")
    name: str | None = Field(None, description="the key's name (keys only)")
    batches: int = Field(description="batches in which it was capped")
    rows: int = Field(description="its rows in those batches")
    weight_removed: float = Field(
        description="rows minus the weight they kept, summed (the weights average 1 per row)"
    )
    max_share: float = Field(description="the largest share of one batch's rows it held")


_TRUST_EXAMPLE: dict[str, Any] = {
    "refused": 120,
    "refused_by_reason": {"wrong_key": 100, "not_shown": 20},
    "refused_users": [
        {"id": "u-7", "name": None, "refused": 120, "reasons": {"wrong_key": 100, "not_shown": 20}}
    ],
    "refused_keys": [
        {
            "id": "k3x9",
            "name": "ci-bot",
            "refused": 120,
            "reasons": {"wrong_key": 100, "not_shown": 20},
        }
    ],
    "batches": 4,
    "capped_users": [
        {
            "id": "u-7",
            "name": None,
            "batches": 4,
            "rows": 2900,
            "weight_removed": 1850.5,
            "max_share": 0.71,
        }
    ],
    "capped_keys": [],
}


class FeedbackTrust(BaseModel):
    """Whose feedback was refused at ingestion or capped in training, over the window (the
    people and keys with the most first, at most 10 each)."""

    model_config = ConfigDict(json_schema_extra={"example": _TRUST_EXAMPLE})

    refused: int = Field(
        description="refused feedback events received in the window (dead "
        "letters with a refusal's reason; the newest 20,000 dead letters read)"
    )
    refused_by_reason: dict[str, int]
    refused_users: list[RefusedGroup] = Field(description="by refused events")
    refused_keys: list[RefusedGroup] = Field(description="by refused events")
    batches: int = Field(
        description="training batches in the window whose caps are known (the "
        "trainer keeps its last 50)"
    )
    capped_users: list[CappedGroup] = Field(description="by weight removed")
    capped_keys: list[CappedGroup] = Field(description="by weight removed")


class MetricsOut(BaseModel):
    model_config = ConfigDict(
        populate_by_name=True,
        json_schema_extra={
            "example": {
                "window_s": 3600,
                "bucket_s": 120,
                "from": "2026-11-29T11:00:00Z",
                "to": "2026-11-29T12:00:00Z",
                "versions": [_ROW_EXAMPLE],
                "buckets": [{"start": "2026-11-29T11:58:00Z", **_ROW_EXAMPLE}],
                "feedback": _TRUST_EXAMPLE,
            }
        },
    )

    window_s: int
    bucket_s: int
    from_: datetime = Field(alias="from", description="start of the window (inclusive)")
    to: datetime = Field(description="end of the window (exclusive): now unless asked")
    versions: list[Row] = Field(description="one row per policy version over the whole window")
    buckets: list[BucketRow] = Field(description="per bucket and version, in time order")
    feedback: FeedbackTrust = Field(
        description="whose feedback was refused or capped in the window (docs/METRICS.md)"
    )
