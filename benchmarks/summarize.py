"""Every run's result in one table, with the mean and spread: the learning phase's last fifth
against its own baseline phase, on fresh lines (or on all lines), from the runs' report.json.

    python benchmarks/summarize.py RUN_DIR [RUN_DIR ...] [--lines all|fresh] [--plot PNG]
    python benchmarks/summarize.py RUN_DIR --at 15 30 45 60   # a longer run, along the way

Prints a Markdown table: per run (its directory's name) its seed and corpus, then kept
characters per 100 requests (accepted x retained: the loop's measure), accept rate of shown and
shown per request (baseline → last fifth, relative change), the gated deploys, errors and lost
events, and the offline exact rest-of-line rate of the base and the last live policy on fresh
lines; then the mean and the standard deviation of each change over the runs. Every run given
is reported: none is dropped or picked.

A run with the trainer paused throughout (`benchmarks/simulation.py --paused`: the people of
its seed, no learning in either phase) is a control. When the runs given include controls, a
second table sets each learning run against the controls of its seed, corpus and service mode
(embedded or full, which benchmarks/simulation.py records in report.json): kept
characters in both runs' baseline phases and last fifths, the learning run's last fifth against
the control's (the loop's own share, with the drift between two runs of one seed beside it:
their baseline phases, both paused, against each other) and the learning run's change less the
control's; `--plot` draws them.

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

from simulator.output import read_records
from simulator.phases import compare_sides, learning_records
from simulator.report import gated_deploys

# kept characters first (report.json's retained_chars_per_100 = kept_chars_per_100, the name
# every report has)
METRICS = ("retained_chars_per_100", "accept_rate_of_shown", "shown_per_request")


def row(run: Path, lines: str) -> tuple[str, dict[str, float], bool]:
    report: dict[str, Any] = json.loads((run / "report.json").read_text())
    cfg, pc = report["config"], report["phase_comparison"]
    side = pc[lines]
    cells = [
        run.name + (" (control)" if is_control(report) else ""),
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
    return "| " + " | ".join(cells) + " |", changes, is_control(report)


def is_control(report: dict[str, Any]) -> bool:
    """The trainer was paused before the run and stayed so (simulator/phases.py)."""
    return bool(report.get("phases", {}).get("trainer", {}).get("paused_before"))


def against_controls(runs: list[Path], lines: str, plot: Path | None = None) -> None:
    """Each learning run's kept characters against the controls of its seed, corpus and
    service mode; `plot`: draw them there (PNG)."""
    reports = {run: json.loads((run / "report.json").read_text()) for run in runs}

    def key(run: Path) -> tuple[Any, Any, Any]:
        cfg = reports[run]["config"]
        return cfg.get("seed"), cfg.get("corpus"), cfg.get("service_mode")

    def chars(run: Path) -> tuple[float, float]:
        side = reports[run]["phase_comparison"][lines]
        m = "retained_chars_per_100"
        return side["reference"][m], side["last_fifth"][m]

    controls = [r for r in runs if is_control(reports[r])]
    pairs = [
        (run, control)
        for run in runs
        if not is_control(reports[run])
        for control in controls
        if key(control) == key(run)
    ]
    if not pairs:
        return
    print(
        f"\nThe loop's own share, on {lines} lines: kept chars / 100 req of each learning "
        "run and the control of its seed (the trainer paused throughout):\n"
    )
    print(
        "| learning run | control | seed | learning: baseline → last fifth | control: baseline "
        "→ last fifth | last fifths, learning vs control | baseline phases (drift) | change "
        "less the control's |"
    )
    print("|" + "---|" * 8)
    shares, diffs = [], []
    for run, control in pairs:
        (lb, ll), (cb, cl) = chars(run), chars(control)
        share, drift, diff = ll / cl - 1, lb / cb - 1, (ll / lb - 1) - (cl / cb - 1)
        shares.append(share)
        diffs.append(diff)
        print(
            f"| {run.name} | {control.name} | {key(run)[0]} | {lb:.1f} → {ll:.1f} | "
            f"{cb:.1f} → {cl:.1f} | {100 * share:+.1f}% | {100 * drift:+.1f}% | "
            f"{100 * diff:+.1f} points |"
        )
    print()
    if plot is not None:
        draw_pairs([(run.name, chars(run), chars(control)) for run, control in pairs], plot)
        print(f"plot: {plot}\n")
    for name, values, unit in (
        ("last fifths, learning vs control", shares, "%"),
        ("change less the control's", diffs, " points"),
    ):
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        print(
            f"- {name}: mean {100 * statistics.mean(values):+.1f}{unit}, s.d. {100 * sd:.1f} "
            f"over {len(values)} pairs"
        )


def draw_pairs(
    pairs: list[tuple[str, tuple[float, float], tuple[float, float]]], path: Path
) -> None:
    """Per pair (learning run, (baseline, last fifth), control's): four bars of kept characters
    per 100 requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(pairs), 3.6))
    bars = (
        ("learning, baseline phase", 0, 0, "C0", 0.45),
        ("learning, last fifth", 0, 1, "C0", 1.0),
        ("control, baseline phase", 1, 0, "C7", 0.45),
        ("control, last fifth", 1, 1, "C7", 1.0),
    )
    width = 0.8 / len(bars)
    for j, (label, side, when, color, alpha) in enumerate(bars):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(pairs))]
        values = [(pair[1], pair[2])[side][when] for pair in pairs]
        ax.bar(xs, values, width, color=color, alpha=alpha, label=label)
    ax.set_xticks(range(len(pairs)), [name for name, _, _ in pairs])
    ax.set_ylabel("kept chars / 100 requests")
    low = min(min(a + b) for _, a, b in pairs)
    ax.set_ylim(0.9 * low, None)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


