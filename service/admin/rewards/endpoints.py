"""Admin API: the reward spec (numbered versions) and replays from the database."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.config import JsonDict

from service.admin.audit.recorder import AuditEntry
from service.deps import ADMIN, AdminKey, AppContext, CtxDep, audited
from service.errors import NotFound, Unprocessable
from service.openapi import error_responses
from tabloop.core import reward_store as store
from tabloop.core.reward_spec import RewardSpec, show_thresholds
from tabloop.core.tables import MAX_VERSION

router = APIRouter(prefix="/admin", tags=["admin: rewards"])


_SPEC: JsonDict = RewardSpec().to_dict()  # the defaults, as the example


_THRESHOLDS: list[JsonValue] = [
    {"chars": t["chars"], "kept": round(t["kept"], 4), "no_report": round(t["no_report"], 4)}
    for t in show_thresholds(RewardSpec.from_dict(_SPEC))
]


class Threshold(BaseModel):
    chars: int = Field(description="the suggestion's length in characters, accepted whole")
    kept: float | None = Field(
        description="the accept rate above which showing it pays, when a retention report says "
        "all of it was kept (null: never pays)"
    )
    no_report: float | None = Field(
        description="... when no retention report comes: the accept counts at measured_retention, "
        "or provisional_accept_weight until that is measured"
    )


class SpecOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"version": 2, "spec": _SPEC, "measured_retention": None, "thresholds": _THRESHOLDS}
            ]
        }
    )

    version: int
    spec: dict[str, Any]
    measured_retention: float | None = Field(
        description="the mean retained fraction reported for the newest accepts of clients that "
        "report retention (all languages); what an accept without a report counts at. null: "
        "too few reports yet, so provisional_accept_weight"
    )
    thresholds: list[Threshold] = Field(
        description="the show thresholds the spec implies (docs/REWARD.md, Break-even accept rates)"
    )

    @classmethod
    def of(cls, conn: sa.Connection, version: int, spec: RewardSpec, ctx: AppContext) -> SpecOut:
        measured = ctx.retention(conn, None)
        return cls(
            version=version,
            spec=spec.to_dict(),
            measured_retention=measured,
            thresholds=[Threshold(**t) for t in show_thresholds(spec, measured)],
        )


class ReplayIn(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "from": "2026-11-29T00:00:00Z",
                    "to": "2026-11-30T00:00:00Z",
                    "reward_spec_version": 2,
                }
            ]
        }
    )

    from_: datetime = Field(alias="from", description="RFC 3339; rollouts created at or after")
    to: datetime = Field(description="RFC 3339; rollouts created before")
    reward_spec_version: int | None = Field(
        None, ge=1, le=MAX_VERSION, description="default: the current spec"
    )


@router.get("/reward-spec", response_model=SpecOut)
def get_spec(_key: AdminKey, ctx: CtxDep) -> SpecOut:
    """The current reward spec and its version number (the profile's defaults as version 1
    until one is stored)."""
    with ctx.engine.connect() as conn:
        version, spec = store.current_spec(conn, ctx.settings.profile)
        return SpecOut.of(conn, version, spec, ctx)


@router.put("/reward-spec", response_model=SpecOut, status_code=201)
def put_spec(
    body: Annotated[
        dict[str, Any],
        Body(examples=[{"reject_penalty": 0.3, "retention_checks_s": [30, 120, 300, 600]}]),
    ],
    audit: Annotated[AuditEntry, audited("reward_spec.update", *ADMIN)],
    ctx: CtxDep,
) -> SpecOut:
    """Store a new numbered version (fields and defaults as in DESIGN.md; omitted fields keep
    the current version's values). New rollouts are rewarded with it."""
    with ctx.engine.begin() as conn:
        _, current = store.current_spec(conn, ctx.settings.profile)
        try:
            spec = RewardSpec.from_dict({**current.to_dict(), **body})
        except ValueError as e:
            raise Unprocessable(str(e)) from None
        version = store.put_spec(conn, spec, audit.actor.key_id)
        new = spec.to_dict()
        audit.record(
            conn,
            target=str(version),
            detail={"changed": {k: new[k] for k in sorted(body) if k in new}},
        )
        return SpecOut.of(conn, version, spec, ctx)


_REPLAY_EXAMPLE = {
    "reward_spec_version": 2,
    "rollouts": 5120,
    "mean_reward": 0.074,
    "outcomes": {"abstained": 2870, "accepted": 610, "rejected": 1240, "ignored": 400},
    "finalized_before": 5012,
    "differ_from_stored": 312,
}


@router.post(
    "/replay",
    responses={
        200: {"content": {"application/json": {"example": _REPLAY_EXAMPLE}}},
        **error_responses(404),
    },
)
def post_replay(
    body: ReplayIn, audit: Annotated[AuditEntry, audited("replay", *ADMIN)], ctx: CtxDep
) -> dict[str, Any]:
    """Recompute the rewards of rollouts in a time range under a spec version, from the
    database. Stored rewards are left as they are; the answer compares the two."""
    # A read: its audit row is written as the answer starts (service/admin/audit/recorder.py).
    asked = {"from": body.from_.isoformat(), "to": body.to.isoformat()}
    audit.detail = asked
    if body.to <= body.from_:
        raise Unprocessable("'to' must be after 'from'")
    with ctx.engine.connect() as conn:
        if body.reward_spec_version is None:
            version, spec = store.current_spec(conn, ctx.settings.profile)
        else:
            version = body.reward_spec_version
            audit.target = str(version)
            found = store.spec_version(conn, version)
            if found is None:
                raise NotFound(f"no reward spec version {version}")
            spec = found
        summary = store.replay(conn, body.from_, body.to, spec)
    audit.target = str(version)
    audit.detail = {
        **asked,
        "rollouts": summary["rollouts"],
        "differ_from_stored": summary["differ_from_stored"],
    }
    return {"reward_spec_version": version, **summary}
