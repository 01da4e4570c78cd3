"""The loop's own share in writing mode: runs of `benchmarks/simulation.py --editing write`,
each labelled with its arm, in one table and one plot, every run reported.

    python -m benchmarks.writing_loop paused=RUN learning=RUN candidate=RUN ... [--plot PNG]

An arm is a label of your choosing (`paused` for the runs with the trainer paused: the base
policy serving); RUN is a run's directory (with report.json). Per run, from the last third of
its requests (report.json `thirds`, computed from its records): kept chars per 100 requests
(characters accepted x the fraction retained: the loop's measure), the accept rate of shown and
shown-but-not-taken per request, then the expected kept and useful chars per 100 requests, whole
rest of line, exact of shown, shown and wrong shown per request, and the gated deploys
(promoted, rolled back).
Then, for every arm but `paused`, per seed, the three first figures, the expected kept
characters (in expectation over the people's own draws) and the useful characters beside the
mean of that seed's paused runs with their ratio (arm / paused), and each figure's change
against the paused mean, with the mean change over the seeds; then the same against the
seed's paused run on the same cursors (the lines both runs asked at in their last thirds; from
records.jsonl, for runs that have one); with `--fresh`, that once more on the cursors at fresh
lines only (lines whose text no request had sent before, in any form: a long run's second pass
over the files sends none).
`--plot` draws kept and expected kept characters, useful characters and not taken per request,
a bar per run, grouped by seed: on the same cursors as above where the runs have their records
(each seed's paused run once), otherwise over each run's whole last third.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from simulator.output import read_records
from simulator.report import RequestRecord, loop_rates, metrics, same_cursors, third_windows

PAUSED = "paused"
# the loop's measure, then how it was reached: (report key, column title, format)
LOOP = (
    ("kept_chars_per_100", "kept chars / 100 req", "{:.1f}"),
    ("accept_rate_of_shown", "accept rate of shown", "{:.3f}"),
    ("not_taken_per_request", "not taken / req", "{:.3f}"),
)
# kept characters in expectation over the people's own coin flips (simulator/report.py)
EXPECTED = ("expected_kept_per_100", "expected kept / 100 req", "{:.1f}")
# characters of shown suggestions that match the true code: the proxy people's measure
USEFUL = ("useful_chars_per_100", "useful chars / 100 req", "{:.1f}")
COLUMNS = (
    *LOOP,
    EXPECTED,
    USEFUL,
    ("whole_line_rate", "whole rest of line", "{:.1%}"),
    ("exact_of_shown", "exact of shown", "{:.3f}"),
    ("shown_per_request", "shown / req", "{:.3f}"),
    ("wrong_shown_per_request", "wrong shown / req", "{:.3f}"),
    ("multi_line_of_shown", "several lines, of shown", "{:.3f}"),
    ("multi_line_of_kept", "several lines, of kept chars", "{:.3f}"),
)
# the figures compared on the same cursors
SAME = (*LOOP, EXPECTED, USEFUL)
CHANGES = (
    *(key for key, _, _ in LOOP),
    "expected_kept_per_100",
    "useful_chars_per_100",
    "exact_of_shown",
    "wrong_shown_per_request",
    "whole_line_rate",
)


Run = tuple[str, int, dict[str, Any]]  # (arm, seed, its last third: `last_third`)


def load(arg: str) -> tuple[str, int, Path, dict[str, Any]]:
    arm, sep, path = arg.partition("=")
    if not sep or not arm or not path:
        raise SystemExit(f"{arg!r}: expected ARM=RUN_DIR")
    if not (Path(path) / "report.json").is_file():
        raise SystemExit(f"{path}: no report.json (a run still going, or not a run's directory)")
    report = json.loads((Path(path) / "report.json").read_text())
    return arm, int(report["config"]["seed"]), Path(path), report


def last_third(report: dict[str, Any]) -> dict[str, Any]:
    """The run's last third (report.json `thirds.last`) with the loop's figures: a report
    written before they had their own keys has the same kept characters as
    retained_chars_per_100, and what was not taken follows from its counts."""
    last = report["thirds"]["last"]
    derived = loop_rates(last["requests"], last["shown"], last["accepted"], 0.0)
    return {
        "kept_chars_per_100": last.get("retained_chars_per_100"),
        "not_taken_per_request": derived["not_taken_per_request"],
        EXPECTED[0]: None,  # a report written before it was measured
        **last,
    }


def last_third_records(run: Path, report: dict[str, Any]) -> list[RequestRecord]:
    """The requests of the run's last third, from its records.jsonl (as report.json `thirds`)."""
    return third_windows(read_records(run), float(report["config"]["duration_s"]))[-1]


