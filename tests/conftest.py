"""Shared pytest fixtures."""

from __future__ import annotations

# ============================================================================
# Service fixtures: real PostgreSQL and a real Kafka-protocol broker.
# Test infrastructure (see tabloop/testing/ and scripts/test.sh); nothing is
# skipped: if a service cannot start, the fixture raises with the log tail.
#
#   postgres_server  session   PostgresServer (fsync off), one per test session
#   pg_url           function  SQLAlchemy URL of a fresh empty database t_<hex>,
#                              dropped after the test
#   kafka_broker     session   KafkaBroker, memory storage (create unique topics!)
#   durable_kafka    function  KafkaBroker with durable S3 storage (SeaweedFS),
#                              for kill()/restart() tests; closed after the test
#
# Import helpers from `tabloop.testing.procs`, `.postgres` and `.kafka` (pyproject:
# pythonpath = ["."], --import-mode=importlib).
# ============================================================================
import shutil
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.tokenizer import CodeTokenizer, train_tokenizer
from tabloop.testing.kafka import KafkaBroker
from tabloop.testing.postgres import PostgresServer


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    # Not tmp_path_factory: its parent directory is mode 0700, unreachable for the
    # `postgres` OS user the server runs as under root.
    base = Path(tempfile.mkdtemp(prefix="tabloop-pg-"))
    server = PostgresServer(base, fast=True)
    try:
        server.start()
        yield server
    finally:
        server.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka"), durable=False)
    try:
        broker.start()
        yield broker
    finally:
        broker.close()


@pytest.fixture
def durable_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    broker = KafkaBroker(tmp_path_factory.mktemp("durable-kafka"), durable=True)
    try:
        broker.start()
        yield broker
    finally:
        broker.close()


# ============================================================================
# End of service fixtures. Application fixtures go below.
# ============================================================================


# ============================================================================
# The `integration` marker (pyproject.toml): a test is integration when it starts real
# processes: PostgreSQL, a Kafka-protocol broker, a browser, the HTTP app over a socket,
# tabby-agent, the `tabloop` program, or training ranks. `pytest -m "not integration"` runs
# the unit tests only.
#
# Marked here, from the fixtures a test uses (item.fixturenames: the transitive closure, so
# `client`, `tabby`, `full_settings` ... are covered through the fixtures they need).
# Tests that start such processes themselves are marked in their modules
# (`pytestmark = pytest.mark.integration` or `@pytest.mark.integration`).
# ============================================================================
INTEGRATION_FIXTURES = frozenset(
    {
        # tests/conftest.py
        "postgres_server",  # PostgreSQL
        "pg_url",  # a database on postgres_server
        "kafka_broker",  # Tansu
        "durable_kafka",  # Tansu + SeaweedFS
        # tests/service/conftest.py: the app served by uvicorn on a loopback port; `served` is
        # also the name of the modules' own in tests/simulator/test_run.py,
        # tests/tabloop/test_client.py and tests/service/dashboard/test_dashboard_browser.py,
        # which serve it too
        "service_factory",
        "service",
        "served",
        # fixtures of a test module
        "served_sim",  # tests/simulator/test_run.py: the app on a loopback port
        "embedded",  # tests/trainer/test_loop.py: the app on a loopback port
        "up",  # tests/simulator/test_e2e.py: `tabloop up` in a subprocess
        "browser_page",  # tests/service/dashboard/test_dashboard_browser.py: chromium
    }
)
# Parameters of a fixture that then asks for PostgreSQL and the broker with
# request.getfixturevalue (not in item.fixturenames): fixture name -> that parameter.
INTEGRATION_PARAMS = {
    "mode": "full",  # tests/service/conftest.py: settings_factory
    "db_settings": "postgresql",  # tests/migrations/test_migrations.py
}


def _direct_params(item: pytest.Item) -> set[str]:
    """Argument names of the item's direct (not indirect) parametrize marks: values, not
    fixtures, although item.fixturenames lists them (e.g. a bool `served` parameter)."""
    names: set[str] = set()
    for mark in item.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if isinstance(argnames, str):
            argnames = [n.strip() for n in argnames.split(",") if n.strip()]
        indirect = mark.kwargs.get("indirect", False)
        names.update(
            n
            for n in argnames
            if not (indirect is True or (isinstance(indirect, list | tuple) and n in indirect))
        )
    return names


def _starts_processes(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ())) - _direct_params(item)
    if INTEGRATION_FIXTURES.intersection(fixtures):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(params.get(name) == value for name, value in INTEGRATION_PARAMS.items())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") is None and _starts_processes(item):
            item.add_marker(pytest.mark.integration)


# ============================================================================
# Tiny policies: a BPE trained on a few stdlib files and a random-init model, for tests that
# need a real (small) policy without the shipped checkpoint.
# ============================================================================
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_SOURCES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py")


@pytest.fixture(scope="session")
def small_code() -> list[str]:
    return [(STDLIB / p).read_text(encoding="utf-8") for p in SMALL_SOURCES]


@pytest.fixture(scope="session")
def tiny_tokenizer(small_code: list[str]) -> CodeTokenizer:
    return train_tokenizer(small_code, vocab_size=400)


@pytest.fixture
def tiny_model(tiny_tokenizer: CodeTokenizer) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tiny_tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
    )
    return GPT(cfg).eval()
