"""Admin API for the policy registry: register, list, deploy (canary), promote, roll back."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Path, UploadFile
from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

from service.admin.audit.recorder import AuditEntry
from service.deps import DEPLOY, AdminKey, CtxDep, DeployKey, audited
from service.errors import NotFound, PayloadTooLarge, Unprocessable
from service.openapi import error_responses
from tabloop.core import registry as store
from tabloop.core.db import blob_transaction
from tabloop.core.policy.checkpoint import MANIFEST_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from tabloop.core.tables import MAX_VERSION

router = APIRouter(prefix="/admin", tags=["admin: policies"])

Version = Annotated[int, Path(ge=1, le=MAX_VERSION)]


_POLICY: JsonDict = {
    "version": 7,
    "parent": 6,
    "sha256": "3f5a0c9e" * 8,
    "status": "canary",
    "created_at": "2026-11-29T12:00:00Z",
    "summary": {"parent": 6, "rollouts": 3276, "mean_reward": 0.112},
    "manifest": None,
}
_DEPLOYMENT: JsonDict = {
    "id": 12,
    "created_at": "2026-11-29T12:00:05Z",
    "action": "deploy",
    "live_version": 6,
    "canary_version": 7,
    "canary_fraction": 0.1,
    "reason": "trainer: gate passed; canary",
}


class PolicyOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [_POLICY]})

    version: int
    parent: int | None
    sha256: str
    status: str
    created_at: datetime
    summary: dict[str, Any]
    manifest: dict[str, Any] | None = None


class DeploymentOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [_DEPLOYMENT]})

    id: int
    created_at: datetime
    action: str
    live_version: int
    canary_version: int | None
    canary_fraction: float
    reason: str | None


class PolicyList(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"deployment": _DEPLOYMENT, "policies": [_POLICY]}]}
    )

    deployment: DeploymentOut | None
    policies: list[PolicyOut]


class DeployIn(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"canary_fraction": 0.1, "reason": "manual canary"}]}
    )

    canary_fraction: float = Field(0.1, gt=0, le=1, description="Share of users; 1 makes it live")
    reason: str | None = Field(None, max_length=2000)


class ReasonIn(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"reason": "accept rate held"}]})

    reason: str | None = Field(None, max_length=2000)


class RollbackIn(ReasonIn):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"reason": "accept rate fell", "canary_version": 7}]}
    )

    # roll back only if this version is still the canary (409 otherwise): a caller that judged
    # a canary never rolls back the live version after someone else promoted or withdrew it
    canary_version: int | None = Field(None, ge=1)


def _policy_out(row: Any, with_manifest: bool = False) -> PolicyOut:
    return PolicyOut(
        version=row.version,
        parent=row.parent,
        sha256=row.sha256,
        status=row.status,
        created_at=row.created_at,
        summary=row.summary or {},
        manifest=row.manifest if with_manifest else None,
    )


def _deployment_out(d: store.Deployment) -> DeploymentOut:
    return DeploymentOut(**d.__dict__)


def _routing(d: store.Deployment) -> dict[str, Any]:
    """The audit detail of a deployment change: the routing it left and why."""
    return {
        "deployment_id": d.id,
        "live_version": d.live_version,
        "canary_version": d.canary_version,
        "reason": d.reason,
    }


@router.get("/policies", response_model=PolicyList)
def list_policies(_key: DeployKey, ctx: CtxDep) -> PolicyList:
    """Every registered version, newest first, with the current deployment (live version,
    canary version and its share of users). Scope `deploy` or `admin`."""
    with ctx.engine.connect() as conn:
        current = store.current_deployment(conn)
        return PolicyList(
            deployment=_deployment_out(current) if current is not None else None,
            policies=[_policy_out(r) for r in store.list_policy_rows(conn)],
        )


@router.get("/policies/{version}", response_model=PolicyOut, responses=error_responses(404))
def get_policy(version: Version, _key: DeployKey, ctx: CtxDep) -> PolicyOut:
    """One version with its manifest (config, tokenizer, file hashes). 404 if unknown."""
    with ctx.engine.connect() as conn:
        row = store.get_policy_row(conn, version)
    if row is None:
        raise NotFound(f"no policy version {version}")
    return _policy_out(row, with_manifest=True)


def _read(upload: UploadFile, limit: int) -> bytes:
    data = upload.file.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"{upload.filename or 'file'} is over the {limit} byte limit")
    return data


_REGISTER_EXAMPLE = {
    "manifest": "(manifest.json)",
    "weights": "(model.safetensors)",
    "tokenizer": "(tokenizer.json)",
    "parent": 6,
    "summary": '{"rollouts": 3276, "mean_reward": 0.112}',
}


@router.post(
    "/policies",
    status_code=201,
    response_model=PolicyOut,
    openapi_extra={
        "requestBody": {"content": {"multipart/form-data": {"example": _REGISTER_EXAMPLE}}}
    },
)
def register_policy(
    audit: Annotated[AuditEntry, audited("policy.register", *DEPLOY)],
    ctx: CtxDep,
    manifest: Annotated[UploadFile, File(description="manifest.json")],
    weights: Annotated[UploadFile, File(description="model.safetensors (safetensors only)")],
    tokenizer: Annotated[UploadFile, File(description="tokenizer.json")],
    parent: Annotated[int | None, Form(ge=1, le=MAX_VERSION)] = None,
    summary: Annotated[str | None, Form(description="training summary, a JSON object")] = None,
) -> PolicyOut:
    """Register a checkpoint as the next version. The files' SHA-256 sums must match the
    manifest and the weights must load into the manifest's model config."""
    limit = ctx.settings.max_checkpoint_bytes
    files = {
        MANIFEST_FILE: _read(manifest, limit),
        WEIGHTS_FILE: _read(weights, limit),
        TOKENIZER_FILE: _read(tokenizer, limit),
    }
    summary_obj = None
    if summary is not None:
        try:
            summary_obj = json.loads(summary)
        except ValueError:
            raise Unprocessable("summary must be a JSON object") from None
        if not isinstance(summary_obj, dict):
            raise Unprocessable("summary must be a JSON object")
    with blob_transaction(ctx.engine) as conn:
        version = store.register_policy(
            conn, files, parent=parent, summary=summary_obj, api_key_id=audit.actor.key_id
        )
        row = store.get_policy_row(conn, version)
        assert row is not None
        audit.record(conn, target=str(version), detail={"parent": parent, "sha256": row.sha256})
    return _policy_out(row)


