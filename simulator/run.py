"""`tabloop simulate`: a population of simulated editors against a running service.

    tabloop simulate --api http://127.0.0.1:8000 --key TOKEN --users 16 --minutes 10 --seed 0

Each seat holds one person (simulator.population) who types, asks for a completion at a cursor
inside a real held-out line, judges the suggestion by the code, accepts / rejects / ignores it,
reports retention at the reward spec's checks, switches models after bad runs and leaves when
suggestions stay useless (a new person takes the seat). The reward windows come from
GET /admin/reward-spec (the sim profile's defaults when the key may not read it).

Order of a run: read the spec; run the people for --minutes while a live table shows the
learning curve; stop asking; let every pending decision and retention report fire and deliver
them; read the deployment timeline; run the offline baseline; write report.json and
learning_curve.png under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from simulator import report as rpt
from simulator.client import ApiError, Client, EventSender
from simulator.display import Display, fmt
from simulator.population import (
    CursorSource,
    Decision,
    PersonParams,
    PopulationConfig,
    Session,
    decide,
    decision_reward,
    draw_person,
    in_reject_family,
    request_context,
    retention_delays,
    step,
    think_time,
)

log = logging.getLogger("tabloop.simulate")


@dataclass
class SimConfig:
    api: str  # the service's base URL
    key: str  # an API key with ingest (and, for the spec and deployments, admin) scope
    users: int = 16  # seats: people active at once
    minutes: float = 10.0  # how long people keep asking for completions
    seed: int = 0  # people, cursors and decisions are all drawn from it
    bucket_s: float | None = None  # report bucket width; default: the run split in ~30
    out: Path = Path("simulation")  # report.json and learning_curve.png go here
    population: PopulationConfig = field(default_factory=PopulationConfig)
    max_new_tokens: int = 32
    baseline_cursors: int = 2000  # 0: skip the offline baseline
    baseline_checkpoint: Path | None = None  # default: the shipped base policy
    baseline_json: Path | None = None  # a baseline already computed (python -m simulator.baseline)
    live: bool | None = None  # rich live display; default: when stdout is a terminal
    flush_interval_s: float = 0.25  # events are sent at least this often
    event_batch_size: int = 200
    poll_s: float = 5.0  # how often the display reads the deployment timeline

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    @property
    def bucket_width_s(self) -> float:
        return self.bucket_s or max(5.0, round(self.duration_s / 30 / 5) * 5)


def utc_z(at: datetime | None = None) -> str:
    return (at or datetime.now(UTC)).isoformat().replace("+00:00", "Z")


# --- the reward spec ---------------------------------------------------------------------------


async def fetch_spec(client: Client) -> tuple[dict[str, Any], str]:
    """(spec, where it came from): the service's current spec, or the sim profile's defaults when
    the key lacks the admin scope (403)."""
    from service.rewards.core import RewardSpec

    status, body = await client.get("/admin/reward-spec")
    if status == 200 and isinstance(body, dict) and isinstance(body.get("spec"), dict):
        spec = RewardSpec.from_dict(body["spec"]).to_dict()
        return spec, f"service (version {body.get('version')})"
    if status == 403:
        return RewardSpec.sim().to_dict(), "sim defaults (the key may not read /admin/reward-spec)"
    if status == 401:
        raise ApiError(401, "the API key was refused")
    raise ApiError(status, f"GET /admin/reward-spec answered {status}: {body}")


# --- the simulation ---------------------------------------------------------------------------


@dataclass
class Counters:
    people: int = 0  # people who took a seat (initial ones and replacements)
    switches: int = 0
    churns: int = 0
    away: int = 0  # seats whose person is on another model right now
    errors: int = 0  # completion requests that got no answer after retries
    retention_reports: int = 0


class Simulation:
    def __init__(self, cfg: SimConfig, spec: dict[str, Any], source: CursorSource, client: Client,
                 sender: EventSender) -> None:
        self.cfg, self.spec, self.source = cfg, spec, source
        self.client, self.sender = client, sender
        self.records: list[rpt.RequestRecord] = []
        self.counters = Counters()
        self.stop = asyncio.Event()  # people stop asking
        self.interrupted = asyncio.Event()  # Ctrl-C: end early, still deliver and report
        self.duration_s = cfg.duration_s  # shortened when interrupted
        self.pending_reports = 0
        self.started_at = datetime.now(UTC)
        self._t0 = time.monotonic()
        # feedback must reach the service inside its windows: decide (and deliver) in time
        self.margin_s = 2 * cfg.flush_interval_s + 0.5
        self.max_delay_s = max(0.3, float(spec["decision_window_s"]) - self.margin_s)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _event(self, type_: str, user_id: str, **fields: Any) -> dict[str, Any]:
        return {"event_id": str(uuid.uuid4()), "type": type_, "user_id": user_id,
                "occurred_at": utc_z(), **fields}

    def _later(self, delay_s: float, make: Callable[[], dict[str, Any]]) -> None:
        """Send an event made `delay_s` from now (a retention check); counted until sent."""
        self.pending_reports += 1

        def fire() -> None:
            self.pending_reports -= 1
            self.sender.add(make())
            self.counters.retention_reports += 1

        asyncio.get_running_loop().call_later(delay_s, fire)

    async def _pause(self, seconds: float) -> None:
        """Sleep, cut short when the run stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    async def seat(self, slot: int) -> None:
        """One seat: a person until they churn, then the next one."""
        generation = 0
        while not self.stop.is_set():
            rng = random.Random(f"{self.cfg.seed}:{slot}:{generation}")
            person = draw_person(self.cfg.population, rng)
            self.counters.people += 1
            user_id = f"sim{self.cfg.seed}-{slot}-{generation}"
            if await self.person(user_id, person, rng) != "churn":
                return
            generation += 1

    async def person(self, user_id: str, person: PersonParams, rng: random.Random) -> str:
        session = Session()
        while True:
            await self._pause(think_time(person, rng))
            if self.stop.is_set():
                return "stop"
            cursor = self.source.draw(rng, self.cfg.population.reject_family_share)
            prefix, suffix = request_context(cursor)
            family = in_reject_family(prefix)
            t = self.now()
            resp = await self.client.complete({
                "user_id": user_id, "session_id": f"{user_id}-s", "workspace_id": "sim",
                "language": "python", "file_path": cursor.path.name, "prefix": prefix[-8000:],
                "suffix": suffix[:2000], "max_new_tokens": self.cfg.max_new_tokens})
            if resp is None:
                self.counters.errors += 1
                continue
            text = resp["text"] if resp["shown"] else ""
            shown_at = self.now()
            decision = None
            if resp["shown"] and text:
                decision = decide(person, text, cursor.rest_of_line, family, self.max_delay_s, rng)
            self._record(t, user_id, resp, family, text, decision)
            if decision is None:
                continue
            await asyncio.sleep(decision.delay_s)  # looking at it; finishes even when stopping
            self._feedback(user_id, resp["suggestion_id"], decision, self.now() - shown_at)
            session, move = step(session, person, decision.action == "accept")
            if move == "switch":
                self.counters.switches += 1
                self.sender.add(self._event("model_switch", user_id, from_model="tabloop",
                                            to_model="another-model"))
                self.counters.away += 1
                await self._pause(person.switch_away_s)
                self.counters.away -= 1
            elif move == "churn":
                self.counters.churns += 1
                self.sender.add(self._event("churn", user_id, reason="suggestions stayed useless"))
                return "churn"

    def _record(self, t: float, user_id: str, resp: dict[str, Any], family: bool, text: str,
                decision: Decision | None) -> None:
        accepted = decision is not None and decision.action == "accept"
        chars = decision.accepted_chars if decision is not None and accepted else 0
        self.records.append(rpt.RequestRecord(
            t=round(t, 3), user_id=user_id, version=int(resp["policy_version"]),
            shown=decision is not None, family=family, shown_chars=len(text),
            verdict=decision.verdict if decision else None,
            action=decision.action if decision else "abstained", accepted_chars=chars,
            retained_chars=chars * decision.retained_fraction if decision and accepted else 0.0,
            reward=decision_reward(self.spec, len(text), decision),
            latency_ms=float(resp.get("latency_ms", 0.0))))

    def _feedback(self, user_id: str, suggestion_id: str, d: Decision, after_s: float) -> None:
        if d.action == "ignore":
            return  # the decision window passes silently
        if d.action == "reject":
            self.sender.add(self._event("reject", user_id, suggestion_id=suggestion_id))
            return
        self.sender.add(self._event("accept", user_id, suggestion_id=suggestion_id,
                                    accepted_chars=d.accepted_chars))
        kept = round(d.retained_fraction, 4)
        for check in retention_delays(self.spec, after_s, self.margin_s):
            self._later(check, self._retention(user_id, suggestion_id, check, kept))

    def _retention(self, user_id: str, suggestion_id: str, after_s: float,
                   fraction: float) -> Callable[[], dict[str, Any]]:
        """Makes the code_retained event at check time (its occurred_at is when it fires)."""
        return lambda: self._event("code_retained", user_id, suggestion_id=suggestion_id,
                                   after_seconds=after_s, retained_fraction=fraction)

    def _end_early_on_error(self, task: asyncio.Task[None]) -> None:
        """A seat or the sender failed (a refused key, a bug): end the run now, not at its end."""
        if not task.cancelled() and task.exception() is not None:
            self.interrupted.set()

    async def run(self, display: Display) -> None:
        sender_stop = asyncio.Event()
        sender_task = asyncio.create_task(self.sender.run(sender_stop))
        seats = [asyncio.create_task(self.seat(i)) for i in range(self.cfg.users)]
        for task in (sender_task, *seats):
            task.add_done_callback(self._end_early_on_error)
        display_task = asyncio.create_task(display.run(self))
        try:
            try:
                await asyncio.wait_for(self.interrupted.wait(), self.cfg.duration_s)
                self.duration_s = min(self.cfg.duration_s, max(1.0, self.now()))
            except TimeoutError:
                pass
            self.stop.set()
            # people finish what they are looking at (bounded by the decision window)
            _, late = await asyncio.wait(seats, timeout=self.max_delay_s + 60)
            for task in late:
                task.cancel()
            for task in (sender_task, *seats):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            deadline = time.monotonic() + float(self.spec["horizon_s"]) + 5
            while self.pending_reports and time.monotonic() < deadline:
                display.status = f"delivering the last retention reports ({self.pending_reports})"
                await asyncio.sleep(0.25)
            if not await self.sender.drain(60):
                log.error("%d events could not be delivered", self.sender.pending)
        finally:
            sender_stop.set()
            if not sender_task.done():
                await sender_task
            display.done = True
            await display_task