AT_WINDOW_S = 180.0  # a fifth of a 15-minute learning phase


def along_the_way(run: Path, minutes: list[float], lines: str) -> None:
    """The window of AT_WINDOW_S ending at each of `minutes` of learning against the baseline."""
    report: dict[str, Any] = json.loads((run / "report.json").read_text())
    baseline_s = 60 * float(report["config"]["baseline_minutes"])
    assert baseline_s > 0, f"{run}: --at needs a run with a baseline phase"
    records = read_records(run)
    if lines == "fresh":
        records = [r for r in records if r.fresh]
    baseline = [r for r in records if r.phase == "baseline"]
    learning = learning_records(records, baseline_s)
    print(
        f"{run.name}, on {lines} lines: the {AT_WINDOW_S / 60:g} minutes of learning ending at "
        "each minute against the baseline phase\n"
    )
    print(
        "| minutes of learning | requests | kept chars / 100 req | accept rate of shown "
        "| shown / request | gated deploys by then |"
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
    p.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="draw each learning run and its control's kept characters here",
    )
    args = p.parse_args()
    unfinished = [str(run) for run in args.runs if not (run / "report.json").is_file()]
    if unfinished:
        p.error(f"no report.json in {', '.join(unfinished)}: not a run's --out, or still running")
    if args.at:
        for run in args.runs:
            along_the_way(run, args.at, args.lines)
        return 0
    print(f"On {args.lines} lines, the baseline phase → the learning phase's last fifth:\n")
    print(
        "| run | seed | corpus | kept chars / 100 req | accept rate of shown | shown / request "
        "| gated deploys | errors | lost events | exact rest of line, base → last |"
    )
    print("|" + "---|" * 10)
    all_changes, learning_changes = [], []
    for run in args.runs:
        line, changes, control = row(run, args.lines)
        print(line)
        all_changes.append(changes)
        if not control:
            learning_changes.append(changes)
    # the mean is the learning runs' when there are controls beside them
    kind = "learning runs" if 0 < len(learning_changes) < len(all_changes) else "runs"
    all_changes = learning_changes or all_changes
    print()
    for name in (*METRICS, "exact"):
        values = [c[name] for c in all_changes if c.get(name) is not None]
        if values:
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(
                f"- {name}: mean {100 * statistics.mean(values):+.1f}%, s.d. {100 * sd:.1f} "
                f"points, range {100 * min(values):+.0f}% to {100 * max(values):+.0f}% "
                f"over {len(values)} {kind}"
            )
    against_controls(args.runs, args.lines, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