SameCursors = tuple[str, int, int, dict[str, Any], dict[str, Any]]  # arm, seed, n, paused, arm's
Bar = tuple[str, int, dict[str, Any]]  # a plotted bar: arm, seed, its figures


def same_cursor_rows(
    runs: list[tuple[str, int, Path, dict[str, Any]]], fresh: bool = False
) -> list[SameCursors]:
    """Every arm but `paused` against its seed's (first) paused run on the cursors both asked at
    in their last thirds: the same people's same lines, whatever else either reached. `fresh`:
    only the cursors on fresh lines (RequestRecord.fresh)."""
    runs = [r for r in runs if (r[2] / "records.jsonl").exists()]  # older runs: report only
    thirds = {
        path: [r for r in last_third_records(path, report) if r.fresh or not fresh]
        for _, _, path, report in runs
    }
    # runs written before the expected kept characters were recorded (their reports lack it)
    unmeasured = {
        path for _, _, path, report in runs if EXPECTED[0] not in report["thirds"]["last"]
    }
    paused = {seed: path for arm, seed, path, _ in reversed(runs) if arm == PAUSED}
    rows: list[SameCursors] = []
    for arm, seed, path, _ in runs:
        if arm == PAUSED or seed not in paused:
            continue
        base_records, records = same_cursors(thirds[paused[seed]], thirds[path])
        base, mine = metrics(base_records), metrics(records)
        if {path, paused[seed]} & unmeasured:
            base[EXPECTED[0]] = mine[EXPECTED[0]] = None
        rows.append((arm, seed, len(records), base, mine))
    return rows


def print_same_cursors(rows: list[SameCursors], fresh: bool = False) -> None:
    if not rows:
        return
    which = "those both runs of a seed asked at in their last thirds"
    print(f"\non the same cursors ({which}{', on fresh lines only' if fresh else ''}):\n")
    print("| seed | arm | cursors | " + " | ".join(t for _, t, _ in SAME) + " |")
    print("|" + "---|" * (3 + len(SAME)))
    changes: dict[tuple[str, str], list[float]] = defaultdict(list)
    for arm, seed, n, base, mine in rows:
        cells = []
        for key, title, form in SAME:
            r = ratio(mine[key], base[key])
            cells.append(f"{cell(base[key], form)} → {cell(mine[key], form)}")
            if r is not None:
                changes[(arm, title)].append(r - 1)
        print(f"| {seed} | {arm} | {n} | " + " | ".join(cells) + " |")
    for (arm, title), values in changes.items():
        each = ", ".join(f"{v:+.0%}" for v in values)
        print(f"- {arm}, {title}: {each} (mean {statistics.mean(values):+.0%})")


def deploys(report: dict[str, Any]) -> str:
    counts = report.get("deploy_counts", {})
    promoted, rolled_back = counts.get("promote", 0), counts.get("rollback", 0)
    return f"{report.get('gated_deploys', 0)} ({promoted}, {rolled_back})"


def cell(value: float | None, form: str) -> str:
    return "–" if value is None else form.format(value)


