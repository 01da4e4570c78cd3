"""The feedback event types (docs/DESIGN.md, the event table): what the API validates
(service/events/schemas.py) and what the reward reads (tabloop/core/reward.py)."""

from __future__ import annotations

EVENT_TYPES = (
    "view",
    "accept",
    "reject",
    "typed_through",
    "code_retained",
    "code_settled",
    "model_switch",
    "churn",
)
