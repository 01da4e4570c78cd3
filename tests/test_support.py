"""Tests of the test infrastructure itself (tabloop/testing/, tests/conftest.py)."""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from tabloop.testing.kafka import (
    KafkaBroker,
    committed_offsets,
    consume_all,
    create_topics,
    kafka_ready,
)
from tabloop.testing.postgres import PostgresServer
from tabloop.testing.procs import free_port

# consumer-group settings for Tansu: it holds a JoinGroup for half the session
GROUP_KW = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _produce(bootstrap: str, topic: str, values: list[bytes], partitions: int) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        futures = [
            producer.send(topic, value=v, partition=i % partitions) for i, v in enumerate(values)
        ]
        for f in futures:
            assert f.get(timeout=10).offset >= 0
    finally:
        producer.close()


# ------------------------------------------------------------------ PostgreSQL


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_pg_url_is_a_fresh_empty_database(pg_url: str, postgres_server: PostgresServer) -> None:
    assert pg_url.startswith(f"postgresql+psycopg://postgres@127.0.0.1:{postgres_server.port}/t_")
    with psycopg.connect(_libpq(pg_url), autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ).fetchone() == (0,)
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO t VALUES (1, 'é')")
        assert conn.execute("SELECT upper(v) FROM t").fetchone() == ("É",)
        assert conn.execute("SHOW max_connections").fetchone() == ("200",)
        assert conn.execute("SHOW fsync").fetchone() == ("off",)


def test_pg_databases_are_isolated_and_dropped(postgres_server: PostgresServer) -> None:
    name = _unique("t_iso")
    url = postgres_server.create_database(name)
    with psycopg.connect(_libpq(url)) as conn:  # left open: drop must force it closed
        conn.execute("CREATE TABLE only_here (x int)")
        conn.commit()
        postgres_server.drop_database(name)
    with postgres_server.connect() as conn:
        assert (
            conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None
        )


@pytest.mark.integration  # starts its own PostgreSQL
def test_postgres_restart_and_crash_keep_committed_data() -> None:
    base = Path(tempfile.mkdtemp(prefix="tabloop-pgtest-"))  # reachable for the postgres user
    try:
        _pg_restart_and_crash(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _pg_restart_and_crash(base: Path) -> None:
    with PostgresServer(base, fast=False) as pg:  # durable settings: fsync on
        url = pg.create_database("app")
        with psycopg.connect(_libpq(url), autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int)")
            conn.execute("INSERT INTO t SELECT generate_series(1, 100)")
        port = pg.port
        pg.restart()
        assert pg.port == port and pg.is_running
        with psycopg.connect(_libpq(url), autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (100,)
            conn.execute("INSERT INTO t VALUES (101)")
        pg.kill()  # crash: start() runs recovery
        assert not pg.is_running
        pg.start()
        with psycopg.connect(_libpq(url)) as conn:
            assert conn.execute("SELECT count(*) FROM t").fetchone() == (101,)
    assert not pg.is_running


# ----------------------------------------------------------------------- Kafka


def test_broker_produce_acks_all_and_consume(kafka_broker: KafkaBroker) -> None:
    assert kafka_ready(kafka_broker.bootstrap)[0]
    topic = _unique("t")
    create_topics(kafka_broker.bootstrap, [topic], partitions=3)
    create_topics(kafka_broker.bootstrap, [topic], partitions=3)  # already exists: ignored
    values = [f"m{i}".encode() for i in range(30)]
    _produce(kafka_broker.bootstrap, topic, values, partitions=3)
    records = consume_all(kafka_broker.bootstrap, topic, timeout_s=10)
    assert sorted(r.value for r in records) == sorted(values)
    assert {r.partition for r in records} == {0, 1, 2}


def test_consume_all_of_empty_topic(kafka_broker: KafkaBroker) -> None:
    topic = _unique("empty")
    create_topics(kafka_broker.bootstrap, topic, partitions=2)
    assert consume_all(kafka_broker.bootstrap, topic, timeout_s=10) == []


def test_durable_broker_keeps_messages_across_kill(durable_kafka: KafkaBroker) -> None:
    topic = _unique("dur")
    create_topics(durable_kafka.bootstrap, [topic], partitions=3)
    values = [f"m{i}".encode() for i in range(300)]
    _produce(durable_kafka.bootstrap, topic, values, partitions=3)
    bootstrap = durable_kafka.bootstrap
    pid = durable_kafka.pid
    durable_kafka.kill()
    assert not durable_kafka.is_running
    assert not kafka_ready(bootstrap, timeout_s=0.5)[0]
    durable_kafka.restart()
    assert durable_kafka.bootstrap == bootstrap and durable_kafka.pid != pid
    records = consume_all(durable_kafka.bootstrap, topic, timeout_s=15)
    assert sorted(r.value for r in records) == sorted(values)


def test_group_commit_survives_broker_restart(durable_kafka: KafkaBroker) -> None:
    bs = durable_kafka.bootstrap
    topic, group = _unique("grp"), _unique("g")
    create_topics(bs, [topic], partitions=2)
    _produce(bs, topic, [f"old{i}".encode() for i in range(20)], partitions=2)

    consumer = KafkaConsumer(
        bootstrap_servers=bs,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **GROUP_KW,
    )
    consumer.subscribe([topic])
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(got) < 20 and time.monotonic() < deadline:
        for rs in consumer.poll(timeout_ms=200).values():
            got.extend(r.value for r in rs)
    assert len(got) == 20
    consumer.commit()
    consumer.close()
    assert sum(committed_offsets(bs, group).values()) == 20

    durable_kafka.kill()
    durable_kafka.restart()

    assert committed_offsets(bs, group) == {
        TopicPartition(topic, 0): 10,
        TopicPartition(topic, 1): 10,
    }
    _produce(bs, topic, [f"new{i}".encode() for i in range(4)], partitions=2)
    consumer = KafkaConsumer(
        bootstrap_servers=bs,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **GROUP_KW,
    )
    consumer.subscribe([topic])
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 4 and time.monotonic() < deadline:
        for rs in consumer.poll(timeout_ms=200).values():
            got.extend(r.value for r in rs)
    consumer.poll(timeout_ms=300)  # nothing more (no redelivery of committed messages)
    consumer.close()
    assert sorted(got) == sorted(f"new{i}".encode() for i in range(4))


@pytest.mark.integration  # starts its own broker and SeaweedFS
def test_broker_close_leaves_no_processes(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path / "k", durable=True).start()
    pids = [broker._broker.pid, broker._weed.pid]  # type: ignore[union-attr]
    ports = list(broker._weed_ports.values())
    broker.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            _signal0(pid)
    leftover = [
        s
        for s in Path("/tmp").glob("seaweedfs-*.sock")
        if any(s.name.endswith(f"-{p}.sock") for p in ports)
    ]
    assert leftover == []
    assert not (tmp_path / "k" / "s3").exists()
    assert (tmp_path / "k" / "tansu.log").exists()


def _signal0(pid: int) -> None:
    """os.kill(pid, 0), treating a zombie (exited, not reaped) as gone."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                raise ProcessLookupError(pid)
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    os.kill(pid, 0)
