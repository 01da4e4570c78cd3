"""From an OpenAI-style completion request to a rollout of the policy, and back.

The request is read as a native one (prefix, suffix, the person, a token budget) and served by
`serve`, like every completion API; the answer is shaped as OpenAI's, or as its server-sent
events when the client streams.
"""

from __future__ import annotations

import time
from typing import Literal

import orjson
from pydantic import ValidationError

from service.completions.rollout import Served
from service.completions.schemas import CompleteRequest
from service.errors import BadRequest
from service.openai.schemas import Choice, CompletionRequest, CompletionResponse, Usage
from tabloop.core.config import Settings
from tabloop.core.keys import ApiKey

# The fill-in-the-middle prompt Continue sends by default (StarCoder's tokens).
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<fim_prefix>", "<fim_suffix>", "<fim_middle>"
DEFAULT_MAX_TOKENS = CompleteRequest.model_fields["max_new_tokens"].default


class InvalidField(BadRequest):
    """A request that validates field by field but not as a whole; names the field at fault."""

    code = "invalid"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def split_fim(prompt: str) -> tuple[str, str] | None:
    """(prefix, suffix) of `<fim_prefix>P<fim_suffix>S<fim_middle>`; None for any other prompt."""
    if not (prompt.startswith(FIM_PREFIX) and prompt.endswith(FIM_MIDDLE)):
        return None
    body = prompt[len(FIM_PREFIX) : len(prompt) - len(FIM_MIDDLE)]
    if body.count(FIM_SUFFIX) != 1:
        raise InvalidField(
            "prompt", f"a {FIM_PREFIX}...{FIM_MIDDLE} prompt must hold {FIM_SUFFIX} exactly once"
        )
    prefix, _, suffix = body.partition(FIM_SUFFIX)
    return prefix, suffix


def native_request(req: CompletionRequest, key: ApiKey, settings: Settings) -> CompleteRequest:
    """The rollout's request: the person is `user` (the key's name without it), the prompt the
    prefix, `max_tokens` bounded by the server's limit. Sampling knobs are not carried over."""
    prefix, suffix = req.prompt, req.suffix or ""
    fim = split_fim(req.prompt)
    if fim is not None:
        if req.suffix:
            raise InvalidField(
                "suffix",
                "given twice: in the prompt's fill-in-the-middle markers and in `suffix`; send one",
            )
        prefix, suffix = fim
    budget = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    try:
        return CompleteRequest(
            user_id=req.user if req.user is not None else key.name or key.id,
            prefix=prefix,
            suffix=suffix,
            max_new_tokens=min(budget, settings.max_new_tokens_limit),
            reports_views=bool(req.reports_views),
            no_train=bool(req.no_train),
        )
    except ValidationError as e:  # the fields were checked as the native ones: the key's name
        raise InvalidField("user", "the API key's name cannot name the person; send `user`") from e


def finish_reason(served: Served) -> Literal["stop", "length"]:
    """ "length" when the token budget ended a suggestion that is shown whole, else "stop" (an end
    of line, a stop string, the policy's confidence stop, or an abstention)."""
    return "length" if served.shown and served.stop_reason == "length" else "stop"


def answer(served: Served) -> CompletionResponse:
    return CompletionResponse(
        id=served.suggestion_id,
        created=int(time.time()),
        model=f"tabloop-v{served.policy_version}",
        choices=[Choice(index=0, text=served.text, finish_reason=finish_reason(served))],
        usage=Usage(
            prompt_tokens=served.context_tokens,
            completion_tokens=served.sampled_tokens,
            total_tokens=served.context_tokens + served.sampled_tokens,
        ),
    )


def event_stream(response: CompletionResponse, include_usage: bool) -> bytes:
    """The answer as server-sent events, as OpenAI streams a completion: the suggestion in one
    chunk (it is sampled whole before it is recorded), the usage in a last chunk if asked for,
    then `[DONE]`."""
    head = response.model_dump(exclude={"usage"})
    events = [head]
    if include_usage:
        events.append({**head, "choices": [], "usage": response.usage.model_dump()})
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
