"""The reward function, table-driven: each row a named case (DESIGN.md "Reward semantics")."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from service.events.schemas import EVENT_TYPES, parse_event
from tabloop.core.reward import (
    CLOCK_SKEW_S,
    COMPONENTS,
    Feedback,
    Reward,
    RolloutInfo,
    compute_reward,
    finalize_at,
    is_late,
    settle,
)
from tabloop.core.reward_spec import RewardSpec, show_threshold, show_thresholds, size_scale
from tabloop.testing.factories import event as event_json

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
DEFAULT = RewardSpec()
# the hand-worked values of the decision, size and worked-example tables are computed under this
TAB = RewardSpec(reject_penalty=0.25, chars_exponent=0.5)
SIM = RewardSpec.sim()
_ids = itertools.count()


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ro(sid: str = "s1", t: float = 0, *, shown: bool = True, chars: int = 20, user: str = "u1"):
    return RolloutInfo(
        suggestion_id=sid, user_id=user, created_at=at(t), shown=shown, text_chars=chars
    )


def ev(
    type_: str,
    t: float,
    sid: str | None = "s1",
    *,
    user: str = "u1",
    eid: str | None = None,
    **kw: Any,
) -> Feedback:
    if type_ in ("model_switch", "churn"):
        sid = None
    return Feedback(
        event_id=eid or f"e{next(_ids):05d}",
        type=type_,
        user_id=user,
        occurred_at=at(t),
        suggestion_id=sid,
        **kw,
    )


def kept(after: float, fraction: float, t: float, sid: str = "s1", **kw: Any) -> Feedback:
    return ev("code_retained", t, sid, after_seconds=after, retained_fraction=fraction, **kw)


W = TAB.provisional_accept_weight  # an accept's retention with no report measured
PROVISIONAL = 0.75 * W  # a whole 20-char accept with no retention report yet


# --- decision, size, share, retention --------------------------------------------------------

DECISION_CASES = [
    # (rollout, events, outcome, value)
    pytest.param(ro(shown=False, chars=0), [], "abstained", 0.0, id="abstained"),
    pytest.param(
        ro(shown=False, chars=0),
        [ev("accept", 5)],
        "abstained",
        0.0,
        id="abstained-decision-ignored",
    ),
    pytest.param(ro(), [], "ignored", -0.25, id="shown-no-events-ignored"),
    pytest.param(ro(), [ev("reject", 5)], "rejected", -0.25, id="reject"),
    pytest.param(ro(), [ev("reject", 30)], "rejected", -0.25, id="reject-exactly-at-window-edge"),
    pytest.param(ro(), [ev("reject", 31)], "ignored", -0.25, id="reject-one-second-after-window"),
    pytest.param(
        ro(), [ev("accept", 30)], "accepted", PROVISIONAL, id="accept-exactly-at-window-edge"
    ),
    pytest.param(ro(), [ev("accept", 31)], "ignored", -0.25, id="accept-one-second-after-window"),
    pytest.param(
        ro(),
        [ev("accept", -CLOCK_SKEW_S)],
        "accepted",
        PROVISIONAL,
        id="accept-before-rollout-within-clock-skew",
    ),
    pytest.param(
        ro(),
        [ev("accept", -CLOCK_SKEW_S - 1)],
        "ignored",
        -0.25,
        id="accept-before-rollout-beyond-clock-skew",
    ),
    pytest.param(
        ro(),
        [ev("accept", 3), ev("reject", 4)],
        "accepted",
        PROVISIONAL,
        id="accept-then-reject-first-wins",
    ),
    pytest.param(
        ro(),
        [ev("accept", 4), ev("reject", 3)],
        "rejected",
        -0.25,
        id="reject-then-accept-first-wins",
    ),
    pytest.param(
        ro(),
        [ev("accept", 3), ev("reject", 3)],
        "rejected",
        -0.25,
        id="accept-and-reject-same-instant-reject-wins",
    ),
    pytest.param(
        ro(),
        [ev("reject", 40), ev("accept", 10)],
        "accepted",
        PROVISIONAL,
        id="reject-after-window-does-not-beat-accept",
    ),
    pytest.param(ro(), [ev("accept", 5, "s2")], "ignored", -0.25, id="accept-other-suggestion"),
    pytest.param(
        ro(), [ev("accept", 5, user="u2")], "ignored", -0.25, id="accept-same-suggestion-other-user"
    ),
    # size and share
    pytest.param(
        ro(),
        [ev("accept", 5, accepted_chars=20)],
        "accepted",
        PROVISIONAL,
        id="accept-with-accepted-chars-whole",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5, accepted_chars=5)],
        "accepted",
        0.75 * 0.5 * 0.25 * W,
        id="partial-accept-5-of-20",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5, accepted_chars=50)],
        "accepted",
        PROVISIONAL,
        id="accepted-chars-more-than-text-clamped",
    ),
    pytest.param(
        ro(), [ev("accept", 5, accepted_chars=0)], "accepted", 0.0, id="accepted-chars-zero"
    ),
    pytest.param(
        ro(chars=80),
        [ev("accept", 5)],
        "accepted",
        0.75 * math.sqrt(3) * W,
        id="long-accept-size-capped-at-3-norm",
    ),
    pytest.param(
        ro(chars=5), [ev("accept", 5)], "accepted", 0.75 * 0.5 * W, id="short-whole-accept"
    ),
    # retention
    pytest.param(
        ro(),
        [ev("accept", 5), kept(30, 0.8, 35)],
        "accepted",
        0.75 * 0.8,
        id="retention-one-report",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5), kept(300, 0.4, 305), kept(30, 0.9, 35), kept(120, 0.6, 125)],
        "accepted",
        0.75 * 0.4,
        id="retention-several-reports-last-counts",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5), kept(120, 0.6, 125), kept(120, 0.2, 126)],
        "accepted",
        0.75 * 0.2,
        id="retention-same-check-twice-later-report-counts",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5), kept(120, 0.6, 125), kept(700, 0.1, 590)],
        "accepted",
        0.75 * 0.6,
        id="retention-check-after-horizon-seconds-ignored",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5), kept(120, 0.6, 125), kept(600, 0.1, 605)],
        "accepted",
        0.75 * 0.6,
        id="retention-report-occurred-after-horizon-ignored",
    ),
    pytest.param(
        ro(),
        [ev("accept", 0), kept(600, 0.3, 600)],
        "accepted",
        0.75 * 0.3,
        id="retention-report-exactly-at-horizon-counts",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5), kept(600, 0.1, 605)],
        "accepted",
        PROVISIONAL,
        id="retention-only-report-after-horizon-stays-provisional",
    ),
    pytest.param(
        ro(), [ev("accept", 5), kept(30, 0.0, 35)], "accepted", 0.0, id="retention-nothing-kept"
    ),
    pytest.param(
        ro(),
        [ev("accept", 5), kept(30, 0.5, 35, "s2")],
        "accepted",
        PROVISIONAL,
        id="retention-report-for-other-suggestion",
    ),
    pytest.param(
        ro(),
        [ev("reject", 5), kept(30, 1.0, 35)],
        "rejected",
        -0.25,
        id="retention-report-on-rejected-rollout",
    ),
    # duplicates
    pytest.param(
        ro(),
        [ev("accept", 5, eid="a"), ev("accept", 5, eid="a")],
        "accepted",
        PROVISIONAL,
        id="duplicate-accept-counted-once",
    ),
    pytest.param(
        ro(),
        [ev("accept", 5), kept(30, 0.8, 35, eid="k"), kept(30, 0.8, 35, eid="k")],
        "accepted",
        0.75 * 0.8,
        id="duplicate-retention-report",
    ),
]


@pytest.mark.parametrize(("rollout", "events", "outcome", "value"), DECISION_CASES)
def test_decision(rollout: RolloutInfo, events: list[Feedback], outcome: str, value: float):
    reward = compute_reward(rollout, events, [rollout], TAB)
    assert reward.outcome == outcome
    assert reward.value == pytest.approx(value)
    assert set(reward.components) == set(COMPONENTS)
    assert reward.value == pytest.approx(
        reward.components["decision"] + reward.components["switch"] + reward.components["churn"]
    )
    # arrival order never matters
    assert compute_reward(rollout, events[::-1], [rollout], TAB) == reward


def test_components_of_an_accept() -> None:
    events = [ev("accept", 5, accepted_chars=5), kept(30, 0.8, 35)]
    reward = compute_reward(ro(), events, [ro()], TAB)
    assert reward.components == pytest.approx(
        {
            "decision": 0.75 * 0.5 * 0.25 * 0.8,
            "size_scale": 0.5,
            "share": 0.25,
            "retention": 0.8,
            "provisional": 0.0,
            "switch": 0.0,
            "churn": 0.0,
        }
    )
    provisional = compute_reward(ro(), events[:1], [ro()], TAB).components
    assert provisional["retention"] == W and provisional["provisional"] == 1.0
    # the retention measured on clients that report it, when the caller has one
    measured = compute_reward(ro(), events[:1], [ro()], TAB, provisional=0.7).components
    assert measured["retention"] == 0.7 and measured["provisional"] == 1.0


@pytest.mark.parametrize(
    ("chars", "expected"),
    [
        pytest.param(0, 0.0, id="nothing"),
        pytest.param(-3, 0.0, id="negative"),
        pytest.param(3, math.sqrt(3 / 20), id="3-chars-median-exact-hit"),
        pytest.param(20, 1.0, id="20-chars-norm"),
        pytest.param(60, math.sqrt(3), id="60-chars-cap"),
        pytest.param(100, math.sqrt(3), id="100-chars-capped"),
    ],
)
def test_size_scale(chars: int, expected: float) -> None:
    assert size_scale(chars, TAB) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("chars", "expected"),
    [
        pytest.param(0, 0.0, id="nothing"),
        pytest.param(3, 3 / 20, id="3-chars"),
        pytest.param(20, 1.0, id="20-chars-norm"),
        pytest.param(60, 3.0, id="60-chars-cap"),
        pytest.param(100, 3.0, id="100-chars-capped"),
    ],
)
def test_default_size_scale_is_linear(chars: int, expected: float) -> None:
    """The default chars_exponent 1: an accept is worth its characters, up to 3 * chars_norm."""
    assert size_scale(chars, DEFAULT) == pytest.approx(expected)


def _break_even(chars: int, spec: RewardSpec) -> float:
    """The accept rate at which showing a whole, kept `chars`-char suggestion earns nothing."""
    rollout = ro(chars=chars)
    accepted = compute_reward(rollout, [ev("accept", 1), kept(30, 1.0, 31)], [rollout], spec)
    rejected = compute_reward(rollout, [ev("reject", 1)], [rollout], spec)
    p = -rejected.value / (accepted.value - rejected.value)
    assert p * accepted.value + (1 - p) * rejected.value == pytest.approx(0.0)
    return p


@pytest.mark.parametrize(
    ("chars", "low", "high"),
    [
        pytest.param(3, 0.45, 0.50, id="3-chars-about-half"),  # 0.4626
        pytest.param(20, 0.25, 0.25, id="20-chars-a-quarter"),
        pytest.param(60, 1 / 6 - 0.01, 1 / 6, id="60-chars-about-one-in-six"),  # 0.1613
        pytest.param(100, 1 / 6 - 0.01, 1 / 6, id="100-chars-same-as-60"),
    ],
)
def test_break_even_accept_rate(chars: int, low: float, high: float) -> None:
    """Showing pays when p * accept - (1 - p) * reject > 0 (kept code, whole accept); TAB."""
    p = _break_even(chars, TAB)
    assert low - 1e-9 <= p <= high + 1e-9
    assert p == pytest.approx(0.25 / (0.25 + 0.75 * size_scale(chars, TAB)))


@pytest.mark.parametrize(
    ("chars", "expected"),
    [
        pytest.param(3, 0.1 / (0.75 * 3 / 20 + 0.1), id="3-chars-about-0.47"),  # 0.4706
        pytest.param(10, 0.1 / (0.75 * 10 / 20 + 0.1), id="10-chars-about-0.21"),  # 0.2105
        pytest.param(20, 0.1 / (0.75 + 0.1), id="20-chars-about-0.12"),  # 0.1176
        pytest.param(60, 0.1 / (0.75 * 3 + 0.1), id="60-chars-about-0.04"),  # 0.04255
        pytest.param(100, 0.1 / (0.75 * 3 + 0.1), id="100-chars-same-as-60"),
    ],
)
def test_default_break_even_accept_rate(chars: int, expected: float) -> None:
    """DESIGN.md "Reward spec": the default spec's thresholds (accept 0.75 per 20 characters,
    linear up to 60; a wrong suggestion shown costs 0.1)."""
    assert _break_even(chars, DEFAULT) == pytest.approx(expected)
    assert show_threshold(DEFAULT, chars, 1.0) == pytest.approx(expected)


SPECS = [
    pytest.param(DEFAULT, id="default"),
    pytest.param(TAB, id="tab"),
    pytest.param(RewardSpec(provisional_accept_weight=1.0), id="no-report-full-weight"),
    pytest.param(
        RewardSpec(reject_penalty=0.1, chars_exponent=1.0, abstain_reward=-0.02), id="linear"
    ),
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("chars", [1, 3, 10, 20, 60, 200])
@pytest.mark.parametrize("report", [True, False], ids=["kept", "no-report"])
def test_show_threshold_is_the_reward_functions_break_even(
    spec: RewardSpec, chars: int, report: bool
) -> None:
    """At the threshold, showing earns what abstaining does, by compute_reward's own values."""
    rollout = ro(chars=chars)
    events = [ev("accept", 1)] + ([kept(30, 1.0, 31)] if report else [])
    accepted = compute_reward(rollout, events, [rollout], spec).value
    rejected = compute_reward(rollout, [ev("reject", 1)], [rollout], spec).value
    ignored = compute_reward(rollout, [], [rollout], spec).value
    silent = ro(chars=0, shown=False)
    abstained = compute_reward(silent, [], [silent], spec).value
    assert ignored == rejected
    p = show_threshold(spec, chars, 1.0 if report else None)
    assert p is not None and 0 < p < 1
    assert p * accepted + (1 - p) * rejected == pytest.approx(abstained)


