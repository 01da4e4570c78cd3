"""Shared pytest fixtures."""

from __future__ import annotations

# ============================================================================
# Service fixtures: real PostgreSQL and a real Kafka-protocol broker.
# Test infrastructure (see tests/services.py and scripts/test.sh); nothing is
# skipped: if a service cannot start, the fixture raises with the log tail.
#
#   postgres_server  session   PostgresServer (fsync off), one per test session
#   pg_url           function  SQLAlchemy URL of a fresh empty database t_<hex>,
#                              dropped after the test
#   kafka_broker     session   KafkaBroker, memory storage (create unique topics!)
#   durable_kafka    function  KafkaBroker with durable S3 storage (SeaweedFS),
#                              for kill()/restart() tests; closed after the test
#
# Import helpers as `tests.services` (pyproject: pythonpath = ["."],
# --import-mode=importlib).
# ============================================================================
import shutil
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.policy.model import GPT, ModelConfig
from service.policy.tokenizer import CodeTokenizer, train_tokenizer
from tests.services import KafkaBroker, PostgresServer


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
