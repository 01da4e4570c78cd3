"""What the command line and the service at start do to keys and policies is in the audit log:
`tabloop keys create|revoke` as `cli`, `tabloop up`'s first admin key, its trainer's key and the
base policy's bootstrap as `service`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tabloop.cli import _bootstrap_policy, _ensure_first_admin_key, _trainer_key
from tabloop.core.config import Settings
from tabloop.core.db import make_engine, upgrade
from tabloop.core.tables import audit_log
from tests.tabloop.test_cli import env_for, run


def audit_rows(settings: Settings) -> list[dict[str, Any]]:
    engine = make_engine(settings)
    try:
        with engine.connect() as conn:
            found = conn.execute(sa.select(audit_log).order_by(audit_log.c.id)).all()
    finally:
        engine.dispose()
    return [dict(r._mapping) for r in found]


@pytest.mark.integration  # `tabloop keys` in a subprocess
def test_keys_made_and_revoked_on_the_command_line(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    assert run(["db", "upgrade"], env).returncode == 0
    out = run(["keys", "create", "--scope", "admin", "--name", "ops"], env)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    key_id = token.split("_")[1]
    assert run(["keys", "revoke", key_id], env).returncode == 0
    assert run(["keys", "revoke", "nosuchkey"], env).returncode == 1  # nothing revoked

    rows = audit_rows(Settings(data_dir=tmp_path / "data"))
    assert [(r["action"], r["target"], r["key_id"], r["key_name"], r["outcome"]) for r in rows] == [
        ("key.create", key_id, None, "cli", "ok"),
        ("key.revoke", key_id, None, "cli", "ok"),
    ]
    assert rows[0]["detail"] == {
        "name": "ops",
        "scopes": ["admin"],
        "no_train": False,
        "workspace": key_id,  # its own
    }
    assert token.split("_", 2)[2] not in json.dumps(rows, default=str)


def test_what_tabloop_up_does_by_itself(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    upgrade(settings)
    _ensure_first_admin_key(settings)
    _ensure_first_admin_key(settings)  # an admin key exists: nothing made, nothing recorded
    _trainer_key(settings)
    _trainer_key(settings)  # the next start replaces the trainer's key
    _bootstrap_policy(settings)
    _bootstrap_policy(settings)  # deployed already: no-op

    rows = audit_rows(settings)
    assert {(r["key_id"], r["key_name"], r["outcome"]) for r in rows} == {(None, "service", "ok")}
    assert [(r["action"], (r["detail"] or {}).get("name")) for r in rows] == [
        ("key.create", "first-admin"),
        ("key.create", "embedded-trainer"),
        ("key.revoke", "embedded-trainer"),
        ("key.create", "embedded-trainer"),
        ("bootstrap", None),
    ]
    assert rows[2]["target"] == rows[1]["target"] != rows[3]["target"]
    assert rows[-1]["target"] == "1"
