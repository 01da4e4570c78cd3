"""The simulator's HTTP side: tabloop's client (`tabloop.client`: retries, batching, redelivery),
as an editor plugin uses it, plus the admin calls the simulation makes along the way."""

from __future__ import annotations

from typing import Any

import httpx

from tabloop import client as sdk
from tabloop.client import (  # noqa: F401 (the simulator's modules and tests import them here)
    ApiError,
    ClientStats,
    EventSender,
    EventStats,
    backoff_s,
    retry_after_s,
    wait_s,
)


class Client(sdk.Client):
    """tabloop's client, with the admin reads and writes a simulation makes (the reward spec,
    the deployment timeline, pausing the trainer), which answer a status rather than raise."""

    async def get(self, path: str, **params: Any) -> tuple[int, Any]:
        """(status, JSON body) of an admin GET; (0, None) when the service stayed unavailable."""
        return _status_and_json(await self.request("GET", path, params=params or None))

    async def post(self, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, JSON body) of an admin POST; (0, None) when the service stayed unavailable."""
        return _status_and_json(await self.request("POST", path, json=body))


def _status_and_json(r: httpx.Response | None) -> tuple[int, Any]:
    """(status, JSON body or None), or (0, None) for no response."""
    if r is None:
        return 0, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None
