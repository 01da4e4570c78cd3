"""Full mode on this machine, as docker-compose.yml runs it, with handles to break every part.

PostgreSQL (tabloop/testing/postgres.PostgresServer, fast=False: fsync and synchronous_commit on),
a Tansu broker with durable S3 storage (tabloop/testing/kafka.KafkaBroker(durable=True): messages
and committed offsets survive a SIGKILL), then `tabloop serve`, `tabloop relay` and
`tabloop train` (with a deploy-scoped key), each in its own process group. Used by
benchmarks/faults.py and soak.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.ingest import Proc, clean_env, free_port, tabloop, wait_ready

ROOT = Path(__file__).resolve().parents[1]

DATABASE = "tabloop_faults"
APPS = ("serve", "relay", "train")


def rss_mib(pid: int | None) -> float:
    """Resident memory of one process in MiB (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Cluster:
    """PostgreSQL + durable Tansu + serve/relay/train; kill, pause and restart any of them."""

    def __init__(self, work: Path, **settings: str) -> None:
        self.work = work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.settings = settings
        self.procs: dict[str, Proc] = {}
        self.starts: dict[str, int] = {}  # app -> processes started so far (log file names)
        self.pg: Any = None
        self.broker: Any = None
        self.env: dict[str, str] = {}
        self.token = ""
        self._pg_dir: Path | None = None

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> Cluster:
        from tabloop.testing.kafka import KafkaBroker
        from tabloop.testing.postgres import PostgresServer

        # its own mkdtemp: the `postgres` OS user must be able to reach it (see PostgresServer)
        self._pg_dir = Path(tempfile.mkdtemp(prefix="tabloop-faults-pg-"))
        self.pg = PostgresServer(self._pg_dir, fast=False).start()
        self.broker = KafkaBroker(self.work / "kafka", durable=True).start()
        self.env = clean_env(
            TABLOOP_PROFILE="sim",
            TABLOOP_PORT=str(self.port),
            TABLOOP_DATA_DIR=str(self.work / "data"),
            TABLOOP_LOG_LEVEL="INFO",
            TABLOOP_RATE_LIMIT_PER_S="100000",
            TABLOOP_RATE_LIMIT_BURST="100000",
            TABLOOP_DATABASE_URL=self.pg.create_database(DATABASE),
            TABLOOP_KAFKA_BOOTSTRAP_SERVERS=self.broker.bootstrap,
            **self.settings,
        )
        tabloop("db", "upgrade", env=self.env)
        self.token = tabloop(
            "keys", "create", "--scope", "admin,ingest", "--name", "faults", env=self.env
        ).strip()
        trainer_key = tabloop(
            "keys", "create", "--scope", "deploy", "--name", "trainer", env=self.env
        ).strip()
        self.env_of = {
            "serve": self.env,
            "relay": {**self.env, "TABLOOP_METRICS_PORT": str(free_port())},
            "train": {
                **self.env,
                "TABLOOP_METRICS_PORT": str(free_port()),
                "TABLOOP_TRAINER_API_KEY": trainer_key,
                "TABLOOP_TRAINER_API_URL": self.url,
            },
        }
        self.spawn("serve")
        self.wait_ready()  # serve registers the base policy
        self.spawn("relay")
        self.spawn("train")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self, app: str) -> Proc:
        assert app in APPS, app
        self.starts[app] = self.starts.get(app, 0) + 1
        name = app if self.starts[app] == 1 else f"{app}-{self.starts[app]}"
        proc = Proc(name, [sys.executable, "-m", "tabloop.cli", app], self.env_of[app], self.logs)
        self.procs[app] = proc
        return proc

    def wait_ready(self, timeout_s: float = 120) -> None:
        wait_ready(self.port, "/readyz", self.procs["serve"], timeout_s)

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        if self.broker is not None:
            self.broker.close()
        if self.pg is not None:
            self.pg.close()
        if self._pg_dir is not None:
            shutil.rmtree(self._pg_dir, ignore_errors=True)

    # -- what to break -------------------------------------------------------------------

    def pid(self, app: str) -> int | None:
        proc = self.procs.get(app)
        return proc.pid if proc is not None and proc.popen.poll() is None else None

    def kill(self, app: str) -> None:
        """SIGKILL an app's whole process group (a crash: no shutdown handler runs)."""
        proc = self.procs[app]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait(10)

    def exited(self) -> list[str]:
        """Apps whose process ended without being killed here."""
        return [app for app, proc in self.procs.items() if proc.popen.poll() is not None]

    def pause(self, what: str, paused: bool) -> None:
        """SIGSTOP / SIGCONT PostgreSQL (postmaster and every backend) or the broker: a
        dependency that still accepts TCP connections but answers nothing."""
        if what == "broker":
            os.killpg(self.broker.pid, signal.SIGSTOP if paused else signal.SIGCONT)
        else:
            self.pg.pause(paused)

    def hold_connections(self) -> list[Any]:
        """Take every PostgreSQL connection slot and end the apps' sessions, again until none is
        left: from then on the apps can open no connection ("too many clients already")."""
        import psycopg

        held: list[Any] = []
        for _ in range(50):
            while True:
                try:
                    held.append(
                        psycopg.connect(self.pg.dsn(DATABASE), autocommit=True, connect_timeout=2)
                    )
                except psycopg.OperationalError:
                    break
            mine = [c.info.backend_pid for c in held]
            ended = (
                held[0]
                .execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> ALL(%s)",
                    (DATABASE, mine),
                )
                .fetchone()[0]
            )
            if not ended:
                break
            time.sleep(0.2)  # their slots free up as the backends exit
        return held

    def rss(self) -> dict[str, float]:
        return {app: rss_mib(self.pid(app)) for app in APPS}


def one(conn: Any, sql: str) -> tuple[Any, ...]:
    """The one row a query returns (an aggregate's); an error naming the query if none."""
    row = conn.execute(sql).fetchone()
    if row is None:
        raise RuntimeError(f"no row from {sql!r}")
    return tuple(row)


def wait_for(check: Any, timeout_s: float, interval_s: float = 0.25) -> float | None:
    """Seconds until `check()` is true (exceptions count as false); None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(Exception):
            if check():
                return time.monotonic() - t0
        time.sleep(interval_s)
    return None