def test_show_threshold_when_showing_never_or_always_pays() -> None:
    assert show_threshold(RewardSpec(accept_reward=0.0), 20) is None
    assert show_threshold(RewardSpec(reject_penalty=0.0), 20) == 0.0
    assert show_threshold(RewardSpec(), 0) is None  # nothing to accept: only the cost


def test_the_documented_thresholds_are_the_defaults() -> None:
    """docs/REWARD.md's table of show thresholds is what show_thresholds gives the default."""
    text = (Path(__file__).parents[3] / "docs" / "REWARD.md").read_text()
    table = text.split("| suggestion chars | kept (report of 1) | no retention report |")[1]
    rows = [line for line in table.split("\n\n")[0].splitlines() if line.startswith("| ")]
    documented = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    assert documented == [
        [str(t["chars"]), f"{t['kept']:.3f}", f"{t['no_report']:.3f}"]
        for t in show_thresholds(DEFAULT)
    ]


# --- model_switch and churn --------------------------------------------------------------------

# One user's rollouts: shown at 0, 100, 200; abstained at 150; shown at 400.
R0, R100, R200, R400 = ro("s0", 0), ro("s100", 100), ro("s200", 200), ro("s400", 400)
A150 = ro("a150", 150, shown=False, chars=0)
USER = [R0, R100, A150, R200, R400]

