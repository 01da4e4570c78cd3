"""The domain errors: one type per kind of failure, each with the HTTP status and code the API
answers it with (service/errors.py renders them). Code outside the API raises them too (the
registry store, the reward spec): they carry no HTTP machinery."""

from __future__ import annotations


class TabloopError(Exception):
    """Base domain error: subclasses set status_code and code."""

    status_code = 400
    code = "bad_request"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(TabloopError):
    status_code, code = 400, "bad_request"


class Unprocessable(TabloopError):
    status_code, code = 422, "invalid"


class Unauthorized(TabloopError):
    status_code, code = 401, "unauthorized"


class Forbidden(TabloopError):
    status_code, code = 403, "forbidden"


class NotFound(TabloopError):
    status_code, code = 404, "not_found"


class Conflict(TabloopError):
    status_code, code = 409, "conflict"


class PayloadTooLarge(TabloopError):
    status_code, code = 413, "too_large"


class UnsupportedMediaType(TabloopError):
    status_code, code = 415, "unsupported_media_type"


class RateLimited(TabloopError):
    status_code, code = 429, "rate_limited"


class Unavailable(TabloopError):
    status_code, code = 503, "unavailable"
