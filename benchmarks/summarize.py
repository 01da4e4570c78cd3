"""Every run's result in one table, with the mean and spread: the learning phase's last fifth
against its own baseline phase, on fresh lines (or on all lines), from the runs' report.json.

    python benchmarks/summarize.py RUN_DIR [RUN_DIR ...] [--lines all|fresh]
    python benchmarks/summarize.py RUN_DIR --at 15 30 45 60   # a longer run, along the way

Prints a Markdown table: per run (its directory's name) its seed and corpus, then shown per
request, accept rate of shown and retained characters per 100 requests (baseline → last
fifth, relative change), the gated deploys, errors and lost events, and the offline exact
rest-of-line rate of the base and the last live policy on fresh lines; then the mean and the
standard deviation of each change over the runs. Every run given is reported: none is dropped
or picked.

`--at M ...` reads the runs' records.jsonl instead and compares, for each M, the 3 minutes of
learning that end at minute M (a fifth of a 15-minute run, so `--at 15` is the last fifth of
one) with the baseline phase, with the gated deploys made by then: what more minutes of
learning buy.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from simulator.phases import compare_sides, learning_records
from simulator.report import RequestRecord, gated_deploys

METRICS = ("shown_per_request", "accept_rate_of_shown", "retained_chars_per_100")


def row(run: Path, lines: str) -> tuple[str, dict[str, float]]:
    report: dict[str, Any] = json.loads((run / "report.json").read_text())
    cfg, pc = report["config"], report["phase_comparison"]
    side = pc[lines]
    cells = [
        run.name,
        str(cfg.get("seed", "")),
        Path(cfg["corpus"]).name if cfg.get("corpus") else "stdlib held-out",
    ]
    changes = {}
    for m in METRICS:
        ref, last, change = side["reference"][m], side["last_fifth"][m], side["change"][m]
        fmt = "{:.1f}" if m.endswith("100") else "{:.3f}"
        shown = [("–" if v is None else fmt.format(v)) for v in (ref, last)]
        if change is None:  # no such requests on one side (fresh lines can run out)
            n = side["last_fifth"]["requests"], side["reference"]["requests"]
            cells.append(f"{shown[0]} → {shown[1]} (n = {n[1]} → {n[0]})")
            continue
        changes[m] = change
        cells.append(f"{shown[0]} → {shown[1]} ({100 * change:+.0f}%)")
    cells += [str(pc["gated_deploys"]), str(pc["errors"]), str(pc["events_lost"])]
    exact = report.get("offline_exact_rest_of_line")
    if exact:
        cells.append(f"{exact['base']['exact_rate']:.3f} → {exact['last']['exact_rate']:.3f}")
        changes["exact"] = exact["last"]["exact_rate"] / exact["base"]["exact_rate"] - 1
    else:
        cells.append("")
    return "| " + " | ".join(cells) + " |", changes


AT_WINDOW_S = 180.0  # a fifth of a 15-minute learning phase


def along_the_way(run: Path, minutes: list[float], lines: str) -> None:
    """The window of AT_WINDOW_S ending at each of `minutes` of learning against the baseline."""
    report: dict[str, Any] = json.loads((run / "report.json").read_text())
    baseline_s = 60 * float(report["config"]["baseline_minutes"])
    assert baseline_s > 0, f"{run}: --at needs a run with a baseline phase"
    with (run / "records.jsonl").open() as f:
        records = [RequestRecord(**json.loads(line)) for line in f]
    if lines == "fresh":
        records = [r for r in records if r.fresh]
    baseline = [r for r in records if r.phase == "baseline"]
    learning = learning_records(records, baseline_s)
    print(
        f"{run.name}, on {lines} lines: the {AT_WINDOW_S / 60:g} minutes of learning ending at "
        "each minute against the baseline phase\n"
    )
    print(
        "| minutes of learning | requests | shown / request | accept rate of shown "
        "| retained chars / 100 req | gated deploys by then |"
    )
    print("|" + "---|" * 6)
    for m in minutes:
        end = 60 * m
        window = [r for r in learning if end - AT_WINDOW_S <= r.t < end]
        side = compare_sides(baseline, window)
        cells = [f"{m:g}", str(len(window))]
        for name in METRICS:
            ref, last = side["reference"][name], side["last_fifth"][name]
            change = side["change"][name]
            fmt = "{:.1f}" if name.endswith("100") else "{:.3f}"
            cells.append(
                f"{fmt.format(ref)} → {fmt.format(last)} ({100 * change:+.0f}%)"
                if last is not None and change is not None
                else ""
            )
        deployments = [d for d in report["deployments"] if d["t"] < baseline_s + end]
        cells.append(str(gated_deploys(deployments)))
        print("| " + " | ".join(cells) + " |")
    print()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="run directories (with report.json)")
    p.add_argument("--lines", choices=["fresh", "all"], default="fresh")
    p.add_argument(
        "--at",
        type=float,
        nargs="+",
        metavar="MINUTES",
        help="minutes of learning to report along the way (from records.jsonl)",
    )
    args = p.parse_args()
    if args.at:
        for run in args.runs:
            along_the_way(run, args.at, args.lines)
        return 0
    print(f"On {args.lines} lines, the baseline phase → the learning phase's last fifth:\n")
    print(
        "| run | seed | corpus | shown / request | accept rate of shown | retained chars / 100 "
        "req | gated deploys | errors | lost events | exact rest of line, base → last |"
    )
    print("|" + "---|" * 10)
    all_changes = []
    for run in args.runs:
        line, changes = row(run, args.lines)
        print(line)
        all_changes.append(changes)
    print()
    for name in (*METRICS, "exact"):
        values = [c[name] for c in all_changes if c.get(name) is not None]
        if values:
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(
                f"- {name}: mean {100 * statistics.mean(values):+.1f}%, s.d. {100 * sd:.1f} "
                f"points, range {100 * min(values):+.0f}% to {100 * max(values):+.0f}% "
                f"over {len(values)} runs"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
