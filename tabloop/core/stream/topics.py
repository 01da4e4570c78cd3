"""Topic names and message framing shared by producers (service, relay) and consumers (trainer)."""

from __future__ import annotations

from typing import Any

import orjson

ROLLOUTS = "tabloop.rollouts"
FEEDBACK = "tabloop.feedback"
POLICIES = "tabloop.policies"
ALL_TOPICS = (ROLLOUTS, FEEDBACK, POLICIES)
SCHEMA_VERSION = 1
# A control message on tabloop.rollouts and tabloop.feedback (key: the user id): the person's
# data was purged; consumers drop what they hold of that user from before it. Data messages
# carry no top-level "type" on rollouts, and an event type on feedback, so the kind is unambiguous.
USER_PURGED = "user_purged"


def encode(value: dict[str, Any]) -> str:
    """A message value: the JSON object with its `schema_version`."""
    return orjson.dumps({"schema_version": SCHEMA_VERSION, **value}).decode()


def user_purged(user_id: str, purged_at: str) -> dict[str, Any]:
    """The tombstone written to ROLLOUTS and FEEDBACK by `DELETE /admin/users/{user_id}`."""
    return {"type": USER_PURGED, "user_id": user_id, "purged_at": purged_at}


def is_user_purged(value: dict[str, Any]) -> bool:
    return value.get("type") == USER_PURGED