# --- the report --------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()}


def build_report(cfg: SimConfig, sim: Simulation, spec_source: str,
                 deployments: list[dict[str, Any]] | None, training: dict[str, Any] | None,
                 baseline: dict[str, Any] | None) -> dict[str, Any]:
    summary = rpt.fifths(sim.records, sim.duration_s)
    return {
        "config": {"api": cfg.api, "users": cfg.users, "minutes": cfg.minutes, "seed": cfg.seed,
                   "duration_s": sim.duration_s,
                   "bucket_s": cfg.bucket_width_s, "max_new_tokens": cfg.max_new_tokens,
                   "population": cfg.population.to_dict(), "reward_spec": sim.spec,
                   "reward_spec_source": spec_source, "started_at": utc_z(sim.started_at),
                   "machine": machine(), "argv": sys.argv[1:] if sys.argv else []},
        "totals": {**rpt.metrics(sim.records), **asdict(sim.counters),
                   "completions": len(sim.records), "events": sim.sender.summary(),
                   "http": asdict(sim.client.stats)},
        "buckets": rpt.bucketize(sim.records, cfg.bucket_width_s, sim.duration_s),
        "fifths": summary,
        "by_version": rpt.by_version(sim.records),
        "deployments": deployments,
        "deploy_counts": None if deployments is None else {
            a: sum(d["action"] == a for d in deployments)
            for a in ("deploy", "promote", "rollback")},
        "gated_deploys": None if deployments is None else rpt.gated_deploys(deployments),
        "training": training,
        "baseline": baseline,
        "comparison": rpt.compare(summary, baseline),
        "targets": rpt.targets(summary, deployments),
    }