SWITCH_CASES = [
    # (rollout, user_rollouts, events, expected switch component)
    pytest.param(R200, [R200], [ev("model_switch", 250)], -0.5, id="one-shown-rollout"),
    pytest.param(
        R200, USER, [ev("model_switch", 250)], -0.5 / 3, id="three-shown-abstained-excluded"
    ),
    pytest.param(R0, USER, [ev("model_switch", 250)], -0.5 / 3, id="three-shown-oldest"),
    pytest.param(A150, USER, [ev("model_switch", 250)], 0.0, id="abstained-gets-no-switch-share"),
    pytest.param(R0, USER, [ev("model_switch", 300)], -0.5 / 3, id="switch-exactly-at-window-edge"),
    pytest.param(R0, USER, [ev("model_switch", 301)], 0.0, id="switch-one-second-after-window"),
    pytest.param(
        R100, USER, [ev("model_switch", 301)], -0.5 / 2, id="outside-window-leaves-the-others"
    ),
    pytest.param(R400, USER, [ev("model_switch", 250)], 0.0, id="switch-before-rollout"),
    pytest.param(
        R400,
        USER,
        [ev("model_switch", 400 - CLOCK_SKEW_S)],
        -0.5 / 3,
        id="switch-before-rollout-within-clock-skew",
    ),
    pytest.param(
        R200,
        USER,
        [ev("model_switch", 250, eid="m"), ev("model_switch", 250, eid="m")],
        -0.5 / 3,
        id="duplicate-switch-counted-once",
    ),
    pytest.param(
        R200,
        USER,
        [ev("model_switch", 250), ev("model_switch", 260)],
        -1.0 / 3,
        id="two-switches-add-up",
    ),
    pytest.param(R200, USER, [ev("model_switch", 250, user="u2")], 0.0, id="other-users-switch"),
    pytest.param(
        R200,
        [R0, R100],
        [ev("model_switch", 250)],
        -0.5 / 3,
        id="rollout-missing-from-user-rollouts-still-counted",
    ),
    pytest.param(
        R200,
        [*USER, ro("x", 220, user="u2")],
        [ev("model_switch", 250)],
        -0.5 / 3,
        id="other-users-rollouts-not-counted",
    ),
]


