"""Checkpoints as an attack surface: an upload over the size cap is refused before it is read in
full, and a checkpoint rewritten in the database after registration is never loaded.
(Wrong sha256 and pickles on upload: test_registry.py.)"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import MANIFEST_FILE, WEIGHTS_FILE
from tabloop.core.registry import bootstrap
from tabloop.core.tables import policies, policy_artifacts
from tests.service.policies.test_registry import upload


@pytest.fixture
def registry(
    settings_factory: Any, tiny_checkpoint_factory: Any, service_factory: Any, key_factory: Any
) -> Any:
    """A service with the tiny policy live and a checkpoint cap below the tiny weights' size."""
    weights = (tiny_checkpoint_factory(0) / WEIGHTS_FILE).stat().st_size
    settings = settings_factory(
        base_checkpoint=tiny_checkpoint_factory(0),
        policy_poll_interval_s=0.1,
        max_checkpoint_bytes=weights - 1,
    )
    engine = make_engine(settings)
    with engine.begin() as conn:
        bootstrap(conn, settings.base_checkpoint)
    svc = service_factory(settings)
    client = httpx.Client(
        base_url=svc.url,
        timeout=30,
        headers={"Authorization": f"Bearer {key_factory('deploy', 'ingest')}"},
    )
    yield svc, client, engine
    client.close()
    engine.dispose()


def versions(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(policies.c.version)).scalars())


def test_oversize_checkpoint_is_refused(registry: Any, tiny_checkpoint_factory: Any) -> None:
    svc, c, engine = registry
    r = upload(c, tiny_checkpoint_factory(1))  # weights one byte over max_checkpoint_bytes
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large", r.text
    # a body past the route's own limit (three files at the cap) is cut off by the middleware
    huge = b"\0" * (3 * svc.settings.max_checkpoint_bytes + 70_000)
    r = upload(c, tiny_checkpoint_factory(1), weights=huge)
    assert r.status_code == 413, r.text
    assert versions(engine) == [1]


def tamper(engine: sa.Engine, version: int, weights: bytes, *, cover_tracks: bool) -> None:
    """Swap the stored weights of `version`; with `cover_tracks`, also the artifact row's hash
    and the stored manifest, so that the checkpoint is consistent with itself."""
    sha = hashlib.sha256(weights).hexdigest()
    with engine.begin() as conn:
        where = policy_artifacts.c.version == version
        values: dict[str, Any] = {"data": weights}
        if cover_tracks:
            values["sha256"] = sha
            manifest = json.loads(
                conn.execute(
                    sa.select(policy_artifacts.c.data).where(
                        where, policy_artifacts.c.name == MANIFEST_FILE
                    )
                ).scalar_one()
            )
            manifest["weights"]["sha256"] = sha
            text = json.dumps(manifest).encode()
            conn.execute(
                policy_artifacts.update()
                .where(where, policy_artifacts.c.name == MANIFEST_FILE)
                .values(data=text, sha256=hashlib.sha256(text).hexdigest())
            )
        conn.execute(
            policy_artifacts.update()
            .where(where, policy_artifacts.c.name == WEIGHTS_FILE)
            .values(**values)
        )


@pytest.mark.parametrize("cover_tracks", [False, True], ids=["weights-only", "consistent-rewrite"])
def test_tampered_checkpoint_is_never_loaded(
    settings_factory: Any,
    tiny_checkpoint_factory: Any,
    service_factory: Any,
    key_factory: Any,
    caplog: pytest.LogCaptureFixture,
    cover_tracks: bool,
) -> None:
    """v2 is registered through the API, then its weights in policy_artifacts are replaced by
    another (loadable) model's before any process has cached it. Deploying it must not put those
    weights in front of users: the service refuses to load v2 and keeps serving v1."""
    settings = settings_factory(
        base_checkpoint=tiny_checkpoint_factory(0), policy_poll_interval_s=0.1
    )
    engine = make_engine(settings)
    with engine.begin() as conn:
        bootstrap(conn, settings.base_checkpoint)
    svc = service_factory(settings)
    token = key_factory("deploy", "ingest")
    with httpx.Client(
        base_url=svc.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
    ) as c:
        assert upload(c, tiny_checkpoint_factory(1)).status_code == 201
        evil: Path = tiny_checkpoint_factory(7) / WEIGHTS_FILE
        tamper(engine, 2, evil.read_bytes(), cover_tracks=cover_tracks)
        caplog.set_level(logging.ERROR, logger="service.completions.serving")
        d = c.post("/admin/policies/2/deploy", json={"canary_fraction": 1.0})
        assert d.status_code == 200, d.text
        deadline = time.monotonic() + 10
        while not any("cannot load policy v2" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the service never tried to load v2"
            time.sleep(0.05)
        r = c.post("/v1/complete", json={"user_id": "u-1", "prefix": "x = ", "max_new_tokens": 2})
        assert r.status_code == 200 and r.json()["policy_version"] == 1, r.text
    engine.dispose()
