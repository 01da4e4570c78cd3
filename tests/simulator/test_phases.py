"""The baseline phase: phase tags, the windows compared, and the comparison on all and on fresh
lines (pure functions, tables of inputs)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from simulator.phases import (
    baseline_phase_deploys,
    learning_comparison,
    learning_records,
    learning_span,
    phase_at,
    targets_summary,
    windows,
)
from simulator.report import RequestRecord, fifths, targets
from tests.simulator.test_report import rec


def tagged(
    t: float,
    action: str = "abstained",
    *,
    baseline_s: float,
    fresh: bool = True,
    accepted: int = 0,
    user: str = "u",
    reward: float = 0.0,
) -> RequestRecord:
    """A request at t, tagged with its phase as the simulator tags it."""
    r = rec(
        t, action, chars=4, accepted=accepted, retained=float(accepted), user=user, reward=reward
    )
    return replace(r, phase=phase_at(t, baseline_s), fresh=fresh)


@pytest.mark.parametrize(
    ("t", "baseline_s", "phase"),
    [
        pytest.param(0.0, 0.0, "learning", id="no-baseline-phase"),
        pytest.param(0.0, 30.0, "baseline", id="first-request"),
        pytest.param(29.99, 30.0, "baseline", id="just-before-the-switch"),
        pytest.param(30.0, 30.0, "learning", id="at-the-switch"),
        pytest.param(500.0, 30.0, "learning", id="late"),
    ],
)
def test_phase_at(t: float, baseline_s: float, phase: str) -> None:
    assert phase_at(t, baseline_s) == phase


@pytest.mark.parametrize(
    ("baseline_s", "duration_s", "span"),
    [
        (0.0, 60.0, 60.0),
        (30.0, 90.0, 60.0),
        pytest.param(30.0, 20.0, 1.0, id="interrupted-in-the-baseline-phase"),
    ],
)
def test_learning_span(baseline_s: float, duration_s: float, span: float) -> None:
    assert learning_span(baseline_s, duration_s) == span


def test_learning_records_start_at_the_switch() -> None:
    records = [tagged(t, baseline_s=30) for t in (1, 29, 30, 45)]
    assert [r.t for r in learning_records(records, 30)] == [0, 15]


# A run of 30 s baseline + 50 s learning: the last fifth is [70, 80).
RUN = [
    tagged(5, "accept", accepted=8, baseline_s=30, reward=0.5),
    tagged(10, "reject", baseline_s=30, reward=-0.25),
    tagged(20, baseline_s=30, fresh=False),
    tagged(25, "accept", accepted=4, baseline_s=30, fresh=False, reward=0.3),
    tagged(35, "accept", accepted=4, baseline_s=30),  # the learning phase's first fifth
    tagged(71, "accept", accepted=12, baseline_s=30, reward=0.6),
    tagged(75, baseline_s=30),
    tagged(79, "reject", baseline_s=30, fresh=False, reward=-0.25),
]


@pytest.mark.parametrize(
    ("baseline_s", "reference_t", "last_t"),
    [
        pytest.param(30.0, [5, 10, 20, 25], [71, 75, 79], id="against-the-baseline-phase"),
        pytest.param(0.0, [5, 10], [71, 75, 79], id="no-baseline-phase-first-fifth"),
    ],
)
def test_windows(baseline_s: float, reference_t: list[float], last_t: list[float]) -> None:
    records = [replace(r, phase=phase_at(r.t, baseline_s)) for r in RUN]
    reference, last = windows(records, baseline_s, 80.0)
    assert [r.t for r in reference] == reference_t
    assert [r.t + baseline_s for r in last] == last_t  # learning time, from the switch


def test_learning_comparison_on_all_and_fresh_lines() -> None:
    c = learning_comparison(RUN, 30.0, 80.0)
    assert c["reference"] == "baseline_phase"
    assert c["reference_window_s"] == [0.0, 30.0] and c["last_window_s"] == [70.0, 80.0]
    every, fresh = c["all"], c["fresh"]
    # all: baseline 4 requests, 3 shown, 2 accepted, 12 chars kept; last 3, 2 shown, 1 accepted
    assert every["reference"] == pytest.approx(
        {
            "requests": 4,
            "shown": 3,
            "accepted": 2,
            "shown_per_request": 0.75,
            "accept_rate_of_shown": 2 / 3,
            "retained_chars_per_100": 300.0,
            "reward_per_request": 0.55 / 4,
        }
    )
    assert every["last_fifth"]["shown_per_request"] == pytest.approx(2 / 3)
    assert every["last_fifth"]["retained_chars_per_100"] == pytest.approx(400.0)
    assert every["change"]["accept_rate_of_shown"] == pytest.approx((1 / 2) / (2 / 3) - 1)
    assert every["change"]["retained_chars_per_100"] == pytest.approx(400 / 300 - 1)
    assert every["difference"]["shown_per_request"] == pytest.approx(2 / 3 - 0.75)
    # fresh: the two baseline requests and the two last-fifth ones on unreported lines
    assert (fresh["reference"]["requests"], fresh["last_fifth"]["requests"]) == (2, 2)
    assert fresh["reference"]["accept_rate_of_shown"] == pytest.approx(0.5)
    assert fresh["last_fifth"]["accept_rate_of_shown"] == pytest.approx(1.0)
    assert fresh["change"]["accept_rate_of_shown"] == pytest.approx(1.0)
    assert set(every["interval"]) == {
        "accept_rate_of_shown",
        "shown_per_request",
        "retained_chars_per_100",
    }


def test_without_a_baseline_phase_the_reference_is_the_first_fifth_as_before() -> None:
    records = [replace(r, phase="learning") for r in RUN]
    c = learning_comparison(records, 0.0, 80.0)
    s = fifths(records, 80.0)
    assert c["reference"] == "first_fifth" and "no baseline phase" in c["note"]
    assert c["all"]["reference"]["requests"] == s["first"]["requests"] == 2
    for key in ("shown_per_request", "accept_rate_of_shown", "retained_chars_per_100"):
        assert c["all"]["change"][key] == s["change"][key]
    assert [t["met"] for t in targets(targets_summary(records, 0.0, 80.0), None)] == [
        t["met"] for t in targets(s, None)
    ]


def test_nothing_on_fresh_lines_has_no_rates() -> None:
    records = [tagged(t, "accept", accepted=4, baseline_s=10, fresh=False) for t in (1, 19)]
    fresh = learning_comparison(records, 10.0, 20.0)["fresh"]
    assert fresh["reference"]["requests"] == fresh["last_fifth"]["requests"] == 0
    assert fresh["reference"]["shown_per_request"] is None
    assert fresh["change"] == dict.fromkeys(fresh["change"])


def test_interrupted_in_the_baseline_phase_has_an_empty_last_fifth() -> None:
    c = learning_comparison([tagged(t, baseline_s=30) for t in (1, 5)], 30.0, 6.0)
    assert c["all"]["reference"]["requests"] == 2
    assert c["all"]["last_fifth"]["requests"] == 0


def test_targets_read_the_baseline_phase() -> None:
    s = targets_summary(RUN, 30.0, 80.0)
    assert s["first"]["requests"] == 4 and s["last"]["requests"] == 3
    got = targets(s, None)
    assert got[2]["value"] == [pytest.approx(300.0), pytest.approx(400.0)]
    assert got[2]["met"] is True


DEPLOYS: list[dict[str, Any]] = [
    {"t": 5.0, "action": "deploy", "canary_version": None},  # a manual full deploy
    {"t": 12.0, "action": "deploy", "canary_version": 2},
    {"t": 40.0, "action": "deploy", "canary_version": 3},
    {"t": 45.0, "action": "promote", "canary_version": None},
]


@pytest.mark.parametrize(
    ("deployments", "baseline_s", "expected"),
    [
        (DEPLOYS, 30.0, 1),
        (DEPLOYS, 10.0, 0),
        (DEPLOYS, 0.0, 0),
        ([], 30.0, 0),
        (None, 30.0, None),
    ],
)
def test_baseline_phase_deploys(
    deployments: list[dict[str, Any]] | None, baseline_s: float, expected: int | None
) -> None:
    assert baseline_phase_deploys(deployments, baseline_s) == expected
