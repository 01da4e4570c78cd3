"""Request bodies, bounded: a size cap before and after gzip, so a gzip bomb is refused cheaply.

Pure ASGI middleware: the body is read (at most `limit` bytes), inflated in bounded steps when
`Content-Encoding: gzip`, and handed to the app as a plain body.
"""

from __future__ import annotations

import zlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_response


def inflate_bounded(data: bytes, limit: int) -> bytes:
    """Gunzip `data`, refusing (OverflowError) as soon as the output would pass `limit` bytes.

    Several gzip members one after the other (RFC 1952; what `cat a.gz b.gz` makes) inflate to
    their concatenation; anything else after a member, a truncated member or a bad checksum is a
    ValueError. Nothing is silently dropped."""
    out: list[bytes] = []
    produced = 0
    pending = data
    while True:  # one gzip member per turn
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        while True:
            try:
                # at least 1: a max_length of 0 would mean "no limit" to zlib
                chunk = inflater.decompress(pending, limit + 1 - produced)
            except zlib.error as e:
                raise ValueError(f"invalid gzip body: {e}") from None
            produced += len(chunk)
            if produced > limit:
                raise OverflowError
            out.append(chunk)
            pending = inflater.unconsumed_tail
            if not pending:
                break
        if not inflater.eof:
            raise ValueError("invalid gzip body: truncated")
        pending = inflater.unused_data
        if not pending:
            return b"".join(out)


class BodyLimitMiddleware:
    """Caps every request body at `limit` bytes (`limits` overrides it by path prefix)."""

    def __init__(self, app: ASGIApp, limit: int, limits: dict[str, int] | None = None) -> None:
        self.app, self.limit, self.limits = app, limit, limits or {}

    def _limit_for(self, path: str) -> int:
        for prefix, limit in self.limits.items():
            if path.startswith(prefix):
                return limit
        return self.limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self._limit_for(scope["path"])
        headers = {k.lower(): v for k, v in scope["headers"]}
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if encoding not in ("identity", "gzip"):
            await self._fail(
                scope,
                receive,
                send,
                415,
                "unsupported_encoding",
                f"Content-Encoding {encoding!r} is not supported; use gzip or none",
            )
            return
        declared = headers.get(b"content-length")
        too_large = f"request body is over the {limit} byte limit"
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._fail(scope, receive, send, 413, "too_large", too_large)
            return

        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._fail(scope, receive, send, 413, "too_large", too_large)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)

        if encoding == "gzip":
            try:
                body = inflate_bounded(body, limit)
            except OverflowError:
                await self._fail(
                    scope,
                    receive,
                    send,
                    413,
                    "too_large",
                    f"decompressed body is over the {limit} byte limit",
                )
                return
            except ValueError as e:
                await self._fail(scope, receive, send, 400, "bad_encoding", str(e))
                return
            scope = dict(scope)
            scope["headers"] = [
                (k, v)
                for k, v in scope["headers"]
                if k.lower() not in (b"content-encoding", b"content-length")
            ] + [(b"content-length", str(len(body)).encode())]

        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def _fail(
        scope: Scope, receive: Receive, send: Send, status: int, code: str, msg: str
    ) -> None:
        await error_response(status, code, msg, {"Connection": "close"})(scope, receive, send)
