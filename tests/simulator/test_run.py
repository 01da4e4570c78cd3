"""`tabloop simulate` against the real app in-process: what a key without the admin scope gets
(the sim windows, no deployment timeline), that every rollout and event lands once, a refused
key, and a baseline phase (the trainer paused, then resumed) with people reporting settled
code."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from simulator.cli import main
from tabloop.core.config import Settings
from tabloop.core.db import make_engine, upgrade
from tabloop.core.keys import create_key
from tabloop.core.registry import bootstrap
from tabloop.core.tables import events, rollouts
from tests.service.conftest import RunningService, make_settings

Served = tuple[Settings, RunningService, sa.Engine]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """The app with the shipped base policy live, on a loopback port."""
    yield from serve(tmp_path)


@pytest.fixture
def served_sim(tmp_path: Path) -> Iterator[Served]:
    """The same in the sim profile (seconds-long reward windows), as `tabloop up` would run it
    for a simulation."""
    yield from serve(tmp_path, profile="sim")


def serve(tmp_path: Path, **overrides: Any) -> Iterator[Served]:
    settings = make_settings(tmp_path, policy_poll_interval_s=0.2, **overrides)
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


def count(engine: sa.Engine, table: sa.Table, *where: sa.ColumnElement[bool]) -> int:
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(table).where(*where)
        return int(conn.execute(query).scalar_one())


@pytest.mark.timeout(120)
def test_an_ingest_key_gets_the_sim_windows_and_everything_lands_once(
    served: tuple[Settings, RunningService, sa.Engine], tmp_path: Path
) -> None:
    _, service, engine = served
    out = tmp_path / "sim"
    rc = main(
        [
            "--api",
            service.url,
            "--key",
            key(engine, "ingest"),
            "--users",
            "4",
            "--minutes",
            "0.2",
            "--seed",
            "3",
            "--reject-family-share",
            "0.3",
            "--baseline-cursors",
            "0",
            "--no-live",
            "--out",
            str(out),
        ]
    )
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
    # every event sent is stored once; the service adds its own typed_through events
    assert count(engine, events, events.c.type != "typed_through") == ev["sent"]
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == totals["completions"]
    assert (out / "learning_curve.png").is_file()


def test_a_refused_key_stops_at_once(
    served: tuple[Settings, RunningService, sa.Engine],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, service, _ = served
    rc = main(
        [
            "--api",
            service.url,
            "--key",
            "tlk_nope",
            "--minutes",
            "1",
            "--no-live",
            "--baseline-cursors",
            "0",
            "--out",
            str(tmp_path / "sim"),
        ]
    )
    assert rc == 1
    assert "401" in capsys.readouterr().err
    assert not (tmp_path / "sim").exists()


def test_the_live_display_renders(tmp_path: Path) -> None:
    import asyncio
    import io

    from rich.console import Console

    from simulator.client import Client, EventSender
    from simulator.config import SimConfig
    from simulator.display import Display
    from simulator.population import CursorSource
    from simulator.report import RequestRecord
    from simulator.run import Simulation
    from tabloop.core.reward_spec import RewardSpec
    from tests.simulator.test_population import corpus_line

    async def render() -> str:
        cfg = SimConfig(api="http://127.0.0.1:9", key="k", minutes=1, out=tmp_path)
        client = Client(cfg.api, cfg.key)
        sim = Simulation(
            cfg,
            RewardSpec.sim().to_dict(),
            CursorSource([corpus_line(2)]),
            client,
            EventSender(client),
        )
        sim.records += [
            RequestRecord(
                float(t),
                "u",
                1 + t // 30,
                t % 3 == 0,
                t % 5 == 0,
                4,
                "correct",
                "accept" if t % 3 == 0 else "abstained",
                4,
                4.0,
                0.1,
                12.0,
            )
            for t in range(60)
        ]
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


# --- the baseline phase and code_settled ------------------------------------------------------

CORPUS = {  # a small corpus: people come back to the same lines, so some are no longer fresh
    "shop/cart.py": (
        "import math\n\n\nclass Cart:\n    def __init__(self, items):\n"
        "        self.items = list(items)\n\n    def total(self):\n"
        "        return sum(item.price for item in self.items)\n\n"
        "    def rounded(self):\n        return math.ceil(self.total())\n"
    ),
    "shop/tests/test_cart.py": "def test_nothing():\n    assert True\n",  # left out
}


def corpus(root: Path) -> Path:
    for name, text in CORPUS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


class PausedWatch:
    """Reads GET /admin/training's `paused` every 0.3 s while a run goes on."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.seen: list[bool] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = httpx.get(
                self.url + "/admin/training",
                timeout=10,
                headers={"Authorization": f"Bearer {self.token}"},
            )
            self.seen.append(bool(r.json()["paused"]))
            time.sleep(0.3)

    def __enter__(self) -> PausedWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


