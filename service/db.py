"""Engine creation and migrations, for SQLite (embedded) and PostgreSQL (full mode)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from service.config import Settings

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _json_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def make_engine(settings: Settings) -> sa.Engine:
    """One engine per process; SQLite gets WAL and a busy timeout, PostgreSQL short timeouts."""
    url = settings.db_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            url,
            json_serializer=_json_dumps,
            json_deserializer=orjson.loads,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=settings.db_pool_size,
            pool_timeout=settings.db_pool_timeout_s,
        )

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        # pysqlite's own transaction handling defers BEGIN; take the write lock up front instead
        # so concurrent writers queue on busy_timeout rather than failing on lock upgrade.
        @sa.event.listens_for(engine, "connect")
        def _no_pysqlite_tx(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None

        @sa.event.listens_for(engine, "begin")
        def _begin(conn: sa.Connection) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return sa.create_engine(
        url,
        json_serializer=_json_dumps,
        json_deserializer=orjson.loads,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_pool_size,
        pool_timeout=settings.db_pool_timeout_s,
        pool_pre_ping=True,
        connect_args={"connect_timeout": settings.db_connect_timeout_s},
    )


@contextmanager
def blob_transaction(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A transaction for moving a checkpoint (megabytes), on a connection closed afterwards
    instead of going back to the pool.

    libpq keeps its input and output buffers at the largest message the connection has carried,
    for the connection's life: one 4.3 MB bytea read leaves ~8 MiB behind. Pooled, every
    connection that once carried a checkpoint would hold that much, and the process's RSS
    would step up at each new policy version until the whole pool had (docs/RELIABILITY.md).
    SQLite connections keep no such buffers and are pooled as usual.
    """
    with engine.connect() as conn:
        try:
            with conn.begin():
                yield conn
        finally:
            if conn.dialect.name == "postgresql":
                conn.invalidate()  # closes the DBAPI connection; the pool opens a fresh one


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(settings: Settings, revision: str = "head") -> None:
    """Run Alembic migrations to `revision` (idempotent)."""
    if settings.is_sqlite:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(settings.db_url), revision)
    log.info("database at revision %s", revision)
