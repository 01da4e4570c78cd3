"""The policy registry: versions, their checkpoint files, and the deployment timeline.

A checkpoint is the three files of `tabloop.core.policy.checkpoint` (weights, tokenizer, manifest).
They are stored in the database, so every worker on every host can load any version; each
process caches them under its data dir. The routing state is the last `deployments` row:
a live version and at most one canary with the share of users it gets.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tabloop.core import audit
from tabloop.core.db import AnyRow
from tabloop.core.errors import Conflict, NotFound, Unprocessable
from tabloop.core.policy.checkpoint import (
    MANIFEST_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint,
)
from tabloop.core.tables import deployments, policies, policy_artifacts, utcnow

FILES = (MANIFEST_FILE, WEIGHTS_FILE, TOKENIZER_FILE)


@dataclass(frozen=True)
class Deployment:
    id: int
    created_at: datetime
    action: str
    live_version: int
    canary_version: int | None
    canary_fraction: float
    reason: str | None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def validate_checkpoint(files: dict[str, bytes]) -> dict[str, Any]:
    """Check an uploaded checkpoint: the three files, hashes matching the manifest, safetensors
    weights that fit the manifest's model config. Returns the manifest. Never unpickles."""
    missing = [n for n in FILES if n not in files]
    if missing:
        raise Unprocessable(f"checkpoint lacks {', '.join(missing)}")
    try:
        manifest = json.loads(files[MANIFEST_FILE])
        weights_sha = manifest["weights"]["sha256"]
        tokenizer_sha = manifest["tokenizer"]["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise Unprocessable(f"manifest.json is not a tabloop manifest: {e}") from None
    if _sha256(files[WEIGHTS_FILE]) != weights_sha:
        raise Unprocessable("model.safetensors does not match the manifest's sha256")
    if _sha256(files[TOKENIZER_FILE]) != tokenizer_sha:
        raise Unprocessable("tokenizer.json does not match the manifest's sha256")
    with tempfile.TemporaryDirectory(prefix="tabloop-upload-") as tmp:
        write_files(Path(tmp), files)
        try:
            load_checkpoint(tmp)  # safetensors parse + shapes against the config
        except CheckpointError as e:
            raise Unprocessable(f"checkpoint does not load: {e}") from None
    if not isinstance(manifest, dict):
        raise Unprocessable("manifest.json is not a JSON object")
    return manifest


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in FILES:  # the manifest last: it commits the others
        if name != MANIFEST_FILE:
            (directory / name).write_bytes(files[name])
    (directory / MANIFEST_FILE).write_bytes(files[MANIFEST_FILE])


def register_policy(
    conn: sa.Connection,
    files: dict[str, bytes],
    *,
    parent: int | None,
    summary: dict[str, Any] | None,
    api_key_id: str | None,
    status: str = "registered",
) -> int:
    """Store a validated checkpoint as the next version; returns the version number."""
    manifest = validate_checkpoint(files)
    if parent is not None and get_policy_row(conn, parent) is None:
        raise Unprocessable(f"parent version {parent} is not registered")
    version = (conn.execute(sa.select(sa.func.max(policies.c.version))).scalar() or 0) + 1
    manifest = {**manifest, "version": version, "parent": parent}
    stored = dict(files, **{MANIFEST_FILE: json.dumps(manifest, indent=2).encode()})
    conn.execute(
        policies.insert().values(
            version=version,
            parent=parent,
            sha256=manifest["weights"]["sha256"],
            manifest=manifest,
            summary=summary if summary is not None else manifest.get("summary", {}),
            status=status,
            created_at=utcnow(),
            api_key_id=api_key_id,
        )
    )
    conn.execute(
        policy_artifacts.insert(),
        [
            {"version": version, "name": n, "sha256": _sha256(b), "data": b}
            for n, b in stored.items()
        ],
    )
    return version


def read_checkpoint_dir(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in FILES}


def artifact_files(conn: sa.Connection, version: int) -> dict[str, bytes]:
    rows = conn.execute(
        sa.select(
            policy_artifacts.c.name, policy_artifacts.c.sha256, policy_artifacts.c.data
        ).where(policy_artifacts.c.version == version)
    ).all()
    files = {r.name: bytes(r.data) for r in rows}
    for r in rows:
        if _sha256(files[r.name]) != r.sha256:
            raise CheckpointError(f"stored {r.name} of version {version} is corrupt")
    # The weights' identity is also kept apart from the artifacts, in `policies`: rewriting the
    # weights, their row's hash and the manifest together still does not get them loaded.
    registered = conn.execute(
        sa.select(policies.c.sha256).where(policies.c.version == version)
    ).scalar()
    if registered is None or _sha256(files.get(WEIGHTS_FILE, b"")) != registered:
        raise CheckpointError(
            f"stored weights of version {version} are not the ones registered (sha256 {registered})"
        )
    return files


def get_policy_row(conn: sa.Connection, version: int) -> AnyRow | None:
    return conn.execute(sa.select(policies).where(policies.c.version == version)).first()


def list_policy_rows(conn: sa.Connection) -> list[AnyRow]:
    return list(conn.execute(sa.select(policies).order_by(policies.c.version.desc())).all())


def current_deployment(conn: sa.Connection) -> Deployment | None:
    row = conn.execute(sa.select(deployments).order_by(deployments.c.id.desc()).limit(1)).first()
    return _deployment(row) if row is not None else None


def deployment_history(conn: sa.Connection, limit: int = 100) -> list[Deployment]:
    rows = conn.execute(sa.select(deployments).order_by(deployments.c.id.desc()).limit(limit)).all()
    return [_deployment(r) for r in rows]


def _deployment(row: AnyRow) -> Deployment:
    return Deployment(
        row.id,
        row.created_at,
        row.action,
        row.live_version,
        row.canary_version,
        row.canary_fraction,
        row.reason,
    )


def _set_status(conn: sa.Connection, version: int, status: str) -> None:
    conn.execute(policies.update().where(policies.c.version == version).values(status=status))


def _append(
    conn: sa.Connection,
    action: str,
    live: int,
    canary: int | None,
    fraction: float,
    reason: str | None,
    api_key_id: str | None,
) -> Deployment:
    conn.execute(
        deployments.insert().values(
            created_at=utcnow(),
            action=action,
            live_version=live,
            canary_version=canary,
            canary_fraction=fraction if canary is not None else 0.0,
            reason=reason,
            api_key_id=api_key_id,
        )
    )
    current = current_deployment(conn)
    assert current is not None
    return current


def _lock_timeline(conn: sa.Connection) -> None:
    """Serialize timeline changes (SQLite already serializes writers)."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7301)"))


def deploy(
    conn: sa.Connection,
    version: int,
    canary_fraction: float,
    *,
    reason: str | None = None,
    api_key_id: str | None = None,
) -> Deployment:
    """Start `version` as the canary for `canary_fraction` of users (1.0: make it live)."""
    _lock_timeline(conn)
    row = get_policy_row(conn, version)
    if row is None:
        raise NotFound(f"no policy version {version}")
    if not 0.0 < canary_fraction <= 1.0:
        raise Unprocessable("canary_fraction must be in (0, 1]")
    current = current_deployment(conn)
    if current is None or canary_fraction >= 1.0:
        if current is not None and current.live_version == version:
            raise Conflict(f"version {version} is already live")
        if current is not None:
            _set_status(conn, current.live_version, "retired")
            if current.canary_version is not None and current.canary_version != version:
                _set_status(conn, current.canary_version, "retired")
        _set_status(conn, version, "live")
        return _append(conn, "deploy", version, None, 0.0, reason, api_key_id)
    if version == current.live_version:
        raise Conflict(f"version {version} is already live")
    if current.canary_version is not None and current.canary_version != version:
        _set_status(conn, current.canary_version, "retired")
    _set_status(conn, version, "canary")
    return _append(
        conn, "deploy", current.live_version, version, canary_fraction, reason, api_key_id
    )


def promote(
    conn: sa.Connection, version: int, *, reason: str | None = None, api_key_id: str | None = None
) -> Deployment:
    """Make the current canary the live version."""
    _lock_timeline(conn)
    current = current_deployment(conn)
    if current is None or current.canary_version != version:
        raise Conflict(f"version {version} is not the current canary")
    _set_status(conn, current.live_version, "retired")
    _set_status(conn, version, "live")
    return _append(conn, "promote", version, None, 0.0, reason, api_key_id)


def rollback(
    conn: sa.Connection,
    *,
    reason: str | None = None,
    api_key_id: str | None = None,
    canary_version: int | None = None,
) -> Deployment:
    """With a canary out: withdraw it. Otherwise: put the previous live version back. With
    `canary_version`, only withdraw that canary (Conflict if it is not the canary now)."""
    _lock_timeline(conn)
    current = current_deployment(conn)
    if current is None:
        raise Conflict("nothing is deployed")
    if canary_version is not None and current.canary_version != canary_version:
        raise Conflict(f"version {canary_version} is not the canary now: nothing rolled back")
    if current.canary_version is not None:
        _set_status(conn, current.canary_version, "rolled_back")
        return _append(conn, "rollback", current.live_version, None, 0.0, reason, api_key_id)
    previous = conn.execute(
        sa.select(deployments.c.live_version)
        .where(deployments.c.live_version != current.live_version)
        .order_by(deployments.c.id.desc())
        .limit(1)
    ).scalar()
    if previous is None:
        raise Conflict("there is no previous live version to roll back to")
    _set_status(conn, current.live_version, "rolled_back")
    _set_status(conn, previous, "live")
    return _append(conn, "rollback", previous, None, 0.0, reason, api_key_id)


def rolled_back_version(conn: sa.Connection, rollback: Deployment) -> int | None:
    """The version a rollback took away: the canary it withdrew, or else the live version it
    replaced (read from the timeline row before it)."""
    before = conn.execute(
        sa.select(deployments.c.live_version, deployments.c.canary_version)
        .where(deployments.c.id < rollback.id)
        .order_by(deployments.c.id.desc())
        .limit(1)
    ).first()
    if before is None:
        return None
    version = before.canary_version if before.canary_version is not None else before.live_version
    return None if version is None else int(version)


def bootstrap(conn: sa.Connection, base_dir: Path) -> int | None:
    """First start: register the shipped base checkpoint and make it live (audited as done by
    the service itself). Returns its version, or None when a policy is already deployed."""
    _lock_timeline(conn)
    if current_deployment(conn) is not None:
        return None
    version = register_policy(
        conn,
        read_checkpoint_dir(base_dir),
        parent=None,
        summary=None,
        api_key_id=None,
        status="live",
    )
    d = _append(conn, "bootstrap", version, None, 0.0, "the pretrained base policy", None)
    row = get_policy_row(conn, version)
    assert row is not None
    audit.record(
        conn,
        actor=audit.SERVICE,
        action="bootstrap",
        target=str(version),
        detail={"deployment_id": d.id, "sha256": row.sha256},
    )
    return version
