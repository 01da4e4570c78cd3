"""Valid example events, one per type (tests override fields to make them invalid), and a stored
rollout row for tests that write the tables directly."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

REQUIRED: dict[str, dict[str, Any]] = {
    "view": {"suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140"},
    "accept": {"suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140", "accepted_chars": 12},
    "reject": {"suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140"},
    "typed_through": {"suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140", "typed_chars": 9},
    "code_retained": {
        "suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140",
        "after_seconds": 30,
        "retained_fraction": 0.75,
    },
    "code_settled": {
        "suggestion_id": "5d3c2b1a-0f9e-4d8c-b7a6-958473625140",
        "after_seconds": 30,
        "text": "x + 1)",
    },
    "model_switch": {"from_model": "tabloop", "to_model": "other"},
    "churn": {"reason": "cancelled"},
}


def event(type_: str = "accept", *, user_id: str = "u-1", **fields: Any) -> dict[str, Any]:
    """A valid event of `type_`; a field given as None is removed."""
    ev: dict[str, Any] = {
        "event_id": str(uuid.uuid4()),
        "type": type_,
        "user_id": user_id,
        "occurred_at": "2026-11-29T12:00:00Z",
        **REQUIRED[type_],
    }
    ev.update(fields)
    return {k: v for k, v in ev.items() if v is not None}


def rollout_row(suggestion_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """The columns of a stored rollout (`rollouts.insert().values(**rollout_row(...))`): one shown
    token from user u-1 on version 1, now; `fields` override any of them."""
    row: dict[str, Any] = {
        "suggestion_id": suggestion_id or str(uuid.uuid4()),
        "user_id": "u-1",
        "policy_version": 1,
        "created_at": datetime.now(UTC),
        "context_token_ids": [1],
        "heal_text": "",
        "token_ids": [2],
        "token_logprobs": [-0.1],
        "text": "x",
        "shown": True,
        "gate_prob_show": 0.5,
        "decision_logprob": -0.7,
        "logprob_total": -0.8,
        "temperature": 0.7,
        "stop_reason": "newline",
        "latency_ms": 1.0,
    }
    row.update(fields)
    return row
