"""The whole loop with a Hugging Face model as the policy, over HTTP, embedded and full: a tiny
Qwen2 built here is imported as the base, serves, gets feedback, and the trainer's LoRA adapter
is gated, deployed as a canary, judged, and served."""

from __future__ import annotations

import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from service.relay import Relay
from tabloop.core.db import make_engine, upgrade
from tabloop.core.keys import create_key
from tabloop.core.policy.checkpoint import import_model
from tabloop.core.registry import bootstrap
from tabloop.core.stream.kafka import ensure_topics
from tabloop.core.tables import deployments, policies, policy_artifacts
from tabloop.testing.hf_models import make_model_dir
from tests.service.conftest import RunningService, make_settings
from tests.trainer.test_loop import PASSING_CHECK, count, drive, wait_for
from trainer.canary import CanaryConfig
from trainer.client import ServiceClient
from trainer.loop import Trainer, TrainerConfig
from trainer.update import UpdateConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [p.read_text(encoding="utf-8") for p in sorted((stdlib / "json").glob("*.py"))]
    model = make_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2", code)
    return import_model(model, tmp_path_factory.mktemp("base") / "ckpt")


@pytest.mark.parametrize("mode", ["embedded", "full"])
def test_a_hugging_face_policy_learns_deploys_and_serves(
    mode: str, hf_base: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    full: dict[str, Any] = {}
    if mode == "full":
        broker = request.getfixturevalue("kafka_broker")
        full = {
            "pg_url": request.getfixturevalue("pg_url"),
            "bootstrap": broker.bootstrap,
            "trainer_group": f"hf-{tmp_path.name[-12:]}",  # the broker is the session's
        }
    settings = make_settings(
        tmp_path,
        **full,
        profile="sim",
        base_checkpoint=hf_base,
        policy_poll_interval_s=0.2,
        rate_limit_per_s=10_000,
        rate_limit_burst=10_000,
    )
    upgrade(settings)
    if not settings.embedded:
        ensure_topics(settings)
    engine = make_engine(settings)
    with engine.begin() as conn:
        assert bootstrap(conn, settings.base_checkpoint) == 1
        ingest = create_key(conn, name="t", scopes=frozenset({"ingest", "admin"}))[1]
        deploy = create_key(conn, name="trainer", scopes=frozenset({"deploy"}))[1]
    svc = RunningService(settings).start()
    stop = threading.Event()
    threads = [] if settings.embedded else [(Relay(settings, make_engine(settings)).run)]
    cfg = TrainerConfig(
        group=settings.trainer_group,
        batch_size=60,
        canary_fraction=0.5,
        canary=CanaryConfig(
            min_rollouts=20, timeout_s=60, reward_tolerance=1.0, accept_tolerance=1.0
        ),
        deploy_check=PASSING_CHECK,
        poll_timeout_s=0.2,
        canary_poll_s=0.6,
        update=UpdateConfig(gate_fit=True, gate_fit_min_shown=0, settled_epochs=0),
    )
    trainer = Trainer(settings, engine, ServiceClient(svc.url, deploy), cfg)
    threads.append(trainer.run)
    running = [threading.Thread(target=t, args=(stop,), daemon=True) for t in threads]
    for t in running:
        t.start()
    served: list[int] = []
    try:
        drive(svc.url, ingest, 120, seed=1, versions=served)
        for seed in range(100, 130):  # traffic until the trained adapter is deployed
            if count(engine, deployments, deployments.c.action == "deploy"):
                break
            drive(svc.url, ingest, 20, seed=seed, versions=served)
            time.sleep(1.0)
        wait_for(
            lambda: count(engine, deployments, deployments.c.action == "deploy") >= 1,
            120,
            "a gated canary deploy of the trained adapter",
        )
        for seed in range(2, 30):
            drive(svc.url, ingest, 40, seed=seed, versions=served)
            if count(engine, deployments, deployments.c.action.in_(("promote", "rollback"))):
                break
        wait_for(
            lambda: (
                count(engine, deployments, deployments.c.action.in_(("promote", "rollback"))) >= 1
            ),
            90,
            "a canary verdict",
        )
        drive(svc.url, ingest, 20, seed=99, versions=served)
    finally:
        stop.set()
        for t in running:
            t.join(timeout=60)
        svc.stop()
    assert 2 in served  # the trained adapter served (as the canary, or live after it)
    with engine.connect() as conn:
        v2 = conn.execute(sa.select(policies).where(policies.c.version == 2)).one()
        sizes = dict(
            conn.execute(
                sa.select(policy_artifacts.c.name, sa.func.length(policy_artifacts.c.data)).where(
                    policy_artifacts.c.version == 2
                )
            ).all()
        )
    assert v2.parent == 1 and v2.manifest["config"]["backend"] == "hf"
    assert v2.summary["gate"]["passed"] is True
    # a deploy ships the adapter and the heads, never the base's weights
    base_bytes = sum(
        f.stat().st_size for f in Path(v2.manifest["config"]["base_dir"]).glob("*.safetensors")
    )
    assert sizes["model.safetensors"] < base_bytes
    engine.dispose()
