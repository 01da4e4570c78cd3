"""`tabloop simulate`'s command line: the options, the checks on them, and the run
(simulator.run). `python -m simulator.cli --help` lists the options."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from simulator import phases
from simulator import report as rpt
from simulator.client import ApiError, Client, EventSender
from simulator.config import SimConfig, default_checkpoint
from simulator.corpus import CorpusError, corpus_paths, load_lines
from simulator.display import Display
from simulator.output import build_report, write_outputs
from simulator.population import (
    ADVERSARY_KINDS,
    AdversaryKind,
    CursorSource,
)
from simulator.run import Simulation, fetch_spec
from simulator.telemetry import PEOPLE, population_from_dict
from simulator.writing import WritingSource
from tabloop.core.corpus import corpus_files

log = logging.getLogger("tabloop.simulate")


async def simulate(cfg: SimConfig, console: Console) -> dict[str, Any]:
    client = Client(cfg.api, cfg.key, seed=cfg.seed)
    admin_client = Client(cfg.api, cfg.admin_key, seed=cfg.seed) if cfg.admin_key else None
    control: phases.TrainerControl | None = None
    sim: Simulation | None = None
    try:
        spec, spec_source = await fetch_spec(admin_client or client)
        admin = not spec_source.startswith("sim defaults")
        console.print(
            f"reward spec: {spec_source}: decision window {spec['decision_window_s']} s, "
            f"retention checks {spec['retention_checks_s']} s, horizon "
            f"{spec['horizon_s']} s",
            highlight=False,
        )
        source = CursorSource(load_lines(cfg.corpus))
        if cfg.corpus is not None:
            console.print(f"corpus: {len(source.lines)} lines under {cfg.corpus}", highlight=False)
        control = await phases.start(
            cfg.baseline_minutes, cfg.minutes, (admin_client or client) if admin else None, console
        )
        sender = EventSender(
            client, batch_size=cfg.event_batch_size, flush_interval_s=cfg.flush_interval_s
        )
        writing = None
        if cfg.mode == "write":
            paths = (
                sorted(corpus_files("heldout")) if cfg.corpus is None else corpus_paths(cfg.corpus)
            )
            writing = WritingSource(paths, cfg.seed)
            console.print(f"writing mode: {len(paths)} files, top to bottom", highlight=False)
        sim = Simulation(cfg, spec, source, client, sender, control, writing)
        display = Display(cfg, admin, console, admin_client)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, sim.interrupted.set)
        loop.add_signal_handler(signal.SIGTERM, sim.interrupted.set)
        try:
            await sim.run(display)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            await phases.resume(control, sim.now(), console)
        deployments = training = None
        if admin:
            reader = admin_client or client
            status, body = await reader.get("/admin/deployments", limit=1000)
            if status == 200:
                deployments = rpt.timeline(body, sim.started_at, sim.now() + 1)
            status, body = await reader.get("/admin/training")
            training = body if status == 200 else None
    finally:
        if sim is None:  # failed before the people started: still never leave it paused
            await phases.resume(control, 0.0, console)
        await client.aclose()
        if admin_client is not None:
            await admin_client.aclose()
    baseline = None
    if cfg.baseline_json:
        baseline = json.loads(cfg.baseline_json.read_text())
    elif cfg.baseline_cursors:
        from simulator import baseline as bl

        checkpoint = cfg.baseline_checkpoint or default_checkpoint()
        # simulator.baseline judges with proxy people whatever --people says
        judges = "" if cfg.people == "proxy" else ", judged by proxy people"
        console.print(
            f"baseline: the base policy on {cfg.baseline_cursors} cursors of the people's code"
            f"{judges} ..."
        )
        baseline = await asyncio.to_thread(
            bl.run,
            checkpoint,
            source,
            cfg.population,
            spec,
            cfg.baseline_cursors,
            cfg.seed,
            max_new_tokens=cfg.max_new_tokens,
        )
    report = build_report(
        cfg,
        sim,
        spec_source,
        deployments,
        training,
        baseline,
        None if control is None else control.state,
    )
    write_outputs(cfg, sim, report, console)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tabloop simulate",
        description="Simulated editors replaying held-out code against a running tabloop; prints "
        "the learning curve and writes report.json and learning_curve.png.",
    )
    p.add_argument("--api", required=True, help="the service, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--key",
        default=os.environ.get("TABLOOP_SIMULATE_KEY"),
        help="API key (ingest; admin to read the reward spec and deployments); "
        "default $TABLOOP_SIMULATE_KEY",
    )
    p.add_argument(
        "--admin-key",
        help="a key with the admin scope for the admin API (the "
        "spec, deployments, pausing the trainer) when --key lacks it",
    )
    p.add_argument("--users", type=int, default=16, help="people active at once (default 16)")
    p.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="the learning phase: minutes with the trainer running (default 10)",
    )
    p.add_argument(
        "--baseline-minutes",
        type=float,
        default=0.0,
        help="first pause the trainer for this many minutes (the live policy serves "
        "unchanged), then resume it for --minutes; the report compares the last fifth "
        "with this phase. Needs the admin scope (default 0: no baseline phase)",
    )
    p.add_argument(
        "--settled",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of people (0-1) who send code_settled when they move on from a "
        "line; the report also compares fresh lines apart (default 0)",
    )
    p.add_argument(
        "--corpus",
        type=Path,
        metavar="DIR",
        help="edit every *.py under DIR (tests left out) instead of the standard "
        "library's held-out files, e.g. a package the policy never trained on",
    )
    p.add_argument(
        "--adversaries",
        type=int,
        default=0,
        metavar="N",
        help="the last N of the --users seats hold adversaries, who accept or reject "
        "every suggestion whatever the code; the report gives the honest people's "
        "figures apart (default 0)",
    )
    p.add_argument(
        "--adversary-kinds",
        default="accept_all,reject_all",
        metavar="KINDS",
        help="comma-separated, taken in turn by the adversaries: "
        f"{', '.join(ADVERSARY_KINDS)} (default accept_all,reject_all)",
    )
    p.add_argument(
        "--mode",
        choices=("retype", "write"),
        default="retype",
        help="retype: people edit lines anywhere in the files (the suffix below is sent); "
        "write: a team writes the files top to bottom, the file above as the prefix and no "
        "suffix, every cursor on a line not yet written (default retype)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds people, cursors and decisions")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("simulation"),
        help="report directory (default ./simulation)",
    )
    p.add_argument("--bucket-s", type=float, help="report bucket width (default: run / 30)")
    p.add_argument(
        "--people",
        choices=PEOPLE,
        default="telemetry",
        help="telemetry: people who take suggestions as Copilot's users do (short ones "
        "almost never, long ones more often; simulator.telemetry); proxy: the control, who "
        "take almost every correct one (default telemetry)",
    )
    p.add_argument(
        "--population",
        type=Path,
        help='JSON object of population ranges, e.g. {"accept_close": [0.1, 0.3]}; with '
        '--people telemetry also its ranges, e.g. {"min_read_chars": 6}',
    )
    p.add_argument(
        "--reject-family-share",
        type=float,
        help="share of cursors on def/class lines, always rejected (default 0.1)",
    )
    p.add_argument(
        "--baseline-cursors",
        type=int,
        default=2000,
        help="held-out cursors for the offline base-policy baseline, run after the "
        "simulation (about 10 a second on one core; 0: skip)",
    )
    p.add_argument("--baseline-checkpoint", type=Path, help="default: the shipped base policy")
    p.add_argument(
        "--baseline-json",
        type=Path,
        help="use this baseline (from python -m simulator.baseline) instead",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    live = p.add_mutually_exclusive_group()
    live.add_argument(
        "--live",
        dest="live",
        action="store_true",
        default=None,
        help="rich live display (default when stdout is a terminal)",
    )
    live.add_argument(
        "--no-live", dest="live", action="store_false", help="print one line per bucket instead"
    )
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    given = json.loads(args.population.read_text()) if args.population else {}
    if args.reject_family_share is not None:
        given = {**given, "reject_family_share": args.reject_family_share}
    population, telemetry = population_from_dict(given, args.people)
    return SimConfig(
        api=args.api,
        key=args.key,
        users=args.users,
        minutes=args.minutes,
        baseline_minutes=args.baseline_minutes,
        settled_share=args.settled,
        corpus=args.corpus,
        admin_key=args.admin_key,
        seed=args.seed,
        bucket_s=args.bucket_s,
        out=args.out,
        population=population,
        people=args.people,
        telemetry=telemetry,
        max_new_tokens=args.max_new_tokens,
        baseline_cursors=args.baseline_cursors,
        baseline_checkpoint=args.baseline_checkpoint,
        baseline_json=args.baseline_json,
        live=args.live,
        adversaries=args.adversaries,
        adversary_kinds=parse_kinds(args.adversary_kinds),
        mode=args.mode,
    )


def parse_kinds(text: str) -> tuple[AdversaryKind, ...]:
    """`accept_all,reject_all` -> the kinds; ValueError naming the known ones."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in ADVERSARY_KINDS]
    if not kinds or unknown:
        raise ValueError(
            f"--adversary-kinds: {', '.join(unknown) or 'none given'}; "
            f"known: {', '.join(ADVERSARY_KINDS)}"
        )
    return kinds  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.key:
        parser.error("--key is required (or set TABLOOP_SIMULATE_KEY)")
    if args.users < 1 or args.minutes <= 0:
        parser.error("--users must be >= 1 and --minutes > 0")
    if args.baseline_minutes < 0:
        parser.error("--baseline-minutes must be >= 0")
    if not 0 <= args.adversaries < args.users:
        parser.error("--adversaries must be >= 0 and leave at least one of --users honest")
    if not 0.0 <= args.settled <= 1.0:
        parser.error("--settled must be a share in [0, 1]")
    if args.corpus is not None and not args.corpus.is_dir():
        parser.error(f"--corpus {args.corpus}: not a directory")
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    # a log or a pipe gets wide lines instead of 80-column wrapping
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        asyncio.run(simulate(cfg, console))
    except ApiError as e:
        why = e.message if e.status == 0 else f"the service refused: {e}"
        print(f"tabloop simulate: {why}", file=sys.stderr)
        return 1
    except CorpusError as e:
        print(f"tabloop simulate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
