"""Fixtures for the service: settings per mode, the real app on a real socket, API keys."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn

from tabloop.core.config import Settings
from tabloop.core.db import make_engine, upgrade
from tabloop.core.keys import create_key
from tabloop.testing.procs import free_port


class RunningService:
    """The FastAPI app served by uvicorn on a loopback port, in a thread of the test process."""

    def __init__(self, settings: Settings) -> None:
        from service.app import create_app

        self.settings = settings
        self.port = free_port()
        self.app = create_app(settings)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> RunningService:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn exited during start-up"
            assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def health(self) -> Any:
        return self.app.state.ctx.health


def make_settings(
    tmp_path: Path, *, pg_url: str | None = None, bootstrap: str | None = None, **overrides: Any
) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        kafka_bootstrap_servers=bootstrap,
        **overrides,
    )


@pytest.fixture(params=["embedded", "full"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def settings_factory(mode: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """Builds migrated Settings for the test's mode; extra keyword arguments override fields."""

    def build(**overrides: Any) -> Settings:
        if mode == "embedded":
            s = make_settings(tmp_path, **overrides)
        else:
            pg_url = request.getfixturevalue("pg_url")
            broker = request.getfixturevalue("kafka_broker")
            s = make_settings(tmp_path, pg_url=pg_url, bootstrap=broker.bootstrap, **overrides)
        upgrade(s)
        return s

    return build


@pytest.fixture
def settings(settings_factory: Any) -> Settings:
    return settings_factory()  # type: ignore[no-any-return]


@pytest.fixture
def engine(settings: Settings) -> Iterator[sa.Engine]:
    e = make_engine(settings)
    yield e
    e.dispose()


@pytest.fixture
def service_factory() -> Iterator[Any]:
    started: list[RunningService] = []

    def start(settings: Settings) -> RunningService:
        svc = RunningService(settings).start()
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture
def service(settings: Settings, service_factory: Any) -> RunningService:
    return service_factory(settings)  # type: ignore[no-any-return]


@pytest.fixture
def key_factory(engine: sa.Engine) -> Any:
    """make_key("ingest", "admin") -> bearer token."""

    def make(*scopes: str, name: str = "test") -> str:
        with engine.begin() as conn:
            _key, token = create_key(conn, name=name, scopes=frozenset(scopes))
        return token

    return make


@pytest.fixture
def client(service: RunningService, key_factory: Any) -> Iterator[httpx.Client]:
    """An HTTP client on the running service, authenticated with an ingest+admin key."""
    token = key_factory("ingest", "admin")
    with httpx.Client(
        base_url=service.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as c:
        yield c


# --- tiny policies: a real (small) tokenizer and a random-init model, saved as checkpoints ----


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """make(seed) -> directory of a tiny random-init checkpoint (distinct weights per seed)."""
    import torch

    from tabloop.core.policy.checkpoint import save_checkpoint
    from tabloop.core.policy.model import GPT, ModelConfig

    made: dict[int, Path] = {}

    def make(seed: int = 0) -> Path:
        if seed not in made:
            torch.manual_seed(seed)
            cfg = ModelConfig(
                vocab_size=tiny_tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
            )
            out = tmp_path_factory.mktemp(f"tiny-ckpt-{seed}")
            made[seed] = save_checkpoint(
                out,
                GPT(cfg).eval(),
                tiny_tokenizer,
                version=0,
                parent=None,
                summary={"seed": seed},
                overwrite=True,
            )
        return made[seed]

    return make


@pytest.fixture(scope="session")
def showing_checkpoint(tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random policy whose gate shows every non-empty suggestion (p(show) ~ 1)."""
    from tests.service.codescan import showing_checkpoint as make

    return make(tiny_tokenizer, tmp_path_factory.mktemp("showing"))


@pytest.fixture
def served_overrides() -> dict[str, Any]:
    """Extra Settings for `served`; a test overrides it with pytest.mark.parametrize."""
    return {}


@pytest.fixture
def served(
    settings_factory: Any,
    tiny_checkpoint_factory: Any,
    service_factory: Any,
    served_overrides: dict[str, Any],
) -> Any:
    """A running service whose registry holds the tiny base policy (v1, live).

    The confidence stop is off: an untrained tiny model is sure of no token, so with it every
    completion would be empty and these tests would log no tokens to check.
    """
    from tabloop.core.registry import bootstrap

    settings = settings_factory(
        **{
            "base_checkpoint": tiny_checkpoint_factory(0),
            "policy_poll_interval_s": 0.2,
            "stop_logprob": float("-inf"),
            **served_overrides,
        }
    )
    engine = make_engine(settings)
    with engine.begin() as conn:
        assert bootstrap(conn, settings.base_checkpoint) == 1
    engine.dispose()
    return service_factory(settings)
