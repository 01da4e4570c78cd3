"""Fixtures the trainer's tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine, upgrade
from tests.service.conftest import make_settings


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    """A migrated embedded (SQLite) database of the service's test settings."""
    settings = make_settings(tmp_path)
    upgrade(settings)
    e = make_engine(settings)
    yield e
    e.dispose()