@pytest.mark.parametrize(("rollout", "user_rollouts", "events", "expected"), SWITCH_CASES)
def test_model_switch(
    rollout: RolloutInfo, user_rollouts: list[RolloutInfo], events: list[Feedback], expected: float
) -> None:
    reward = compute_reward(rollout, events, user_rollouts, DEFAULT)
    assert reward.components["switch"] == pytest.approx(expected)
    assert reward.components["churn"] == 0.0


def test_switch_penalty_sums_to_the_spec_over_the_shown_rollouts() -> None:
    switch = [ev("model_switch", 250)]
    total = sum(compute_reward(r, switch, USER, DEFAULT).components["switch"] for r in USER)
    assert total == pytest.approx(-DEFAULT.switch_penalty)


CHURN_CASES = [
    # (rollout, events, expected churn component); USER as the user's rollouts
    pytest.param(R0, [ev("churn", 450)], -1.0 / 5, id="all-five-inside-horizon"),
    pytest.param(A150, [ev("churn", 450)], -1.0 / 5, id="abstained-gets-churn-share"),
    pytest.param(R0, [ev("churn", 600)], -1.0 / 5, id="churn-exactly-at-horizon"),
    pytest.param(R0, [ev("churn", 601)], 0.0, id="churn-one-second-past-horizon"),
    pytest.param(R100, [ev("churn", 601)], -1.0 / 4, id="past-horizon-leaves-the-others"),
    pytest.param(R400, [ev("churn", 300)], 0.0, id="churn-before-rollout"),
    pytest.param(
        R0,
        [ev("churn", 450, eid="c"), ev("churn", 450, eid="c")],
        -1.0 / 5,
        id="duplicate-churn-counted-once",
    ),
    pytest.param(R0, [ev("churn", 450, user="u2")], 0.0, id="other-users-churn"),
]


@pytest.mark.parametrize(("rollout", "events", "expected"), CHURN_CASES)
def test_churn(rollout: RolloutInfo, events: list[Feedback], expected: float) -> None:
    reward = compute_reward(rollout, events, USER, DEFAULT)
    assert reward.components["churn"] == pytest.approx(expected)
    assert reward.components["switch"] == 0.0


def test_abstained_with_switch_and_churn() -> None:
    reward = compute_reward(A150, [ev("model_switch", 250), ev("churn", 450)], USER, DEFAULT)
    assert reward.outcome == "abstained"
    assert reward.components["switch"] == 0.0
    assert reward.value == pytest.approx(0.0 - 1.0 / 5)