def print_summary(console: Console, report: dict[str, Any], out: Path) -> None:
    f = report["fifths"]
    table = Table(title="first fifth vs last fifth")
    for col in ("", "first", "last", "change", "baseline (best threshold)"):
        table.add_column(col, justify="right")
    base = (report.get("baseline") or {}).get("best") or {}
    for key, label, form in (("accept_rate_of_shown", "accept rate of shown", ".3f"),
                             ("shown_per_request", "shown per request", ".3f"),
                             ("retained_chars_per_100", "retained chars / 100 req", ".1f"),
                             ("reward_per_request", "reward per request", ".4f"),
                             ("family_shown_rate", "def/class shown rate", ".3f")):
        ch, first, last = f["change"].get(key), f["first"][key], f["last"][key]
        if ch is not None:
            change = f"{ch:+.0%}"
        elif first is not None and last is not None:  # no ratio from <= 0: the difference
            change = f"{last - first:+{form}}"
        else:
            change = "-"
        table.add_row(label, fmt(first, form), fmt(last, form), change, fmt(base.get(key), form))
    console.print(table)
    for t in report["targets"]:
        mark = {True: "[green]met[/]", False: "[red]not met[/]", None: "[yellow]n/a[/]"}[t["met"]]
        value, sure = t["value"], t.get("interval")
        if isinstance(value, float):
            value = f"{value:+.0%}"
        elif isinstance(value, list) and None not in value:
            value = " -> ".join(f"{v:.1f}" for v in value)
        sure = f"; 95% interval of the change {sure[0]:+.0%} to {sure[1]:+.0%}" if sure else ""
        console.print(f"  {mark}  {t['name']}: {value} (target {t['target']}{sure})")
    console.print(f"report: {out / 'report.json'}  plot: {out / 'learning_curve.png'}  "
                  f"requests: {out / 'records.jsonl'}")


