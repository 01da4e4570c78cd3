"""benchmarks/summarize.py, run as its docs say: `--at 15` on a 15-minute run is the row of the
standard table (the learning phase's last fifth), and later minutes read later windows."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

from simulator.phases import learning_comparison
from tests.simulator.test_phases import tagged

ROOT = Path(__file__).resolve().parents[2]
BASELINE_S = 240.0


def write_run(out: Path, minutes: float) -> Path:
    """A run directory with report.json and records.jsonl: in the baseline phase half the
    requests are accepted; in learning, every request of the last 3 minutes is."""
    duration = BASELINE_S + 60 * minutes
    records = []
    for t in range(0, int(duration), 5):
        late = t >= duration - 180
        action = "accept" if late or (t < BASELINE_S and t % 10 == 0) else "reject"
        records.append(
            tagged(
                float(t),
                action,
                accepted=4 if action == "accept" else 0,
                baseline_s=BASELINE_S,
                user=f"u{t % 3}",
            )
        )
    # a seen line (not fresh) that would change the figures if it were counted
    records.append(
        replace(
            records[-1],
            t=duration - 1,
            action="reject",
            fresh=False,
            accepted_chars=0,
            retained_chars=0.0,
        )
    )
    out.mkdir()
    with (out / "records.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    comparison = learning_comparison(records, BASELINE_S, duration)
    comparison.update(gated_deploys=1, errors=0, events_lost=0)
    deployments = [
        {"t": BASELINE_S + 30, "id": 2, "action": "deploy", "live_version": 1, "canary_version": 2}
    ]
    (out / "report.json").write_text(
        json.dumps(
            {
                "config": {"seed": 0, "corpus": None, "baseline_minutes": BASELINE_S / 60},
                "phase_comparison": comparison,
                "deployments": deployments,
            }
        )
    )
    return out


def summarize(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "benchmarks/summarize.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in done.stdout.splitlines() if line.startswith("| ")]


def test_at_the_end_of_a_run_is_its_last_fifth(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", minutes=15)
    table = summarize(str(run))[1]  # header, then the run's row
    window = summarize(str(run), "--at", "15")[1]
    assert window.split(" | ")[2:5] == table.split(" | ")[3:6]
    assert "+100%" in window  # half accepted in the baseline phase, all at the end


def test_earlier_minutes_read_earlier_windows(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", minutes=15)
    early, end = summarize(str(run), "--at", "6", "15")[1:]
    assert early.split(" | ")[3].endswith("(-100%)")  # nothing accepted in minutes 3-6
    assert end.split(" | ")[3].endswith("(+100%)")
    assert early.endswith("| 1 |") and end.endswith("| 1 |")


def test_fresh_lines_that_ran_out_are_counted_not_compared(tmp_path: Path) -> None:
    """With a memory, every line may have been sent by the end: the last fifth then has no fresh
    request, and the table says so instead of failing."""
    run = write_run(tmp_path / "run", minutes=15)
    report = json.loads((run / "report.json").read_text())
    fresh = report["phase_comparison"]["fresh"]
    fresh["last_fifth"] = {
        k: (0 if k in ("requests", "shown", "accepted") else None) for k in fresh["last_fifth"]
    }
    fresh["change"] = dict.fromkeys(fresh["change"])
    (run / "report.json").write_text(json.dumps(report))
    (row,) = summarize(str(run), "--lines", "fresh")[1:]
    n = fresh["reference"]["requests"]
    assert f"→ – (n = {n} → 0)" in row
    assert "%" not in row.split(" | ")[3]


def test_a_learning_run_is_set_against_the_control_of_its_seed(tmp_path: Path) -> None:
    """A run with the trainer paused throughout is a control: it is marked, left out of the
    learning runs' mean, and each learning run of its seed and service mode is compared with
    it."""

    def run(name: str, control: bool, **config: object) -> Path:
        out = write_run(tmp_path / name, minutes=15)
        report = json.loads((out / "report.json").read_text())
        report["config"].update(config)
        if control:
            report["phases"] = {"trainer": {"paused_before": True}}
        (out / "report.json").write_text(json.dumps(report))
        return out

    learning = run("learning", False, service_mode="embedded")
    control = run("control", True, service_mode="embedded")
    other_seed = run("other", False, seed=1, service_mode="embedded")
    other_mode = run("full", True, service_mode="full")
    report = json.loads((control / "report.json").read_text())
    side = report["phase_comparison"]["all"]
    base = side["reference"]["retained_chars_per_100"]
    side["last_fifth"]["retained_chars_per_100"] = base  # no change without learning
    (control / "report.json").write_text(json.dumps(report))
    last = json.loads((learning / "report.json").read_text())["phase_comparison"]["all"]
    rise = last["last_fifth"]["retained_chars_per_100"] / base - 1

    png = tmp_path / "pairs.png"
    runs = (learning, control, other_seed, other_mode)
    rows = summarize(*map(str, runs), "--lines", "all", "--plot", str(png))
    assert png.read_bytes().startswith(b"\x89PNG")
    assert [r.split(" | ")[0] for r in rows[1:5]] == [
        "| learning",
        "| control (control)",
        "| other",
        "| full (control)",
    ]
    (pair,) = [r for r in rows if r.startswith("| learning | control |")]
    cells = pair.split(" | ")
    assert cells[5] == f"{100 * rise:+.1f}%"  # the last fifths, learning against control
    assert cells[6] == "+0.0%"  # the same baseline phase: no drift
    assert cells[7] == f"{100 * rise:+.1f} points |"
    assert not [r for r in rows if r.startswith("| other | control |")]  # another seed
    assert not [r for r in rows if r.startswith("| learning | full |")]  # another mode


def test_a_run_without_its_report_is_named_not_a_traceback(tmp_path: Path) -> None:
    """A directory that is not a finished run (no report.json yet) is a usage error naming it."""
    done = write_run(tmp_path / "done", minutes=15)
    (running := tmp_path / "running").mkdir()
    out = subprocess.run(
        [sys.executable, "benchmarks/summarize.py", str(done), str(running)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"no report.json in {running}" in out.stderr
