"""`view` events and clients that report views (docs/REWARD.md, "Views").

A rollout whose client reports views (`reports_views`) and that was shown but never viewed,
accepted or rejected inside the decision window is "unviewed": decision 0, no training signal.
Viewed and left alone, it is ignored (a silent reject) as any shown rollout. For a client that
does not report views, a view changes nothing.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tabloop.core.reward import (
    CLOCK_SKEW_S,
    Feedback,
    RolloutInfo,
    compute_reward,
    finalize_at,
    is_late,
    settle,
)
from tabloop.core.reward_spec import RewardSpec
from tabloop.core.reward_store import rollout_info

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
DEFAULT = RewardSpec()
# the values in CASES are worked out under this spec (a reject or silence costs 0.25)
TAB = RewardSpec(reject_penalty=0.25, chars_exponent=0.5)
PROVISIONAL = 0.75 * TAB.provisional_accept_weight  # a whole 20-char accept, no report yet
_ids = itertools.count()


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ro(*, views: bool = True, shown: bool = True, sid: str = "s1", t: float = 0) -> RolloutInfo:
    return RolloutInfo(
        suggestion_id=sid,
        user_id="u1",
        created_at=at(t),
        shown=shown,
        text_chars=20 if shown else 0,
        reports_views=views,
    )


def ev(type_: str, t: float, *, sid: str | None = "s1", user: str = "u1", **kw: Any) -> Feedback:
    if type_ in ("model_switch", "churn"):
        sid = None
    return Feedback(
        event_id=f"e{next(_ids):05d}",
        type=type_,
        user_id=user,
        occurred_at=at(t),
        suggestion_id=sid,
        **kw,
    )


CASES = [
    # (rollout, events, outcome, value)
    pytest.param(ro(), [], "unviewed", 0.0, id="reports-views-never-viewed"),
    pytest.param(ro(), [ev("view", 1)], "ignored", -0.25, id="viewed-then-nothing"),
    pytest.param(
        ro(), [ev("view", 1), ev("accept", 3)], "accepted", PROVISIONAL, id="viewed-then-accepted"
    ),
    pytest.param(
        ro(), [ev("view", 1), ev("reject", 3)], "rejected", -0.25, id="viewed-then-rejected"
    ),
    pytest.param(
        ro(), [ev("accept", 3)], "accepted", PROVISIONAL, id="accept-without-view-still-an-accept"
    ),
    pytest.param(
        ro(), [ev("reject", 3)], "rejected", -0.25, id="reject-without-view-still-a-reject"
    ),
    pytest.param(ro(), [ev("view", 30)], "ignored", -0.25, id="view-exactly-at-window-edge"),
    pytest.param(ro(), [ev("view", 31)], "unviewed", 0.0, id="view-after-decision-window"),
    pytest.param(
        ro(),
        [ev("view", -CLOCK_SKEW_S)],
        "ignored",
        -0.25,
        id="view-before-rollout-within-clock-skew",
    ),
    pytest.param(
        ro(),
        [ev("view", -CLOCK_SKEW_S - 1)],
        "unviewed",
        0.0,
        id="view-before-rollout-beyond-clock-skew",
    ),
    pytest.param(ro(), [ev("view", 1, user="u2")], "unviewed", 0.0, id="view-by-another-user"),
    pytest.param(ro(), [ev("view", 1, sid="s2")], "unviewed", 0.0, id="view-of-another-suggestion"),
    pytest.param(ro(), [ev("view", 1), ev("view", 2)], "ignored", -0.25, id="viewed-twice"),
    pytest.param(
        ro(), [ev("view", 31), ev("accept", 31)], "unviewed", 0.0, id="late-view-and-late-accept"
    ),
    # typed through: right, not taken; neither a reject (-0.25) nor an accept: it cost a read
    # (typed_through_penalty, 0.05). An explicit decision inside the window still decides
    pytest.param(
        ro(), [ev("view", 1), ev("typed_through", 3)], "typed_through", -0.05, id="viewed-typed"
    ),
    pytest.param(ro(), [ev("typed_through", 3)], "typed_through", -0.05, id="typed-never-viewed"),
    pytest.param(
        ro(views=False), [ev("typed_through", 3)], "typed_through", -0.05, id="typed-no-views"
    ),
    pytest.param(
        ro(),
        [ev("view", 1), ev("typed_through", 3), ev("accept", 4)],
        "accepted",
        PROVISIONAL,
        id="typed-then-accepted",
    ),
    pytest.param(
        ro(),
        [ev("view", 1), ev("typed_through", 3), ev("reject", 4)],
        "rejected",
        -0.25,
        id="typed-then-dismissed",
    ),
    pytest.param(
        ro(), [ev("view", 1), ev("typed_through", 31)], "ignored", -0.25, id="typed-too-late"
    ),
    pytest.param(
        ro(), [ev("view", 1), ev("typed_through", 3, sid="s2")], "ignored", -0.25, id="typed-other"
    ),
    pytest.param(ro(shown=False), [], "abstained", 0.0, id="abstained-reports-views"),
    pytest.param(
        ro(shown=False), [ev("view", 1)], "abstained", 0.0, id="abstained-view-means-nothing"
    ),
    pytest.param(ro(views=False), [], "ignored", -0.25, id="no-views-reported-silence-rejects"),
    pytest.param(
        ro(views=False),
        [ev("view", 1)],
        "ignored",
        -0.25,
        id="no-views-reported-a-view-changes-nothing",
    ),
    pytest.param(
        ro(views=False),
        [ev("view", 1), ev("accept", 2)],
        "accepted",
        PROVISIONAL,
        id="no-views-reported-accept",
    ),
]


@pytest.mark.parametrize(("rollout", "events", "outcome", "value"), CASES)
def test_reward_with_views(
    rollout: RolloutInfo, events: list[Feedback], outcome: str, value: float
) -> None:
    reward = compute_reward(rollout, events, [rollout], TAB)
    assert reward.outcome == outcome
    assert reward.value == pytest.approx(value)
    # the same in any order of the events
    assert compute_reward(rollout, events[::-1], [rollout], TAB) == reward


def test_an_unviewed_rollout_still_takes_its_share_of_user_penalties() -> None:
    """A model_switch is spread over the shown rollouts, unviewed ones included (the reward
    knows no other rollout's views); the trainer does not train on an unviewed one at all."""
    mine, other = ro(), ro(sid="s2", views=False)
    reward = compute_reward(mine, [ev("model_switch", 10)], [mine, other], DEFAULT)
    assert reward.outcome == "unviewed"
    assert reward.components["decision"] == 0.0
    assert reward.value == pytest.approx(-0.5 / 2)


@pytest.mark.parametrize(
    ("rollout", "events", "final_after_s"),
    [
        pytest.param(ro(), [], 300, id="unviewed-final-when-the-windows-close"),
        pytest.param(ro(), [ev("view", 1)], 300, id="viewed-final-when-the-windows-close"),
        pytest.param(ro(shown=False), [], 0, id="abstained-final-at-once"),
    ],
)
def test_finalize_at_with_views(
    rollout: RolloutInfo, events: list[Feedback], final_after_s: float
) -> None:
    assert finalize_at(rollout, events, DEFAULT) == at(final_after_s)


def test_a_view_is_late_only_where_it_could_have_counted() -> None:
    spec = RewardSpec.sim()  # decision window 4 s, final after 8 s
    reports, silent = ro(), ro(views=False)
    assert is_late(ev("view", 5), reports, spec)  # after the decision window
    assert not is_late(ev("view", 2), reports, spec)
    assert is_late(ev("view", 2), reports, spec, received_at=at(9))  # after it was final
    # a view never counts for a client that does not report views: unrelated, never late
    assert not is_late(ev("view", 5), silent, spec)
    assert not is_late(ev("view", 2), silent, spec, received_at=at(9))


def test_settle_keeps_a_view_in_time_and_drops_a_late_one() -> None:
    spec = RewardSpec.sim()
    view = ev("view", 1)
    final, kept = settle(ro(), [(at(1), view)], spec)
    assert kept == [view] and compute_reward(ro(), kept, [], spec).outcome == "ignored"
    final, kept = settle(ro(), [(at(9), view)], spec)  # received once the reward was final
    assert kept == [] and compute_reward(ro(), kept, [], spec).outcome == "unviewed"
    assert final == at(8)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param({"reports_views": True}, True, id="message-true"),
        pytest.param({"reports_views": False}, False, id="message-false"),
        pytest.param({"reports_views": None}, False, id="null-older-row"),
        pytest.param({}, False, id="absent-older-message"),
    ],
)
def test_rollout_info_reads_reports_views(source: dict[str, Any], expected: bool) -> None:
    message = {
        "suggestion_id": "s1",
        "user_id": "u1",
        "created_at": "2026-11-29T12:00:00Z",
        "shown": True,
        "text": "x)",
        **source,
    }
    assert rollout_info(message).reports_views is expected
