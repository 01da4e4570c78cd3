"""The dashboard in a real browser (Debian's chromium, driven by Playwright) against the real
service on a socket, with data from a short real flow: a canary deployed through the API,
completions from both versions (the shipped base policy and a
tiny random one), accept/reject feedback, rewards finalized by the trainer's join.

Then: a wrong key is refused with a message; the right key shows each version's kept characters
per 100 requests first, and charts with data; "Roll back" adds the rollback to the timeline and
to the audit log.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tabloop.core.keys import create_key
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.tables import utcnow
from tabloop.testing.factories import event
from tests.service.policies.test_registry import upload, wait_for_routing
from trainer.join import Join

pytestmark = pytest.mark.integration  # chromium

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--no-first-run",
]
# lines the base policy completes with confidence, so it shows most of the time (on a bare
# "for i in range(" it shows about 1 request in 50, too few to count on), and with nothing
# above them to copy: the tiny random policy (v2) shows nothing
PREFIXES = [
    "#!/usr/bin/env ",
    'if __name__ == "__main__',
    "class Point:\n    def __init__(self",
    "def add(a, b):\n    return a ",
]
TIMEOUT_MS = 30_000  # generous: CI machines are shared


@pytest.fixture
def mode() -> str:
    return "embedded"  # the page is the same over either database; /admin/metrics tests both


@pytest.fixture
def served(settings_factory: Any, service_factory: Any) -> Any:
    """The service with the shipped base policy live as v1: unlike a random tiny model, it
    shows suggestions, so the accept-rate chart has data."""
    from tabloop.core.db import make_engine
    from tabloop.core.registry import bootstrap

    settings = settings_factory(policy_poll_interval_s=0.2)
    engine = make_engine(settings)
    with engine.begin() as conn:
        assert bootstrap(conn, settings.base_checkpoint) == 1
    engine.dispose()
    return service_factory(settings)


@pytest.fixture
def browser_page() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "chromium is missing: scripts/test.sh installs it (apt)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page
        browser.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


def real_traffic(served: Any, admin: httpx.Client, ingest: httpx.Client, ckpt: Path) -> None:
    """v2 as a 50% canary, at least 40 users asking for completions (more until the base
    policy, which samples whether to show, has shown a few), feedback on what was shown, and
    the trainer's join finalizing every reward (as if the windows had passed)."""
    assert upload(admin, ckpt).status_code == 201
    d = admin.post("/admin/policies/2/deploy", json={"canary_fraction": 0.5}).json()
    wait_for_routing(served, d["id"])
    events, shown_by_base, i = [], 0, -1
    while i < 39 or (shown_by_base < 3 and i < 400):
        i += 1
        user = f"user-{i}"
        r = ingest.post(
            "/v1/complete", json={"user_id": user, "prefix": PREFIXES[i % 4], "max_new_tokens": 12}
        )
        assert r.status_code == 200, r.text
        s = r.json()
        if s["shown"]:
            shown_by_base += s["policy_version"] == 1
            now, sid = utcnow().isoformat(), s["suggestion_id"]
            if i % 3:
                events.append(
                    event(
                        "accept",
                        user_id=user,
                        suggestion_id=sid,
                        occurred_at=now,
                        accepted_chars=None,
                    )
                )
                events.append(
                    event(
                        "code_retained",
                        user_id=user,
                        suggestion_id=sid,
                        occurred_at=now,
                        after_seconds=30,
                        retained_fraction=0.75,
                    )
                )
            else:
                events.append(event("reject", user_id=user, suggestion_id=sid, occurred_at=now))
    if events:
        assert ingest.post("/v1/events", json={"events": events}).status_code == 202
    join = Join(served.app.state.ctx.engine, RewardSpec(), spec_version=1)
    assert shown_by_base >= 3, f"the base policy showed {shown_by_base} of {i + 1} requests"
    assert join.recover() == i + 1
    assert join.finalize_due(now=utcnow() + timedelta(hours=1)) == i + 1


