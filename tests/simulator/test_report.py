"""Buckets, fifths, targets and the deployment timeline of a simulation report."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from simulator.plot import plot
from simulator.report import (
    RequestRecord,
    bucketize,
    by_length,
    by_version,
    change_intervals,
    fifths,
    gated_deploys,
    length_bucket,
    length_rows,
    loop_rates,
    metrics,
    relative_change,
    split_by_time,
    targets,
    timeline,
)


def rec(
    t: float,
    action: str = "abstained",
    *,
    family: bool = False,
    chars: int = 0,
    accepted: int = 0,
    retained: float = 0.0,
    version: int = 1,
    reward: float = 0.0,
    user: str = "u",
) -> RequestRecord:
    shown = action != "abstained"
    return RequestRecord(
        t=t,
        user_id=user,
        version=version,
        shown=shown,
        family=family,
        shown_chars=chars if shown else 0,
        verdict="correct" if shown else None,
        action=action,
        accepted_chars=accepted,
        retained_chars=retained,
        reward=reward,
        latency_ms=10.0,
    )


@pytest.mark.parametrize(
    ("first", "last", "change"),
    [
        (0.5, 0.6, 0.2),
        (0.2, 0.15, -0.25),
        (0.0, 0.1, None),
        (-0.0007, 0.0091, None),
        (None, 0.1, None),
    ],
)
def test_relative_change_only_from_a_positive_start(
    first: float | None, last: float | None, change: float | None
) -> None:
    assert relative_change(first, last) == (None if change is None else pytest.approx(change))


def test_split_by_time_edges() -> None:
    records = [rec(t) for t in (0.0, 4.9, 5.0, 9.99, 10.0)]
    parts = split_by_time(records, 5.0, 10.0)
    assert [(a, b, len(p)) for a, b, p in parts] == [(0.0, 5.0, 2), (5.0, 10.0, 3)]


def test_split_by_time_partial_last_window() -> None:
    parts = split_by_time([rec(11.0)], 5.0, 12.0)
    assert [(a, b, len(p)) for a, b, p in parts] == [(0, 5, 0), (5, 10, 0), (10, 12, 1)]


def test_metrics() -> None:
    records = [
        rec(0, "accept", chars=10, accepted=10, retained=10.0, reward=0.5),
        rec(1, "accept", chars=20, accepted=5, retained=2.5, version=2, reward=0.1),
        rec(2, "reject", chars=8, family=True, reward=-0.25),
        rec(3, "ignore", chars=4, reward=-0.25),
        rec(4, family=True),
    ]
    m = metrics(records)
    counts = (m["requests"], m["shown"], m["accepted"], m["rejected"], m["ignored"])
    assert counts == (5, 4, 2, 1, 1)
    assert m["shown_per_request"] == pytest.approx(0.8)
    assert m["accept_rate_of_shown"] == pytest.approx(0.5)
    assert m["accepted_chars_per_100"] == pytest.approx(100 * 15 / 5)
    assert m["retained_chars_per_100"] == pytest.approx(100 * 12.5 / 5)
    assert m["reward_per_request"] == pytest.approx(0.1 / 5)
    assert (m["family_requests"], m["family_shown"], m["family_shown_rate"]) == (2, 1, 0.5)
    assert m["other_shown_per_request"] == pytest.approx(1.0)
    assert m["other_accept_rate_of_shown"] == pytest.approx(2 / 3)
    assert m["mean_shown_chars"] == pytest.approx(42 / 4)
    assert m["versions"] == {"1": 4, "2": 1}
    # the loop's measure and its alias, then how it was reached
    assert m["kept_chars_per_100"] == m["retained_chars_per_100"]
    assert m["not_taken_per_request"] == pytest.approx(2 / 5)  # a reject and an ignore
    assert list(m)[5:8] == ["kept_chars_per_100", "accept_rate_of_shown", "not_taken_per_request"]


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ((0, 0, 0, 0.0), (None, None, None)),  # no requests
        ((10, 0, 0, 0.0), (0.0, None, 0.0)),  # nothing shown: no accept rate
        ((1, 1, 1, 7.5), (750.0, 1.0, 0.0)),  # one request, accepted, 7.5 characters kept
        ((20, 8, 2, 15.0), (75.0, 0.25, 0.3)),
    ],
)
def test_loop_rates(
    counts: tuple[int, int, int, float], expected: tuple[float | None, ...]
) -> None:
    rates = loop_rates(*counts)
    assert list(rates) == ["kept_chars_per_100", "accept_rate_of_shown", "not_taken_per_request"]
    assert tuple(rates.values()) == tuple(None if e is None else pytest.approx(e) for e in expected)


@pytest.mark.parametrize(
    ("chars", "bucket"),
    [(0, "<=5"), (1, "<=5"), (5, "<=5"), (6, "6-20"), (20, "6-20"), (21, "21-60")]
    + [(60, "21-60"), (61, ">60"), (1000, ">60")],
)
def test_length_bucket_edges(chars: int, bucket: str) -> None:
    assert length_bucket(chars) == bucket


def zeros(n: int) -> dict[str, Any]:
    """A length_rows row with nothing shown out of n requests."""
    return {
        "requests": n,
        "shown": 0,
        "accepted": 0,
        "kept_chars_per_100": 0.0 if n else None,
        "accept_rate_of_shown": None,
        "not_taken_per_request": 0.0 if n else None,
    }


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        pytest.param([], {}, id="empty"),
        pytest.param(
            [rec(0, "accept", chars=4, accepted=4, retained=2.0)],
            {
                "<=5": {
                    "requests": 1,
                    "shown": 1,
                    "accepted": 1,
                    "kept_chars_per_100": 200.0,
                    "accept_rate_of_shown": 1.0,
                    "not_taken_per_request": 0.0,
                }
            },
            id="one record",
        ),
        pytest.param(
            [
                rec(0, "accept", chars=30, accepted=30, retained=15.0),
                rec(1, "reject", chars=21),
                rec(2, "ignore", chars=60),
                rec(3),  # abstained: a request, in no bucket
            ],
            {
                "21-60": {
                    "requests": 4,
                    "shown": 3,
                    "accepted": 1,
                    "kept_chars_per_100": 375.0,
                    "accept_rate_of_shown": pytest.approx(1 / 3),
                    "not_taken_per_request": 0.5,
                }
            },
            id="all in one bucket",
        ),
    ],
)
def test_length_rows(records: list[RequestRecord], expected: dict[str, Any]) -> None:
    rows = length_rows(records)
    assert list(rows) == ["<=5", "6-20", "21-60", ">60", "all"]
    for label in ("<=5", "6-20", "21-60", ">60"):
        assert rows[label] == expected.get(label, zeros(len(records))), label
    # the buckets add up to all lengths: one denominator, every request
    assert rows["all"]["requests"] == len(records)
    assert rows["all"]["shown"] == sum(r.shown for r in records)
    if expected:
        (only,) = expected.values()
        assert rows["all"] == only


def test_by_length_per_version_and_over_all() -> None:
    records = [
        rec(0, "accept", chars=3, accepted=3, retained=3.0, version=1),
        rec(1, "reject", chars=80, version=1),
        rec(2, version=1),
        rec(3, "accept", chars=80, accepted=40, retained=20.0, version=2),
    ]
    out = by_length(records)
    assert out["buckets"] == ["<=5", "6-20", "21-60", ">60"]
    assert list(out["versions"]) == ["1", "2"]
    v1, v2, both = out["versions"]["1"], out["versions"]["2"], out["all_versions"]
    assert (v1["<=5"]["requests"], v1["<=5"]["kept_chars_per_100"]) == (3, 100.0)
    assert (v1[">60"]["shown"], v1[">60"]["accepted"]) == (1, 0)
    assert v1[">60"]["not_taken_per_request"] == pytest.approx(1 / 3)
    assert v1[">60"]["accept_rate_of_shown"] == 0.0
    assert v2[">60"]["kept_chars_per_100"] == 2000.0 and v2["<=5"]["shown"] == 0
    assert both[">60"]["accept_rate_of_shown"] == 0.5
    assert both["all"]["kept_chars_per_100"] == pytest.approx(100 * 23 / 4)
    assert both["all"]["kept_chars_per_100"] == metrics(records)["kept_chars_per_100"]
    assert by_length([]) == {
        "buckets": ["<=5", "6-20", "21-60", ">60"],
        "versions": {},
        "all_versions": length_rows([]),
    }


def test_metrics_of_nothing_has_no_rates() -> None:
    m = metrics([])
    assert m["requests"] == 0
    assert m["shown_per_request"] is None and m["accept_rate_of_shown"] is None
    assert m["family_shown_rate"] is None and m["latency_ms_p50"] is None


def test_metrics_nothing_shown_has_no_accept_rate() -> None:
    assert metrics([rec(0), rec(1)])["accept_rate_of_shown"] is None


def test_bucketize_and_by_version() -> None:
    records = [rec(0, version=1), rec(12, "accept", chars=3, accepted=3, retained=3, version=2)]
    buckets = bucketize(records, 10, 20)
    assert [(b["t0"], b["requests"], b["versions"]) for b in buckets] == [
        (0, 1, {"1": 1}),
        (10, 1, {"2": 1}),
    ]
    assert by_version(records)["2"]["accept_rate_of_shown"] == 1.0
    assert "versions" not in by_version(records)["1"]


def test_fifths_compare_first_and_last() -> None:
    # first fifth: 4 requests, 2 shown, 1 accepted; last fifth: 4 requests, 1 shown and accepted
    first = [
        rec(0, "accept", chars=4, accepted=4, retained=4),
        rec(1, "reject", chars=4),
        rec(2),
        rec(3),
    ]
    last = [rec(40, "accept", chars=8, accepted=8, retained=8), rec(41), rec(42), rec(43)]
    s = fifths(first + last, 50.0)
    assert [p["requests"] for p in s["parts"]] == [4, 0, 0, 0, 4]
    assert s["change"]["accept_rate_of_shown"] == pytest.approx(1.0)  # 0.5 -> 1.0
    assert s["change"]["shown_per_request"] == pytest.approx(-0.5)  # 0.5 -> 0.25
    assert s["change"]["retained_chars_per_100"] == pytest.approx(1.0)  # 100 -> 200
    assert s["change"]["family_shown_rate"] is None  # no family requests


def summary(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    base = {"shown_per_request": 0.2, "accept_rate_of_shown": 0.5, "retained_chars_per_100": 100.0}
    f, la = {**base, **first}, {**base, **last}
    return {
        "first": f,
        "last": la,
        "change": {k: (la[k] - f[k]) / f[k] for k in ("shown_per_request", "accept_rate_of_shown")},
    }


DEPLOY = {"action": "deploy", "canary_version": 2}


@pytest.mark.parametrize(
    ("first", "last", "deploys", "expected"),
    [
        pytest.param(
            {},
            {
                "accept_rate_of_shown": 0.65,
                "shown_per_request": 0.16,
                "retained_chars_per_100": 100.0,
            },
            [DEPLOY] * 5,
            [True, True, True, True, True],
            id="all-met",
        ),
        pytest.param(
            {},
            {
                "accept_rate_of_shown": 0.64,
                "shown_per_request": 0.17,
                "retained_chars_per_100": 99.0,
            },
            [DEPLOY] * 4,
            [False, False, False, False, True],
            id="all-just-missed",
        ),
        pytest.param(
            {},
            {"shown_per_request": 0.04},
            [DEPLOY] * 5,
            [False, True, True, True, False],
            id="collapse-stops-showing",
        ),
        pytest.param(
            {},
            {"retained_chars_per_100": 49.0},
            None,
            [False, False, False, None, False],
            id="collapse-loses-retained-no-admin",
        ),
        pytest.param(
            {},
            {},
            [{"action": "deploy", "canary_version": None}, {"action": "promote"}],
            [False, False, True, False, True],
            id="only-canary-deploys-count",
        ),
    ],
)
def test_targets(
    first: dict[str, Any],
    last: dict[str, Any],
    deploys: list[dict[str, Any]] | None,
    expected: list[bool | None],
) -> None:
    assert [t["met"] for t in targets(summary(first, last), deploys)] == expected


def test_gated_deploys_counts_canaries_only() -> None:
    assert (
        gated_deploys(
            [
                DEPLOY,
                {"action": "deploy", "canary_version": None},
                {"action": "bootstrap"},
                {"action": "rollback"},
                DEPLOY,
            ]
        )
        == 2
    )


def test_timeline_keeps_the_run_in_order() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def at(s: float) -> str:
        return (start + timedelta(seconds=s)).isoformat().replace("+00:00", "Z")

    rows = [
        {
            "id": 3,
            "created_at": at(50),
            "action": "promote",
            "live_version": 2,
            "canary_version": None,
            "canary_fraction": 0.0,
            "reason": "r",
        },
        {
            "id": 2,
            "created_at": at(20),
            "action": "deploy",
            "live_version": 1,
            "canary_version": 2,
            "canary_fraction": 0.3,
            "reason": "r",
        },
        {
            "id": 1,
            "created_at": at(-5),
            "action": "bootstrap",
            "live_version": 1,
            "canary_version": None,
            "canary_fraction": 0.0,
            "reason": "r",
        },
        {
            "id": 4,
            "created_at": at(500),
            "action": "deploy",
            "live_version": 2,
            "canary_version": 3,
            "canary_fraction": 0.3,
            "reason": "r",
        },
    ]
    got = timeline(rows, start, 100)
    assert [(d["id"], d["t"], d["action"]) for d in got] == [
        (2, 20.0, "deploy"),
        (3, 50.0, "promote"),
    ]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    records = [
        rec(
            t,
            "accept" if t % 3 == 0 else "abstained",
            chars=5,
            accepted=5,
            retained=5,
            family=t % 4 == 0,
        )
        for t in range(60)
    ]
    report = {
        "config": {"users": 2, "minutes": 1, "seed": 0, "bucket_s": 10},
        "buckets": bucketize(records, 10, 60),
        "deployments": [{"t": 20, "action": "deploy"}, {"t": 40, "action": "rollback"}],
        "baseline": {
            "best": {
                "accept_rate_of_shown": 0.6,
                "shown_per_request": 0.2,
                "retained_chars_per_100": 50,
                "reward_per_request": 0.01,
            }
        },
    }
    plot(report, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_main_swaps_the_baseline_and_redraws(tmp_path: Path) -> None:
    import json

    from simulator.plot import main

    records = [
        rec(t, "accept" if t % 2 else "abstained", chars=4, accepted=4, retained=4)
        for t in range(50)
    ]
    report = {
        "config": {"users": 1, "minutes": 1, "seed": 0, "bucket_s": 10, "duration_s": 50},
        "buckets": bucketize(records, 10, 50),
        "fifths": fifths(records, 50),
        "deployments": None,
        "baseline": None,
        "comparison": None,
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    best = {
        "accept_rate_of_shown": 0.4,
        "shown_per_request": 0.1,
        "retained_chars_per_100": 9.0,
        "reward_per_request": 0.0,
        "family_shown_rate": None,
    }
    (tmp_path / "b.json").write_text(json.dumps({"best": best, "stochastic_gate": best}))
    assert main([str(tmp_path / "report.json"), "--baseline", str(tmp_path / "b.json")]) == 0
    out = json.loads((tmp_path / "report.json").read_text())
    assert out["baseline"]["best"] == best
    assert out["comparison"]["accept_rate_of_shown"] == {
        "learned_last_fifth": 1.0,
        "baseline": 0.4,
        "difference": pytest.approx(0.6),
        "live_first_fifth": 1.0,
        "base_as_served_offline": 0.4,
    }
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000


def person_requests(
    user: str, t0: float, accepts: int, rejects: int, abstains: int
) -> list[RequestRecord]:
    """One person's requests in a fifth starting at t0: accepts of 4 characters, all kept."""
    acts = ["accept"] * accepts + ["reject"] * rejects + ["abstained"] * abstains
    return [
        rec(
            t0 + 0.01 * i,
            a,
            chars=4,
            accepted=4 if a == "accept" else 0,
            retained=4.0 if a == "accept" else 0.0,
            user=user,
        )
        for i, a in enumerate(acts)
    ]