async def simulate(cfg: SimConfig, console: Console) -> dict[str, Any]:
    from trainer.corpus import heldout_lines

    client = Client(cfg.api, cfg.key, seed=cfg.seed)
    try:
        spec, spec_source = await fetch_spec(client)
        admin = not spec_source.startswith("sim defaults")
        console.print(f"reward spec: {spec_source}: decision window {spec['decision_window_s']} s, "
                      f"retention checks {spec['retention_checks_s']} s, horizon "
                      f"{spec['horizon_s']} s", highlight=False)
        source = CursorSource(list(heldout_lines()))
        sender = EventSender(client, batch_size=cfg.event_batch_size,
                             flush_interval_s=cfg.flush_interval_s)
        sim = Simulation(cfg, spec, source, client, sender)
        display = Display(cfg, admin, console)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, sim.interrupted.set)
        loop.add_signal_handler(signal.SIGTERM, sim.interrupted.set)
        try:
            await sim.run(display)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
        deployments = training = None
        if admin:
            status, body = await client.get("/admin/deployments", limit=1000)
            if status == 200:
                deployments = rpt.timeline(body, sim.started_at, sim.now() + 1)
            status, body = await client.get("/admin/training")
            training = body if status == 200 else None
    finally:
        await client.aclose()
    baseline = None
    if cfg.baseline_json:
        baseline = json.loads(cfg.baseline_json.read_text())
    elif cfg.baseline_cursors:
        from simulator import baseline as bl

        checkpoint = cfg.baseline_checkpoint or default_checkpoint()
        console.print(f"baseline: the base policy on {cfg.baseline_cursors} held-out cursors ...")
        baseline = await asyncio.to_thread(bl.run, checkpoint, source, cfg.population, spec,
                                           cfg.baseline_cursors, cfg.seed,
                                           max_new_tokens=cfg.max_new_tokens)
    report = build_report(cfg, sim, spec_source, deployments, training, baseline)
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    with (cfg.out / "records.jsonl").open("w") as f:
        for r in sim.records:
            f.write(json.dumps(asdict(r)) + "\n")
    rpt.plot(report, cfg.out / "learning_curve.png")
    print_summary(console, report, cfg.out)
    return report