@pytest.mark.timeout(180)
def test_a_baseline_phase_pauses_then_resumes_the_trainer_and_people_settle_their_lines(
    served_sim: Served, tmp_path: Path
) -> None:
    _, service, engine = served_sim
    token = key(engine, "admin", "ingest")
    out = tmp_path / "sim"
    with PausedWatch(service.url, token) as watch:
        rc = main(
            [
                "--api",
                service.url,
                "--key",
                token,
                "--users",
                "4",
                "--minutes",
                "0.2",
                "--baseline-minutes",
                "0.2",
                "--settled",
                "1.0",
                "--seed",
                "3",
                "--corpus",
                str(corpus(tmp_path / "code")),
                "--bucket-s",
                "4",
                "--baseline-cursors",
                "0",
                "--no-live",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    # paused during the baseline phase, running again after it, and left running
    assert True in watch.seen and watch.seen[-1] is False
    assert False in watch.seen[watch.seen.index(True) :]
    report = json.loads((out / "report.json").read_text())
    trainer = report["phases"]["trainer"]
    assert report["phases"]["baseline_s"] == 12.0
    assert trainer["paused_before"] is False and trainer["paused_by_simulator"] is True
    assert 12.0 <= trainer["resumed_at_s"] < 17.0
    assert report["config"]["duration_s"] == 24.0
    assert report["config"]["corpus"] == str((tmp_path / "code").resolve())

    # every request is tagged with the phase it was sent in, and on fresh lines or not
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert all(r["phase"] == ("baseline" if r["t"] < 12.0 else "learning") for r in records)
    assert {r["phase"] for r in records} == {"baseline", "learning"}
    assert {Path(r["path"]).name for r in records} == {"cart.py"}
    assert any(r["fresh"] for r in records) and not all(r["fresh"] for r in records)

    # both comparisons, against the baseline phase
    comparison = report["phase_comparison"]
    assert comparison["reference"] == "baseline_phase"
    for side in ("all", "fresh"):
        assert comparison[side]["reference"]["requests"] > 0, side
        assert set(comparison[side]["change"]) == {
            "shown_per_request",
            "accept_rate_of_shown",
            "retained_chars_per_100",
            "reward_per_request",
        }
    assert comparison["all"]["reference"]["requests"] == sum(
        r["phase"] == "baseline" for r in records
    )
    assert comparison["errors"] == 0 and comparison["events_lost"] == 0
    assert comparison["events_refused"] == 0

    # everyone opted in, and every request's line was reported once the person moved on
    settled = report["settled"]
    assert settled["opted_in"] == settled["people"] > 0
    assert settled["events"] == len(records)
    assert settled["lines"] == len(json.loads((out / "settled_lines.json").read_text()))
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(events.c.payload, events.c.suggestion_id).where(
                events.c.type == "code_settled"
            )
        ).all()
        suggestions = set(conn.execute(sa.select(rollouts.c.suggestion_id)).scalars())
    assert len(rows) == settled["events"]
    cart = CORPUS["shop/cart.py"].split("\n")
    for payload, suggestion_id in rows:
        assert set(payload) >= {
            "event_id",
            "type",
            "user_id",
            "suggestion_id",
            "occurred_at",
            "after_seconds",
            "text",
        }
        assert suggestion_id in suggestions and payload["after_seconds"] >= 0
        assert payload["text"] and any(line.endswith(payload["text"]) for line in cart)


@pytest.mark.timeout(120)
def test_a_paused_trainer_stays_paused_and_an_admin_key_can_come_apart(
    served_sim: Served, tmp_path: Path
) -> None:
    _, service, engine = served_sim
    admin = key(engine, "admin")
    r = httpx.post(
        service.url + "/admin/training/pause",
        timeout=10,
        headers={"Authorization": f"Bearer {admin}"},
    )
    assert r.status_code == 200
    out = tmp_path / "sim"
    rc = main(
        [
            "--api",
            service.url,
            "--key",
            key(engine, "ingest"),
            "--admin-key",
            admin,
            "--users",
            "2",
            "--minutes",
            "0.05",
            "--baseline-minutes",
            "0.05",
            "--corpus",
            str(corpus(tmp_path / "code")),
            "--baseline-cursors",
            "0",
            "--no-live",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    trainer = json.loads((out / "report.json").read_text())["phases"]["trainer"]
    assert trainer["paused_before"] is True and trainer["paused_by_simulator"] is False
    assert trainer["resumed_at_s"] is None and "already paused" in trainer["note"]
    r = httpx.get(
        service.url + "/admin/training", timeout=10, headers={"Authorization": f"Bearer {admin}"}
    )
    assert r.json()["paused"] is True  # the simulator never resumes what it did not pause


def test_a_baseline_phase_needs_the_admin_scope(
    served_sim: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, service, engine = served_sim
    rc = main(
        [
            "--api",
            service.url,
            "--key",
            key(engine, "ingest"),
            "--minutes",
            "1",
            "--baseline-minutes",
            "1",
            "--no-live",
            "--baseline-cursors",
            "0",
            "--out",
            str(tmp_path / "sim"),
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "admin scope" in err and "--admin-key" in err
    assert not (tmp_path / "sim").exists()
    assert count(engine, rollouts) == 0  # nobody started


def test_a_settled_event_says_what_stands_after_the_cursor(tmp_path: Path) -> None:
    import asyncio

    from simulator.client import Client, EventSender
    from simulator.config import SimConfig
    from simulator.population import CursorSource, cursor_at
    from simulator.run import Simulation
    from tabloop.core.reward_spec import RewardSpec
    from tests.simulator.test_population import corpus_line

    async def settle() -> tuple[list[dict[str, Any]], Simulation]:
        cfg = SimConfig(
            api="http://127.0.0.1:9", key="k", minutes=1, out=tmp_path, settled_share=1.0
        )
        client = Client(cfg.api, cfg.key)
        sender = EventSender(client)
        sim = Simulation(
            cfg, RewardSpec.sim().to_dict(), CursorSource([corpus_line(2)]), client, sender
        )
        sim._settle(
            "u-1", "6f1c1b1e-0000-4000-8000-000000000001", cursor_at(corpus_line(2), 8), sim.now()
        )
        await client.aclose()
        return list(sender._queue), sim

    queued, sim = asyncio.run(settle())
    assert len(queued) == 1
    event = queued[0]
    assert set(event) == {
        "event_id",
        "type",
        "user_id",
        "suggestion_id",
        "occurred_at",
        "after_seconds",
        "text",
    }
    assert (event["type"], event["user_id"], event["text"]) == (
        "code_settled",
        "u-1",
        "walk(self, top):",
    )
    assert isinstance(event["after_seconds"], float) and event["after_seconds"] >= 0
    assert event["occurred_at"].endswith("Z")
    assert sim.settled_lines == {("mod.py", 2)} and sim.counters.settled == 1


def test_a_service_that_never_answers_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """No service at the URL: after its retries the command says where it looked, not a
    status of 0."""
    import asyncio

    from simulator.client import Client
    from simulator.run import fetch_spec
    from tabloop.client import ApiError

    async def attempt() -> None:
        async with Client("http://127.0.0.1:9/", "tlk_x_y", max_attempts=1) as client:
            await fetch_spec(client)

    with pytest.raises(ApiError) as err:
        asyncio.run(attempt())
    assert err.value.status == 0
    assert err.value.message == "no answer from http://127.0.0.1:9 (is the service running there?)"