def test_change_intervals_of_an_unchanged_population_straddle_zero() -> None:
    first = [r for u in range(12) for r in person_requests(f"p{u}", 0, 3 + u % 3, 3, 10)]
    last = [r for u in range(12) for r in person_requests(f"p{u}", 40, 3 + (u + 1) % 3, 3, 10)]
    iv = change_intervals(first, last)
    for key in ("accept_rate_of_shown", "shown_per_request", "retained_chars_per_100"):
        assert iv[key] is not None and iv[key][0] < 0 < iv[key][1], key
    assert iv == change_intervals(first, last)  # seeded: the same report twice


def test_change_intervals_exclude_zero_for_a_change_everyone_shares() -> None:
    first = [r for u in range(12) for r in person_requests(f"p{u}", 0, 4 + u % 2, 4, 8)]
    last = [r for u in range(12) for r in person_requests(f"p{u}", 40, 6 + u % 2, 1, 9)]
    s = fifths(first + last, 50.0)
    iv = s["interval"]
    acc = iv["accept_rate_of_shown"]
    shown = iv["shown_per_request"]
    assert acc is not None and 0 < acc[0] <= s["change"]["accept_rate_of_shown"] <= acc[1]
    assert shown is not None and shown[0] <= s["change"]["shown_per_request"] <= shown[1] < 0
    assert [t["interval"] for t in targets(s, None)[:3]] == [
        acc,
        shown,
        iv["retained_chars_per_100"],
    ]


