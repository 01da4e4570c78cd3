"""The offline exact rest-of-line check: the rates, the fresh-line cursors, and a run on the
shipped base policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.config import default_checkpoint
from simulator.exact import check, exact_rates, fresh_cursors, fresh_lines
from simulator.population import in_reject_family
from tabloop.core.corpus import CorpusLine

LINES = ("import os", "", "def walk(self, top):", "    x = top + 1", "    return x")
CORPUS = [CorpusLine(Path("m.py"), no, LINES) for no in (0, 2, 3, 4)]


@pytest.mark.parametrize(
    ("texts", "truths", "expected"),
    [
        pytest.param(
            ["abc", "", "ab", "x  "],
            ["abc", "abc", "abc", "x"],
            {
                "cursors": 4,
                "non_empty": 3,
                "exact": 2,
                "exact_rate": 0.5,
                "exact_rate_non_empty": 2 / 3,
            },
            id="empty-is-a-miss-prefix-is-not-exact",
        ),
        pytest.param(
            ["a)"],
            ["a)  "],
            {
                "cursors": 1,
                "non_empty": 1,
                "exact": 1,
                "exact_rate": 1.0,
                "exact_rate_non_empty": 1.0,
            },
            id="trailing-space-ignored",
        ),
        pytest.param(
            ["", ""],
            ["a", "b"],
            {
                "cursors": 2,
                "non_empty": 0,
                "exact": 0,
                "exact_rate": 0.0,
                "exact_rate_non_empty": None,
            },
            id="all-empty",
        ),
        pytest.param(
            ["abc d"],
            ["abc"],
            {
                "cursors": 1,
                "non_empty": 1,
                "exact": 0,
                "exact_rate": 0.0,
                "exact_rate_non_empty": 0.0,
            },
            id="longer-than-the-line",
        ),
        pytest.param(
            [],
            [],
            {
                "cursors": 0,
                "non_empty": 0,
                "exact": 0,
                "exact_rate": None,
                "exact_rate_non_empty": None,
            },
            id="nothing",
        ),
    ],
)
def test_exact_rates(texts: list[str], truths: list[str], expected: dict[str, object]) -> None:
    assert exact_rates(texts, truths) == pytest.approx(expected)


def test_fresh_cursors_avoid_settled_lines_and_the_reject_family() -> None:
    settled = {("m.py", 3)}
    assert [cl.line_no for cl in fresh_lines(CORPUS, settled)] == [0, 2, 4]
    cursors = fresh_cursors(CORPUS, settled, 60, seed=1)
    assert len(cursors) == 60
    assert {c.line_no for c in cursors} <= {0, 2, 4}
    assert not any(in_reject_family(c.prefix) for c in cursors)
    assert cursors == fresh_cursors(CORPUS, settled, 60, seed=1)  # seeded
    assert cursors != fresh_cursors(CORPUS, settled, 60, seed=2)


def test_check_on_the_base_policy() -> None:
    base = default_checkpoint()
    got = check(base, base, CORPUS, {("m.py", 0)}, 4, seed=0)
    assert (got["cursors"], got["lines"], got["settled_lines"], got["fresh_lines"]) == (4, 4, 1, 3)
    assert "as served" in got["sampling"]
    assert got["base"]["cursors"] == 4 and got["last"] == got["base"]  # the same policy
    assert got["difference"]["exact_rate"] == 0.0
