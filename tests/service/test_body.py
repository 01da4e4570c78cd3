"""Bounded gzip inflation: a bomb is stopped at the limit, not inflated in full."""

from __future__ import annotations

import gzip

import pytest

from service.body import inflate_bounded


def test_inflates_within_limit() -> None:
    data = b'{"events": []}' * 100
    assert inflate_bounded(gzip.compress(data), len(data)) == data


def test_bomb_stops_at_limit() -> None:
    bomb = gzip.compress(b"\0" * 200_000_000)  # ~200 KB compressed
    with pytest.raises(OverflowError):
        inflate_bounded(bomb, 1_000_000)


@pytest.mark.parametrize(
    "data",
    [b"not gzip at all", gzip.compress(b"x" * 1000, mtime=0)[:-12]],
    ids=["not gzip", "truncated"],
)
def test_broken_gzip(data: bytes) -> None:
    with pytest.raises(ValueError, match="invalid gzip body"):
        inflate_bounded(data, 10_000)
