"""Soak: full mode for `--minutes` at 70% of the measured peak ingest rate, plus completions.

    python benchmarks/soak.py [--minutes 10] [--rate EVENTS_PER_S] [--complete-rate 4]

The services of benchmarks/cluster.py (PostgreSQL fsync on, durable Tansu, `tabloop serve`,
`relay`, `train`, TABLOOP_PROFILE=sim, per-key rate limit lifted), on loopback. Unless `--rate`
is given, the peak is measured first: `--peak-s` seconds of 100-event batches posted back to back
on `--connections` connections (benchmarks/loadgen.closed_loop), then the relay's drain of what
they left (see peak_rate: the rate the API and relay sustain together). Then batches start on a
fixed schedule at 70% of it (loadgen.open_loop: latency counted from the scheduled start, so a
stalling server cannot hide its queue) while completions run at `--complete-rate`. Every
`--every` seconds one line: events/s accepted, batch p50/p99, completions and their p50/p99,
answers other than 200/202, the outbox backlog, and the RSS of each process. Exit status 1 if
any answer was an error (no 429 is expected: the limit is lifted) or the outbox did not drain.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks import plugin
from benchmarks.cluster import DATABASE, Cluster, one, rss_mib, wait_for
from benchmarks.ingest import machine
from benchmarks.loadgen import BATCH, closed_loop, open_loop

ROOT = Path(__file__).resolve().parents[1]


def backlog(cluster: Cluster) -> int:
    import psycopg

    with psycopg.connect(cluster.pg.dsn(DATABASE), connect_timeout=2, autocommit=True) as conn:
        return int(one(conn, "SELECT count(*) FROM outbox WHERE published_at IS NULL")[0])


def peak_rate(cluster: Cluster, args: argparse.Namespace) -> float:
    """Events/s the whole pipeline sustains on this machine. The API's peak A is measured back to
    back; the relay's D by timing how fast it drains the backlog that left, alone. Both use the
    same CPUs, so the pipeline holds X with X/A + X/D = 1 (more would grow the outbox until the
    API sheds load with 503s)."""
    peak = asyncio.run(
        closed_loop(cluster.port, cluster.token, args.connections, args.peak_s, 10**9, 0)
    )
    waiting0, t0 = backlog(cluster), time.monotonic()
    wait_for(lambda: backlog(cluster) == 0, 600)
    drain = waiting0 / (time.monotonic() - t0)
    sustained = 1 / (1 / peak.rate + 1 / drain)
    print(
        f"peak: API {peak.rate:,.0f} events/s (p50 {peak.pct(0.5):.0f} ms, p99 "
        f"{peak.pct(0.99):.0f} ms, other answers {peak.statuses or '-'}); relay alone "
        f"{drain:,.0f} rows/s ({waiting0:,} rows); pipeline {sustained:,.0f} events/s",
        flush=True,
    )
    return sustained


async def soak(cluster: Cluster, args: argparse.Namespace, rate: float) -> Counter[str]:
    plugins = plugin.Plugins()
    stop = asyncio.Event()
    errors: Counter[str] = Counter()
    head = (
        f"{'t s':>5}{'events/s':>10}{'p50 ms':>8}{'p99 ms':>8}{'cmpl':>6}{'p50 ms':>8}"
        f"{'p99 ms':>8}{'backlog':>9}  RSS MiB serve/relay/train/broker  errors"
    )
    print(head)
    print("-" * len(head), flush=True)
    async with plugin.client(cluster.url, cluster.token, 4) as client:
        completions = asyncio.create_task(
            plugin.complete_loop(client, plugins, rate=args.complete_rate, concurrency=2, stop=stop)
        )
        t0 = time.monotonic()
        seed = 100
        while time.monotonic() - t0 < args.minutes * 60:
            seen = len(plugins.answers)
            seed += 1
            s = await open_loop(
                cluster.port, cluster.token, args.connections, rate / BATCH, args.every, 10**9, seed
            )
            comp = plugins.answers[seen:]
            rss = "/".join(
                f"{mib:.0f}" for mib in [*cluster.rss().values(), rss_mib(cluster.broker.pid)]
            )
            bad = Counter({**s.statuses, **Counter(str(a.status) for a in comp if a.status != 200)})
            errors.update(bad)
            ok = [a.seconds * 1000 for a in comp if a.status == 200]
            print(
                f"{time.monotonic() - t0:>5.0f}{s.rate:>10,.0f}{s.pct(0.5):>8.1f}"
                f"{s.pct(0.99):>8.1f}{len(ok):>6}{plugin.percentile(ok, 0.5):>8.1f}"
                f"{plugin.percentile(ok, 0.99):>8.1f}{backlog(cluster):>9}  {rss:<30}  "
                f"{dict(bad) or '-'}",
                flush=True,
            )
        stop.set()
        await completions
    return errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--rate", type=float, help="events/s to hold (default: 70%% of the peak)")
    p.add_argument("--peak-s", type=float, default=15, help="seconds of the peak measurement")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--complete-rate", type=float, default=4, help="completions per second")
    p.add_argument("--every", type=float, default=30, help="seconds per report line")
    p.add_argument("--keep", type=Path, help="keep the service logs in this directory")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tabloop-soak-"))
    cluster = Cluster(work)
    try:
        cluster.start()
        print(f"machine: {machine()}; service on {cluster.url}, logs in {cluster.logs}", flush=True)
        rate = args.rate
        if rate is None:
            rate = 0.7 * peak_rate(cluster, args)
        print(
            f"holding {rate:,.0f} events/s and {args.complete_rate:g} completions/s for "
            f"{args.minutes:g} min",
            flush=True,
        )
        errors = asyncio.run(soak(cluster, args, rate))
        drained = wait_for(lambda: backlog(cluster) == 0, 180)
        exited = cluster.exited()
        print(
            f"\nerrors: {dict(errors) or 'none'}; outbox drained "
            f"{'no' if drained is None else f'{drained:.1f} s'} after the load; "
            f"processes exited: {exited or 'none'}"
        )
        return 1 if errors or drained is None or exited else 0
    finally:
        cluster.close()
        if args.keep:
            shutil.copytree(cluster.logs, args.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
