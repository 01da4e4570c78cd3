"""Logging: one JSON object per line (or plain text), request ids, and the access log.

`RequestLogMiddleware` gives every HTTP request an id — the client's `X-Request-ID` when it is
sane, else a new one — returns it in the response header, and keeps it in a context variable
that a filter copies onto every log record made while the request is handled (the thread pool
that runs sync routes copies the context, so their records carry it too). Each request ends with
one access line on the `tabloop.access` logger: method, path (no query string), status,
duration and the API key id once authenticated. Never the token, a body or code text.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import IO, Any, Literal

from pythonjsonlogger.json import JsonFormatter

LogFormat = Literal["json", "text"]
REQUEST_ID_HEADER = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

access_log = logging.getLogger("tabloop.access")


@dataclass
class RequestLog:
    """What the log knows about the request being handled (mutable: auth sets key_id)."""

    request_id: str
    key_id: str | None = None


_current: ContextVar[RequestLog | None] = ContextVar("tabloop_request", default=None)


def current_request() -> RequestLog | None:
    return _current.get()


class RequestIdFilter(logging.Filter):
    """Puts `request_id` on records made inside a request (on the handler: every logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        req = _current.get()
        if req is not None and not hasattr(record, "request_id"):
            record.request_id = req.request_id
        return True


class TextFormatter(logging.Formatter):
    """The human format, with the request id when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [request_id={rid}]" if rid else line


def make_formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter(
            "{levelname}{name}{message}",
            style="{",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",  # ISO 8601, UTC
            json_ensure_ascii=False,
        )
    return TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def setup_logging(level: str, fmt: LogFormat, stream: IO[str] | None = None) -> None:
    """Route every logger (uvicorn's included: it is started with log_config=None) to one
    stderr handler in `fmt`; replaces any handler set up before."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # one line a plugin


def request_id_from(value: str | None) -> str:
    """The client's id if it is short and plain (it is echoed and logged), else a new one."""
    if value is not None and _SANE_ID.fullmatch(value):
        return value
    return uuid.uuid4().hex


class RequestLogMiddleware:
    """Request id in, request id out, one access line per request (pure ASGI, so it runs in the
    request's own task and the context variable is seen by everything below it)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        req = RequestLog(request_id_from(header.decode("latin-1") if header else None))
        token = _current.set(req)
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                headers.append((b"x-request-id", req.request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            ms = round((time.perf_counter() - start) * 1000, 2)
            extra: dict[str, Any] = {
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "duration_ms": ms,
            }
            if req.key_id is not None:
                extra["key_id"] = req.key_id
            access_log.info(
                "%s %s %d %.1fms", scope["method"], scope["path"], status, ms, extra=extra
            )
            _current.reset(token)
