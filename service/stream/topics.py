"""Topic names and message framing shared by producers (service, relay) and consumers (trainer)."""

from __future__ import annotations

from typing import Any

import orjson

ROLLOUTS = "tabloop.rollouts"
FEEDBACK = "tabloop.feedback"
POLICIES = "tabloop.policies"
ALL_TOPICS = (ROLLOUTS, FEEDBACK, POLICIES)
SCHEMA_VERSION = 1


def encode(value: dict[str, Any]) -> str:
    """A message value: the JSON object with its `schema_version`."""
    return orjson.dumps({"schema_version": SCHEMA_VERSION, **value}).decode()