def against_paused(runs: list[Run]) -> dict[str, list[tuple[int, dict[str, Any], dict[str, Any]]]]:
    """Per arm but `paused`: (seed, its last third, the mean of that seed's paused runs' last
    thirds over CHANGES) for each of its runs whose seed has a paused run."""
    paused: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for arm, seed, report in runs:
        if arm == PAUSED:
            paused[seed].append(last_third(report))
    out: dict[str, list[tuple[int, dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for arm, seed, report in runs:
        if arm == PAUSED or not paused[seed]:
            continue
        base = {key: mean([r[key] for r in paused[seed]]) for key in CHANGES}
        out[arm].append((seed, last_third(report), base))
    return out


def mean(values: list[float | None]) -> float | None:
    """The mean; None when a run lacks the figure (no request shown, say)."""
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known and len(known) == len(values) else None


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None where either is unknown or base is 0."""
    return None if value is None or not base else value / base


def print_loop(arm: str, rows: list[tuple[int, dict[str, Any], dict[str, Any]]]) -> None:
    """The loop's figures of one arm's runs beside their seeds' paused runs, with the ratio."""
    print(f"\n{arm} against the mean of its seed's paused runs, last third, with the ratio:\n")
    print(f"| seed | measure | {arm} | {PAUSED} | ratio |")
    print("|" + "---|" * 5)
    ratios: dict[str, list[float]] = defaultdict(list)
    for seed, last, base in rows:
        for key, title, form in SAME:
            r = ratio(last[key], base[key])
            if r is not None:
                ratios[title].append(r)
            cells = (cell(last[key], form), cell(base[key], form), cell(r, "{:.2f}"))
            print(f"| {seed} | {title} | " + " | ".join(cells) + " |")
    for title, values in ratios.items():
        print(f"- {title}: mean ratio {statistics.mean(values):.2f} over {len(values)} seeds")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="ARM=RUN", help="a run's arm and its directory")
    p.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    p.add_argument(
        "--fresh", action="store_true", help="the same cursors again, on fresh lines only"
    )
    args = p.parse_args(argv)
    loaded = sorted((load(a) for a in args.runs), key=lambda r: (r[1], r[0] != PAUSED, r[0]))
    runs = [(arm, seed, report) for arm, seed, _, report in loaded]

    header = [
        "seed",
        "arm",
        *(title for _, title, _ in COLUMNS),
        "gated deploys (promoted, rolled back)",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for arm, seed, report in runs:
        last = last_third(report)
        cells = [cell(last.get(key), form) for key, _, form in COLUMNS]
        print(f"| {seed} | {arm} | " + " | ".join(cells) + f" | {deploys(report)} |")

    for arm, rows in against_paused(runs).items():
        print_loop(arm, rows)
        print(f"\n{arm} against the mean of its seed's paused runs, per seed, then the mean:")
        for key in CHANGES:
            ratios = [ratio(last[key], base[key]) for _, last, base in rows]
            values = [r - 1 for r in ratios if r is not None]
            each = ", ".join(f"{v:+.0%}" for v in values)
            mean_change = f"mean {statistics.mean(values):+.0%}" if values else "no ratio"
            print(f"  {key}: {each} ({mean_change})")
    same = same_cursor_rows(loaded)
    print_same_cursors(same)
    if args.fresh:
        print_same_cursors(same_cursor_rows(loaded, fresh=True), fresh=True)
    if args.plot:
        draw(*plot_bars(runs, same), args.plot)
        print(f"\nplot: {args.plot}")
    return 0


def plot_bars(runs: list[Run], same: list[SameCursors]) -> tuple[list[Bar], str]:
    """The plot's bars, (arm, seed, figures), and what they cover: on the same cursors where
    the runs have their records (each seed's paused run once, then every other arm), as the
    comparisons are made; otherwise each run's whole last third."""
    if not same:
        whole = [(arm, seed, last_third(report)) for arm, seed, report in runs]
        return whole, "each run's last third"
    bars: list[Bar] = []
    for arm, seed, _, base, mine in same:
        if seed not in {s for _, s, _ in bars}:
            bars.append((PAUSED, seed, base))
        bars.append((arm, seed, mine))
    return bars, "last thirds, on the cursors both runs of a seed asked at"


def draw(bars: list[Bar], covers: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({seed for _, seed, _ in bars})
    arms = sorted({arm for arm, _, _ in bars}, key=lambda a: (a != PAUSED, a))
    panels = (
        ("kept_chars_per_100", "kept chars / 100 requests"),
        ("expected_kept_per_100", "expected kept / 100 requests"),
        ("useful_chars_per_100", "useful chars / 100 requests"),
        ("not_taken_per_request", "not taken / request"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.8))
    colors = {arm: f"C{i}" for i, arm in enumerate(arms)}
    for ax, (key, title) in zip(axes, panels, strict=True):
        for s_i, seed in enumerate(seeds):
            mine = [(arm, figures) for arm, sd, figures in bars if sd == seed]
            width = 0.8 / max(1, len(mine))
            for j, (arm, figures) in enumerate(mine):
                x = s_i - 0.4 + width * (j + 0.5)
                ax.bar(x, figures[key] or 0.0, width, color=colors[arm])
        ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
        ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[a]) for a in arms]
    fig.legend(handles, arms, loc="lower center", ncol=len(arms))
    fig.suptitle(covers)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
