"""The learning result of docs/RESULTS.md: service + trainer + `tabloop simulate`, one command.

    python benchmarks/simulation.py --mode embedded --minutes 15 --users 16 --seed 0 --out DIR
    python benchmarks/simulation.py --mode full --minutes 15 --users 16 --seed 0 --out DIR \
        [--baseline DIR/baseline.json] [--reward chars_norm=8 ...] [--paused] [--no-lines-fit] \
        [--baseline-minutes 5] [--settled 1.0] [--corpus DIR] [--exact-cursors 1000] \
        [--adversaries 2 --adversary-kinds accept_all,reject_all]

Everything runs on this machine, on 127.0.0.1 only, with TABLOOP_PROFILE=sim (seconds-long
reward windows, the sim trainer profile) and otherwise default settings, except the per-key
rate limit, which is lifted (16 people send ~10 requests/s with one key).

- embedded: `tabloop up` (SQLite, the outbox table as the log, the trainer in-process);
- full: PostgreSQL (tabloop/testing/postgres.PostgresServer: fsync on) and a Tansu broker
  (tabloop/testing/kafka.KafkaBroker), then the production processes: `tabloop serve`,
  `tabloop relay`, `tabloop train` (with a deploy-scoped key), as docker-compose.yml runs them.

Then `tabloop simulate --no-live` writes DIR/report.json, records.jsonl and
learning_curve.png (with --baseline, the offline baseline from that file instead of computing
one: it depends only on the base policy and the seed, so one file serves every run), and
this script adds the service's mode to the report (`config.service_mode`: embedded or full)
and whether the trainer fit the lines head (`config.lines_fit`).
The service logs are in DIR/logs/. Before the service stops, the learning-related rows of its
database go to DIR/db/*.jsonl (rollouts without their tokens, rewards, policies, deployments),
so two runs can be compared after their databases are gone (`--no-dump` skips it).

`--paused` pauses the trainer (POST /admin/training/pause) before the people start: the base
policy serves the whole run, a control for how much a run's first and last fifths differ
without any learning (with --baseline-minutes, how much the baseline phase and the last fifth
differ). `--no-lines-fit` runs the trainer without the lines head's fit (an ablation).

`--baseline-minutes`, `--settled`, `--corpus`, `--adversaries` and `--adversary-kinds` go to
`tabloop simulate` (a baseline phase with the trainer paused; the share of people sending
code_settled; the code people edit; how many of the --users seats hold adversaries, and their
kinds: report.json's `honest` section then gives the honest people's figures apart), and
`--editing` as its `--mode` (retype lines anywhere, or write the files top to bottom).

After the run, the offline exact rest-of-line check (simulator.exact): the base policy (version
1, the one the service started with) and the last live policy (GET /admin/policies: the current
deployment's live version), their checkpoints read from the service's database, complete the
same `--exact-cursors` cursors on fresh lines of the people's code (lines no code_settled was
sent for during the run), drawn with the run's seed as the people draw them, reject-family
cursors left out, sampled as served (serving temperature, top-p and confidence stop, a torch
generator seeded with the run's seed). It goes into DIR/report.json as
`offline_exact_rest_of_line` and is printed: the exact rate over all cursors (an empty
completion is a miss) and among non-empty completions, for both policies.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.ingest import (
    Proc,
    clean_env,
    free_port,
    parse_pairs,
    tabloop,
    wait_ready,
)

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    # a SIGTERM (kill, a job's timeout) stops the service, broker and database as Ctrl-C does,
    # through the `finally` below, instead of leaving them running with no parent
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["embedded", "full"], default="embedded")
    p.add_argument("--minutes", type=float, default=15)
    p.add_argument("--users", type=int, default=16)
    p.add_argument(
        "--trainers",
        type=int,
        default=1,
        help="full mode: `tabloop train` processes, one consumer group (one leads and trains)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--people",
        choices=["telemetry", "proxy"],
        default="telemetry",
        help="the simulated people (tabloop simulate --people; default telemetry)",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--baseline", type=Path, help="an offline baseline JSON to reuse")
    p.add_argument("--baseline-cursors", type=int, default=2000)
    p.add_argument("--no-dump", action="store_true", help="do not write DIR/db/*.jsonl")
    p.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="PUT /admin/reward-spec with these fields before simulating "
        "(an operator's spec; default: the sim profile's)",
    )
    p.add_argument(
        "--paused",
        action="store_true",
        help="pause the trainer first: the base policy serves throughout (a control)",
    )
    p.add_argument(
        "--no-lines-fit",
        action="store_true",
        help="TABLOOP_TRAINER_LINES_FIT=false: the lines head learns by the policy gradient "
        "alone (docs/TRAINER.md)",
    )
    p.add_argument(
        "--baseline-minutes",
        type=float,
        default=0.0,
        help="tabloop simulate --baseline-minutes: first this long with the trainer "
        "paused (the run is this plus --minutes)",
    )
    p.add_argument(
        "--settled",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="tabloop simulate --settled: share of people sending code_settled",
    )
    p.add_argument(
        "--corpus",
        type=Path,
        metavar="DIR",
        help="tabloop simulate --corpus: people edit the *.py files under DIR",
    )
    p.add_argument(
        "--editing",
        choices=("retype", "write"),
        default="retype",
        help="tabloop simulate --mode: retype lines anywhere, or write the files top to "
        "bottom with no suffix (default retype)",
    )
    p.add_argument(
        "--adversaries",
        type=int,
        default=0,
        metavar="N",
        help="tabloop simulate --adversaries: the last N of --users seats are "
        "adversaries (default 0)",
    )
    p.add_argument(
        "--adversary-kinds",
        default="accept_all,reject_all",
        metavar="KINDS",
        help="tabloop simulate --adversary-kinds (default accept_all,reject_all)",
    )
    p.add_argument(
        "--exact-cursors",
        type=int,
        default=1000,
        help="fresh-line cursors for the offline exact rest-of-line check of the base "
        "and the last live policy (0: skip)",
    )
    args = p.parse_args()

    out = args.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tabloop-sim-"))
    checkpoints = Path(tempfile.mkdtemp(prefix="tabloop-sim-policies-"))
    policies: tuple[Path, Path] | None = None
    port = free_port()
    env = clean_env(
        TABLOOP_PROFILE="sim",
        TABLOOP_PORT=str(port),
        TABLOOP_DATA_DIR=str(work / "data"),
        TABLOOP_LOG_LEVEL="INFO",
        TABLOOP_RATE_LIMIT_PER_S="100000",
        TABLOOP_RATE_LIMIT_BURST="100000",
        TABLOOP_TRAINER_LINES_FIT="false" if args.no_lines_fit else "true",
    )
    procs: list[Proc] = []
    pg = broker = None
    pg_dir: Path | None = None
    try:
        if args.mode == "embedded":
            tabloop("db", "upgrade", env=env)
            token = tabloop(
                "keys", "create", "--scope", "admin,deploy,ingest", "--name", "sim", env=env
            ).strip()
            procs.append(Proc("up", [sys.executable, "-m", "tabloop.cli", "up"], env, logs))
        else:
            from tabloop.testing.kafka import KafkaBroker
            from tabloop.testing.postgres import PostgresServer

            pg_dir = Path(tempfile.mkdtemp(prefix="tabloop-sim-pg-"))  # reachable by `postgres`
            pg = PostgresServer(pg_dir, fast=False).start()
            broker = KafkaBroker(work / "kafka", durable=False).start()
            env.update(
                TABLOOP_DATABASE_URL=pg.create_database("tabloop_sim"),
                TABLOOP_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
            )
            tabloop("db", "upgrade", env=env)
            token = tabloop(
                "keys", "create", "--scope", "admin,deploy,ingest", "--name", "sim", env=env
            ).strip()
            trainer_key = tabloop(
                "keys", "create", "--scope", "deploy", "--name", "trainer", env=env
            ).strip()
            procs.append(Proc("serve", [sys.executable, "-m", "tabloop.cli", "serve"], env, logs))
            wait_ready(port, "/readyz", procs[-1])  # serve registers the base policy
            procs.append(
                Proc(
                    "relay",
                    [sys.executable, "-m", "tabloop.cli", "relay"],
                    {**env, "TABLOOP_METRICS_PORT": str(free_port())},
                    logs,
                )
            )
            for i in range(args.trainers):  # one consumer group; the first to lock leads
                procs.append(
                    Proc(
                        "train" if i == 0 else f"train-{i + 1}",
                        [sys.executable, "-m", "tabloop.cli", "train"],
                        {
                            **env,
                            "TABLOOP_METRICS_PORT": str(free_port()),
                            "TABLOOP_TRAINER_API_KEY": trainer_key,
                            "TABLOOP_TRAINER_API_URL": f"http://127.0.0.1:{port}",
                            # each its own checkpoint cache
                            "TABLOOP_DATA_DIR": str(work / ("data" if i == 0 else f"data-{i + 1}")),
                        },
                        logs,
                    )
                )
        wait_ready(port, "/readyz", procs[0])
        print(
            f"{args.mode}: service on :{port}, logs in {logs}; simulating "
            f"{args.baseline_minutes} + {args.minutes} min",
            flush=True,
        )
        if args.reward:
            put_reward_spec(port, token, args.reward)
        if args.paused:
            pause_trainer(port, token)
        argv = [
            sys.executable,
            "-m",
            "tabloop.cli",
            "simulate",
            "--api",
            f"http://127.0.0.1:{port}",
            "--users",
            str(args.users),
            "--minutes",
            str(args.minutes),
            "--seed",
            str(args.seed),
            "--out",
            str(out),
            "--no-live",
            "--baseline-minutes",
            str(args.baseline_minutes),
            "--settled",
            str(args.settled),
            "--adversaries",
            str(args.adversaries),
            "--adversary-kinds",
            args.adversary_kinds,
        ]
        if args.corpus:
            argv += ["--corpus", str(args.corpus.resolve())]
        argv += ["--mode", args.editing, "--people", args.people]
        if args.baseline:
            argv += ["--baseline-cursors", "0"]
        else:
            argv += ["--baseline-cursors", str(args.baseline_cursors)]
        # the key by environment, not argv: argv shows in `ps` and in report.json
        rc = subprocess.run(
            argv, cwd=ROOT, env={**env, "TABLOOP_SIMULATE_KEY": token}, check=False
        ).returncode
        if rc == 0:  # which service the people ran against (summarize.py pairs runs by it)
            report_path = out / "report.json"
            report = json.loads(report_path.read_text())
            report["config"]["service_mode"] = args.mode
            report["config"]["lines_fit"] = not args.no_lines_fit
            report_path.write_text(json.dumps(report, indent=1, default=str))
        url = env.get("TABLOOP_DATABASE_URL") or f"sqlite:///{work / 'data' / 'tabloop.db'}"
        if rc == 0 and args.exact_cursors > 0:  # the checkpoints, before the database goes
            policies = export_policies(port, token, url, checkpoints)
        if not args.no_dump:
            dump_tables(url, out / "db")
        for proc in procs:
            if proc.popen.poll() is not None:
                print(f"{proc.name} exited early ({proc.popen.returncode}):\n{proc.tail()}")
                rc = rc or 1
    finally:
        for proc in reversed(procs):
            proc.stop()
        if broker is not None:
            broker.close()
        if pg is not None:
            pg.close()
        if pg_dir is not None:  # PostgreSQL's data directory (~300 MB after 15 minutes)
            shutil.rmtree(pg_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        if policies is None:  # no offline check to come
            shutil.rmtree(checkpoints, ignore_errors=True)
    if rc == 0 and args.baseline:  # the report's comparison and plot against that baseline
        from simulator.plot import main as redraw

        rc = redraw([str(out / "report.json"), "--baseline", str(args.baseline)])
    if policies is not None:
        try:
            if rc == 0:
                exact_check(out, policies, args)
        finally:
            shutil.rmtree(checkpoints, ignore_errors=True)
    return rc


def export_policies(port: int, token: str, url: str, directory: Path) -> tuple[Path, Path]:
    """(base, last live): the checkpoints of version 1 and of the current deployment's live
    version (GET /admin/policies), written from the service's database under `directory`."""
    import httpx
    import sqlalchemy as sa

    from tabloop.core.registry import artifact_files, write_files

    r = httpx.get(
        f"http://127.0.0.1:{port}/admin/policies",
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    r.raise_for_status()
    live = int(r.json()["deployment"]["live_version"])
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            for version in sorted({1, live}):
                write_files(directory / f"v{version}", artifact_files(conn, version))
    finally:
        engine.dispose()
    return directory / "v1", directory / f"v{live}"


def exact_check(out: Path, policies: tuple[Path, Path], args: argparse.Namespace) -> None:
    """The offline exact rest-of-line check (module docstring), into report.json and printed."""
    import torch

    from simulator.corpus import load_lines
    from simulator.exact import check
    from simulator.output import read_settled_lines

    torch.set_num_threads(1)
    base, last = policies
    print(
        f"offline exact rest-of-line check: {base.name} (base) and {last.name} (last live) on "
        f"{args.exact_cursors} fresh-line cursors ...",
        flush=True,
    )
    result = check(
        base, last, load_lines(args.corpus), read_settled_lines(out), args.exact_cursors, args.seed
    )
    for name in ("base", "last"):  # the temporary copy is gone after the run
        version = result[name]["policy_version_in_manifest"]
        result[name]["checkpoint"] = f"policy v{version}, from the service's database"
    report_path = out / "report.json"
    report = json.loads(report_path.read_text())
    report["offline_exact_rest_of_line"] = result
    report_path.write_text(json.dumps(report, indent=1, default=str))
    print(f"  {result['sampling']}; {result['fresh_lines']} of {result['lines']} lines fresh")
    for name in ("base", "last"):
        r = result[name]
        print(
            f"  {name} v{r['policy_version_in_manifest']}: exact {pct(r['exact_rate'])} of "
            f"{r['cursors']} cursors; {pct(r['exact_rate_non_empty'])} of {r['non_empty']} "
            "non-empty completions",
            flush=True,
        )


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def put_reward_spec(port: int, token: str, pairs: list[str]) -> None:
    """Store a reward spec with the given fields changed, as an operator would."""
    import httpx

    r = httpx.put(
        f"http://127.0.0.1:{port}/admin/reward-spec",
        json=parse_pairs(pairs),
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    r.raise_for_status()
    print(f"reward spec v{r.json()['version']}: {r.json()['spec']}", flush=True)


def pause_trainer(port: int, token: str) -> None:
    """Pause the trainer as an operator would; it takes no step while paused."""
    import httpx

    r = httpx.post(
        f"http://127.0.0.1:{port}/admin/training/pause",
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    r.raise_for_status()
    print(f"trainer paused: {r.json()['paused']}", flush=True)


def dump_tables(url: str, directory: Path) -> None:
    """The rows that say what the loop learned from, one JSON object per line and table."""
    import sqlalchemy as sa

    from tabloop.core.tables import deployments, policies, rewards, rollouts

    directory.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url)
    tokens = {"context_token_ids", "token_ids", "token_logprobs"}
    queries = {
        "rollouts": sa.select(*[c for c in rollouts.c if c.name not in tokens]),
        "rewards": sa.select(rewards),
        "policies": sa.select(*[c for c in policies.c if c.name != "manifest"]),
        "deployments": sa.select(deployments),
    }
    try:
        with engine.connect() as conn:
            for name, query in queries.items():
                with (directory / f"{name}.jsonl").open("w") as f:
                    for row in conn.execute(query).mappings():
                        f.write(json.dumps(dict(row), default=str) + "\n")
    finally:
        engine.dispose()
    print(f"database rows in {directory}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
