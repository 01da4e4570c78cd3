"""The reward join's throughput with 1 and more consumer-group members.

    python benchmarks/join.py [--rollouts 20000] [--members 1 2]

For each member count, on a fresh PostgreSQL database (fsync on) and a Tansu broker: start that
many `tabloop train` processes (one consumer group, 6 partitions, no deployment, so they only
join), wait until they share the partitions, then store --rollouts rollouts of 200 people and
an accept for a third of the shown ones, and publish them on the topics as the relay would.
The rollouts are dated an hour back, so each reward is final as soon as its records are read:
the figure is how fast the members read, join and write rewards, not the reward windows.
Prints records (rollouts + events) per second from the first record published to the last
reward written.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks.ingest import Proc, clean_env, tabloop
from tabloop.core.config import load_settings
from tabloop.core.db import make_engine
from tabloop.core.stream.kafka import ensure_topics, make_producer
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS, encode
from tabloop.core.tables import TRAINER_MEMBER_PREFIX, events, rewards, rollouts, trainer_state
from tabloop.testing.factories import rollout_row

ROOT = Path(__file__).resolve().parents[1]

PARTITIONS = 6
PEOPLE = 200


def records(n: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """n rollouts an hour old (half shown) and an accept for a third of the shown ones."""
    rng = random.Random(seed)
    at = datetime.now(UTC) - timedelta(hours=1)
    made: list[dict[str, Any]] = []
    accepts: list[dict[str, Any]] = []
    for i in range(n):
        shown = rng.random() < 0.5
        text = "return x" if shown else ""
        made.append(
            rollout_row(
                user_id=f"user-{rng.randrange(PEOPLE)}",
                created_at=at + timedelta(milliseconds=i),
                text=text,
                text_chars=len(text),
                shown=shown,
            )
        )
        if shown and rng.random() < 0.34:
            occurred = at + timedelta(milliseconds=i, seconds=1)
            event = {
                "event_id": str(uuid.uuid4()),
                "type": "accept",
                "user_id": made[-1]["user_id"],
                "suggestion_id": made[-1]["suggestion_id"],
                "accepted_chars": len(text),
                "occurred_at": occurred.isoformat(),
            }
            accepts.append({**event, "occurred_at": occurred, "received_at": occurred})
            accepts[-1]["payload"] = event
    return made, accepts


def message(row: dict[str, Any]) -> bytes:
    return encode(
        {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}
    ).encode()


def members_settled(engine: sa.Engine, n: int) -> bool:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(trainer_state.c.info).where(
                trainer_state.c.name.startswith(TRAINER_MEMBER_PREFIX)
            )
        ).all()
    held = sorted(p for r in rows for p in (r.info or {}).get("partitions") or [])
    return len(rows) == n and held == list(range(PARTITIONS))


def run(pg: Any, broker: Any, work: Path, members: int, n: int, seed: int) -> float:
    name = f"join_{members}"
    url = pg.create_database(name)
    env = clean_env(
        TABLOOP_PROFILE="sim",
        TABLOOP_DATA_DIR=str(work / name),
        TABLOOP_DATABASE_URL=url,
        TABLOOP_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
        TABLOOP_KAFKA_TOPIC_PARTITIONS=str(PARTITIONS),
        TABLOOP_TRAINER_GROUP=f"bench-{name}-{uuid.uuid4().hex[:6]}",
        TABLOOP_TRAINER_API_KEY="unused: no deployment",
        TABLOOP_LOG_LEVEL="WARNING",
    )
    tabloop("db", "upgrade", env=env)
    settings = load_settings(
        database_url=url,
        kafka_bootstrap_servers=broker.bootstrap,
        kafka_topic_partitions=PARTITIONS,
        data_dir=work / name,
    )
    engine = make_engine(settings)
    procs = [
        Proc(f"{name}-{i}", [sys.executable, "-m", "tabloop.cli", "train"], env, work)
        for i in range(members)
    ]
    try:
        deadline = time.monotonic() + 120
        while not members_settled(engine, members):
            if time.monotonic() > deadline:
                raise SystemExit(f"{members} members did not share the partitions in 120 s")
            time.sleep(0.5)
        made, accepts = records(n, seed)
        with engine.begin() as conn:  # stored first, as the API does before the relay publishes
            conn.execute(rollouts.insert(), made)
            conn.execute(
                events.insert(),
                [{c.name: a[c.name] for c in events.c if c.name in a} for a in accepts],
            )
        producer = make_producer(settings)
        started = time.monotonic()
        for topic, rows in ((ROLLOUTS, made), (FEEDBACK, [a["payload"] for a in accepts])):
            for row in rows:
                producer.send(topic, key=row["user_id"].encode(), value=message(row))
        producer.flush()
        producer.close()
        while True:
            with engine.connect() as conn:
                done = conn.execute(sa.select(sa.func.count()).select_from(rewards)).scalar_one()
            if done >= n:
                break
            if time.monotonic() - started > 600:
                raise SystemExit(f"only {done} of {n} rewards after 600 s")
            time.sleep(0.1)
        seconds = time.monotonic() - started
    finally:
        for proc in procs:
            proc.stop()
        engine.dispose()
    rate = (n + len(accepts)) / seconds
    print(
        f"members={members}: {n} rollouts + {len(accepts)} events joined in {seconds:.1f} s: "
        f"{rate:,.0f} records/s",
        flush=True,
    )
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=20000)
    ap.add_argument("--members", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from tabloop.testing.kafka import KafkaBroker
    from tabloop.testing.postgres import PostgresServer

    work = Path(tempfile.mkdtemp(prefix="tabloop-join-"))
    pg_dir = Path(tempfile.mkdtemp(prefix="tabloop-join-pg-"))  # reachable by `postgres`
    pg = PostgresServer(pg_dir, fast=False).start()
    broker = KafkaBroker(work / "kafka", durable=False).start()
    try:
        ensure_topics(
            load_settings(
                kafka_bootstrap_servers=broker.bootstrap, kafka_topic_partitions=PARTITIONS
            )
        )
        for members in args.members:
            run(pg, broker, work, members, args.rollouts, args.seed)
    finally:
        broker.close()
        pg.close()
        shutil.rmtree(pg_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
