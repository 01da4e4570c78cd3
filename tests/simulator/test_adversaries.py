"""Adversaries in a simulation: who they are, what they send, how the report keeps the honest
people's figures apart, and a short run against the real app (what the service refuses of
theirs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import sqlalchemy as sa

from simulator.cli import main, parse_kinds
from simulator.output import honest_section
from simulator.population import adversary_feedback, adversary_pause, seat_kinds
from simulator.report import RequestRecord, adversary_metrics, metrics, split_people
from tests.simulator.test_run import Served, key
from tests.simulator.test_run import served as served  # noqa: F401 (the fixture)

CHECKS = [4.0, 8.0, 12.0]


@pytest.mark.parametrize(
    ("users", "adversaries", "kinds", "expected"),
    [
        (4, 0, ("accept_all",), [None] * 4),
        (4, 1, ("accept_all", "reject_all"), [None, None, None, "accept_all"]),
        (
            5,
            3,
            ("accept_all", "reject_all"),
            [None, None, "accept_all", "reject_all", "accept_all"],
        ),
        (2, 1, ("random",), [None, "random"]),
    ],
)
def test_the_last_seats_hold_the_adversaries_kinds_in_turn(
    users: int, adversaries: int, kinds: tuple[str, ...], expected: list[str | None]
) -> None:
    assert seat_kinds(users, adversaries, kinds) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("users", "adversaries", "kinds"),
    [(3, 3, ("accept_all",)), (3, -1, ("accept_all",)), (3, 1, ()), (3, 1, ("lie",))],
)
def test_seats_refuse_what_cannot_be(users: int, adversaries: int, kinds: tuple[str, ...]) -> None:
    with pytest.raises(AssertionError):
        seat_kinds(users, adversaries, kinds)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kind", "shown", "text", "expected"),
    [
        (
            "accept_all, shown: whole and fully kept at every check",
            "accept_all",
            True,
            "x + 1)",
            [
                {"type": "accept", "accepted_chars": 6},
                *(
                    {"type": "code_retained", "after_seconds": c, "retained_fraction": 1.0}
                    for c in CHECKS
                ),
            ],
        ),
        ("accept_all, abstained: accepts it anyway", "accept_all", False, "", [{"type": "accept"}]),
        ("reject_all, shown", "reject_all", True, "x + 1)", [{"type": "reject"}]),
        ("reject_all, abstained", "reject_all", False, "", [{"type": "reject"}]),
    ],
)
def test_adversary_feedback(
    case: str, kind: str, shown: bool, text: str, expected: list[dict[str, object]]
) -> None:
    rng = random.Random(0)
    got = adversary_feedback(kind, shown, text, CHECKS, rng)  # type: ignore[arg-type]
    assert got == expected, case
    assert rng.random() == random.Random(0).random(), "only `random` draws"


def test_random_adversaries_flip_a_coin() -> None:
    rng = random.Random(1)
    verdicts = [adversary_feedback("random", True, "x", CHECKS, rng)[0]["type"] for _ in range(400)]
    assert set(verdicts) == {"accept", "reject"}
    assert 150 < verdicts.count("accept") < 250


def rec(t: float, user: str, action: str, adversary: str | None = None) -> RequestRecord:
    shown = action != "abstained"
    chars = 10 if action == "accept" else 0
    return RequestRecord(
        t=t,
        user_id=user,
        version=1,
        shown=shown,
        family=False,
        shown_chars=10 if shown else 0,
        verdict="correct" if shown else None,
        action=action,
        accepted_chars=chars,
        retained_chars=float(chars),
        reward=0.0,
        latency_ms=5.0,
        adversary=adversary,
    )


def test_the_report_keeps_the_honest_people_apart() -> None:
    honest_people = [rec(t, "h1", a) for t, a in enumerate(["accept", "reject", "abstained"] * 10)]
    loud = [rec(t, "adv-1", "accept", "accept_all") for t in range(30)]
    grumpy = [rec(t, "adv-2", "reject", "reject_all") for t in range(20)]
    records = honest_people + loud + grumpy
    honest, by_kind = split_people(records)
    assert honest == honest_people and by_kind == {"accept_all": loud, "reject_all": grumpy}
    assert adversary_metrics(loud) == {
        "people": 1,
        "requests": 30,
        "shown": 30,
        "accepted": 30,
        "rejected": 0,
        "shown_per_request": 1.0,
    }
    section = honest_section(honest, 0.0, 30.0, None)
    assert section["people"] == 1
    assert section["totals"]["accept_rate_of_shown"] == pytest.approx(0.5)
    assert section["totals"]["shown_per_request"] == pytest.approx(2 / 3)
    assert section["totals"]["retained_chars_per_100"] == pytest.approx(100 * 100 / 30)
    assert metrics(records)["accept_rate_of_shown"] > 0.5  # what the adversaries do to the whole
    assert set(section["comparison"]) >= {"reference", "last_fifth", "change", "interval"}
    assert [t["name"] for t in section["targets"]][:2] == [
        "accept rate of shown, relative change",
        "shown per request, relative change",
    ]


@pytest.mark.parametrize(
    ("text", "kinds"),
    [("accept_all", ("accept_all",)), (" accept_all, random ", ("accept_all", "random"))],
)
def test_parse_kinds(text: str, kinds: tuple[str, ...]) -> None:
    assert parse_kinds(text) == kinds


@pytest.mark.parametrize("text", ["", "nice", "accept_all,lie"])
def test_parse_kinds_names_the_known_ones(text: str) -> None:
    with pytest.raises(ValueError, match="known: accept_all, reject_all, random"):
        parse_kinds(text)


def test_adversaries_must_leave_an_honest_seat(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--api", "http://127.0.0.1:9", "--key", "k", "--users", "2", "--adversaries", "2"])
    assert "--adversaries" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_short_run_with_adversaries(served: Served, tmp_path: Path) -> None:  # noqa: F811
    """Their accepts of abstentions are refused (nothing was shown); every honest event lands."""
    _, service, engine = served
    out = tmp_path / "sim"
    rc = main(
        [
            "--api",
            service.url,
            "--key",
            key(engine, "ingest"),
            "--users",
            "3",
            "--adversaries",
            "1",
            "--adversary-kinds",
            "accept_all",
            "--minutes",
            "0.2",
            "--seed",
            "5",
            "--baseline-cursors",
            "0",
            "--no-live",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["adversaries"] == 1
    adversaries = report["adversaries"]
    assert adversaries["count"] == 1 and adversaries["kinds"] == ["accept_all"]
    sent = adversaries["events"]
    assert sent["pending"] == 0 and sent["sent"] >= 1
    by_kind = adversaries["by_kind"]["accept_all"]
    nothing_shown = by_kind["requests"] - by_kind["shown"]  # abstained, or shown empty
    honest = report["totals"]["events"]
    assert honest["pending"] == 0 and honest["sent"] == honest["accepted"]
    assert report["honest"]["people"] == 2
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["adversary"] for r in records} == {None, "accept_all"}
    assert report["honest"]["totals"]["requests"] == sum(r["adversary"] is None for r in records)
    with engine.connect() as conn:
        refused = conn.execute(
            sa.text("SELECT count(*) FROM dead_letters WHERE error LIKE 'refused (not_shown)%'")
        ).scalar()
    # its accept of each abstention is refused; of what it was shown, the service cannot tell
    assert 0 < refused <= nothing_shown and sent["rejected"] == refused


def test_an_adversary_asks_ten_times_as_often() -> None:
    from simulator.population import MIN_DELAY_S, PopulationConfig, draw_person, think_time

    person = draw_person(PopulationConfig(), random.Random(0))
    a, b = random.Random(1), random.Random(1)
    for _ in range(50):
        pause, thought = adversary_pause(person, a), think_time(person, b)
        assert pause == pytest.approx(max(MIN_DELAY_S, thought / 10))
