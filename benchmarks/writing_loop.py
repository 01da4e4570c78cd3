"""The loop's own share in writing mode: runs of `benchmarks/simulation.py --editing write`,
each labelled with its arm, in one table and one plot, every run reported.

    python -m benchmarks.writing_loop paused=RUN learning=RUN candidate=RUN ... [--plot PNG]

An arm is a label of your choosing (`paused` for the runs with the trainer paused: the base
policy serving); RUN is a run's directory (with report.json). Per run, from the last third of
its requests: useful chars per 100 requests, whole rest of line, exact of shown, shown and wrong
shown per request, the accept rate of shown, and the gated deploys (promoted, rolled back).
Then, for every arm but `paused`, each seed's change against the mean of that seed's paused
runs, and the mean change over the seeds. `--plot` draws useful characters, exact of shown and
wrong shown per request, a bar per run, grouped by seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

PAUSED = "paused"
# (report key, column title, format)
COLUMNS = (
    ("useful_chars_per_100", "useful chars / 100 req", "{:.1f}"),
    ("whole_line_rate", "whole rest of line", "{:.1%}"),
    ("exact_of_shown", "exact of shown", "{:.3f}"),
    ("shown_per_request", "shown / req", "{:.3f}"),
    ("wrong_shown_per_request", "wrong shown / req", "{:.3f}"),
    ("accept_rate_of_shown", "accept rate of shown", "{:.3f}"),
)
CHANGES = ("useful_chars_per_100", "exact_of_shown", "wrong_shown_per_request", "whole_line_rate")


def load(arg: str) -> tuple[str, int, dict[str, Any]]:
    arm, sep, path = arg.partition("=")
    if not sep or not arm or not path:
        raise SystemExit(f"{arg!r}: expected ARM=RUN_DIR")
    report = json.loads((Path(path) / "report.json").read_text())
    return arm, int(report["config"]["seed"]), report


def deploys(report: dict[str, Any]) -> str:
    counts = report.get("deploy_counts", {})
    promoted, rolled_back = counts.get("promote", 0), counts.get("rollback", 0)
    return f"{report.get('gated_deploys', 0)} ({promoted}, {rolled_back})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="ARM=RUN", help="a run's arm and its directory")
    p.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = p.parse_args(argv)
    runs = sorted((load(a) for a in args.runs), key=lambda r: (r[1], r[0] != PAUSED, r[0]))

    header = [
        "seed",
        "arm",
        *(title for _, title, _ in COLUMNS),
        "gated deploys (promoted, rolled back)",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for arm, seed, report in runs:
        last = report["thirds"]["last"]
        cells = [fmt.format(last[key]) for key, _, fmt in COLUMNS]
        print(f"| {seed} | {arm} | " + " | ".join(cells) + f" | {deploys(report)} |")

    paused: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for arm, seed, report in runs:
        if arm == PAUSED:
            paused[seed].append(report["thirds"]["last"])
    changes: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for arm, seed, report in runs:
        if arm == PAUSED or not paused[seed]:
            continue
        last = report["thirds"]["last"]
        for key in CHANGES:
            base = statistics.mean(r[key] for r in paused[seed])
            changes[arm][key].append(last[key] / base - 1 if base else float("nan"))
    for arm, by_key in changes.items():
        print(f"\n{arm} against the mean of its seed's paused runs, per seed, then the mean:")
        for key, values in by_key.items():
            each = ", ".join(f"{v:+.0%}" for v in values)
            print(f"  {key}: {each} (mean {statistics.mean(values):+.0%})")
    if args.plot:
        draw(runs, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


def draw(runs: list[tuple[str, int, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({seed for _, seed, _ in runs})
    arms = sorted({arm for arm, _, _ in runs}, key=lambda a: (a != PAUSED, a))
    panels = (
        ("useful_chars_per_100", "useful chars / 100 requests"),
        ("exact_of_shown", "exact of shown"),
        ("wrong_shown_per_request", "wrong shown / request"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.8))
    colors = {arm: f"C{i}" for i, arm in enumerate(arms)}
    for ax, (key, title) in zip(axes, panels, strict=True):
        for s_i, seed in enumerate(seeds):
            mine = [(arm, r) for arm, sd, r in runs if sd == seed]
            width = 0.8 / max(1, len(mine))
            for j, (arm, report) in enumerate(mine):
                x = s_i - 0.4 + width * (j + 0.5)
                ax.bar(x, report["thirds"]["last"][key], width, color=colors[arm])
        ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
        ax.set_title(title + " (last third)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[a]) for a in arms]
    fig.legend(handles, arms, loc="lower center", ncol=len(arms))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
