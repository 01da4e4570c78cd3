"""One error type per domain, each with a status code; one set of handlers renders them all.

Every error leaves as `{"error": {"code": ..., "message": ...}}`. Anything the client sent maps
to a 4xx; a database or broker that is down maps to 503 with Retry-After; only our own bugs
are 500s, and they are logged with a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tabloop.core.errors import (  # noqa: F401  (re-exported: the API raises them from here)
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    TabloopError,
    Unauthorized,
    Unavailable,
    Unprocessable,
    UnsupportedMediaType,
)

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """What every error response carries (the OpenAPI schema of every 4xx and 503)."""

    error: ErrorDetail


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps({"error": {"code": code, "message": message}})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _jsonable_loc(loc: Any) -> str:
    # FastAPI puts "body" first for the request body; a field may be called "body" too
    parts = loc[1:] if loc and loc[0] == "body" else loc
    return ".".join(str(p) for p in parts) or "body"


def install_handlers(app: FastAPI, retry_after_s: int) -> None:
    @app.exception_handler(TabloopError)
    async def _domain(_req: Request, exc: TabloopError) -> Response:
        return error_response(exc.status_code, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> Response:
        errs = exc.errors()
        msg = "; ".join(f"{_jsonable_loc(e.get('loc', ()))}: {e.get('msg')}" for e in errs[:10])
        bad_json = [e for e in errs if e.get("type") == "json_invalid"]
        if bad_json:
            reason = (bad_json[0].get("ctx") or {}).get("error", "JSON decode error")
            return error_response(400, "bad_json", f"request body is not valid JSON: {reason}")
        return error_response(422, "invalid", msg)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    retry = {"Retry-After": str(retry_after_s)}

    @app.exception_handler(sqlalchemy.exc.OperationalError)
    @app.exception_handler(sqlalchemy.exc.InterfaceError)
    @app.exception_handler(sqlalchemy.exc.TimeoutError)
    async def _db_down(_req: Request, exc: Exception) -> Response:
        log.warning("database unavailable: %s", type(exc).__name__ + ": " + str(exc).split("\n")[0])
        return error_response(503, "database_unavailable", "the database is unavailable", retry)

    @app.exception_handler(sqlalchemy.exc.DataError)
    async def _db_refused(req: Request, exc: Exception) -> Response:
        # A value the database cannot hold that validation let through: the client's input.
        log.warning("database refused a value on %s: %s", req.url.path, str(exc).split("\n")[0])
        return error_response(422, "invalid", "a value in the request cannot be stored")

    @app.exception_handler(Exception)
    async def _bug(req: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", req.method, req.url.path)
        return error_response(500, "internal", "internal error; it has been logged")
