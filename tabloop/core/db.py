"""Engine creation, migrations and the standby lock, for SQLite (embedded) and PostgreSQL (full
mode)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

import orjson
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from tabloop.core.config import Settings

log = logging.getLogger(__name__)

# a result row of any columns (sa.Row is generic over the columns' types)
AnyRow: TypeAlias = sa.Row[*tuple[Any, ...]]

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def _json_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def json_array(items: list[str] | list[int]) -> str:
    """The value of a `json_rows` parameter (UTF-8 text as it is: no escapes that a database in
    another encoding could not read back)."""
    return orjson.dumps(items).decode()


def json_rows(dialect: str, name: str) -> Any:
    """The bound parameter `name`, a JSON array of strings (`json_array(ids)`), as a one-column
    table (`.c.value`), in `dialect`. A statement that reads ids this way instead of through
    `IN (...)` has the same text for any number of them: built once, it is compiled once and
    prepared by the database, and it knows no bound-parameter limit."""
    array = sa.bindparam(name, type_=sa.Text)
    if dialect == "postgresql":
        return sa.func.json_array_elements_text(sa.cast(array, sa.JSON)).table_valued("value")
    return sa.func.json_each(array).table_valued("value")


def make_engine(settings: Settings) -> sa.Engine:
    """One engine per process; SQLite gets WAL and a busy timeout, PostgreSQL short timeouts."""
    url = settings.db_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(
            url,
            hide_parameters=True,  # an error's message never carries the values (code text)
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
            # what a purge deletes or code retention blanks is zeroed in the file, not left in
            # free space (docs/PRIVACY.md)
            cur.execute("PRAGMA secure_delete=ON")
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
        hide_parameters=True,  # an error's message never carries the values (code text)
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


class StandbyLock:
    """One active process per database for a role (the relay, the trainer); extra replicas
    wait as standbys and the first to see the lock free takes over.

    A PostgreSQL session advisory lock on a connection of its own, outside the pool: it is held
    as long as that connection lives, so a crashed or SIGKILLed holder releases it at once.
    Other databases (SQLite: embedded mode, one process) always hold it.
    """

    def __init__(self, engine: sa.Engine, key: int, role: str, poll_s: float = 2.0) -> None:
        self.engine, self.key, self.role, self.poll_s = engine, key, role, poll_s
        self._conn: sa.Connection | None = None
        self._held = False

    def acquire(self, stop: threading.Event) -> bool:
        """Wait until this process holds the lock (True), or until `stop` (False). When it is
        already held this checks that its connection is still alive (a dead one is dropped and
        the lock waited for again: another replica may have taken over meanwhile)."""
        if self.engine.dialect.name != "postgresql":
            return True
        waiting = False
        while not stop.is_set():
            try:
                if self._held:
                    self.check()  # a dead connection raises (and is dropped): wait again
                    return True
                if self._attempt():
                    if waiting:
                        log.info(
                            "%s lock acquired: this %s is now the active one", self.role, self.role
                        )
                    return True
                if not waiting:
                    log.info("another %s is active; standing by", self.role)
                    waiting = True
            except sa.exc.SQLAlchemyError as e:
                log.warning("%s lock: database unavailable (%s)", self.role, str(e).split("\n")[0])
                self.release()
            stop.wait(self.poll_s)
        return False

    def try_acquire(self) -> bool:
        """One attempt, without waiting: True if this process holds the lock now (it checks a
        lock already held, raising if its connection died), False if another one does."""
        if self.engine.dialect.name != "postgresql":
            return True
        if self._held:
            self.check()
            return True
        try:
            return self._attempt()
        except sa.exc.SQLAlchemyError:
            self.release()
            raise

    def _attempt(self) -> bool:
        """One pg_try_advisory_lock on the lock's own connection (opened if needed)."""
        if self._conn is None:
            self._conn = self.engine.connect()
        self._held = bool(
            self._conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar()
        )
        self._conn.commit()
        return self._held

    def check(self) -> None:
        """Raise (an SQLAlchemyError) unless the lock is still held: a holder that lost its
        connection must stop acting, since a standby may already have taken over."""
        if self.engine.dialect.name != "postgresql":
            return
        if self._conn is None or not self._held:
            raise sa.exc.InvalidRequestError(f"the {self.role} lock is not held")
        try:
            self._conn.execute(sa.text("SELECT 1"))
            self._conn.commit()
        except sa.exc.SQLAlchemyError:
            self.release()
            raise

    def release(self) -> None:
        """Close the lock's connection (which releases the lock); safe to call twice."""
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except sa.exc.SQLAlchemyError:
                log.debug("closing the %s lock connection failed", self.role, exc_info=True)
        self._conn, self._held = None, False


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