def test_worked_example() -> None:
    """docs/REWARD.md's worked example, number for number, under TAB; then the default's."""
    r1 = ro("s1", 0, chars=40)
    r2 = ro("s2", 60, chars=12)
    r3 = ro("s3", 90, shown=False, chars=0)
    user = [r1, r2, r3]
    events = [
        ev("accept", 4, "s1", accepted_chars=30),
        kept(30, 1.0, 34, "s1"),
        kept(120, 0.9, 124, "s1"),
        kept(300, 0.8, 304, "s1"),
        ev("reject", 62, "s2"),
        ev("model_switch", 200),
    ]
    one = compute_reward(r1, events, user, TAB)
    assert one.outcome == "accepted"
    assert one.components["size_scale"] == pytest.approx(math.sqrt(1.5))  # 1.2247
    assert one.components["share"] == pytest.approx(0.75)
    assert one.components["decision"] == pytest.approx(0.75 * math.sqrt(1.5) * 0.75 * 0.8)
    assert one.components["switch"] == pytest.approx(-0.25)
    assert one.value == pytest.approx(0.5511 - 0.25, abs=1e-4)
    two = compute_reward(r2, events, user, TAB)
    assert two.outcome == "rejected"
    assert two.value == pytest.approx(-0.25 - 0.25)
    assert compute_reward(r3, events, user, TAB).value == 0.0
    # the default spec: size_scale linear (30 / 20 = 1.5), a reject costs 0.1
    one = compute_reward(r1, events, user, DEFAULT)
    assert one.components["size_scale"] == pytest.approx(1.5)
    assert one.components["decision"] == pytest.approx(0.75 * 1.5 * 0.75 * 0.8)  # 0.675
    assert one.value == pytest.approx(0.675 - 0.25)
    assert compute_reward(r2, events, user, DEFAULT).value == pytest.approx(-0.1 - 0.25)
    assert compute_reward(r3, events, user, DEFAULT).value == 0.0
    assert finalize_at(r1, events, DEFAULT) == at(304)
    assert finalize_at(r2, events, DEFAULT) == at(360)
    assert finalize_at(r3, events, DEFAULT) == at(90)
    churn = ev("churn", 300)
    for r in (r1, r2):
        assert not is_late(churn, r, DEFAULT, received_at=at(300), arrived=events)
        with_churn = compute_reward(r, [*events, churn], user, DEFAULT)
        assert with_churn.components["churn"] == pytest.approx(-1.0 / 3)
    assert is_late(churn, r3, DEFAULT, received_at=at(300), arrived=events)
    assert all(is_late(ev("churn", 400), r, DEFAULT, arrived=events) for r in user)


# --- finalization ------------------------------------------------------------------------------

FINALIZE_CASES = [
    # (spec, rollout, events, final at, seconds after T0)
    pytest.param(DEFAULT, ro(shown=False, chars=0), [], 0, id="abstained-immediately"),
    pytest.param(
        DEFAULT,
        ro(shown=False, chars=0),
        [ev("churn", 10)],
        0,
        id="abstained-immediately-churn-or-not",
    ),
    pytest.param(DEFAULT, ro(), [], 300, id="shown-nothing-yet-switch-window"),
    pytest.param(DEFAULT, ro(), [ev("reject", 5)], 300, id="rejected-switch-window"),
    pytest.param(DEFAULT, ro(), [ev("accept", 40)], 300, id="accept-after-window-ignored"),
    pytest.param(DEFAULT, ro(), [ev("accept", 5)], 600, id="accepted-no-report-horizon"),
    pytest.param(
        DEFAULT,
        ro(),
        [ev("accept", 5), kept(30, 1, 35), kept(120, 1, 125)],
        600,
        id="accepted-waiting-for-last-expected-check",
    ),
    pytest.param(
        DEFAULT,
        ro(),
        [ev("accept", 5), kept(30, 1, 35), kept(300, 0.5, 305)],
        305,
        id="accepted-last-check-that-fits-arrived",
    ),
    pytest.param(
        DEFAULT,
        ro(),
        [ev("accept", 5), kept(300, 0.5, 298)],
        300,
        id="accepted-last-check-never-before-switch-window",
    ),
    pytest.param(
        DEFAULT,
        ro(),
        [ev("accept", 0), kept(300, 0.5, 300)],
        600,
        id="accepted-at-once-600s-check-fits-and-is-waited-for",
    ),
    pytest.param(
        DEFAULT,
        ro(),
        [ev("accept", 0), kept(300, 1, 300), kept(600, 0.5, 600)],
        600,
        id="accepted-at-once-600s-check-arrived",
    ),
    pytest.param(
        DEFAULT,
        ro(),
        [ev("reject", 3), ev("accept", 5), kept(300, 1, 305)],
        300,
        id="rejected-retention-irrelevant",
    ),
    pytest.param(
        RewardSpec(retention_checks_s=()),
        ro(),
        [ev("accept", 5)],
        300,
        id="no-checks-configured-accept-final-at-switch-window",
    ),
    pytest.param(SIM, ro(), [ev("reject", 1)], 8, id="sim-rejected"),
    pytest.param(SIM, ro(), [ev("accept", 2)], 16, id="sim-accepted-no-report"),
    pytest.param(
        SIM,
        ro(),
        [ev("accept", 4), kept(12, 0.5, 16)],
        16,
        id="sim-accept-at-window-edge-last-check-fits",
    ),
    pytest.param(SIM, ro(), [ev("accept", 2), kept(12, 0.5, 14)], 14, id="sim-accepted-final"),
]


@pytest.mark.parametrize(("spec", "rollout", "events", "seconds"), FINALIZE_CASES)
def test_finalize_at(
    spec: RewardSpec, rollout: RolloutInfo, events: list[Feedback], seconds: float
) -> None:
    assert finalize_at(rollout, events, spec) == at(seconds)
    assert finalize_at(rollout, events, spec) <= rollout.created_at + timedelta(
        seconds=spec.horizon_s
    )


ACCEPT = ev("accept", 5, eid="acc")
LAST_CHECK = kept(300, 0.5, 305, eid="last")