def test_change_intervals_resample_people_not_requests() -> None:
    # one person of ten makes the whole gain: 28 more accepts. Resampling requests would call it
    # certain; resampling people finds runs without that person, and the interval reaches 0.
    first = [r for u in range(10) for r in person_requests(f"p{u}", 0, 2, 2, 36)]
    last = [
        r
        for u in range(10)
        for r in person_requests(f"p{u}", 40, *((30, 2, 8) if u == 0 else (2, 2, 36)))
    ]
    lo, hi = change_intervals(first, last)["retained_chars_per_100"] or (None, None)
    assert lo is not None and hi is not None
    assert lo <= 0.0 < hi


def test_change_intervals_need_a_ratio_in_every_resample() -> None:
    # the first fifth showed one suggestion, to one person of two: some resamples show nothing
    first = person_requests("a", 0, 1, 0, 3) + person_requests("b", 0, 0, 0, 4)
    last = person_requests("a", 40, 1, 1, 2) + person_requests("b", 40, 1, 0, 3)
    iv = change_intervals(first, last)
    assert iv["accept_rate_of_shown"] is None and iv["shown_per_request"] is None
    assert change_intervals([], []) == dict.fromkeys(iv)


def test_bucketize_rates_fresh_lines_apart() -> None:
    from dataclasses import replace

    records = [
        rec(1, "accept", chars=4, accepted=4, retained=4.0),
        replace(rec(2, "reject", chars=4), fresh=False),
        rec(3),
    ]
    b = bucketize(records, 10, 10)[0]
    assert b["accept_rate_of_shown"] == 0.5 and b["fresh_accept_rate_of_shown"] == 1.0
    assert b["fresh_shown_per_request"] == 0.5
    assert b["fresh_retained_chars_per_100"] == pytest.approx(200.0)


def test_plot_shades_the_baseline_phase_and_draws_fresh_lines(tmp_path: Path) -> None:
    from dataclasses import replace

    from simulator.phases import learning_comparison, learning_records, phase_at

    records = [
        replace(
            rec(t, "accept" if t % 3 == 0 else "abstained", chars=5, accepted=5, retained=5),
            phase=phase_at(t, 20),
            fresh=t % 2 == 0,
        )
        for t in range(60)
    ]
    report = {
        "config": {
            "users": 2,
            "minutes": 40 / 60,
            "seed": 0,
            "bucket_s": 10,
            "duration_s": 60,
            "settled_share": 1.0,
        },
        "phases": {"baseline_s": 20.0, "learning_s": 40.0},
        "buckets": bucketize(records, 10, 60),
        "fifths": fifths(learning_records(records, 20), 40),
        "phase_comparison": learning_comparison(records, 20, 60),
        "deployments": [{"t": 30, "action": "deploy"}],
    }
    plot(report, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
