"""Faults under load, measured: nothing acknowledged is lost or duplicated, rewards train once.

    python benchmarks/faults.py [--short] [--faults broker-kill,pg-kill,...] [--rate 200]
                                [--json FILE] [--keep DIR]

Full mode on this machine (benchmarks/cluster.py: PostgreSQL with fsync on, Tansu with durable
S3 storage, `tabloop serve`, `tabloop relay`, `tabloop train` with TABLOOP_PROFILE=sim). Editor
plugins (benchmarks/plugin.py) send numbered feedback events at `--rate` events/s in 20-event
batches with bounded concurrency, retrying like a plugin (same event ids, after Retry-After),
plus completions at `--complete-rate`. Meanwhile the faults run one after the other:

  broker-kill   SIGKILL the broker, start it again after --down seconds
  broker-stop   SIGSTOP the broker for --slow seconds (reachable, answers nothing), SIGCONT
  pg-restart    PostgreSQL fast shutdown, start after --down seconds
  pg-kill       SIGKILL the postmaster (crash recovery at start), start after --down seconds
  pg-stop       SIGSTOP every PostgreSQL process for --slow seconds, SIGCONT
  pg-full       hold every PostgreSQL connection slot for --slow seconds (apps' sessions ended)
  relay-kill    SIGKILL `tabloop relay`, start a new one after --down seconds
  trainer-kill  SIGKILL `tabloop train`, start a new one after --down seconds

After the load stops and the relay drains the outbox: every acknowledged event id must be in
PostgreSQL `events` and in `tabloop.feedback` exactly once (rollouts likewise), each policy the
trainer registered must have exactly as many rewards stamped `trained_into` it as it trained on
(a reward trained into two candidates would leave the first one short), and the trainer must be
running with a fresh heartbeat. Prints the figures per fault: answers, 503s (all with
Retry-After?), the longest answer, recovery time. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import plugin
from benchmarks.cluster import DATABASE, Cluster, one, wait_for
from benchmarks.ingest import machine

ROOT = Path(__file__).resolve().parents[1]

SHORT = "broker-kill,relay-kill,pg-kill,trainer-kill"
FULL = (
    "broker-kill,relay-kill,pg-restart,trainer-kill,broker-stop,pg-stop,pg-full,"
    "broker-kill,pg-kill,relay-kill,trainer-kill,broker-kill"
)
RECOVERY_LIMIT_S = 120.0


@dataclass
class Fault:
    name: str
    start: float  # monotonic
    cleared: float  # when the dependency was back (restarted / resumed / released)
    recovered_s: float | None  # from cleared until the service had recovered (see `recovery`)
    recovery: str  # what recovered means for this fault
    crashed: list[str]  # apps that exited by themselves meanwhile (restarted, as by a supervisor)
    readyz: str  # what /readyz answered at the end of the fault


class Faults:
    def __init__(self, cluster: Cluster, plugins: plugin.Plugins, args: argparse.Namespace) -> None:
        self.c, self.p, self.args = cluster, plugins, args
        self.done: list[Fault] = []
        self.rss: list[tuple[float, dict[str, float]]] = []
        self.readyz = ""

    # -- probes ----------------------------------------------------------------------------

    def query(self, sql: str) -> Any:
        import psycopg

        with psycopg.connect(self.c.pg.dsn(DATABASE), connect_timeout=2, autocommit=True) as conn:
            return one(conn, sql)[0]

    def backlog(self, written_before: float | None = None) -> int:
        """Unpublished outbox rows (only those written before `written_before`, a wall time)."""
        sql = "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        if written_before is not None:
            sql += f" AND created_at <= to_timestamp({written_before})"
        return int(self.query(sql))

    def first_202_after(self, t: float) -> bool:
        return any(
            a.route == "events" and a.status == 202 and a.t0 >= t
            for a in reversed(self.p.answers[-2000:])
        )

    def trained(self) -> bool:
        return int(self.query("SELECT count(*) FROM rewards WHERE trained_at IS NOT NULL")) > 0

    def heartbeat_after(self, wall: float) -> bool:
        return (
            float(
                self.query(
                    "SELECT extract(epoch FROM heartbeat_at) FROM trainer_state "
                    "WHERE name = 'trainer'"
                )
            )
            > wall
        )

    # -- the schedule ----------------------------------------------------------------------

    def hold(self, seconds: float) -> None:
        """Keep the fault on; at its end, note what /readyz says (a load balancer's view)."""
        import httpx

        time.sleep(seconds)
        try:
            self.readyz = str(httpx.get(f"{self.c.url}/readyz", timeout=5).status_code)
        except httpx.HTTPError as e:
            self.readyz = type(e).__name__

    def inject(self, name: str) -> tuple[str, Any]:
        """Break something, wait, repair it; returns (what recovery means, its check)."""
        c, a = self.c, self.args
        if name == "broker-kill":
            c.broker.kill()
            self.hold(a.down)
            c.broker.start()
        elif name == "broker-stop":
            c.pause("broker", True)
            self.hold(a.slow)
            c.pause("broker", False)
        elif name == "pg-restart":
            c.pg.stop()
            self.hold(a.down)
            c.pg.start()
        elif name == "pg-kill":
            c.pg.kill()
            self.hold(a.down)
            c.pg.start()
        elif name == "pg-stop":
            c.pause("postgres", True)
            self.hold(a.slow)
            c.pause("postgres", False)
        elif name == "pg-full":
            held = c.hold_connections()
            self.hold(a.slow)
            for conn in held:
                conn.close()
        elif name in ("relay-kill", "trainer-kill"):
            app = name.split("-")[0].replace("trainer", "train")
            c.kill(app)
            self.hold(a.down)
            c.spawn(app)
            if app == "train":
                wall = time.time()
                return "trainer heartbeat", lambda: self.heartbeat_after(wall)
        else:
            raise SystemExit(f"unknown fault {name!r}")
        if name.startswith(("broker", "relay")):
            wall = time.time()
            return "outage's rows published", lambda: self.backlog(written_before=wall) == 0
        cleared = time.monotonic()
        return "first 202", lambda: self.first_202_after(cleared)

    def run(self, names: list[str]) -> None:
        for name in names:
            time.sleep(self.args.gap)
            print(f"  {time.strftime('%H:%M:%S')} {name}", flush=True)
            start = time.monotonic()
            what, check = self.inject(name)
            cleared = time.monotonic()
            recovered = wait_for(check, RECOVERY_LIMIT_S)
            crashed = self.c.exited()
            for app in crashed:  # a supervisor (docker compose, systemd) would restart it
                print(f"    {app} exited by itself:\n{self.c.procs[app].tail()}", flush=True)
                self.c.spawn(app)
            self.done.append(Fault(name, start, cleared, recovered, what, crashed, self.readyz))
            took = "never" if recovered is None else f"{recovered:.2f} s after it cleared"
            print(f"    recovered ({what}): {took}", flush=True)

    def sample_rss(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            self.rss.append((time.monotonic(), self.c.rss()))


# -- checks ----------------------------------------------------------------------------------


def verify(cluster: Cluster, plugins: plugin.Plugins) -> dict[str, Any]:
    """Compare what was acknowledged with PostgreSQL and the topics; rewards; the trainer."""
    import orjson
    import psycopg

    from service.relay import HEADER
    from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
    from tabloop.testing.kafka import consume_all

    out: dict[str, Any] = {}
    with psycopg.connect(cluster.pg.dsn(DATABASE), autocommit=True) as conn:
        db_events = {r[0] for r in conn.execute("SELECT event_id FROM events")}
        db_rollouts = {r[0] for r in conn.execute("SELECT suggestion_id FROM rollouts")}
        out["dead_letters"] = one(conn, "SELECT count(*) FROM dead_letters")[0]
        out["unpublished"] = one(conn, "SELECT count(*) FROM outbox WHERE published_at IS NULL")[0]
        out["rewards"], out["reward_rows_per_suggestion_max"] = one(
            conn,
            "SELECT count(*), coalesce(max(n), 0) FROM "
            "(SELECT count(*) AS n FROM rewards GROUP BY suggestion_id) r",
        )
        # each registered candidate: rollouts it trained on vs rewards stamped trained_into it
        trained = conn.execute(
            "SELECT p.version, (p.summary->>'rollouts')::int, "
            "(SELECT count(*) FROM rewards r WHERE r.trained_into = p.version) "
            "FROM policies p WHERE p.parent IS NOT NULL ORDER BY 1"
        ).fetchall()
        out["candidates"] = [list(r) for r in trained]
        # a reward trained into two candidates leaves the first with part of its batch
        out["candidates_partial"] = [v for v, n, got in trained if got not in (0, n)]
        # none: the trainer died between registering and stamping (its rewards stay used)
        out["candidates_unstamped"] = [v for v, n, got in trained if got == 0]
        out["rewards_trained"] = one(
            conn, "SELECT count(*) FROM rewards WHERE trained_at IS NOT NULL"
        )[0]
        out["candidate_rollouts"] = sum(n for _, n, _ in trained)
        out["rewards_into_untrained"] = one(
            conn,
            "SELECT count(*) FROM rewards WHERE trained_into IS NOT NULL AND trained_at IS NULL",
        )[0]
        missing = sorted(plugins.acked - db_events)[:5]
        feedback = consume_all(cluster.broker.bootstrap, FEEDBACK, timeout_s=180)
        in_topic = Counter(orjson.loads(r.value)["event_id"] for r in feedback)
        lost = sorted(plugins.acked - set(in_topic))
        # where the lost ones were: their outbox rows (id, partition key, written, stamped)
        out["lost_examples"] = [
            list(map(str, r))
            for r in conn.execute(
                "SELECT id, key, created_at, published_at, payload::jsonb->>'event_id' FROM outbox "
                "WHERE topic = %s AND payload::jsonb->>'event_id' = ANY(%s) ORDER BY id LIMIT 20",
                (FEEDBACK, lost),
            )
        ]
        out["missing_db_examples"] = missing
        where = {
            int(v): (r.partition, r.offset)
            for r in feedback
            for k, v in (r.headers or ())
            if k == HEADER
        }
        out["lost_neighbours"] = [
            {i: where.get(i) for i in range(int(row[0]) - 3, int(row[0]) + 4)}
            for row in out["lost_examples"][:3]
        ]
    outbox_ids = Counter(v for r in feedback for k, v in (r.headers or ()) if k == HEADER)
    rollouts = consume_all(cluster.broker.bootstrap, ROLLOUTS, timeout_s=180)
    rollouts_in_topic = Counter(orjson.loads(r.value)["suggestion_id"] for r in rollouts)
    acked = plugins.acked
    out.update(
        events_sent=len(plugins.sent),
        events_acked=len(acked),
        events_in_db=len(db_events),
        events_in_topic=len(in_topic),
        missing_in_db=len(acked - db_events),
        missing_in_topic=len(acked - set(in_topic)),
        duplicated_in_topic=sum(1 for n in in_topic.values() if n > 1),
        duplicated_outbox_ids=sum(1 for n in outbox_ids.values() if n > 1),
        stored_not_acked=len(db_events - acked),
        rollouts_in_db=len(db_rollouts),
        rollouts_missing_in_topic=len(db_rollouts - set(rollouts_in_topic)),
        rollouts_duplicated_in_topic=sum(1 for n in rollouts_in_topic.values() if n > 1),
        unexpected_answers=plugins.unexpected,
        batches_given_up=plugins.gave_up,
    )
    return out


def failures(v: dict[str, Any], answers: list[plugin.Answer]) -> list[str]:
    bad = [
        k
        for k in (
            "missing_in_db",
            "missing_in_topic",
            "duplicated_in_topic",
            "duplicated_outbox_ids",
            "rollouts_missing_in_topic",
            "rollouts_duplicated_in_topic",
            "unpublished",
            "dead_letters",
            "rewards_into_untrained",
            "batches_given_up",
        )
        if v[k]
    ]
    if v["candidates_partial"]:
        bad.append(f"candidates with part of their batch stamped: {v['candidates_partial']}")
    if v["candidate_rollouts"] > v["rewards_trained"]:
        bad.append(
            f"candidates trained on {v['candidate_rollouts']} rewards, only "
            f"{v['rewards_trained']} used: some were used twice"
        )
    if v["reward_rows_per_suggestion_max"] > 1:
        bad.append("a suggestion with two reward rows")
    if not v["trainer_running"]:
        bad.append("the trainer was not running at the end")
    if v["unexpected_answers"]:
        bad.append(f"{len(v['unexpected_answers'])} unexpected answers")
    no_retry = sum(1 for a in answers if a.status in (429, 503) and not a.retry_after)
    if no_retry:
        bad.append(f"{no_retry} 429/503 answers without Retry-After")
    return bad


# -- report ----------------------------------------------------------------------------------


def fault_rows(
    faults: list[Fault], answers: list[plugin.Answer], rss: list[Any]
) -> list[dict[str, Any]]:
    """Per fault, the answers started between its start and its recovery (or +5 s)."""
    rows = []
    windows = []
    for f in faults:
        end = f.cleared + (f.recovered_s if f.recovered_s is not None else 5.0)
        windows.append((f.start, end))
        rows.append(
            _window_row(
                f.name,
                [a for a in answers if f.start <= a.t0 <= end],
                [r for t, r in rss if f.start <= t <= end],
                f.cleared - f.start,
                f.recovered_s,
                f.crashed,
            )
        )
        rows[-1]["readyz"] = f.readyz
    calm = [a for a in answers if not any(s <= a.t0 <= e for s, e in windows)]
    rows.insert(0, _window_row("(no fault)", calm, [r for _, r in rss], 0.0, None, []))
    return rows


def _window_row(
    name: str,
    answers: list[plugin.Answer],
    rss: list[dict[str, float]],
    down_s: float,
    recovered_s: float | None,
    crashed: list[str],
) -> dict[str, Any]:
    ev = [a for a in answers if a.route == "events"]
    comp = [a for a in answers if a.route == "complete"]
    statuses = Counter(str(a.status) for a in answers)
    return {
        "fault": name,
        "down_s": round(down_s, 1),
        "recovered_s": None if recovered_s is None else round(recovered_s, 1),
        "event_posts": len(ev),
        "event_202": sum(a.status == 202 for a in ev),
        "complete_posts": len(comp),
        "complete_200": sum(a.status == 200 for a in comp),
        "n503": statuses.get("503", 0),
        "n429": statuses.get("429", 0),
        "errors": {k: n for k, n in statuses.items() if k not in ("200", "202", "503", "429")},
        "max_answer_s": round(max((a.seconds for a in answers), default=0.0), 2),
        "max_503_s": round(max((a.seconds for a in answers if a.status == 503), default=0.0), 3),
        "p50_503_s": round(
            plugin.percentile([a.seconds for a in answers if a.status == 503], 0.5), 3
        ),
        "timeouts": statuses.get("timeout", 0),
        "p99_s": round(plugin.percentile([a.seconds for a in answers], 0.99), 3),
        "serve_rss_max_mib": round(max((r["serve"] for r in rss), default=0.0)),
        "crashed": crashed,
    }


def report(
    rows: list[dict[str, Any]], v: dict[str, Any], args: argparse.Namespace, elapsed: float
) -> None:
    print()
    print(
        f"machine: {machine()}; load: {args.rate:.0f} events/s in {args.batch}-event batches, "
        f"<= {args.concurrency} in flight, {args.complete_rate:.0f} completions/s; "
        f"client timeout {plugin.CLIENT_TIMEOUT_S:.0f} s; {elapsed:.0f} s under load"
    )
    head = (
        f"{'fault':<14}{'down s':>7}{'recov s':>8}{'posts':>7}{'202':>6}{'503':>6}"
        f"{'429':>5}{'max s':>7}{'503 p50':>8}{'503 max':>8}{'p99 s':>7}{'cmpl':>6}{'200':>5}"
        f"{'RSS MiB':>8}  readyz / errors / crashed"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        rec = "-" if r["recovered_s"] is None else f"{r['recovered_s']:.1f}"
        extra = (
            ", ".join(
                ([f"readyz {r['readyz']}"] if r.get("readyz") else [])
                + [f"{k} x{n}" for k, n in r["errors"].items()]
                + [f"{app} exited" for app in r["crashed"]]
            )
            or "-"
        )
        print(
            f"{r['fault']:<14}{r['down_s']:>7.1f}{rec:>8}{r['event_posts']:>7}"
            f"{r['event_202']:>6}{r['n503']:>6}{r['n429']:>5}{r['max_answer_s']:>7.2f}"
            f"{r['p50_503_s']:>8.3f}{r['max_503_s']:>8.3f}{r['p99_s']:>7.3f}{r['complete_posts']:>6}"
            f"{r['complete_200']:>5}{r['serve_rss_max_mib']:>8}  {extra}"
        )
    print()
    print(
        f"events: sent {v['events_sent']}, acknowledged {v['events_acked']}, in PostgreSQL "
        f"{v['events_in_db']}, in {'tabloop.feedback'} {v['events_in_topic']}; "
        f"stored but never acknowledged {v['stored_not_acked']}"
    )
    print(
        f"missing: PostgreSQL {v['missing_in_db']}, topic {v['missing_in_topic']}; "
        f"duplicated in the topic: {v['duplicated_in_topic']} event ids, "
        f"{v['duplicated_outbox_ids']} outbox ids"
    )
    print(
        f"rollouts: {v['rollouts_in_db']} in PostgreSQL, missing in the topic "
        f"{v['rollouts_missing_in_topic']}, duplicated {v['rollouts_duplicated_in_topic']}"
    )
    print(
        f"rewards: {v['rewards']} rows (at most {v['reward_rows_per_suggestion_max']} per "
        f"suggestion), {v['rewards_trained']} trained; candidates [version, trained on, "
        f"rewards trained_into it]: {v['candidates']}"
    )
    print(
        f"trainer: running at the end {v['trainer_running']}, heartbeat fresh "
        f"{v['heartbeat_fresh']}; candidates registered but never stamped (trainer killed "
        f"in between): {v['candidates_unstamped'] or 'none'}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--short",
        action="store_true",
        help=f"the CI form: {SHORT}, 3 s down, 4 s between faults, "
        "100 events/s, trainer batches of 48",
    )
    p.add_argument("--faults", help=f"comma-separated schedule (default: {FULL})")
    p.add_argument("--rate", type=float, default=200, help="feedback events per second")
    p.add_argument("--batch", type=int, default=20, help="events per POST")
    p.add_argument("--concurrency", type=int, default=16, help="batches in flight at most")
    p.add_argument("--complete-rate", type=float, default=4, help="completions per second")
    p.add_argument("--down", type=float, default=5, help="seconds a killed process stays down")
    p.add_argument("--slow", type=float, default=15, help="seconds of a stopped dependency")
    p.add_argument("--gap", type=float, default=10, help="seconds of plain load between faults")
    p.add_argument(
        "--trainer-batch",
        type=int,
        default=160,
        help="TABLOOP_TRAINER_BATCH_SIZE (the sim profile's is 160)",
    )
    p.add_argument(
        "--until-trained",
        type=float,
        default=90,
        metavar="S",
        help="after the faults, keep the load on up to S seconds until the trainer "
        "has used some rewards",
    )
    p.add_argument("--json", type=Path, help="write the figures and checks here")
    p.add_argument("--keep", type=Path, help="keep the logs in this directory")
    args = p.parse_args(argv)
    if args.short:
        args.faults = args.faults or SHORT
        args.down, args.gap, args.rate = 3, 4, min(args.rate, 100)
        args.trainer_batch = min(args.trainer_batch, 48)  # so that a candidate is trained
    names = (args.faults or FULL).split(",")

    work = Path(tempfile.mkdtemp(prefix="tabloop-faults-"))
    cluster = Cluster(work, TABLOOP_TRAINER_BATCH_SIZE=str(args.trainer_batch))
    plugins = plugin.Plugins()
    try:
        cluster.start()
        faults = Faults(cluster, plugins, args)
        print(
            f"service on {cluster.url}; logs in {cluster.logs}; faults: {', '.join(names)}",
            flush=True,
        )
        stop_rss = threading.Event()
        sampler = threading.Thread(target=faults.sample_rss, args=(stop_rss,), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        asyncio.run(_load(cluster, plugins, faults, names, args))
        elapsed = time.monotonic() - t0
        drained = wait_for(lambda: faults.backlog() == 0, 180)
        print(
            f"  outbox drained {drained if drained is None else round(drained, 1)} s after "
            f"the load stopped",
            flush=True,
        )
        fresh = wait_for(
            lambda: (
                float(
                    faults.query(
                        "SELECT extract(epoch FROM now() - heartbeat_at) FROM trainer_state"
                    )
                )
                < 5
            ),
            60,
        )
        print(
            f"  trainer heartbeat fresh {fresh if fresh is None else round(fresh, 1)} s after that",
            flush=True,
        )
        heartbeat_fresh = fresh is not None
        stop_rss.set()
        crashed = cluster.exited()
        running = cluster.pid("train") is not None
        cluster.procs["train"].stop()  # SIGTERM: it finishes the update in hand, then stops
        v = verify(cluster, plugins)
        v["trainer_running"] = running
        v["crashed_at_end"] = crashed
        rows = fault_rows(faults.done, plugins.answers, faults.rss)
        v["heartbeat_fresh"] = heartbeat_fresh
        report(rows, v, args, elapsed)
        bad = failures(v, plugins.answers) + [f"{a} exited by itself" for a in crashed]
        if not heartbeat_fresh:
            bad.append("no fresh trainer heartbeat within 60 s of the end")
        bad += [f"{f.name}: {a} exited by itself" for f in faults.done for a in f.crashed]
        bad += [
            f"{f.name}: not recovered in {RECOVERY_LIMIT_S:.0f} s"
            for f in faults.done
            if f.recovered_s is None
        ]
        print("\nchecks: " + ("all passed" if not bad else "FAILED: " + "; ".join(map(str, bad))))
        if args.json:
            no_retry = sum(
                1 for a in plugins.answers if a.status in (429, 503) and not a.retry_after
            )
            args.json.write_text(
                json.dumps(
                    {
                        "checks": v,
                        "faults": rows,
                        "failures": bad,
                        "no_retry_after": no_retry,
                        "schedule": [asdict(f) for f in faults.done],
                    },
                    indent=1,
                    default=str,
                )
            )
        return 1 if bad else 0
    finally:
        cluster.close()
        if args.keep:
            with contextlib.suppress(OSError):
                shutil.copytree(cluster.logs, args.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)


async def _load(
    cluster: Cluster,
    plugins: plugin.Plugins,
    faults: Faults,
    names: list[str],
    args: argparse.Namespace,
) -> None:
    stop = asyncio.Event()
    async with plugin.client(cluster.url, cluster.token, args.concurrency + 4) as client:
        load = [
            asyncio.create_task(
                plugin.events_loop(
                    client,
                    plugins,
                    rate=args.rate,
                    batch=args.batch,
                    concurrency=args.concurrency,
                    stop=stop,
                )
            ),
            asyncio.create_task(
                plugin.complete_loop(
                    client, plugins, rate=args.complete_rate, concurrency=2, stop=stop
                )
            ),
        ]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, faults.run, names)
        await asyncio.sleep(args.gap)
        # keep the load on until the trainer has used some rewards, so that "trained at most
        # once" is checked on real candidates
        await loop.run_in_executor(None, wait_for, faults.trained, args.until_trained, 1.0)
        stop.set()
        await asyncio.gather(*load)


if __name__ == "__main__":
    raise SystemExit(main())
