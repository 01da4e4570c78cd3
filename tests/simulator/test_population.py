"""The simulated people's decision logic: pure functions, tables of inputs and expected outputs."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from simulator.population import (
    MIN_DELAY_S,
    SETTLED_TEXT_MAX_CHARS,
    CursorSource,
    Decision,
    PersonParams,
    PopulationConfig,
    Session,
    cursor_at,
    decide,
    decision_reward,
    draw_person,
    family_cursor,
    in_reject_family,
    judge,
    line_key,
    matched_fraction,
    request_context,
    retention_delays,
    settled_text,
    settles,
    step,
    think_time,
)
from tabloop.core.corpus import CorpusLine

# the sim profile's windows; the decision_reward table below is worked out under these rewards
# (reject 0.25, chars_exponent 0.5), not the RewardSpec defaults
SIM_SPEC = {
    "accept_reward": 0.75,
    "reject_penalty": 0.25,
    "abstain_reward": 0.0,
    "chars_norm": 20,
    "chars_exponent": 0.5,
    "decision_window_s": 4,
    "retention_checks_s": [4, 8, 12],
    "horizon_s": 16,
}

# A person whose every probability is 0: tests set the ones they need to 1.
NOBODY = PersonParams(
    accept_correct=0.0,
    accept_close=0.0,
    accept_wrong=0.0,
    close_similarity=0.8,
    partial_accept=0.0,
    explicit_reject=0.0,
    decide_mean_s=1.0,
    think_mean_s=1.0,
    switch_after=3,
    switch_away_s=5.0,
    churn_after_switches=2,
    useless_window=4,
    useless_accept_rate=0.3,
)


@pytest.mark.parametrize(
    ("text", "truth", "expected"),
    [
        ("foo(a, b):", "foo(a, b):", 1.0),  # exact
        ("foo(", "foo(a, b):", 1.0),  # a prefix of the truth
        ("x = 1  ", "x = 1", 1.0),  # trailing whitespace ignored
        ("foo(a, c):", "foo(a, b):", 0.9),  # one character off
        ("foo(a, b): pass", "foo(a, b):", 10 / 15),  # the truth plus extra text
        ("zzz", "foo", 0.0),  # nothing in common
        ("   ", "   x", 0.0),  # blank: nothing to keep
        ("", "foo", 0.0),  # empty
    ],
)
def test_matched_fraction(text: str, truth: str, expected: float) -> None:
    assert matched_fraction(text, truth) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "truth", "close_similarity", "expected"),
    [
        ("foo(a, b):", "foo(a, b):", 0.8, "correct"),  # the rest of the line
        ("foo(", "foo(a, b):", 0.8, "correct"),  # a prefix of it
        ("x = 1  ", "x = 1", 0.8, "correct"),  # trailing whitespace
        ("foo(a, c):", "foo(a, b):", 0.8, "close"),  # 90% matches
        ("foo(a, c):", "foo(a, b):", 0.95, "wrong"),  # ... but this person is stricter
        ("foo(a, b): pass", "foo(a, b):", 0.7, "wrong"),  # 67% matches
        ("foo(a, b): pass", "foo(a, b):", 0.6, "close"),
        ("bar", "foo(a, b):", 0.8, "wrong"),
        ("   ", "   x", 0.5, "wrong"),  # a blank suggestion is never correct nor close
    ],
)
def test_judge(text: str, truth: str, close_similarity: float, expected: str) -> None:
    assert judge(text, truth, close_similarity) == expected


@pytest.mark.parametrize(
    ("person", "text", "truth", "family", "action", "verdict", "chars", "retained"),
    [
        pytest.param(
            replace(NOBODY, accept_correct=1.0),
            "foo(",
            "foo(a)",
            False,
            "accept",
            "correct",
            4,
            1.0,
            id="correct-accepted-whole",
        ),
        pytest.param(
            replace(NOBODY, explicit_reject=1.0),
            "foo(",
            "foo(a)",
            False,
            "reject",
            "correct",
            0,
            0.0,
            id="correct-but-this-person-rejects",
        ),
        pytest.param(
            NOBODY,
            "foo(",
            "foo(a)",
            False,
            "ignore",
            "correct",
            0,
            0.0,
            id="not-accepted-not-rejected-is-ignored",
        ),
        pytest.param(
            replace(
                NOBODY, accept_correct=1.0, accept_close=1.0, accept_wrong=1.0, explicit_reject=1.0
            ),
            "foo(",
            "foo(a)",
            True,
            "reject",
            "wrong",
            0,
            0.0,
            id="reject-family-is-always-rejected",
        ),
        pytest.param(
            replace(NOBODY, accept_correct=1.0, accept_close=1.0, accept_wrong=1.0),
            "foo(",
            "foo(a)",
            True,
            "ignore",
            "wrong",
            0,
            0.0,
            id="reject-family-ignored-by-a-silent-person",
        ),
        pytest.param(
            replace(NOBODY, accept_close=1.0, partial_accept=1.0),
            "foo(a, c):",
            "foo(a, b):",
            False,
            "accept",
            "close",
            7,
            1.0,
            id="close-partial-accept",
        ),
        pytest.param(
            replace(NOBODY, accept_close=1.0),
            "foo(a, c):",
            "foo(a, b):",
            False,
            "accept",
            "close",
            10,
            0.9,
            id="close-whole-accept-keeps-what-matches",
        ),
        pytest.param(
            replace(NOBODY, accept_close=1.0, partial_accept=1.0),
            "xoo(a, b):",
            "foo(a, b):",
            False,
            "accept",
            "close",
            10,
            0.9,
            id="close-partial-with-no-matching-lead-takes-all",
        ),
        pytest.param(
            replace(NOBODY, accept_wrong=1.0),
            "bar()",
            "foo(a, b):",
            False,
            "accept",
            "wrong",
            5,
            0.4,
            id="wrong-accepted-keeps-little",
        ),
        pytest.param(
            replace(NOBODY, accept_correct=1.0, explicit_reject=1.0),
            "bar()",
            "foo(a, b):",
            False,
            "reject",
            "wrong",
            0,
            0.0,
            id="wrong-rejected",
        ),
    ],
)
def test_decide(
    person: PersonParams,
    text: str,
    truth: str,
    family: bool,
    action: str,
    verdict: str,
    chars: int,
    retained: float,
) -> None:
    d = decide(person, text, truth, family, 3.0, random.Random(0))
    assert (d.action, d.verdict, d.accepted_chars) == (action, verdict, chars)
    assert d.retained_fraction == pytest.approx(retained)


@pytest.mark.parametrize("seed", range(20))
def test_decision_delay_stays_inside_the_window(seed: int) -> None:
    d = decide(replace(NOBODY, decide_mean_s=5.0), "x", "x", False, 2.5, random.Random(seed))
    assert MIN_DELAY_S <= d.delay_s <= 2.5


def test_decide_is_reproducible() -> None:
    person = draw_person(PopulationConfig(), random.Random(3))
    a = [decide(person, "foo(a, c)", "foo(a, b)", False, 3.0, random.Random(9)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


# --- switching and churn -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("session", "accepted", "move", "after"),
    [
        pytest.param(Session(), True, "stay", Session(0, 0, (True,)), id="accept"),
        pytest.param(
            Session(2, 0, (False, False)),
            True,
            "stay",
            Session(0, 0, (False, False, True)),
            id="an-accept-ends-the-bad-run",
        ),
        pytest.param(
            Session(1, 0, (False,)),
            False,
            "stay",
            Session(2, 0, (False, False)),
            id="bad-run-grows",
        ),
        pytest.param(
            Session(2, 0, (True, False, False)),
            False,
            "switch",
            Session(0, 1, (True, False, False, False)),
            id="switch-after-3-bad",
        ),
        pytest.param(
            Session(2, 1, (False, False, False)),
            False,
            "switch",
            Session(0, 2, (False, False, False, False)),
            id="useless-but-too-few-switches-to-leave",
        ),
        pytest.param(
            Session(0, 2, (False, False, False)),
            False,
            "churn",
            Session(1, 2, (False, False, False, False)),
            id="useless-after-2-switches",
        ),
        pytest.param(
            Session(0, 2, (True, True, False)),
            False,
            "stay",
            Session(1, 2, (True, True, False, False)),
            id="two-accepts-in-four-is-not-useless",
        ),
        pytest.param(
            Session(0, 5, (False, False)),
            False,
            "stay",
            Session(1, 5, (False,) * 3),
            id="window-not-full-yet",
        ),
        pytest.param(
            Session(0, 0, (True, True, True, True)),
            True,
            "stay",
            Session(0, 0, (True,) * 4),
            id="window-keeps-the-last-four",
        ),
    ],
)
def test_step(session: Session, accepted: bool, move: str, after: Session) -> None:
    assert step(session, NOBODY, accepted) == (after, move)


# --- where the cursor is -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("import os\n    def fo", True),
        ("def ", True),
        ("class A(B", True),
        ("    async def run(self", True),
        ("    de", False),  # the keyword is not typed yet: not visible in the prefix
        ("    define = 1", False),
        ("x = 'def ", False),
        ("def f():\n    return ", False),  # the def is on an earlier line
    ],
)
def test_in_reject_family(prefix: str, expected: bool) -> None:
    assert in_reject_family(prefix) is expected


LINES = ("import os", "", "    def walk(self, top):", "        return top")


def corpus_line(no: int) -> CorpusLine:
    return CorpusLine(Path("mod.py"), no, LINES)


@pytest.mark.parametrize("col", [5, 10, 20, 23])
def test_request_context_never_sends_the_rest_of_the_line(col: int) -> None:
    cursor = cursor_at(corpus_line(2), col)
    prefix, suffix = request_context(cursor)
    assert prefix + cursor.rest_of_line + suffix == "\n".join(LINES)
    assert cursor.rest_of_line == LINES[2][col:]
    assert suffix == "\n" + LINES[3]  # the following lines only


@pytest.mark.parametrize("seed", range(10))
def test_family_cursor_is_past_the_keyword(seed: int) -> None:
    cursor = family_cursor(corpus_line(2), random.Random(seed))
    assert cursor is not None and in_reject_family(cursor.prefix)
    assert cursor.rest_of_line  # something left to complete


def test_family_cursor_needs_a_signature_line() -> None:
    assert family_cursor(corpus_line(3), random.Random(0)) is None


@pytest.mark.parametrize(("share", "low", "high"), [(1.0, 1.0, 1.0), (0.0, 0.0, 0.2)])
def test_cursor_source_family_share(share: float, low: float, high: float) -> None:
    source = CursorSource([corpus_line(0), corpus_line(2), corpus_line(3)])
    rng = random.Random(0)
    draws = [in_reject_family(source.draw(rng, share).prefix) for _ in range(200)]
    # natural draws land on the def line a third of the time, past its keyword about half of it
    assert low <= sum(draws) / len(draws) <= max(high, 1 / 3)


def test_cursor_source_is_seeded() -> None:
    source = CursorSource([corpus_line(0), corpus_line(2), corpus_line(3)])
    rng_a, rng_b = random.Random(5), random.Random(5)
    a = [source.draw(rng_a, 0.5) for _ in range(20)]
    assert a == [source.draw(rng_b, 0.5) for _ in range(20)]


# --- reward and timing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shown_chars", "decision", "expected"),
    [
        pytest.param(0, None, 0.0, id="abstained"),
        pytest.param(12, Decision("wrong", "reject", 1.0), -0.25, id="rejected"),
        pytest.param(12, Decision("wrong", "ignore", 1.0), -0.25, id="ignored-costs-as-much"),
        pytest.param(20, Decision("correct", "accept", 1.0, 20, 1.0), 0.75, id="20-chars-kept"),
        pytest.param(
            20,
            Decision("close", "accept", 1.0, 5, 1.0),
            0.75 * math.sqrt(5 / 20) * 5 / 20,
            id="partial",
        ),
        pytest.param(20, Decision("close", "accept", 1.0, 20, 0.5), 0.375, id="half-rewritten"),
        pytest.param(
            80,
            Decision("correct", "accept", 1.0, 80, 1.0),
            0.75 * math.sqrt(3),
            id="size-capped-at-3x",
        ),
        pytest.param(
            10,
            Decision("correct", "accept", 1.0, 30, 1.0),
            0.75 * math.sqrt(10 / 20),
            id="accepted-chars-capped-at-shown",
        ),
    ],
)
def test_decision_reward(shown_chars: int, decision: Decision | None, expected: float) -> None:
    assert decision_reward(SIM_SPEC, shown_chars, decision) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("after_s", "margin_s", "expected"),
    [
        (1.0, 1.0, [4.0, 8.0, 12.0]),
        (3.0, 1.0, [4.0, 8.0, 12.0]),  # 3 + 12 = 15 = 16 - 1
        (3.5, 1.0, [4.0, 8.0]),  # the last check would land too close to the horizon
        (0.5, 0.0, [4.0, 8.0, 12.0]),
        (12.5, 0.0, []),
    ],
)
def test_retention_delays(after_s: float, margin_s: float, expected: list[float]) -> None:
    assert retention_delays(SIM_SPEC, after_s, margin_s) == expected


def test_retention_delays_prod_cadence() -> None:
    spec = {**SIM_SPEC, "retention_checks_s": [30, 120, 300, 600], "horizon_s": 600}
    assert retention_delays(spec, 2.0, 1.0) == [30.0, 120.0, 300.0]


@pytest.mark.parametrize("seed", range(10))
def test_think_time_is_bounded(seed: int) -> None:
    assert 0 <= think_time(NOBODY, random.Random(seed)) <= 4 * NOBODY.think_mean_s


# --- the population ------------------------------------------------------------------------


def test_draw_person_is_seeded_and_in_range() -> None:
    cfg = PopulationConfig()
    a, b = draw_person(cfg, random.Random(1)), draw_person(cfg, random.Random(1))
    assert a == b
    assert draw_person(cfg, random.Random(2)) != a
    for name, value in a.__dict__.items():
        low, high = getattr(cfg, name)
        assert low <= value <= high, name
    assert isinstance(a.switch_after, int) and isinstance(a.useless_window, int)


@pytest.mark.parametrize(
    ("given", "field", "expected"),
    [
        ({"accept_close": 0.2}, "accept_close", (0.2, 0.2)),
        ({"accept_close": [0.1, 0.3]}, "accept_close", (0.1, 0.3)),
        ({"reject_family_share": 0.5}, "reject_family_share", 0.5),
        ({}, "accept_wrong", PopulationConfig().accept_wrong),
    ],
)
def test_population_from_dict(given: dict, field: str, expected: object) -> None:
    assert getattr(PopulationConfig.from_dict(given), field) == expected


@pytest.mark.parametrize(
    "given",
    [
        {"accept_typo": 0.1},  # unknown
        {"accept_close": [0.5, 0.1]},  # low > high
        {"accept_close": [0.5, 1.5]},  # a probability above 1
        {"switch_after": [0, 3]},  # nobody switches after zero suggestions
        {"reject_family_share": 2.0},
        {"accept_close": "often"},
    ],
)
def test_population_from_dict_refuses(given: dict) -> None:
    with pytest.raises(ValueError):
        PopulationConfig.from_dict(given)


# --- code_settled ----------------------------------------------------------------------------


def test_nobody_settles_at_share_zero() -> None:
    assert not any(
        settles(seed, slot, gen, 0.0) for seed in range(3) for slot in range(16) for gen in range(3)
    )


def test_everybody_settles_at_share_one() -> None:
    assert all(settles(0, slot, gen, 1.0) for slot in range(16) for gen in range(3))


def test_settles_is_pinned_per_seat_and_generation() -> None:
    # the opt-in stream of seed 0 (seat by seat): changing it changes every run with --settled
    assert [settles(0, slot, 0, 0.5) for slot in range(8)] == [
        False,
        False,
        True,
        False,
        True,
        False,
        False,
        True,
    ]
    assert [settles(0, slot, 1, 0.5) for slot in range(8)] == [
        True,
        False,
        True,
        False,
        False,
        False,
        True,
        False,
    ]


def test_a_larger_share_keeps_everyone_already_opted_in() -> None:
    for low, high in ((0.1, 0.3), (0.3, 0.9)):
        for slot in range(32):
            assert not settles(0, slot, 0, low) or settles(0, slot, 0, high)


def test_the_first_person_of_a_seed_is_pinned() -> None:
    # a seat's person and cursors come from its own rng (seed:seat:generation), which the opt-in
    # draw never touches: pinned here, so a seed replays the same people at every share
    rng = random.Random("0:0:0")
    person = draw_person(PopulationConfig(), rng)
    assert (person.accept_correct, person.switch_after, person.useless_window) == (
        pytest.approx(0.88842727388753),
        8,
        30,
    )


@pytest.mark.parametrize(
    ("line", "col", "expected"),
    [
        pytest.param("x = compute(a, b)", 4, "compute(a, b)", id="rest-of-line"),
        pytest.param("x = 1  ", 4, "1  ", id="trailing-space-kept"),
        pytest.param(
            "s = '" + "a" * 1500 + "'",
            4,
            ("'" + "a" * 1500)[:SETTLED_TEXT_MAX_CHARS],
            id="cut-to-1000",
        ),
        pytest.param("s = 'a\x00b'", 4, "'ab'", id="no-nul"),
    ],
)
def test_settled_text(line: str, col: int, expected: str) -> None:
    cursor = cursor_at(CorpusLine(Path("pkg/m.py"), 0, (line, "y = 2")), col)
    assert settled_text(cursor) == expected
    assert len(settled_text(cursor)) <= SETTLED_TEXT_MAX_CHARS


def test_line_key_is_file_and_line() -> None:
    lines = ("a", "b", "c", "value = 10")
    a = cursor_at(CorpusLine(Path("pkg/m.py"), 3, lines), 3)
    b = cursor_at(CorpusLine(Path("pkg/m.py"), 3, lines), 7)
    assert line_key(a) == line_key(b) == ("pkg/m.py", 3)  # any column of the same line
    assert line_key(cursor_at(CorpusLine(Path("pkg/m.py"), 2, lines), 0)) == ("pkg/m.py", 2)
    assert line_key(cursor_at(CorpusLine(Path("pkg/n.py"), 3, lines), 3)) == ("pkg/n.py", 3)


def test_proxy_decisions_are_pinned() -> None:
    # seed 0's first person deciding on one rng, as a seat does: (action, verdict, delay,
    # accepted chars, retained). Changing these changes every proxy run (--people proxy).
    rng = random.Random("0:0:0")
    person = draw_person(PopulationConfig(), rng)
    cases = [
        ("foo(a, b)", "foo(a, b)", False),
        ("foo(a, c)", "foo(a, b)", False),
        ("bar()", "foo(a, b)", False),
        (")", ")", False),
        ("x", "x = 1", True),
        ("foo(a, c)", "foo(a, b)", False),
    ]
    got = [
        (d.action, d.verdict, round(d.delay_s, 4), d.accepted_chars, round(d.retained_fraction, 4))
        for d in (decide(person, t, tr, f, 3.0, rng) for _ in range(2) for t, tr, f in cases)
    ]
    assert got == [
        ("reject", "correct", 0.15, 0, 0.0),
        ("reject", "close", 0.5464, 0, 0.0),
        ("ignore", "wrong", 1.0483, 0, 0.0),
        ("accept", "correct", 0.246, 1, 1.0),
        ("reject", "wrong", 0.4038, 0, 0.0),
        ("reject", "close", 0.15, 0, 0.0),
        ("accept", "correct", 0.5996, 9, 1.0),
        ("accept", "close", 0.638, 9, 0.8889),
        ("reject", "wrong", 0.7596, 0, 0.0),
        ("accept", "correct", 2.3259, 1, 1.0),
        ("reject", "wrong", 1.8007, 0, 0.0),
        ("accept", "close", 0.1916, 9, 0.8889),
    ]
