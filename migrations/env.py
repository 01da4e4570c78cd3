"""Alembic environment: the URL comes from the tabloop settings (via alembic_config)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from tabloop.core.tables import metadata

config = context.config


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url, "alembic_config() sets sqlalchemy.url from TABLOOP_DATABASE_URL"
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs go via copies
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `tabloop db upgrade`")
run_migrations_online()
