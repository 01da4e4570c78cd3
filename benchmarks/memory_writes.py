"""What the workspace memory costs each completion request in the database: writing the
request's document, and reading the previous one's end to tell a suggestion typed through.

    python -m benchmarks.memory_writes [--file PATH] [--writes 200]

On a fresh database of each kind (SQLite, as embedded; PostgreSQL, started by
tabloop.testing.postgres, migrated to head), one person's file (`--file`; default: the largest
of the standard library's held-out files) is written `--writes` times with the cursor moving a
character each time (tabloop.core.memory.remember, each in its own transaction, as a request
does), then read back as tabloop.core.memory.typed_through reads it. In PostgreSQL the write is
timed with the text compressed as migrated (lz4) and with PostgreSQL's default (pglz). Prints
the p50 of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import sqlalchemy as sa

from tabloop.core.config import Settings
from tabloop.core.corpus import corpus_files, read_text
from tabloop.core.db import make_engine, upgrade
from tabloop.core.memory import remember, typed_through
from tabloop.core.tables import rollouts, utcnow


def p50_ms(run: Callable[[int], object], n: int) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(engine: sa.Engine, text: str, writes: int, label: str) -> None:
    sid = str(uuid.uuid4())
    with engine.begin() as conn:
        conn.execute(
            rollouts.insert().values(
                suggestion_id=sid,
                user_id="u",
                policy_version=1,
                context_token_ids=[],
                heal_text="",
                token_ids=[],
                token_logprobs=[],
                text="x = 1",
                text_chars=5,
                shown=True,
                gate_prob_show=0.5,
                decision_logprob=0.0,
                logprob_total=0.0,
                temperature=0.7,
                top_p=0.95,
                stop_reason="newline",
                latency_ms=1.0,
                created_at=utcnow(),
            )
        )

    def write(i: int) -> None:
        with engine.begin() as conn:
            prefix = text[: len(text) - writes + i]
            remember(
                conn,
                workspace="w",
                scope=None,
                user_id="u",
                document="f.py",
                prefix=prefix,
                suffix=text[len(prefix) :],
                suggestion_id=sid,
            )

    def read(_: int) -> None:
        with engine.connect() as conn:
            typed_through(
                conn,
                workspace="w",
                scope=None,
                user_id="u",
                document="f.py",
                prefix=text + "y",
                api_key_id=None,
            )

    print(f"{label}: write p50 {p50_ms(write, writes):.2f} ms", flush=True)
    print(f"{label}: typed-through read p50 {p50_ms(read, writes):.2f} ms", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", type=Path, help="the document (default: the largest held-out file)")
    ap.add_argument("--writes", type=int, default=200)
    args = ap.parse_args(argv)
    path = args.file or max(corpus_files("heldout"), key=lambda p: p.stat().st_size)
    text = read_text(path).replace("\x00", "")
    print(f"{path.name}: {len(text):,} characters")

    with tempfile.TemporaryDirectory() as tmp:
        sqlite = Settings.model_validate({"data_dir": Path(tmp) / "sqlite"})
        upgrade(sqlite)
        engine = make_engine(sqlite)
        measure(engine, text, args.writes, "SQLite")
        engine.dispose()

        from tabloop.testing.postgres import PostgresServer

        pg_dir = Path(tempfile.mkdtemp(prefix="tabloop-memory-writes-pg-"))  # postgres reaches it
        with PostgresServer(pg_dir).start() as pg:
            for method in ("lz4", "pglz"):
                full = Settings.model_validate(
                    {
                        "database_url": pg.create_database(f"writes_{method}"),
                        "kafka_bootstrap_servers": "127.0.0.1:1",  # never reached: no broker
                        "data_dir": Path(tmp) / method,
                    }
                )
                upgrade(full)
                engine = make_engine(full)
                with engine.begin() as conn:
                    conn.exec_driver_sql(
                        f"ALTER TABLE workspace_code ALTER COLUMN text SET COMPRESSION {method}"
                    )
                measure(engine, text, args.writes, f"PostgreSQL, {method}")
                engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
