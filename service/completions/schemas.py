"""POST /v1/complete request and response."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
)

from service.events.schemas import NoNul, UserId

Tag = Annotated[StrictStr, Field(max_length=256), NoNul]


def _integral(value: object) -> object:
    # JSON has one number type: 8.0 is the integer 8 (as JSON Schema's "integer" says); "8" and
    # 8.5 are still refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


class Snippet(BaseModel):
    """Code from elsewhere in the workspace that the editor sends with a request (Tabby's
    `declarations` and `relevant_snippets_from_changed_files`): the policy copies from it
    (tabloop.core.recall)."""

    model_config = ConfigDict(extra="ignore")  # Tabby adds `score`, ranges, ...

    filepath: Annotated[StrictStr, Field(max_length=1024), NoNul] | None = None
    body: Annotated[StrictStr, Field(max_length=1_000_000), NoNul]


MAX_SNIPPETS = 64  # snippets read per request (more are refused: 422)


class CompleteRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "user_id": "u-42",
                    "session_id": "s-1",
                    "workspace_id": "w-1",
                    "language": "python",
                    "file_path": "pkg/mod.py",
                    "prefix": "def add(a, b):\n    return a",
                    "suffix": "\n",
                    "max_new_tokens": 32,
                }
            ]
        },
    )

    user_id: UserId
    session_id: Tag | None = None
    workspace_id: Tag | None = None
    language: Annotated[StrictStr, Field(max_length=64), NoNul] | None = None
    file_path: Annotated[StrictStr, Field(max_length=1024), NoNul] | None = None
    # Editors send what they have; the service keeps the last TABLOOP_MAX_PREFIX_CHARS.
    prefix: Annotated[StrictStr, Field(max_length=1_000_000), NoNul]
    suffix: Annotated[StrictStr, Field(max_length=1_000_000), NoNul] = ""
    snippets: list[Snippet] = Field(
        default_factory=list,
        max_length=MAX_SNIPPETS,
        description="Code from elsewhere in the workspace (other files, declarations, the "
        "clipboard) the policy may copy from; the service reads the first "
        "TABLOOP_MAX_SNIPPET_CHARS characters of them in all",
    )
    max_new_tokens: Annotated[StrictInt, BeforeValidator(_integral)] = Field(32, ge=1)
    reports_views: StrictBool = Field(
        False,
        description="This client sends a `view` event when it displays a suggestion; then a shown "
        "suggestion it never reports viewed is not counted as a silent reject (docs/REWARD.md)",
    )
    no_train: StrictBool = Field(
        False,
        description="Privacy mode: the suggestion is served, but none of this request's code is "
        "stored and it is never trained on (also the `X-Tabloop-No-Train: 1` header, or a key "
        "made with `no_train`; docs/PRIVACY.md)",
    )


class CompleteResponse(BaseModel):
    suggestion_id: str
    policy_version: int
    text: str = Field(description="The suggestion; empty when the policy abstains")
    shown: bool
    latency_ms: float
