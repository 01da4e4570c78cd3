"""`tabloop simulate` against the real app in-process: what a key without the admin scope gets
(the sim windows, no deployment timeline), that every rollout and event lands once, and a
refused key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.auth.keys import create_key
from service.config import Settings
from service.db import make_engine, upgrade
from service.registry.store import bootstrap
from service.tables import events, rollouts
from simulator.run import main
from tests.service.conftest import RunningService, make_settings


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Settings, RunningService, sa.Engine]]:
    """The app with the shipped base policy live, on a loopback port."""
    settings = make_settings(tmp_path, policy_poll_interval_s=0.2)
    upgrade(settings)
    engine = make_engine(settings)
    with engine.begin() as conn:
        assert bootstrap(conn, settings.base_checkpoint) == 1
    service = RunningService(settings).start()
    try:
        yield settings, service, engine
    finally:
        service.stop()
        engine.dispose()


def key(engine: sa.Engine, *scopes: str) -> str:
    with engine.begin() as conn:
        return create_key(conn, name="sim", scopes=frozenset(scopes))[1]


def count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


@pytest.mark.timeout(120)
def test_an_ingest_key_gets_the_sim_windows_and_everything_lands_once(
        served: tuple[Settings, RunningService, sa.Engine], tmp_path: Path) -> None:
    _, service, engine = served
    out = tmp_path / "sim"
    rc = main(["--api", service.url, "--key", key(engine, "ingest"), "--users", "4",
               "--minutes", "0.2", "--seed", "3", "--reject-family-share", "0.3",
               "--baseline-cursors", "0", "--no-live", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["reward_spec_source"].startswith("sim defaults")
    assert report["config"]["reward_spec"]["decision_window_s"] == 4
    assert report["deployments"] is None and report["gated_deploys"] is None
    assert [t["met"] for t in report["targets"]][3] is None  # deploys: not measurable
    totals = report["totals"]
    assert totals["completions"] >= 10 and totals["errors"] == 0
    assert totals["versions"] == {"1": totals["completions"]}
    assert count(engine, rollouts) == totals["completions"]
    ev = totals["events"]
    assert ev["pending"] == 0 and ev["sent"] == ev["queued"] == ev["accepted"]
    assert count(engine, events) == ev["sent"]
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == totals["completions"]
    assert (out / "learning_curve.png").is_file()


def test_a_refused_key_stops_at_once(served: tuple[Settings, RunningService, sa.Engine],
                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, service, _ = served
    rc = main(["--api", service.url, "--key", "tlk_nope", "--minutes", "1", "--no-live",
               "--baseline-cursors", "0", "--out", str(tmp_path / "sim")])
    assert rc == 1
    assert "401" in capsys.readouterr().err
    assert not (tmp_path / "sim").exists()


def test_the_live_display_renders(tmp_path: Path) -> None:
    import asyncio
    import io

    from rich.console import Console

    from service.rewards.core import RewardSpec
    from simulator.client import Client, EventSender
    from simulator.display import Display
    from simulator.population import CursorSource
    from simulator.report import RequestRecord
    from simulator.run import SimConfig, Simulation
    from tests.simulator.test_population import corpus_line

    async def render() -> str:
        cfg = SimConfig(api="http://127.0.0.1:9", key="k", minutes=1, out=tmp_path)
        client = Client(cfg.api, cfg.key)
        sim = Simulation(cfg, RewardSpec.sim().to_dict(), CursorSource([corpus_line(2)]), client,
                         EventSender(client))
        sim.records += [RequestRecord(float(t), "u", 1 + t // 30, t % 3 == 0, t % 5 == 0, 4,
                                      "correct", "accept" if t % 3 == 0 else "abstained", 4, 4.0,
                                      0.1, 12.0) for t in range(60)]
        display = Display(cfg, admin=True, console=Console())
        display.deployments = [{"t": 20.0, "action": "deploy"}]
        display.training = {"trainer": {"state": "canary"}, "rewards_finalized": 55}
        out = Console(file=io.StringIO(), width=160)
        out.print(display.render(sim))
        await client.aclose()
        return out.file.getvalue()  # type: ignore[attr-defined, no-any-return]

    text = asyncio.run(render())
    assert "learning curve" in text and "v1:" in text and "trainer canary" in text
    assert "deploys 1" in text and "rewards finalized 55" in text
