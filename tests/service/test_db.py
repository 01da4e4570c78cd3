"""tabloop.core.db: blob_transaction (a transaction whose PostgreSQL connection is not pooled after)
and StandbyLock (one active process per role, the others standing by)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from tabloop.core.db import StandbyLock, blob_transaction, make_engine

BLOB = b"\x00\x01" * 600_000  # a checkpoint-sized value: libpq's buffers grow to hold it


def test_blob_transaction_commits_rolls_back_and_closes_postgres_connections(
    settings_factory: Any,
) -> None:
    engine = make_engine(settings_factory())
    postgres = engine.dialect.name == "postgresql"
    table = sa.Table("blobs", sa.MetaData(), sa.Column("data", sa.LargeBinary))
    table.create(engine)
    try:
        with blob_transaction(engine) as conn:
            conn.execute(table.insert(), {"data": BLOB})
            used = conn.connection.dbapi_connection
        with pytest.raises(RuntimeError), blob_transaction(engine) as conn:
            conn.execute(table.insert(), {"data": b"rolled back"})
            raise RuntimeError("abort")
        with blob_transaction(engine) as conn:
            assert conn.execute(sa.select(table.c.data)).scalars().all() == [BLOB]
        # PostgreSQL: closed (psycopg's `closed`), SQLite: back in the pool as usual
        assert getattr(used, "closed", False) is postgres
        with engine.connect() as conn:  # an ordinary connection stays pooled and open
            pooled = conn.connection.dbapi_connection
            conn.execute(sa.select(table.c.data)).all()
        assert not getattr(pooled, "closed", False)
    finally:
        table.drop(engine)
        engine.dispose()


def _stopped_after(seconds: float) -> threading.Event:
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()
    return stop


def test_standby_lock_one_holder_then_takeover(settings_factory: Any) -> None:
    """PostgreSQL: a second holder waits until stopped; when the first one's connection dies (a
    SIGKILLed process) the standby takes over and the first one's check raises. SQLite (one
    process): always held."""
    settings = settings_factory()
    engines = [make_engine(settings), make_engine(settings)]
    a, b = (StandbyLock(e, 0x7AB1_7E57, "worker", poll_s=0.05) for e in engines)
    try:
        assert a.acquire(threading.Event())
        a.check()
        if engines[0].dialect.name != "postgresql":
            assert b.acquire(threading.Event())
            b.check()
            return
        assert not b.acquire(_stopped_after(0.3))  # waited as a standby, then stopped
        assert a.try_acquire() is True and b.try_acquire() is False  # one try, no waiting
        with pytest.raises(sa.exc.SQLAlchemyError):
            b.check()
        assert a._conn is not None
        pid = a._conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        a._conn.commit()
        with engines[1].connect() as conn:  # the holder's session ends, as when it is killed
            conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        assert b.acquire(_stopped_after(10.0))
        with pytest.raises(sa.exc.SQLAlchemyError):
            a.try_acquire()  # held on a dead connection: raises, as check() does
        with pytest.raises(sa.exc.SQLAlchemyError):
            a.check()
        assert not a.acquire(_stopped_after(0.3))
        b.release()
        assert a.acquire(_stopped_after(10.0))
    finally:
        a.release()
        b.release()
        for e in engines:
            e.dispose()