LATE_CASES = [
    # (rollout, event, received_at seconds or None, arrived, late?)
    pytest.param(ro(), ev("accept", 10), None, [], False, id="accept-in-window"),
    pytest.param(ro(), ev("accept", 30), None, [], False, id="accept-exactly-at-window-edge"),
    pytest.param(ro(), ev("accept", 31), None, [], True, id="accept-after-window"),
    pytest.param(ro(), ev("accept", 10), 20, [], False, id="accept-received-soon"),
    pytest.param(
        ro(), ev("accept", 10), 301, [], True, id="accept-received-after-ignored-rollout-was-final"
    ),
    pytest.param(ro(), ACCEPT, 301, [ACCEPT], True, id="late-event-itself-in-arrived"),
    pytest.param(ro(), kept(400, 0.5, 405), None, [ACCEPT], False, id="report-awaited"),
    pytest.param(
        ro(), kept(200, 0.5, 205), 400, [], True, id="report-after-rollout-final-as-ignored"
    ),
    pytest.param(ro(), kept(700, 0.5, 590), None, [ACCEPT], True, id="report-check-past-horizon"),
    pytest.param(
        ro(), kept(600, 0.5, 601), None, [ACCEPT], True, id="report-occurred-past-horizon"
    ),
    pytest.param(
        ro(),
        kept(400, 0.5, 405),
        None,
        [ACCEPT, LAST_CHECK],
        True,
        id="report-after-last-expected-check",
    ),
    pytest.param(ro(), ev("reject", 6), 7, [ACCEPT], False, id="losing-reject-not-late"),
    pytest.param(ro(), ev("model_switch", 300), None, [], False, id="switch-at-window-edge"),
    pytest.param(ro(), ev("model_switch", 301), None, [], True, id="switch-after-window"),
    pytest.param(ro(), ev("churn", 250), None, [ev("reject", 5)], False, id="churn-before-final"),
    pytest.param(
        ro(), ev("churn", 400), None, [ev("reject", 5)], True, id="churn-after-rejected-was-final"
    ),
    pytest.param(ro(), ev("churn", 400), None, [ACCEPT], False, id="churn-while-retention-open"),
    pytest.param(
        ro(),
        ev("churn", 400),
        None,
        [ACCEPT, LAST_CHECK],
        True,
        id="churn-after-accepted-was-final",
    ),
    pytest.param(
        ro(), ev("churn", 200), 400, [ACCEPT, LAST_CHECK], True, id="churn-received-after-final"
    ),
    pytest.param(
        ro(shown=False, chars=0), ev("churn", 0), None, [], False, id="abstained-churn-same-instant"
    ),
    pytest.param(
        ro(shown=False, chars=0), ev("churn", 10), None, [], True, id="abstained-churn-later"
    ),
    pytest.param(
        ro(shown=False, chars=0),
        ev("accept", 5),
        None,
        [],
        False,
        id="decision-on-abstained-never-counts-not-late",
    ),
    pytest.param(
        ro(shown=False, chars=0),
        ev("model_switch", 5),
        None,
        [],
        False,
        id="switch-on-abstained-never-counts-not-late",
    ),
    pytest.param(ro(), ev("accept", 500, "s2"), None, [], False, id="other-suggestion"),
    pytest.param(ro(), ev("churn", 900, user="u2"), None, [], False, id="other-user"),
    pytest.param(ro(t=100), ev("churn", 10), None, [], False, id="before-the-rollout"),
]


@pytest.mark.parametrize(("rollout", "event", "received", "arrived", "late"), LATE_CASES)
def test_is_late(
    rollout: RolloutInfo,
    event: Feedback,
    received: float | None,
    arrived: list[Feedback],
    late: bool,
) -> None:
    received_at = None if received is None else at(received)
    assert is_late(event, rollout, DEFAULT, received_at=received_at, arrived=arrived) is late


def _arrivals(pairs: Sequence[tuple[float, Feedback]]) -> list[tuple[datetime, Feedback]]:
    return [(at(r), e) for r, e in pairs]


def test_settle_replays_the_join() -> None:
    accept = ev("accept", 5, accepted_chars=20)
    reports = [kept(30, 1.0, 35), kept(120, 0.9, 125), kept(300, 0.6, 305)]
    churn = ev("churn", 320)
    pairs = [
        (6, accept),
        (7, accept),  # duplicate delivery
        (40, reports[0]),
        (130, reports[1]),
        (310, reports[2]),
        (330, churn),  # after the last expected check: the reward was final at 305
        (20, ev("accept", 10, "other")),
    ]
    final, counted = settle(ro(), _arrivals(pairs), DEFAULT)
    assert final == at(305)
    assert counted == [accept, *reports]
    shuffled = _arrivals(pairs)
    random.Random(0).shuffle(shuffled)
    assert settle(ro(), shuffled, DEFAULT) == (final, counted)
    assert compute_reward(ro(), counted, [ro()], DEFAULT).value == pytest.approx(0.75 * 0.6)


def test_settle_accept_received_too_late() -> None:
    pairs = [(350, ev("accept", 5)), (360, kept(30, 1.0, 35))]
    final, counted = settle(ro(), _arrivals(pairs), DEFAULT)
    assert (final, counted) == (at(300), [])
    assert compute_reward(ro(), counted, [ro()], DEFAULT).outcome == "ignored"


def test_settle_churn_received_before_final_counts() -> None:
    churn = ev("churn", 250)
    final, counted = settle(ro(), _arrivals([(2, ev("reject", 1)), (251, churn)]), DEFAULT)
    assert final == at(300) and churn in counted


# --- code_settled: stored for training, never part of the reward ------------------------------


def settled(t: float, sid: str = "s1", **kw: Any) -> Feedback:
    return ev("code_settled", t, sid, after_seconds=t, **kw)


