"""Who this trainer process is among the members of a consumer group, and whether it leads.

In full mode every `tabloop train` process joins the consumer group (`Membership.open`): it
joins the rollouts of its partitions, and a partition taken from it is dropped from its join
while the pending rollouts of one it is given are read back from the database. One member
leads, the one holding the trainer lock (a PostgreSQL advisory lock): it trains, judges canaries
and deploys; another takes over within a heartbeat when the leader's database connection goes.
Each member keeps a row in `trainer_state` (its partitions, its join, whether it leads). On
SQLite (embedded mode) the one process always leads.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tabloop.core.config import Settings
from tabloop.core.db import StandbyLock
from tabloop.core.status import TrainerStatus
from tabloop.core.stream.consumer import KafkaLogConsumer, LogConsumer, partition_of
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
from tabloop.core.tables import TRAINER_MEMBER_PREFIX as MEMBER_PREFIX
from tabloop.core.tables import trainer_state, utcnow
from trainer.join import Join

log = logging.getLogger(__name__)

TRAINER_LOCK_ID = 0x7AB1_00B1  # pg_advisory_lock key held by the active trainer (relay: ...B0)


class Membership:
    def __init__(
        self, settings: Settings, engine: sa.Engine, group: str, state: TrainerStatus
    ) -> None:
        self.settings, self.engine, self.group, self.state = settings, engine, group, state
        self.lock = StandbyLock(engine, TRAINER_LOCK_ID, "trainer")
        self._leading = False
        self._following = False  # said that another member leads
        self.partitions: set[int] = set()  # the rollout partitions this member joins (Kafka)
        self.member = f"{socket.gethostname()}:{os.getpid()}"

    def open(self, join: Join) -> LogConsumer:
        """Join the consumer group: partitions taken from this member are dropped from its
        join, and the pending rollouts of those it is given are read back from the database."""
        consumer: KafkaLogConsumer | None = None
        self.partitions = set()

        def owner(tps: set[tuple[str, int]]) -> Callable[[str], bool]:
            assert consumer is not None
            parts = {p for t, p in tps if t == ROLLOUTS}
            n = consumer.partitions(ROLLOUTS)
            return lambda user_id: partition_of(user_id, n) in parts

        def revoked(tps: set[tuple[str, int]]) -> None:
            dropped = join.drop(owner(tps)) if tps else 0
            self.partitions -= {p for t, p in tps if t == ROLLOUTS}
            log.info("partitions revoked: %d pending rollouts handed over", dropped)

        def assigned(tps: set[tuple[str, int]]) -> None:
            recovered = join.recover(owner(tps)) if tps else 0
            self.partitions |= {p for t, p in tps if t == ROLLOUTS}
            log.info(
                "partitions %s assigned: %d rollouts pending from the database",
                sorted(self.partitions),
                recovered,
            )

        consumer = KafkaLogConsumer(
            self.settings, self.group, [ROLLOUTS, FEEDBACK], revoked, assigned
        )
        return consumer

    @property
    def leading(self) -> bool:
        """Whether this process trains, judges canaries and deploys: the one holding the
        trainer lock (always, on SQLite). Other members only join; one of them takes over
        within a heartbeat when the leader's database connection goes."""
        if self.settings.embedded:
            return True
        return self._leading

    def lead(self) -> None:
        """Take the trainer lock if it is free (one attempt); a leader whose lock connection
        died raises (SQLAlchemyError) and restarts its round, as a standby would take over."""
        was = self._leading
        try:
            self._leading = self.lock.try_acquire()
        except sa.exc.SQLAlchemyError:
            self._leading = False
            raise
        if self._leading and not was:
            log.info("this member (%s) now leads: it trains and deploys", self.member)
            self.state.state = "collecting"
        elif not self._leading and not self._following:
            log.info("another trainer leads; this member (%s) joins its partitions", self.member)
        self._following = not self._leading

    def write_row(self, conn: sa.Connection, joined: dict[str, Any], now: datetime) -> None:
        """This member's row: its join's figures, its partitions, whether it leads."""
        member = {**joined, "partitions": sorted(self.partitions), "leader": self.leading}
        upsert_state(conn, MEMBER_PREFIX + self.member, heartbeat_at=now, info=member)

    def leave(self) -> None:
        """A clean stop: this member's row goes (a killed member's row goes stale instead)."""
        if self.settings.embedded:
            return
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    trainer_state.delete().where(
                        trainer_state.c.name == MEMBER_PREFIX + self.member
                    )
                )
        except sa.exc.SQLAlchemyError as e:
            log.warning("could not remove this member's row: %s", str(e).split("\n")[0])


def upsert_state(conn: sa.Connection, name: str, **values: Any) -> None:
    """Write a trainer_state row's heartbeat and info (the paused flag is the operator's)."""
    now = utcnow()
    updated = conn.execute(
        trainer_state.update().where(trainer_state.c.name == name).values(**values, updated_at=now)
    )
    if updated.rowcount == 0:
        conn.execute(trainer_state.insert().values(name=name, **values, updated_at=now))
