"""The dashboard's feedback-trust panel in a real browser (as test_dashboard_browser.py drives
it): the people and keys whose feedback was refused, from refused events sent over HTTP, and
those the trainer capped, from its state."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.tables import TRAINER_STATE_NAME, rollouts, trainer_state
from tabloop.testing.factories import event, rollout_row
from tests.service.dashboard.test_dashboard_browser import (  # noqa: F401 (fixtures)
    browser_page,
    mode,
    served,
)

pytestmark = pytest.mark.integration  # chromium


def test_refused_and_capped_people_are_listed(
    served: Any,  # noqa: F811
    key_factory: Any,
    engine: sa.Engine,
    browser_page: Any,  # noqa: F811
) -> None:
    from playwright.sync_api import expect

    admin_token, ingest_token = key_factory("admin"), key_factory("ingest", name="team-bot")
    now = datetime.now(UTC)
    sid = str(uuid.uuid4())
    with engine.begin() as conn:  # served to another key
        conn.execute(
            rollouts.insert().values(
                **rollout_row(sid, user_id="u-mallory", created_at=now, api_key_id="other")
            )
        )
        conn.execute(
            trainer_state.insert().values(
                name=TRAINER_STATE_NAME,
                updated_at=now,
                heartbeat_at=now,
                info={
                    "capped": [
                        {
                            "at": (now - timedelta(minutes=5)).isoformat(),
                            "rollouts": 100,
                            "max_share": 0.25,
                            "keys": [],
                            "users": [
                                {
                                    "id": "u-loud",
                                    "rows": 90,
                                    "share": 0.9,
                                    "weight_share": 0.25,
                                    "weight_removed": 65.0,
                                }
                            ],
                        }
                    ]
                },
            )
        )
    evs = [
        event("accept", user_id="u-mallory", suggestion_id=sid, occurred_at=now.isoformat())
        for _ in range(2)
    ]
    with httpx.Client(
        base_url=served.url, timeout=30, headers={"Authorization": f"Bearer {ingest_token}"}
    ) as ingest:
        r = ingest.post("/v1/events", json={"events": evs})
        assert r.status_code == 202 and len(r.json()["rejected"]) == 2, r.text

    page = browser_page
    page.goto(served.url + "/admin/")
    page.fill("#key-input", admin_token)
    page.click("#login-button")
    expect(page.locator("#app")).to_be_visible()
    refused = page.locator("#refused-table tbody tr")
    expect(refused).to_have_count(2)  # the person, then the key they sent through
    expect(refused.nth(0)).to_have_attribute("data-id", "u-mallory")
    expect(refused.nth(0)).to_contain_text("wrong_key 2")
    expect(refused.nth(1)).to_have_attribute("data-kind", "key")
    expect(refused.nth(1)).to_contain_text("key team-bot")
    expect(page.locator("#refused-total")).to_have_text("2 events")
    capped = page.locator("#capped-table tbody tr")
    expect(capped).to_have_count(1)
    expect(capped.first).to_have_attribute("data-id", "u-loud")
    expect(capped.first).to_contain_text("65.0")
    expect(capped.first).to_contain_text("90.0%")
