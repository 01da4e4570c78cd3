"""Property tests of bounded gzip inflation (service/body.py): round trips, the limit, and broken
input, which must only ever be a ValueError (400) or an OverflowError (413)."""

from __future__ import annotations

import gzip
import zlib

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service.body import inflate_bounded

FUZZ = settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
payloads = st.binary(max_size=4096) | st.text(max_size=2048).map(str.encode)


@FUZZ
@given(data=payloads, extra=st.integers(0, 64))
def test_round_trip_within_limit(data: bytes, extra: int) -> None:
    assert inflate_bounded(gzip.compress(data), len(data) + extra) == data


@FUZZ
@given(data=st.binary(min_size=1, max_size=4096), short=st.integers(1, 64))
def test_over_the_limit_is_overflow(data: bytes, short: int) -> None:
    limit = max(0, len(data) - short)
    try:
        inflate_bounded(gzip.compress(data), limit)
    except OverflowError:
        return
    raise AssertionError("inflated past the limit")


@FUZZ
@given(parts=st.lists(payloads, min_size=1, max_size=4))
def test_several_members_inflate_to_their_concatenation(parts: list[bytes]) -> None:
    body = b"".join(gzip.compress(p) for p in parts)
    assert inflate_bounded(body, sum(map(len, parts))) == b"".join(parts)


@FUZZ
@given(data=payloads, cut=st.integers(1, 10_000))
def test_truncated_is_value_error(data: bytes, cut: int) -> None:
    whole = gzip.compress(data)
    truncated = whole[: max(0, len(whole) - cut)]
    try:
        inflate_bounded(truncated, 1 << 20)
    except ValueError as e:
        assert "invalid gzip body" in str(e)
        return
    raise AssertionError("a truncated gzip body was accepted")


@FUZZ
@given(data=payloads, where=st.integers(0), flip=st.integers(1, 255))
def test_corrupt_is_refused_or_harmless(data: bytes, where: int, flip: int) -> None:
    body = bytearray(gzip.compress(data, mtime=0))
    body[where % len(body)] ^= flip
    try:
        out = inflate_bounded(bytes(body), len(data) + 64)
    except (ValueError, OverflowError):
        return
    # a flipped bit the format does not check (the header's time, extra flags, OS byte): the
    # CRC-32 and length in the trailer still vouch for the data, never other data
    assert out == data


@FUZZ
@given(
    data=payloads,
    tail=st.binary(min_size=1, max_size=32).filter(lambda t: not t.startswith(b"\x1f\x8b")),
)
def test_trailing_garbage_is_refused(data: bytes, tail: bytes) -> None:
    try:
        inflate_bounded(gzip.compress(data) + tail, len(data) + 64)
    except ValueError:
        return
    raise AssertionError("bytes after the gzip stream were silently dropped")


@FUZZ
@given(body=st.binary(max_size=2048))
@example(body=b"\x1f\x8b")
@example(body=b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03")
@example(body=zlib.compress(b"{}"))  # zlib, not gzip
def test_arbitrary_bytes_only_raise_the_intended_errors(body: bytes) -> None:
    try:
        out = inflate_bounded(body, 4096)
    except (ValueError, OverflowError):
        return
    assert len(out) <= 4096
