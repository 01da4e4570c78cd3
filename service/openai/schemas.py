"""POST /openai/v1/completions request and response, shaped like OpenAI's completions API.

Fields the service cannot honour are in the schema with the only values it takes (`n: 1`,
`echo: false`, ...), so a request for more is refused by validation, with the message in
REFUSED. Fields it does not know are ignored, as SDKs and editors add their own.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
)

from service.completions.schemas import _integral
from service.events.schemas import NO_NUL_PATTERN, NoNul

MAX_STOP = 16  # OpenAI takes 4; Continue sends up to about 10 to servers other than OpenAI's

# Why a value is refused, by field: what a client reads in the error instead of pydantic's words.
REFUSED = {
    "n": "only 1 is supported (one suggestion per request)",
    "best_of": "only 1 is supported (one suggestion per request)",
    "echo": "the prompt is not echoed back: send false or leave it out",
    "logprobs": "log-probabilities are not returned: leave it out or send null",
    "logit_bias": "not supported (the policy's tokens are not OpenAI's): leave it out",
}


def _bool_only(value: object) -> object:
    # Literal[False] alone would take 0 (0 == False)
    if not isinstance(value, bool):
        raise ValueError("must be a boolean")
    return value


def _one_prompt(value: object) -> object:
    """OpenAI takes a list of prompts (a batch); a list of one is the one prompt."""
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], str):
            raise ValueError("must be a string, or a list of exactly one string")
        return value[0]
    if not isinstance(value, str):
        raise ValueError("must be a string, or a list of exactly one string")
    return value


def _stop_list(value: object) -> object:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("must be a string or a list of strings")
    return value


Text = Annotated[StrictStr, Field(max_length=1_000_000), NoNul]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=256)]
One = Annotated[StrictInt, Field(ge=1, le=1), BeforeValidator(_integral)]
Prompt = Annotated[
    Text,
    BeforeValidator(_one_prompt),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "maxLength": 1_000_000, "pattern": NO_NUL_PATTERN},
                {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 1_000_000, "pattern": NO_NUL_PATTERN},
                    "minItems": 1,
                    "maxItems": 1,
                },
            ]
        }
    ),
]
Stop = Annotated[
    list[StopString],
    Field(max_length=MAX_STOP),
    BeforeValidator(_stop_list),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": 256},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": 256},
                    "maxItems": MAX_STOP,
                },
            ]
        }
    ),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "model": "tabloop",
                    "prompt": "def add(a, b):\n    return a",
                    "suffix": "\n",
                    "max_tokens": 32,
                    "stop": ["\n\n"],
                    "user": "u-42",
                }
            ]
        },
    )

    model: Annotated[StrictStr, Field(max_length=256)] | None = Field(
        None, description="Accepted and ignored: the answer comes from the live (or canary) policy"
    )
    prompt: Prompt = Field(
        description="The text before the cursor (or a list of one); "
        "`<fim_prefix>P<fim_suffix>S<fim_middle>` is read as prefix P and suffix S"
    )
    suffix: Text | None = Field(None, description="The text after the cursor")
    max_tokens: Annotated[StrictInt, Field(ge=1), BeforeValidator(_integral)] | None = Field(
        None, description="At most this many tokens, and at most the server's limit"
    )
    # Sampling knobs: validated, then the policy samples at the service's own settings.
    temperature: Annotated[StrictFloat, Field(ge=0, le=2)] | None = None
    top_p: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    seed: StrictInt | None = None
    stop: Stop | None = Field(None, description="The suggestion ends before the first of these")
    n: One | None = None
    best_of: One | None = None
    echo: Annotated[Literal[False], BeforeValidator(_bool_only)] | None = None
    logprobs: None = None
    logit_bias: Annotated[dict[str, StrictFloat], Field(max_length=0)] | None = None
    stream: StrictBool | None = Field(None, description="Answer as server-sent events")
    stream_options: StreamOptions | None = None
    user: Annotated[StrictStr, Field(min_length=1, max_length=256), NoNul] | None = Field(
        None, description="The person (the user_id of feedback events); default: the key's name"
    )
    # tabloop's own, as on /v1/complete
    reports_views: StrictBool | None = Field(
        None,
        description="tabloop: this client sends a `view` event when it displays a suggestion "
        "(a shown suggestion never viewed is then not a silent reject)",
    )
    no_train: StrictBool | None = Field(
        None,
        description="tabloop: privacy mode, as on /v1/complete: none of this request's code is "
        "stored and it is never trained on",
    )


class Choice(BaseModel):
    index: int
    text: str = Field(description="The suggestion; empty when the policy abstains")
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of the prompt the policy read")
    completion_tokens: int = Field(description="Tokens it sampled (also when it abstained)")
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str = Field(description="The suggestion id: `suggestion_id` of feedback events")
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str = Field(description="The policy version that answered, e.g. tabloop-v3")
    choices: list[Choice]
    usage: Usage


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str | None = None
    param: str | None = None
    code: str


class OpenAIErrorBody(BaseModel):
    """Errors on this path, as OpenAI SDKs read them (`type` and `param` added to every
    tabloop error's `code` and `message`)."""

    error: OpenAIErrorDetail
