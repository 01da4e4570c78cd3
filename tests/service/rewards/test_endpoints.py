"""Reward spec versions and replay through the admin API."""

from __future__ import annotations

import datetime as dt
from typing import Any

import httpx
import pytest

from tabloop.testing.factories import event


def test_reward_spec_versions(client: httpx.Client) -> None:
    first = client.get("/admin/reward-spec").json()
    assert first["version"] == 1 and first["spec"]["accept_reward"] == 0.75
    r = client.put("/admin/reward-spec", json={"reject_penalty": 0.3})
    assert r.status_code == 201 and r.json()["version"] == 2
    assert r.json()["spec"]["reject_penalty"] == 0.3 and r.json()["spec"]["accept_reward"] == 0.75
    # the show thresholds each version implies, for a whole, kept accept:
    # reject_penalty / (0.75 * size_scale + reject_penalty). Under the defaults size_scale =
    # chars / 20 (linear) and a reject costs 0.1, so a 20-character one pays above 0.1 / 0.85;
    # under version 2 above 0.3 / (0.75 + 0.3). With no retention measured yet, an accept
    # without a report counts whole (provisional_accept_weight 1)
    assert first["measured_retention"] is None
    assert first["thresholds"] == [
        {"chars": n, "kept": pytest.approx(p), "no_report": pytest.approx(p)}
        for n, p in [
            (3, 0.1 / (0.75 * 3 / 20 + 0.1)),  # 0.4706
            (10, 0.1 / (0.75 * 10 / 20 + 0.1)),  # 0.2105
            (20, 0.1 / (0.75 + 0.1)),  # 0.1176
            (60, 0.1 / (0.75 * 3 + 0.1)),  # 0.0426
        ]
    ]
    assert r.json()["thresholds"][2]["kept"] == pytest.approx(0.3 / 1.05)
    assert client.get("/admin/reward-spec").json()["version"] == 2
    bad = client.put("/admin/reward-spec", json={"horizon_s": -1})
    assert bad.status_code == 422 and "horizon_s" in bad.json()["error"]["message"]
    assert client.put("/admin/reward-spec", json={"bogus": 1}).status_code == 422
    assert client.get("/admin/reward-spec").json()["version"] == 2
    # an accept without a report counted at half: such suggestions need a higher accept rate
    halved = client.put("/admin/reward-spec", json={"provisional_accept_weight": 0.5}).json()
    assert halved["version"] == 3
    assert halved["thresholds"][2] == {
        "chars": 20,
        "kept": pytest.approx(0.3 / 1.05),
        "no_report": pytest.approx(0.3 / (0.375 + 0.3)),
    }


def test_replay_recomputes_from_the_database(served: Any, key_factory: Any) -> None:
    token = key_factory("ingest", "admin")
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {token}"}) as c:
        start = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        ids = [
            c.post("/v1/complete", json={"user_id": f"u{i}", "prefix": "x = "}).json()
            for i in range(6)
        ]
        c.post(
            "/v1/events",
            json={
                "events": [
                    event(
                        "reject",
                        user_id="u0",
                        suggestion_id=ids[0]["suggestion_id"],
                        occurred_at=dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z"),
                    )
                ]
            },
        )
        end = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
        body = {"from": start.isoformat(), "to": end.isoformat()}
        r = c.post("/admin/replay", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["rollouts"] == 6 and out["reward_spec_version"] == 1
        assert sum(out["outcomes"].values()) == 6
        assert c.post("/admin/replay", json={**body, "reward_spec_version": 9}).status_code == 404
        swapped = {"from": end.isoformat(), "to": start.isoformat()}
        assert c.post("/admin/replay", json=swapped).status_code == 422
