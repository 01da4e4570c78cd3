"""The Tabby server API's bodies, as tabby-agent and Tabby's editor plugins send and read them.

Fields a Tabby client may send and tabloop does not use are declared loosely (or not at all:
unknown fields are ignored), so that a newer client never fails on them. What is stored is
bounded as on `POST /v1/complete`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from service.completions.schemas import MAX_SNIPPETS, Snippet
from service.events.schemas import NoNul

# The Tabby server release whose API this one answers as: tabby-agent fetches the server
# setting from 0.9.0 on, and reads nothing else from the version.
TABBY_API_VERSION = "v0.10.0"
COMPLETION_ID_PREFIX = "cmpl-"

Text = Annotated[StrictStr, Field(max_length=1_000_000), NoNul]


def _integral(value: object) -> object:
    # JSON has one number type: 1.0 is the integer 1 (as JSON Schema's "integer" says); "1" and
    # 1.5 are still refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


class Segments(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # Editors send what they have; the service keeps the last TABLOOP_MAX_PREFIX_CHARS.
    prefix: Text = Field(description="Text before the cursor")
    suffix: Text | None = Field(None, description="Text after the cursor")
    filepath: Annotated[StrictStr, Field(max_length=1024), NoNul] | None = Field(
        None, description="The file's path in its repository or workspace"
    )
    git_url: Annotated[StrictStr, Field(max_length=256), NoNul] | None = Field(
        None, description="The repository's remote URL (recorded as the rollout's workspace_id)"
    )
    # What Tabby clients send for their server's prompt: the policy copies from them
    # (tabloop.core.recall), as it does from the prefix and the suffix.
    declarations: list[Snippet] | None = Field(None, max_length=MAX_SNIPPETS)
    relevant_snippets_from_changed_files: list[Snippet] | None = Field(
        None, max_length=MAX_SNIPPETS
    )
    clipboard: Text | None = None


class TabbyCompletionRequest(BaseModel):
    model_config = ConfigDict(
        extra="ignore",  # temperature, seed, debug_options, ...: the policy decides
        json_schema_extra={
            "examples": [
                {
                    "language": "python",
                    "segments": {
                        "prefix": "def fib(n):\n    if n < 2:\n        return ",
                        "suffix": "\n",
                        "filepath": "pkg/fib.py",
                        "git_url": "https://github.com/example/pkg.git",
                    },
                }
            ]
        },
    )

    language: Annotated[StrictStr, Field(max_length=64), NoNul] | None = None
    segments: Segments
    user: Annotated[StrictStr, Field(max_length=256), NoNul] | None = Field(
        None, description="The person (user_id); without it, the API key's name"
    )


class Choice(BaseModel):
    index: int
    text: str


class TabbyCompletionResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "cmpl-5d3c2b1a-0f9e-4d8c-b7a6-958473625140",
                    "choices": [{"index": 0, "text": "n"}],
                }
            ]
        }
    )

    id: str = Field(
        description="`cmpl-` and the suggestion id: the completion_id of its events (and the "
        "suggestion_id of native events)"
    )
    choices: list[Choice] = Field(description="One suggestion, or none when the policy abstains")


class TabbyEvent(BaseModel):
    """What the person did with a suggestion: view (displayed it), select (accepted it; with
    select_kind "line", its first line only), dismiss (rejected it)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "type": "select",
                    "completion_id": "cmpl-5d3c2b1a-0f9e-4d8c-b7a6-958473625140",
                    "choice_index": 0,
                    "view_id": "view-8f1e2d3c",
                    "elapsed": 1200,
                }
            ]
        },
    )

    type: Literal["view", "select", "dismiss"]
    completion_id: Annotated[StrictStr, Field(min_length=1, max_length=100), NoNul]
    choice_index: Annotated[StrictInt, BeforeValidator(_integral)] = Field(0, ge=0, le=2**31 - 1)
    view_id: Annotated[StrictStr, Field(max_length=200), NoNul] | None = Field(
        None, description="Set by the client per display; one view, select or dismiss each"
    )
    elapsed: StrictFloat | None = Field(None, description="Milliseconds since the view (unused)")
    select_kind: Literal["line"] | None = Field(
        None, description="Also accepted as a query parameter, as tabby-agent sends it"
    )


class TabbyVersion(BaseModel):
    build_date: str
    build_timestamp: str
    git_sha: str
    git_describe: str


class TabbyHealth(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "tabloop policy v7",
                    "chat_model": None,
                    "device": "cpu",
                    "arch": "x86_64",
                    "cpu_info": "x86_64",
                    "cpu_count": 8,
                    "cuda_devices": [],
                    "version": {
                        "build_date": "",
                        "build_timestamp": "",
                        "git_sha": "",
                        "git_describe": TABBY_API_VERSION,
                    },
                }
            ]
        }
    )

    model: str = Field(description="The live policy version")
    chat_model: str | None = None
    device: str
    arch: str
    cpu_info: str
    cpu_count: int
    cuda_devices: list[str]
    version: TabbyVersion = Field(
        description="git_describe: the Tabby server API this service answers as"
    )


class ServerSetting(BaseModel):
    disable_client_side_telemetry: bool = Field(
        description="True would ask Tabby clients to turn off their anonymous usage reports"
    )
