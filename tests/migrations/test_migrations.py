"""The Alembic history works on both databases and matches the tables the code uses."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tabloop.core.config import Settings
from tabloop.core.db import alembic_config, make_engine, upgrade
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.tables import metadata, reward_specs


@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    if request.param == "sqlite":
        return Settings(data_dir=tmp_path)
    pg_url = request.getfixturevalue("pg_url")
    broker = request.getfixturevalue("kafka_broker")
    return Settings(
        data_dir=tmp_path, database_url=pg_url, kafka_bootstrap_servers=broker.bootstrap
    )


def test_upgrade_downgrade_upgrade(db_settings: Settings) -> None:
    upgrade(db_settings)
    cfg = alembic_config(db_settings.db_url)
    command.downgrade(cfg, "base")
    engine = make_engine(db_settings)
    assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade(db_settings)
    upgrade(db_settings)  # idempotent


def test_migrations_match_the_tables(db_settings: Settings) -> None:
    upgrade(db_settings)
    engine = make_engine(db_settings)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    engine.dispose()
    assert diff == [], f"tables and migrations disagree: {diff}"


def test_a_spec_stored_before_the_typed_through_penalty_keeps_its_rewards(
    db_settings: Settings,
) -> None:
    cfg = alembic_config(db_settings.db_url)
    command.upgrade(cfg, "0012")
    engine = make_engine(db_settings)
    old = {k: v for k, v in RewardSpec().to_dict().items() if k != "typed_through_penalty"}
    with engine.begin() as conn:
        conn.execute(
            reward_specs.insert().values(version=1, spec=old, created_at=dt.datetime.now(dt.UTC))
        )
    upgrade(db_settings)
    with engine.connect() as conn:
        stored = conn.execute(sa.select(reward_specs.c.spec)).scalar_one()
    # a typed-through suggestion earned 0 under it, and still does; the new default is not 0
    assert RewardSpec.from_dict(stored).typed_through_penalty == 0.0
    assert RewardSpec().typed_through_penalty > 0
    command.downgrade(cfg, "0012")
    with engine.connect() as conn:
        assert conn.execute(sa.select(reward_specs.c.spec)).scalar_one() == old
    engine.dispose()
