"""The OpenAPI schema, completed by rule so that it documents every response the service gives.

FastAPI documents what a route declares. The errors that come from shared machinery are added
here for every operation that can get them, so a new route is documented without repeating
them: the API-key check (401, 403, 429, and 503 when the database is down), the body limit
middleware on every request that may carry a body (400 broken gzip, 413, 415), and request
validation (422, and 400 for a body that is not JSON). Every error has the `ErrorBody` schema.
Limits that depend on settings are written into the schema from the app's settings.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.errors import ErrorBody
from tabloop.core.config import Settings

ERROR_DESCRIPTIONS = {
    400: "Not JSON, or a broken gzip body",
    401: "No API key, or an unknown or revoked one",
    403: "The key lacks the scope this route needs",
    404: "No such resource",
    409: "Conflicts with the current state",
    413: "Body over the size limit (after gzip too)",
    415: "Unsupported Content-Encoding",
    422: "Invalid request",
    429: "Rate limited for this key; see Retry-After",
    503: "Database (or broker) unavailable; see Retry-After",
}
_BODY_METHODS = {"post", "put", "patch", "delete"}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route's own errors (404, 409, ...), with the error model."""
    return {c: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[c]} for c in codes}


def _complete(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    refs = "#/components/schemas/{model}"
    components["ErrorBody"] = ErrorBody.model_json_schema(ref_template=refs)
    components.update(components["ErrorBody"].pop("$defs", {}))
    for path_item in schema.get("paths", {}).values():
        for method, op in path_item.items():
            codes: set[int] = set()
            if op.get("security"):
                codes |= {401, 403, 429, 503}
            if method in _BODY_METHODS:
                codes |= {400, 413, 415}
            if op.get("parameters") or op.get("requestBody"):
                codes |= {400, 422} if op.get("requestBody") else {422}
            responses = op.setdefault("responses", {})
            for code in sorted(codes):
                responses.setdefault(str(code), {"description": ERROR_DESCRIPTIONS[code]})
            for code, response in responses.items():
                content = response.get("content", {}).get("application/json")
                # FastAPI's default 422 model is not what the service sends
                schema_ = (content or {}).get("schema") or {}
                default = not schema_ or schema_.get("$ref", "").endswith("/HTTPValidationError")
                if code.startswith(("4", "5")) and default:
                    response["content"] = {"application/json": {"schema": _ERROR_REF}}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    complete = components.get("CompleteRequest", {}).get("properties", {})
    if "max_new_tokens" in complete:
        complete["max_new_tokens"]["maximum"] = settings.max_new_tokens_limit
    return schema


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Serve the completed schema at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            app.openapi_schema = _complete(schema, settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
