"""benchmarks/writing_loop.py: every run in the table, each arm's change against the mean of
its seed's paused runs, and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.writing_loop import main


def write_run(root: Path, name: str, seed: int, useful: float, wrong: float) -> str:
    last = {
        "useful_chars_per_100": useful,
        "whole_line_rate": 0.2,
        "exact_of_shown": 0.3,
        "shown_per_request": 0.6,
        "wrong_shown_per_request": wrong,
        "accept_rate_of_shown": 0.6,
    }
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
        "paused=" + write_run(tmp_path, "paused-a", 0, 100.0, 0.2),
        "paused=" + write_run(tmp_path, "paused-b", 0, 120.0, 0.2),
        "learning=" + write_run(tmp_path, "learning-0", 0, 121.0, 0.1),
        "paused=" + write_run(tmp_path, "paused-c", 1, 200.0, 0.4),
        "learning=" + write_run(tmp_path, "learning-1", 1, 180.0, 0.4),
    ]
    assert main([*runs, "--plot", str(tmp_path / "loop.png")]) == 0
    out = capsys.readouterr().out
    assert out.count("| 0 | paused |") == 2 and out.count("| 1 | learning |") == 1  # every run
    assert "| 0 | learning | 121.0 | 20.0% |" in out and "| 5 (3, 1) |" in out
    # seed 0: 121 against the mean of 100 and 120; seed 1: 180 against 200
    assert "useful_chars_per_100: +10%, -10% (mean +0%)" in out
    assert "wrong_shown_per_request: -50%, +0% (mean -25%)" in out
    assert (tmp_path / "loop.png").stat().st_size > 0


def test_a_run_without_its_arm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="expected ARM=RUN_DIR"):
        main([str(tmp_path)])
