"""Talking to the service as the trainer does: register, deploy, promote, roll back over HTTP
with a deploy-scoped key. The trainer reaches the API only through this client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tabloop.client import ApiError
from tabloop.core.policy.checkpoint import MANIFEST_FILE, TOKENIZER_FILE, WEIGHTS_FILE


class ServiceClient:
    def __init__(self, base_url: str, token: str, timeout_s: float = 60.0) -> None:
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"}
        )

    def _ok(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            raise ApiError(r.status_code, f"{r.request.method} {r.request.url.path}: {r.text}")
        return r.json()

    def register(self, ckpt: Path, parent: int | None, summary: dict[str, Any]) -> int:
        files = {
            "manifest": (MANIFEST_FILE, (ckpt / MANIFEST_FILE).read_bytes()),
            "weights": (WEIGHTS_FILE, (ckpt / WEIGHTS_FILE).read_bytes()),
            "tokenizer": (TOKENIZER_FILE, (ckpt / TOKENIZER_FILE).read_bytes()),
        }
        data = {"summary": json.dumps(summary)}
        if parent is not None:
            data["parent"] = str(parent)
        return int(self._ok(self._http.post("/admin/policies", files=files, data=data))["version"])

    def deploy(self, version: int, fraction: float, reason: str) -> dict[str, Any]:
        return self._ok(
            self._http.post(
                f"/admin/policies/{version}/deploy",
                json={"canary_fraction": fraction, "reason": reason},
            )
        )

    def promote(self, version: int, reason: str) -> dict[str, Any]:
        return self._ok(
            self._http.post(
                f"/admin/policies/{version}/promote",
                json={"reason": reason},
            )
        )

    def rollback(self, reason: str, canary_version: int | None = None) -> dict[str, Any]:
        """Roll back; with `canary_version`, only that canary (a 409 if it no longer is one)."""
        body: dict[str, Any] = {"reason": reason}
        if canary_version is not None:
            body["canary_version"] = canary_version
        return self._ok(self._http.post("/admin/rollback", json=body))

    def close(self) -> None:
        self._http.close()
