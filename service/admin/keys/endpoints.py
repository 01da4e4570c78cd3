"""Admin API for keys: create (the token is shown once), list (never the secret), revoke."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from pydantic.config import JsonDict

from service.admin.audit.recorder import AuditEntry
from service.deps import ADMIN, AdminKey, CtxDep, audited
from service.errors import NotFound, Unprocessable
from service.events.schemas import NoNul
from service.openapi import error_responses
from tabloop.core.audit import key_detail
from tabloop.core.keys import SCOPES, ApiKey, create_key, list_keys, parse_scopes, revoke_key

router = APIRouter(prefix="/admin/keys", tags=["admin: keys"])


_KEY: JsonDict = {
    "id": "9f2c4e1a0b3d5c7e",
    "name": "vscode-plugin",
    "scopes": ["ingest"],
    "created_at": "2026-11-29T12:00:00Z",
    "revoked_at": None,
    "no_train": False,
    "workspace": "9f2c4e1a0b3d5c7e",
}


class KeyCreate(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"name": "vscode-plugin", "scopes": ["ingest"]}]}
    )

    name: str = Field(min_length=1, max_length=200, examples=["vscode-plugin"])
    scopes: list[Literal["ingest", "deploy", "admin"]] = Field(
        min_length=1, examples=[["ingest"]], description=f"Any of {SCOPES}"
    )
    no_train: StrictBool = Field(
        False,
        description="Privacy mode for every request made with the key: served, but none "
        "of its code is stored and it is never trained on (docs/PRIVACY.md). Set for good.",
    )
    workspace: Annotated[StrictStr, Field(min_length=1, max_length=200), NoNul] | None = Field(
        None,
        description="The workspace the key belongs to: its requests read and feed that "
        "workspace's memory of code, and no other (docs/MODEL.md). Default: the key's own. "
        "Set for good.",
        examples=["team-payments"],
    )


class KeyOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [_KEY]})

    id: str
    name: str
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None
    no_train: bool = Field(
        description="Privacy mode: its requests' code is never stored or trained on"
    )
    workspace: str = Field(description="The workspace whose memory its requests read and feed")

    @classmethod
    def of(cls, key: ApiKey) -> KeyOut:
        return cls(
            id=key.id,
            name=key.name,
            scopes=sorted(key.scopes),
            created_at=key.created_at,
            revoked_at=key.revoked_at,
            no_train=key.no_train,
            workspace=key.workspace,
        )


class KeyCreated(KeyOut):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{**_KEY, "token": "tlk_9f2c4e1a0b3d5c7e_<secret>"}]}
    )

    token: str = Field(description="Shown once; only its hash is stored")


@router.post("", status_code=201, response_model=KeyCreated)
def post_key(
    body: KeyCreate, audit: Annotated[AuditEntry, audited("key.create", *ADMIN)], ctx: CtxDep
) -> KeyCreated:
    """Make a key with the given scopes (`ingest`, `deploy`, `admin`). The token is in this
    answer only: the database keeps its hash."""
    try:
        scopes = parse_scopes(body.scopes)
    except ValueError as e:
        raise Unprocessable(str(e)) from None
    with ctx.engine.begin() as conn:
        key, token = create_key(
            conn,
            name=body.name,
            scopes=scopes,
            no_train=body.no_train,
            workspace=body.workspace,
        )
        audit.record(conn, target=key.id, detail=key_detail(key))  # never the token
    return KeyCreated(**KeyOut.of(key).model_dump(), token=token)


@router.get("", response_model=list[KeyOut])
def get_keys(_admin: AdminKey, ctx: CtxDep) -> list[KeyOut]:
    """Every key, revoked ones included, oldest first; never a token or its hash."""
    with ctx.engine.connect() as conn:
        return [KeyOut.of(k) for k in list_keys(conn)]


@router.delete("/{key_id}", response_model=KeyOut, responses=error_responses(404))
def delete_key(
    key_id: str,
    audit: Annotated[AuditEntry, audited("key.revoke", *ADMIN, target="key_id")],
    ctx: CtxDep,
) -> KeyOut:
    """Revoke a key: refused from the next request here, and by every other API process
    within `TABLOOP_AUTH_CACHE_TTL_S` (1 s by default)."""
    with ctx.engine.begin() as conn:
        key = revoke_key(conn, key_id)
        if key is not None:
            audit.record(conn, detail=key_detail(key))
    ctx.keys.invalidate(key_id)  # at once here; other API processes within auth_cache_ttl_s
    if key is None:
        raise NotFound(f"no key {key_id!r}")
    return KeyOut.of(key)