SETTLED_CASES = [
    # (rollout, the other events): adding code_settled events changes nothing
    pytest.param(ro(shown=False, chars=0), [], id="abstained"),
    pytest.param(ro(shown=False, chars=0), [ev("churn", 10)], id="abstained-churned"),
    pytest.param(ro(), [], id="shown-ignored"),
    pytest.param(ro(), [ev("reject", 5)], id="rejected"),
    pytest.param(ro(), [ev("accept", 5)], id="accepted-provisional"),
    pytest.param(
        ro(), [ev("accept", 5, accepted_chars=7), kept(30, 0.8, 35)], id="partial-accept-retained"
    ),
    pytest.param(ro(), [ev("accept", 5), kept(300, 0.5, 305)], id="accepted-final-early"),
    pytest.param(
        ro(),
        [ev("accept", 5), ev("model_switch", 60), ev("churn", 200)],
        id="accepted-switched-churned",
    ),
]
SETTLED_REPORTS = [
    settled(1),
    settled(29),
    settled(31),
    settled(305),
    settled(900),
    settled(-10),
    settled(40, eid="dup"),
    settled(40, eid="dup"),
]


@pytest.mark.parametrize(("rollout", "events"), SETTLED_CASES)
def test_code_settled_changes_no_reward(rollout: RolloutInfo, events: list[Feedback]) -> None:
    """Not counted, not expected, not late: with or without code_settled reports (at any time,
    duplicated, or about another suggestion) the reward and its final instant are the same."""
    noise = [*SETTLED_REPORTS, settled(10, "s2"), settled(10, user="u2")]
    for spec in (DEFAULT, SIM):
        assert compute_reward(rollout, [*events, *noise], [rollout], spec) == compute_reward(
            rollout, events, [rollout], spec
        )
        assert finalize_at(rollout, [*noise, *events], spec) == finalize_at(rollout, events, spec)
        assert not any(
            is_late(e, rollout, spec, received_at=at(10_000), arrived=events) for e in noise
        )
    arrivals = [(e.occurred_at, e) for e in events] + [(at(10_000), e) for e in noise]
    assert settle(rollout, arrivals, DEFAULT) == settle(
        rollout, [(e.occurred_at, e) for e in events], DEFAULT
    )


# --- the spec ----------------------------------------------------------------------------------

DESIGN_JSON = {
    "accept_reward": 0.75,
    "reject_penalty": 0.1,
    "typed_through_penalty": 0.05,
    "abstain_reward": 0.0,
    "chars_norm": 20,
    "chars_exponent": 1.0,
    "decision_window_s": 30,
    "retention_checks_s": [30, 120, 300, 600],
    "horizon_s": 600,
    "provisional_accept_weight": 1.0,
    "switch_penalty": 0.5,
    "switch_window_s": 300,
    "churn_penalty": 1.0,
}


def test_defaults_are_designs_json() -> None:
    assert RewardSpec().to_dict() == DESIGN_JSON
    assert RewardSpec.from_dict(DESIGN_JSON) == RewardSpec()
    # the JSON block of DESIGN.md "Reward spec" is this one
    text = (Path(__file__).parents[3] / "docs" / "DESIGN.md").read_text()
    section = text.split("## Reward spec")[1]
    assert json.loads(section.split("```json")[1].split("```")[0]) == DESIGN_JSON


@pytest.mark.parametrize(
    "spec", [DEFAULT, SIM, RewardSpec(retention_checks_s=())], ids=["default", "sim", "no-checks"]
)
def test_round_trip_through_json(spec: RewardSpec) -> None:
    assert RewardSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    hash(spec)


def test_from_dict_missing_keys_take_defaults() -> None:
    spec = RewardSpec.from_dict({"accept_reward": 1.0, "retention_checks_s": [60]})
    assert spec.accept_reward == 1.0 and spec.retention_checks_s == (60,)
    assert spec.horizon_s == 600


@pytest.mark.parametrize(
    ("d", "message"),
    [
        pytest.param(
            {"decision_window_s": -1}, "decision_window_s must be > 0", id="negative-window"
        ),
        pytest.param({"horizon_s": 0}, "horizon_s must be > 0", id="zero-horizon"),
        pytest.param(
            {"reject_penalty": -0.25}, "reject_penalty must be >= 0", id="negative-penalty"
        ),
        pytest.param(
            {"accept_reward": 0.75, "colour": 1}, "unknown key(s) colour", id="unknown-key"
        ),
        pytest.param(
            {"accept_reward": "0.75"},
            "accept_reward must be a finite number",
            id="wrong-type-string",
        ),
        pytest.param(
            {"switch_penalty": True}, "switch_penalty must be a finite number", id="wrong-type-bool"
        ),
        pytest.param(
            {"churn_penalty": None}, "churn_penalty must be a finite number", id="wrong-type-null"
        ),
        pytest.param({"chars_norm": float("nan")}, "chars_norm must be a finite number", id="nan"),
        pytest.param(
            {"retention_checks_s": [30, 300, 120]},
            "strictly increasing",
            id="retention-checks-not-increasing",
        ),
        pytest.param(
            {"retention_checks_s": [30, 30]}, "strictly increasing", id="retention-checks-repeated"
        ),
        pytest.param(
            {"retention_checks_s": 30},
            "retention_checks_s must be a list",
            id="retention-checks-not-a-list",
        ),
        pytest.param(
            {"retention_checks_s": [0, 30]},
            "retention_checks_s must all be > 0",
            id="retention-check-zero",
        ),
        pytest.param(
            {"retention_checks_s": [30, 900]},
            "must all be <= horizon_s",
            id="retention-check-past-horizon",
        ),
        pytest.param(
            {"switch_window_s": 900},
            "switch_window_s (900) must be <= horizon_s",
            id="switch-window-past-horizon",
        ),
        pytest.param(
            {"decision_window_s": 601},
            "decision_window_s (601) must be <= horizon_s",
            id="decision-window-past-horizon",
        ),
        pytest.param(
            {"provisional_accept_weight": 1.5},
            "provisional_accept_weight must be <= 1",
            id="weight-above-one",
        ),
        pytest.param([1, 2], "must be a JSON object", id="not-an-object"),
    ],
)
def test_from_dict_errors(d: Any, message: str) -> None:
    with pytest.raises(ValueError, match="invalid reward spec") as err:
        RewardSpec.from_dict(d)
    assert message in str(err.value)


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ValueError) as err:
        RewardSpec.from_dict({"horizon_s": -1, "churn_penalty": "x"})
    assert "horizon_s" in str(err.value) and "churn_penalty" in str(err.value)


