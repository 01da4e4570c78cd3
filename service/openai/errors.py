"""Errors on the OpenAI-compatible path, in the shape OpenAI SDKs parse.

Every tabloop error is `{"error": {"code", "message"}}`; OpenAI's also carry `type` and `param`
(the request field at fault), and SDKs raise with the message and expose those fields. The
route class renders what the route raises (the key check, validation, serving) that way, with
the same status codes and headers as everywhere else. Invalid requests are 400s, as OpenAI
answers them (its SDKs raise BadRequestError).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from service.errors import TabloopError
from service.openai.schemas import REFUSED

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def openai_error(
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    body = {
        "message": message,
        "type": ERROR_TYPES.get(status, "api_error"),
        "param": param,
        "code": code,
    }
    return Response(
        orjson.dumps({"error": body}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def validation_error(exc: RequestValidationError) -> Response:
    """One 400 naming the first field at fault (`param`), in words meant for a person."""
    errs = exc.errors()
    bad_json = [e for e in errs if e.get("type") == "json_invalid"]
    if bad_json:
        reason = (bad_json[0].get("ctx") or {}).get("error", "JSON decode error")
        return openai_error(400, "bad_json", f"request body is not valid JSON: {reason}")
    messages: dict[str, str] = {}  # field -> message, from the first error about it
    for e in errs:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        field = loc[0] if loc else "body"
        if field in messages:
            continue  # a union's other branches: one message per field
        if e.get("type") == "missing":
            messages[field] = f"{'.'.join(loc)}: required" if loc else "a JSON body is required"
        elif field in REFUSED:
            messages[field] = f"{field}: {REFUSED[field]}"
        else:
            msg = str(e.get("msg")).removeprefix("Value error, ")
            messages[field] = f"{'.'.join(loc) or 'body'}: {msg}"
    param = next((f for f in messages if f != "body"), None)
    text = "; ".join(list(messages.values())[:10]) or "invalid request"
    return openai_error(400, "invalid", text, param)


class OpenAIRoute(APIRoute):
    """Renders the route's errors as OpenAI does; the rest of the app is left as it is."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return validation_error(e)
            except HTTPException as e:  # a body FastAPI could not parse
                if e.status_code != 400:
                    return openai_error(
                        e.status_code, "http_error", str(e.detail), headers=e.headers
                    )
                return openai_error(
                    400,
                    "bad_json",
                    "request body could not be read as JSON "
                    "(nested too deep, not UTF-8, or a number too long)",
                )
            except TabloopError as e:
                param = getattr(e, "param", None)  # set by the fields' own checks
                return openai_error(e.status_code, e.code, e.message, param, e.headers)

        return openai_handler
