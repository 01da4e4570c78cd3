"""tabloop.core.person: the person and the moment as numbers, from tables of cases."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from tabloop.core.person import (
    HISTORY,
    PERSON_INPUTS,
    History,
    features,
    history_of,
    length_bucket,
    moment_of,
)


def _f(history: History, prefix: str, text: str, suffix: str = "") -> dict[str, float]:
    return dict(zip(PERSON_INPUTS, features(history, moment_of(prefix, suffix), text), strict=True))


def test_nothing_known_is_all_zero_but_the_moment() -> None:
    f = _f(History(), "x = foo(", "a, b)")
    assert [f[k] for k in PERSON_INPUTS[:4]] == [0.0, 0.0, 0.0, 0.0]
    assert f["gap"] == 0.0 and f["short"] == 1.0 and f["short_rate"] == 0.0
    assert f["end_open"] == 1.0 and f["end_word"] == 0.0


@pytest.mark.parametrize(
    ("outcomes", "prev", "rate_sign"),
    [
        (((10, True),), 1.0, 1),
        (((10, False),), -1.0, -1),
        (((10, False), (10, True), (10, True), (10, True)), -1.0, 1),
        (((3, True), (3, False), (3, False), (3, False)), 1.0, -1),
    ],
    ids=["one-taken", "one-not", "last-not-most-taken", "last-taken-most-not"],
)
def test_the_previous_outcome_and_the_rate(
    outcomes: tuple[tuple[int, bool], ...], prev: float, rate_sign: int
) -> None:
    f = _f(History(outcomes, 1.0), "x = ", "value")
    assert f["prev_accepted"] == prev
    assert math.copysign(1, f["accept_rate"]) == rate_sign
    assert f["history"] == len(outcomes) / HISTORY


def test_the_length_rate_reads_the_same_bucket_only() -> None:
    refuses_short = History(((3, False), (4, False), (40, True), (50, True)), 1.0)
    short, long = _f(refuses_short, "x = ", "1)"), _f(refuses_short, "x = ", "a" * 45)
    assert short["length_rate"] < 0 < long["length_rate"]
    assert short["short_rate"] == short["length_rate"] and long["short_rate"] == 0.0
    assert short["accept_rate"] == long["accept_rate"]


@pytest.mark.parametrize(
    ("chars", "bucket"), [(0, 0), (5, 0), (6, 1), (20, 1), (21, 2), (60, 2), (61, 3)]
)
def test_length_buckets(chars: int, bucket: int) -> None:
    assert length_bucket(chars) == bucket


@pytest.mark.parametrize(
    ("prefix", "suffix", "expect"),
    [
        ("def f(x):\n    return x", "", {"end_word": 1.0}),
        ("def f(x):\n    return ", "", {"end_space": 1.0}),
        ("def f(x):\n    ", "", {"at_indent": 1.0}),
        ("def f(x):\n    # note: ", "", {"comment": 1.0, "end_space": 1.0}),
        ("print(", ")\nx = 1", {"end_open": 1.0, "follows": 1.0}),
        ("", "", {"at_indent": 1.0}),  # the start of a line
    ],
    ids=["word", "space", "indent", "comment", "open-follows", "empty-file"],
)
def test_the_moment(prefix: str, suffix: str, expect: dict[str, float]) -> None:
    f = _f(History(), prefix, "abc", suffix)
    for k in ("end_word", "end_space", "end_open", "at_indent", "comment", "follows"):
        assert f[k] == expect.get(k, 0.0), k


def test_gap_and_position_are_capped() -> None:
    far = _f(History((), 1e9), "\n" * 100_000, "x")
    assert far["gap"] == 1.0 and far["position"] == 1.0
    near = _f(History((), 0.0), "x", "y")
    assert near["gap"] == 0.0 and near["position"] == 0.0


def test_history_of_rows_leaves_pending_suggestions_out() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def row(age_s: float, shown: bool, taken: bool, judged: bool) -> SimpleNamespace:
        return SimpleNamespace(
            created_at=now - timedelta(seconds=age_s),
            shown=shown,
            text_chars=7,
            taken=taken,
            judged=judged,
        )

    rows = [
        row(1, True, False, False),  # pending: still inside the window
        row(2, False, False, False),  # abstained: no outcome
        row(3, True, True, True),
        row(50, True, False, False),  # never judged, window over: not taken
    ]
    h = history_of(rows, now, pending_s=30)
    assert h.outcomes == ((7, True), (7, False)) and h.since_s == 1.0
    assert history_of([], now, 30) == History()