def default_checkpoint() -> Path:
    import service.policy

    return Path(service.policy.__file__).resolve().parent / "base"


# --- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tabloop simulate",
        description="Simulated editors replaying held-out code against a running tabloop; prints "
        "the learning curve and writes report.json and learning_curve.png.")
    p.add_argument("--api", required=True, help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument("--key", default=os.environ.get("TABLOOP_SIMULATE_KEY"),
                   help="API key (ingest; admin to read the reward spec and deployments); "
                   "default $TABLOOP_SIMULATE_KEY")
    p.add_argument("--users", type=int, default=16, help="people active at once (default 16)")
    p.add_argument("--minutes", type=float, default=10.0, help="run length (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seeds people, cursors and decisions")
    p.add_argument("--out", type=Path, default=Path("simulation"),
                   help="report directory (default ./simulation)")
    p.add_argument("--bucket-s", type=float, help="report bucket width (default: run / 30)")
    p.add_argument("--population", type=Path,
                   help="JSON object of population ranges, e.g. {\"accept_close\": [0.1, 0.3]}")
    p.add_argument("--reject-family-share", type=float,
                   help="share of cursors on def/class lines, always rejected (default 0.1)")
    p.add_argument("--baseline-cursors", type=int, default=2000,
                   help="held-out cursors for the offline base-policy baseline, run after the "
                   "simulation (about 10 a second on one core; 0: skip)")
    p.add_argument("--baseline-checkpoint", type=Path, help="default: the shipped base policy")
    p.add_argument("--baseline-json", type=Path,
                   help="use this baseline (from python -m simulator.baseline) instead")
    p.add_argument("--max-new-tokens", type=int, default=32)
    live = p.add_mutually_exclusive_group()
    live.add_argument("--live", dest="live", action="store_true", default=None,
                      help="rich live display (default when stdout is a terminal)")
    live.add_argument("--no-live", dest="live", action="store_false",
                      help="print one line per bucket instead")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    given = json.loads(args.population.read_text()) if args.population else {}
    if args.reject_family_share is not None:
        given = {**given, "reject_family_share": args.reject_family_share}
    population = PopulationConfig.from_dict(given)
    return SimConfig(api=args.api, key=args.key, users=args.users, minutes=args.minutes,
                     seed=args.seed, bucket_s=args.bucket_s, out=args.out, population=population,
                     max_new_tokens=args.max_new_tokens, baseline_cursors=args.baseline_cursors,
                     baseline_checkpoint=args.baseline_checkpoint,
                     baseline_json=args.baseline_json, live=args.live)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.key:
        parser.error("--key is required (or set TABLOOP_SIMULATE_KEY)")
    if args.users < 1 or args.minutes <= 0:
        parser.error("--users must be >= 1 and --minutes > 0")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    # a log or a pipe gets wide lines instead of 80-column wrapping
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        asyncio.run(simulate(cfg, console))
    except ApiError as e:
        print(f"tabloop simulate: the service refused: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
