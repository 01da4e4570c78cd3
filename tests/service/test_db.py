"""service.db.blob_transaction: a transaction whose PostgreSQL connection is not pooled after."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from service.db import blob_transaction, make_engine

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
