"""A background thread that watches the database, the outbox backlog and the broker.

Ingestion reads its last view to shed load fast (503) instead of queueing on a dead dependency.
With TABLOOP_CODE_RETENTION_DAYS set, the monitor also runs the code retention job, in a thread
of its own (a pass can take a while; the checks here must not wait for it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import sqlalchemy as sa

from service.deps import Health
from service.metrics import OUTBOX_BACKLOG, OUTBOX_LAG
from tabloop.core.config import Settings
from tabloop.core.outbox import backlog
from tabloop.core.retention import RetentionJob

log = logging.getLogger(__name__)


def check_database(engine: sa.Engine, health: Health, *, backlog_limit: int | None) -> None:
    """Is the database there, and (full mode: `backlog_limit`, the admission limit) how far
    behind is the relay."""
    health.db_check_started = time.monotonic()  # a check that never returns is a stall
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
            if backlog_limit is not None:
                b = backlog(conn, count_from=backlog_limit)
                health.backlog_rows, health.backlog_age_s = b.rows, b.oldest_age_s
                OUTBOX_BACKLOG.set(b.rows)
                OUTBOX_LAG.set(b.oldest_age_s)
        if not health.db_ok:
            log.info("database reachable")
        health.db_ok = True
        health.detail.pop("database", None)
    except sa.exc.SQLAlchemyError as e:
        if health.db_ok:
            log.warning("database unreachable: %s", str(e).split("\n")[0])
        health.db_ok = False
        health.detail["database"] = type(e).__name__
    finally:
        health.db_check_started = None


class BrokerProbe:
    """Asks the broker for its topic list; keeps one admin client and rebuilds it after errors."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._admin: Any = None

    def ok(self) -> bool:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        try:
            if self._admin is None:
                self._admin = KafkaAdminClient(
                    bootstrap_servers=self.bootstrap,
                    client_id="tabloop-readyz",
                    request_timeout_ms=3000,
                )
            self._admin.list_topics()
            return True
        except (KafkaError, OSError, ValueError) as e:
            log.debug("broker probe failed: %s", e)
            self.close()
            return False

    def close(self) -> None:
        if self._admin is not None:
            try:
                self._admin.close()
            except Exception:  # closing a broken client; nothing left to save
                log.debug("closing admin client failed", exc_info=True)
            self._admin = None


class Monitor:
    def __init__(self, settings: Settings, engine: sa.Engine, health: Health) -> None:
        self.settings, self.engine, self.health = settings, engine, health
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tabloop-monitor", daemon=True)
        self._probe = (
            None if settings.embedded else BrokerProbe(settings.kafka_bootstrap_servers or "")
        )
        self._retention = (
            RetentionJob(settings, engine) if settings.code_retention_days is not None else None
        )

    def check_once(self) -> None:
        settings = self.settings
        limit = None if settings.embedded else settings.outbox_backlog_limit
        check_database(self.engine, self.health, backlog_limit=limit)

    def start(self) -> None:
        self.check_once()
        if self._probe is not None:
            self.health.broker_ok = self._probe.ok()
        self._thread.start()
        if self._retention is not None:
            self._retention.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.5):
            self.check_once()
            if self._probe is not None and tick % 4 == 0:
                was = self.health.broker_ok
                self.health.broker_ok = self._probe.ok()
                if was is not None and was != self.health.broker_ok:
                    log.warning(
                        "broker %s", "reachable" if self.health.broker_ok else "unreachable"
                    )
            tick += 1

    def stop(self) -> None:
        self._stop.set()
        if self._retention is not None:
            self._retention.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._probe is not None:
            self._probe.close()