@router.post(
    "/policies/{version}/deploy", response_model=DeploymentOut, responses=error_responses(404, 409)
)
def deploy_policy(
    version: Version,
    body: DeployIn,
    audit: Annotated[AuditEntry, audited("deploy", *DEPLOY, target="version")],
    ctx: CtxDep,
) -> DeploymentOut:
    """Send `canary_fraction` of users (chosen by a stable hash of user_id) to this version."""
    with ctx.engine.begin() as conn:
        d = store.deploy(
            conn, version, body.canary_fraction, reason=body.reason, api_key_id=audit.actor.key_id
        )
        audit.record(conn, detail={"canary_fraction": body.canary_fraction, **_routing(d)})
    return _deployment_out(d)


@router.post(
    "/policies/{version}/promote", response_model=DeploymentOut, responses=error_responses(409)
)
def promote_policy(
    version: Version,
    audit: Annotated[AuditEntry, audited("promote", *DEPLOY, target="version")],
    ctx: CtxDep,
    body: ReasonIn | None = None,
) -> DeploymentOut:
    """Make the current canary the live version."""
    with ctx.engine.begin() as conn:
        d = store.promote(
            conn, version, reason=body.reason if body else None, api_key_id=audit.actor.key_id
        )
        audit.record(conn, detail=_routing(d))
    return _deployment_out(d)


@router.post("/rollback", response_model=DeploymentOut, responses=error_responses(409))
def rollback(
    audit: Annotated[AuditEntry, audited("rollback", *DEPLOY)],
    ctx: CtxDep,
    body: RollbackIn | None = None,
) -> DeploymentOut:
    """Withdraw the canary if there is one; otherwise put the previous live version back. With
    `canary_version`: withdraw that canary, or 409 if it is no longer the canary."""
    with ctx.engine.begin() as conn:
        d = store.rollback(
            conn,
            reason=body.reason if body else None,
            api_key_id=audit.actor.key_id,
            canary_version=body.canary_version if body else None,
        )
        withdrawn = store.rolled_back_version(conn, d)
        audit.record(
            conn, target=str(withdrawn) if withdrawn is not None else None, detail=_routing(d)
        )
    return _deployment_out(d)


@router.get("/deployments", response_model=list[DeploymentOut])
def deployments(_key: AdminKey, ctx: CtxDep, limit: int = 100) -> list[DeploymentOut]:
    """The deployment timeline, newest first."""
    with ctx.engine.connect() as conn:
        return [
            _deployment_out(d) for d in store.deployment_history(conn, min(max(limit, 1), 1000))
        ]
