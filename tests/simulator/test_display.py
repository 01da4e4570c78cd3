"""The summary's tables: kept characters lead, then the accept rate of shown and what was shown
but not taken, per suggestion length and policy version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from simulator.display import ROWS, length_table, phase_table, print_summary, with_not_taken
from simulator.phases import learning_comparison
from simulator.report import RequestRecord, by_length, fifths, targets, thirds
from tests.simulator.test_report import rec


def text(table: Table) -> str:
    console = Console(record=True, width=240)
    console.print(table)
    return console.export_text()


def test_kept_characters_lead_the_summary_rows() -> None:
    assert [label for _, label, _ in ROWS[:3]] == [
        "kept chars / 100 req",
        "accept rate of shown",
        "not taken per request",
    ]


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({"requests": 0, "shown": 0, "accepted": 0}, None),  # empty
        ({"requests": 4, "shown": 3, "accepted": 1}, 0.5),
        ({"requests": 4, "shown": 3, "accepted": 1, "not_taken_per_request": 0.1}, 0.1),  # kept
    ],
)
def test_with_not_taken(counts: dict[str, Any], expected: float | None) -> None:
    assert with_not_taken(counts)["not_taken_per_request"] == expected


def test_length_table_a_row_per_version_and_all() -> None:
    records = [
        rec(0, "accept", chars=3, accepted=3, retained=3.0, version=1),
        rec(1, "reject", chars=80, version=1),
        rec(2, version=2),
    ]
    out = text(length_table(by_length(records)))
    rows = [line.strip("│ ") for line in out.splitlines()]
    lines = [row for row in rows if row.startswith(("v1 ", "v2 ", "all "))]
    assert len(lines) == 3
    v1, v2, every = lines
    # v1, 2 requests: 3 kept chars of a 3-char suggestion (150 / 100 req), nothing 6-60 long,
    # an 80-char suggestion rejected (0 kept, accept rate 0, 0.5 not taken per request)
    assert "150.0 · 1.00 · 0.000" in v1 and "0.0 · - · 0.000" in v1
    assert "0.0 · 0.00 · 0.500" in v1
    assert "0.0 · - · 0.000" in v2  # abstained only: no accept rate
    assert every.split("│")[1].strip() == "3"  # requests of every version


def test_phase_table_derives_what_was_not_taken() -> None:
    """simulator.phases' comparison carries counts, not not_taken_per_request: the table
    derives it, and its change."""
    records: list[RequestRecord] = []
    for i in range(50):  # first fifth: shown and rejected half the time; last: never shown
        records.append(rec(i * 0.1, "reject" if i % 2 else "abstained", chars=10))
        records.append(rec(40 + i * 0.1))
    out = text(phase_table(learning_comparison(records, 0.0, 50.0)))
    row = next(line for line in out.splitlines() if "not taken per request" in line)
    assert "0.500" in row and "0.000" in row and "-100%" in row
    assert out.index("kept chars / 100 req") < out.index("accept rate of shown")


def test_the_printed_summary_leads_with_kept_characters() -> None:
    """print_summary on a report made of the report's own functions: the fifths table starts
    with kept characters, and the by-length table follows it."""
    records = [
        rec(t, "accept" if t % 3 == 0 else "reject", chars=4 + t, accepted=4, retained=2.0)
        for t in range(50)
    ] + [rec(t + 0.5, version=2) for t in range(50)]
    fifth = fifths(records, 50.0)
    report = {
        "fifths": fifth,
        "phases": {"baseline_s": 0, "trainer": None},
        "baseline": None,
        "by_length": by_length(records),
        "thirds": thirds(records, 50.0),
        "phase_comparison": {
            **learning_comparison(records, 0.0, 50.0),
            "gated_deploys": 1,
            "gated_deploys_in_baseline_phase": None,
            "errors": 0,
            "events_refused": 0,
            "events_lost": 0,
        },
        "settled": {"events": 0, "opted_in": 0, "people": 1, "lines": 0},
        "totals": {"events": {"rejected_by_type": {}}},
        "targets": targets(fifth, None),
        "adversaries": {},
    }
    console = Console(record=True, width=240)
    print_summary(console, report, Path("run"))
    out = console.export_text()
    first_table = out[: out.index("by suggestion length")]
    assert first_table.index("kept chars / 100 req") < first_table.index("accept rate of shown")
    assert first_table.index("accept rate of shown") < first_table.index("not taken per request")
    rows = [line.strip("│ ") for line in out.splitlines()]
    assert [r.split()[0] for r in rows if r.startswith(("v1 ", "v2 ", "all "))] == [
        "v1",
        "v2",
        "all",
    ]