def test_login_charts_and_rollback(
    served: Any, key_factory: Any, tiny_checkpoint_factory: Any, browser_page: Any
) -> None:
    from playwright.sync_api import expect

    admin_token, ingest_token = key_factory("admin", "deploy"), key_factory("ingest")
    with (
        httpx.Client(
            base_url=served.url, timeout=30, headers={"Authorization": f"Bearer {admin_token}"}
        ) as admin,
        httpx.Client(
            base_url=served.url, timeout=30, headers={"Authorization": f"Bearer {ingest_token}"}
        ) as ingest,
    ):
        real_traffic(served, admin, ingest, tiny_checkpoint_factory(1))
    with served.app.state.ctx.engine.begin() as conn:  # a key of a named workspace
        team_key, _ = create_key(
            conn, name="payments-vscode", scopes=frozenset({"ingest"}), workspace="team-payments"
        )
    page = browser_page
    page.goto(served.url + "/admin/")

    # a wrong key, then a key without the admin scope: refused, with a message, still at login
    for token, message in (("tlk_nope_nope", "not accepted"), (ingest_token, "admin scope")):
        page.fill("#key-input", token)
        page.click("#login-button")
        expect(page.locator("#login-error")).to_contain_text(message)
        expect(page.locator("#app")).to_be_hidden()

    page.fill("#key-input", admin_token)
    page.click("#login-button")
    expect(page.locator("#app")).to_be_visible()
    expect(page.locator("#routing")).to_contain_text("canary v2")
    expect(page.locator("#versions-table tbody tr[data-version]")).to_have_count(2)

    # the headline per version: kept characters per 100 requests, then the accept rate of shown
    # and what was shown but not taken, as GET /admin/metrics gives them
    headers = page.locator("#versions-table thead th").all_inner_texts()
    assert [h.strip() for h in headers[:4]] == [
        "version",
        "kept chars / 100 req",
        "accept rate of shown",
        "not taken / req",
    ], headers
    versions = page.evaluate("() => window.tabloopDashboard.metrics.versions")
    for v in versions:
        cells = page.locator(f"#versions-table tr[data-version='{v['policy_version']}'] td")
        kept, not_taken = v["kept_chars_per_100"], v["not_taken_per_request"]
        assert kept is not None and not_taken is not None, v  # every reward is final
        expect(cells.nth(1)).to_have_text(f"{kept:.1f}")
        expect(cells.nth(3)).to_have_text(f"{not_taken:.3f}")
    base = next(v for v in versions if v["policy_version"] == 1)
    assert base["kept_chars_per_100"] > 0, base  # two thirds of what it showed, kept at 0.75
    assert base["kept_chars_per_100"] == pytest.approx(100 * base["retained_chars_per_request"])

    # every chart drew a canvas and holds data for both versions
    for chart in ("kept", "accept", "shown", "reward"):
        expect(page.locator(f"#chart-{chart} canvas").first).to_be_visible()
    series = page.evaluate("""() => Object.fromEntries(
        Object.entries(window.tabloopDashboard.charts).map(([id, c]) =>
            [id, c.data.slice(1).map((s) => s.filter((v) => v != null).length)]))""")
    assert series["shown"] == [1, 1] and series["reward"] == [1, 1], series
    assert series["kept"] == [1, 1], series  # v2 shows nothing: 0 kept, still a point
    # the accept rate is of shown suggestions: the base policy (v1) shows some, the tiny one
    # (v2) shows nothing, so it has no accept rate
    assert series["accept"] == [1, 0], series

    # the keys, each with its workspace: a named one, or the key's own
    expect(page.locator(f"#keys-table tr[data-key='{team_key.id}']")).to_contain_text(
        "team-payments"
    )
    expect(page.locator("#keys-table tbody")).to_contain_text("(its own)")

    # when showing pays under the current (default) reward spec: a 20-character suggestion,
    # kept, above 0.1 / (0.75 + 0.1) of the time; without a retention report, before any is
    # measured, the same; a 3-character one above 0.1 / (0.75 * 3 / 20 + 0.1)
    expect(page.locator("#spec-version")).to_contain_text("reward spec v1")
    cells = page.locator("#thresholds-table tr[data-chars='20'] td")
    expect(cells).to_have_text(["20", "11.8%", "11.8%"])
    expect(page.locator("#thresholds-table tr[data-chars='3'] td").nth(1)).to_have_text("47.1%")

    # the audit log: what the service and this key did so far, newest first
    audit = page.locator("#audit-table tbody tr")
    expect(audit).to_have_count(3)
    assert audit.evaluate_all("rows => rows.map((r) => r.dataset.action)") == [
        "deploy",
        "policy.register",
        "bootstrap",
    ]

    # roll back the canary from the page (confirming the dialog); the timeline gains the entry
    expect(page.locator("#timeline li")).to_have_count(2)  # bootstrap, deploy
    page.on("dialog", lambda d: d.accept())
    expect(page.locator("#rollback")).to_be_enabled()
    page.click("#rollback")
    expect(page.locator("#timeline li").first).to_have_attribute("data-action", "rollback")
    expect(page.locator("#timeline li")).to_have_count(3)
    expect(page.locator("#banner")).to_contain_text("Rolled back")
    expect(page.locator("#routing")).not_to_contain_text("canary")
    expect(page.locator("#promote")).to_be_disabled()
    # ... and the audit log its row: the rollback, by this key (named "test"), done
    expect(audit).to_have_count(4)
    expect(audit.first).to_have_attribute("data-action", "rollback")
    expect(audit.first).to_have_attribute("data-outcome", "ok")
    expect(audit.first).to_contain_text("test")
    expect(audit.first).to_contain_text("2")  # the canary it withdrew

    # signing out returns to the form; the key is gone from the tab
    page.click("#logout")
    expect(page.locator("#login")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('tabloop.adminKey')") is None