def test_sim_windows_smaller_same_rewards() -> None:
    for name in ("decision_window_s", "horizon_s", "switch_window_s"):
        assert getattr(SIM, name) < getattr(DEFAULT, name), name
    assert SIM.retention_checks_s[-1] < DEFAULT.retention_checks_s[0] + DEFAULT.horizon_s
    assert all(
        s < d for s, d in zip(SIM.retention_checks_s, DEFAULT.retention_checks_s, strict=False)
    )
    for name in (
        "accept_reward",
        "reject_penalty",
        "typed_through_penalty",
        "abstain_reward",
        "chars_norm",
        "chars_exponent",
        "provisional_accept_weight",
        "switch_penalty",
        "churn_penalty",
    ):
        assert getattr(SIM, name) == getattr(DEFAULT, name), name
    # every check fits even for an accept at the end of the decision window
    assert SIM.decision_window_s + SIM.retention_checks_s[-1] <= SIM.horizon_s


# --- events and rollouts ----------------------------------------------------------------------


@pytest.mark.parametrize("type_", EVENT_TYPES)
def test_from_event_as_published(type_: str) -> None:
    """The feedback topic carries the validated event plus schema_version."""
    published = {"schema_version": 1, **parse_event(event_json(type_, user_id="u-9"))}
    feedback = Feedback.from_event(published)
    assert feedback.type == type_ and feedback.user_id == "u-9"
    assert feedback.event_id == published["event_id"]
    assert feedback.occurred_at == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert feedback.occurred_at.utcoffset() == timedelta(0)
    if type_ == "code_retained":
        assert (feedback.after_seconds, feedback.retained_fraction) == (30.0, 0.75)
    if type_ == "accept":
        assert feedback.accepted_chars == 12
    if type_ == "code_settled":  # the text is not the reward's business
        assert feedback.suggestion_id == published["suggestion_id"]
        assert not hasattr(feedback, "text")
    if type_ in ("model_switch", "churn"):
        assert feedback.suggestion_id is None


def test_from_event_offset_zone() -> None:
    feedback = Feedback.from_event(event_json("churn", occurred_at="2026-11-29T14:00:00+02:00"))
    assert feedback.occurred_at == T0


@pytest.mark.parametrize(
    ("type_", "override", "message"),
    [
        pytest.param(
            "accept",
            {"suggestion_id": None},
            "suggestion_id is missing",
            id="accept-without-suggestion",
        ),
        pytest.param(
            "accept",
            {"accepted_chars": "12"},
            "accepted_chars must be an integer",
            id="accepted-chars-string",
        ),
        pytest.param(
            "accept",
            {"accepted_chars": True},
            "accepted_chars must be an integer",
            id="accepted-chars-bool",
        ),
        pytest.param(
            "code_retained",
            {"retained_fraction": None},
            "needs after_seconds",
            id="retained-without-fraction",
        ),
        pytest.param(
            "code_retained",
            {"after_seconds": "30"},
            "after_seconds must be a finite",
            id="after-seconds-string",
        ),
        pytest.param(
            "churn", {"occurred_at": "yesterday"}, "occurred_at must be RFC 3339", id="bad-time"
        ),
        pytest.param(
            "churn", {"occurred_at": "2026-11-29T12:00:00"}, "with a zone", id="naive-time"
        ),
        pytest.param(
            "code_settled",
            {"suggestion_id": None},
            "suggestion_id is missing",
            id="settled-without-suggestion",
        ),
        pytest.param("churn", {"type": "bounce"}, "type must be one of", id="unknown-type"),
        pytest.param(
            "churn", {"user_id": ""}, "user_id must be a non-empty string", id="empty-user"
        ),
        pytest.param("churn", {"event_id": None}, "event_id is missing", id="no-event-id"),
    ],
)
def test_from_event_errors(type_: str, override: dict[str, Any], message: str) -> None:
    raw = event_json(type_)
    raw.update(override)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ValueError, match="event") as err:
        Feedback.from_event(raw)
    assert message in str(err.value)


def test_naive_times_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        RolloutInfo("s", "u", datetime(2026, 1, 1), True, 3)
    with pytest.raises(ValueError, match="timezone-aware"):
        Feedback("e", "churn", "u", datetime(2026, 1, 1))


def test_reward_is_plain_data() -> None:
    reward = compute_reward(ro(), [], [ro()], TAB)
    assert reward == Reward(
        value=-0.25,
        components={**dict.fromkeys(COMPONENTS, 0.0), "decision": -0.25},
        outcome="ignored",
    )
