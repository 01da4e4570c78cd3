"""benchmarks/writing_loop.py: every run in the table, the loop's figures (kept characters, accept
rate of shown, not taken per request) against the mean of its seed's paused runs with their
ratio, each arm's change, and a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.writing_loop import (
    against_paused,
    last_third,
    load,
    main,
    plot_bars,
    ratio,
    same_cursor_rows,
)


def third(
    useful: float, wrong: float, kept: float = 50.0, shown: int = 60, accepted: int = 36
) -> dict[str, Any]:
    """A last third of 100 requests."""
    return {
        "requests": 100,
        "shown": shown,
        "accepted": accepted,
        "kept_chars_per_100": kept,
        "retained_chars_per_100": kept,
        "accept_rate_of_shown": accepted / shown if shown else None,
        "not_taken_per_request": (shown - accepted) / 100,
        "useful_chars_per_100": useful,
        "whole_line_rate": 0.2,
        "exact_of_shown": 0.3,
        "shown_per_request": shown / 100,
        "wrong_shown_per_request": wrong,
    }


def write_run(root: Path, name: str, seed: int, last: dict[str, Any]) -> str:
    run = root / name
    run.mkdir()
    report = {
        "config": {"seed": seed},
        "thirds": {"first": last, "last": last},
        "gated_deploys": 0 if name.startswith("paused") else 5,
        "deploy_counts": {"promote": 3, "rollback": 1},
    }
    (run / "report.json").write_text(json.dumps(report))
    return str(run)


def test_each_arm_against_its_seeds_paused_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        "paused=" + write_run(tmp_path, "paused-a", 0, third(100.0, 0.2, kept=40.0)),
        "paused=" + write_run(tmp_path, "paused-b", 0, third(120.0, 0.2, kept=60.0)),
        "learning="
        + write_run(tmp_path, "learning-0", 0, third(121.0, 0.1, kept=60.0, accepted=45)),
        "paused=" + write_run(tmp_path, "paused-c", 1, third(200.0, 0.4, kept=80.0)),
        "learning=" + write_run(tmp_path, "learning-1", 1, third(180.0, 0.4, kept=64.0)),
    ]
    assert main([*runs, "--plot", str(tmp_path / "loop.png")]) == 0
    out = capsys.readouterr().out
    assert out.count("| 0 | paused |") == 2 and out.count("| 1 | learning |") == 1  # every run
    # kept chars lead the table, then the accept rate of shown and what was not taken
    assert out.splitlines()[0].startswith(
        "| seed | arm | kept chars / 100 req | accept rate of shown | not taken / req |"
    )
    assert "| 0 | learning | 60.0 | 0.750 | 0.150 | – | 121.0 | 20.0% |" in out  # no expected
    assert "| 5 (3, 1) |" in out
    # the loop's figures beside the paused mean (seed 0: 40 and 60 -> 50), with the ratio
    assert "| 0 | kept chars / 100 req | 60.0 | 50.0 | 1.20 |" in out
    assert "| 0 | accept rate of shown | 0.750 | 0.600 | 1.25 |" in out
    assert "| 0 | not taken / req | 0.150 | 0.240 | 0.62 |" in out
    assert "| 1 | kept chars / 100 req | 64.0 | 80.0 | 0.80 |" in out
    assert "- kept chars / 100 req: mean ratio 1.00 over 2 seeds" in out
    # seed 0: 121 against the mean of 100 and 120; seed 1: 180 against 200
    assert "kept_chars_per_100: +20%, -20% (mean +0%)" in out
    assert "useful_chars_per_100: +10%, -10% (mean +0%)" in out
    assert "wrong_shown_per_request: -50%, +0% (mean -25%)" in out
    assert out.index("kept_chars_per_100:") < out.index("useful_chars_per_100:")
    assert (tmp_path / "loop.png").stat().st_size > 0
    assert "on the same cursors" not in out  # no records.jsonl: the reports alone


def record(
    t: float, line_no: int, shown: bool = True, kept: float = 0.0, fresh: bool = True
) -> dict[str, Any]:
    """A records.jsonl row: a request at line `line_no` of one file, `kept` characters kept
    (accepted when above 0) and expected; `fresh`: on a line never sent before."""
    return {
        "t": t,
        "user_id": "u",
        "version": 1,
        "shown": shown,
        "family": False,
        "shown_chars": 10 if shown else 0,
        "verdict": "correct" if shown else None,
        "action": ("accept" if kept else "ignore") if shown else "abstained",
        "accepted_chars": int(kept),
        "retained_chars": kept,
        "reward": 0.0,
        "latency_ms": 10.0,
        "useful_chars": 10 if kept else 0,
        "path": "a.py",
        "line_no": line_no,
        "expected_kept": kept / 2,
        "fresh": fresh,
        "some_later_field": 1,  # read past: fields a later simulator adds
    }


def test_same_cursors_compare_the_lines_both_runs_asked_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the cursors both runs asked at in their last thirds (here lines 10-13 of 90 s runs:
    the paused run's last third also has line 9, the learning run's line 14, and line 1 is in
    both runs' first thirds)."""
    paused = [record(1.0, 1, kept=100.0), record(61.0, 9, kept=50.0)]
    paused += [record(62.0 + i, 10 + i, kept=10.0 * (i == 0), fresh=i > 0) for i in range(4)]
    learning = [record(1.0, 1)] + [record(70.0 + i, 10 + i, kept=20.0) for i in range(4)]
    learning += [record(75.0, 14, kept=100.0)]
    runs = []
    for arm, rows in (("paused", paused), ("learning", learning)):
        path = Path(write_run(tmp_path, arm, 0, third(100.0, 0.2)))
        report = json.loads((path / "report.json").read_text())
        report["config"]["duration_s"] = 90.0
        report["thirds"]["last"]["expected_kept_per_100"] = 0.0  # recorded by this simulator
        (path / "report.json").write_text(json.dumps(report))
        (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(f"{arm}={path}")
    assert main(runs) == 0
    out = capsys.readouterr().out
    # paused: 10 kept of 4 requests, 1 accept of 4 shown; learning: 80 kept, all 4 accepted
    assert (
        "| 0 | learning | 4 | 250.0 → 2000.0 | 0.250 → 1.000 | 0.750 → 0.000 | 125.0 → 1000.0 "
        "| 250.0 → 1000.0 |" in out
    )
    assert "- learning, kept chars / 100 req: +700% (mean +700%)" in out
    assert "fresh lines only" not in out
    # the plot's bars are the same cursors' figures, the paused run's once
    loaded = [load(r) for r in runs]
    bars, covers = plot_bars([(a, s, rep) for a, s, _, rep in loaded], same_cursor_rows(loaded))
    assert [(arm, seed, f["kept_chars_per_100"]) for arm, seed, f in bars] == [
        ("paused", 0, 250.0),
        ("learning", 0, 2000.0),
    ]
    assert covers == "last thirds, on the cursors both runs of a seed asked at"
    assert main([*runs, "--plot", str(tmp_path / "same.png")]) == 0
    assert (tmp_path / "same.png").stat().st_size > 0
    capsys.readouterr()
    # --fresh: again on the fresh lines, here 11-13 (line 10 was sent before the paused run
    # asked at it): nothing kept paused
    assert main([*runs, "--fresh"]) == 0
    out = capsys.readouterr().out
    assert (
        "| 0 | learning | 3 | 0.0 → 2000.0 | 0.000 → 1.000 | 1.000 → 0.000 |"
        in out.split("fresh lines only")[1]
    )
    # a run written before the expected kept characters (its report and records lack them):
    # none shown
    for r in learning:
        del r["expected_kept"]
    (tmp_path / "learning" / "records.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in learning)
    )
    report = json.loads((tmp_path / "learning" / "report.json").read_text())
    del report["thirds"]["last"]["expected_kept_per_100"]
    (tmp_path / "learning" / "report.json").write_text(json.dumps(report))
    assert main(runs) == 0
    assert (
        "| 0 | learning | 4 | 250.0 → 2000.0 | 0.250 → 1.000 | 0.750 → 0.000 | – → – "
        "| 250.0 → 1000.0 |" in capsys.readouterr().out
    )


def test_a_report_before_the_loops_keys_gives_them_from_its_figures() -> None:
    """An older report's last third has retained_chars_per_100 (the same kept characters) and
    the counts, not kept_chars_per_100 or not_taken_per_request."""
    old = {"requests": 50, "shown": 20, "accepted": 5, "retained_chars_per_100": 12.5}
    last = last_third({"thirds": {"last": old}})
    assert last["kept_chars_per_100"] == 12.5
    assert last["not_taken_per_request"] == pytest.approx(15 / 50)
    empty = last_third({"thirds": {"last": {"requests": 0, "shown": 0, "accepted": 0}}})
    assert empty["kept_chars_per_100"] is None and empty["not_taken_per_request"] is None


@pytest.mark.parametrize(
    ("value", "base", "expected"),
    [(1.0, 2.0, 0.5), (0.0, 2.0, 0.0), (1.0, 0.0, None), (None, 1.0, None), (1.0, None, None)],
)
def test_ratio(value: float | None, base: float | None, expected: float | None) -> None:
    assert ratio(value, base) == expected


def test_against_paused_needs_a_paused_run_of_the_seed() -> None:
    runs = [
        ("paused", 0, {"thirds": {"last": third(10.0, 0.1)}}),
        ("learning", 1, {"thirds": {"last": third(10.0, 0.1)}}),  # no paused run of seed 1
    ]
    assert against_paused(runs) == {}
    runs.append(("learning", 0, {"thirds": {"last": third(10.0, 0.1, kept=25.0)}}))
    ((seed, last, base),) = against_paused(runs)["learning"]
    assert (seed, last["kept_chars_per_100"], base["kept_chars_per_100"]) == (0, 25.0, 50.0)


def test_a_run_without_its_arm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="expected ARM=RUN_DIR"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match="no report.json"):
        main([f"paused={tmp_path}"])
