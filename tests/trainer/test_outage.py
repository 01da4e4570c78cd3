"""The trainer rides out a database restart: it logs, waits and resumes from what is durable
instead of ending the process (nothing restarts `tabloop train` in docker-compose.yml)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine, upgrade
from tabloop.core.registry import bootstrap
from tabloop.core.tables import trainer_state
from tabloop.testing.postgres import PostgresServer
from tests.service.conftest import make_settings
from trainer.client import ServiceClient
from trainer.loop import Trainer

pytestmark = pytest.mark.integration  # its own PostgreSQL


def heartbeat(engine: sa.Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(trainer_state.c.heartbeat_at)).scalar()


def wait_for(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except sa.exc.OperationalError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_trainer_keeps_running_through_a_database_restart(
    tmp_path: Path, kafka_broker: Any
) -> None:
    base = Path(tempfile.mkdtemp(prefix="tabloop-pg-outage-"))  # reachable by `postgres`
    pg = PostgresServer(base, fast=True).start()
    stop = threading.Event()
    try:
        settings = make_settings(
            tmp_path,
            pg_url=pg.create_database("outage"),
            bootstrap=kafka_broker.bootstrap,
            profile="sim",
            kafka_session_timeout_ms=3000,
        )
        upgrade(settings)
        engine = make_engine(settings)
        with engine.begin() as conn:
            bootstrap(conn, settings.base_checkpoint)
        trainer = Trainer(settings, make_engine(settings), ServiceClient("http://127.0.0.1:9", "x"))
        thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
        thread.start()
        wait_for(lambda: heartbeat(engine) is not None, 60, "the first heartbeat")
        pg.stop()
        time.sleep(3)  # the trainer meets the outage
        assert thread.is_alive()
        pg.start()
        restarted = heartbeat(engine)
        wait_for(lambda: heartbeat(engine) > restarted, 60, "a heartbeat after the restart")
        assert thread.is_alive()
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()
        engine.dispose()
    finally:
        stop.set()
        pg.close()
        shutil.rmtree(base, ignore_errors=True)
