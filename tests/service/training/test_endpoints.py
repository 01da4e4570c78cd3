"""Training status and pause/resume through the admin API."""

from __future__ import annotations

import httpx


def test_pause_and_resume(client: httpx.Client) -> None:
    status = client.get("/admin/training").json()
    assert status["paused"] is False and status["alive"] is False  # no trainer in this test
    assert status["rewards_finalized"] == 0
    assert client.post("/admin/training/pause").json()["paused"] is True
    assert client.get("/admin/training").json()["paused"] is True
    assert client.post("/admin/training/resume").json()["paused"] is False


def test_training_needs_admin(service: object, key_factory: object) -> None:
    token = key_factory("deploy")  # type: ignore[operator]
    r = httpx.get(
        service.url + "/admin/training",  # type: ignore[attr-defined]
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 403
