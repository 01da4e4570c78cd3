"""The learning curve of a run (learning_curve.png) from its report, and `python -m
simulator.plot REPORT.json` to draw it again, optionally with another offline baseline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from simulator.report import compare

_MARKS = {
    "deploy": ("tab:blue", ":", "canary deploy"),
    "promote": ("tab:green", "-", "promotion"),
    "rollback": ("tab:red", "--", "rollback"),
}


def plot(report: dict[str, Any], path: Path) -> None:
    """A PNG of the learning curve, deployments marked, the baseline as dashed lines; the baseline
    phase shaded, with its means as dotted lines, and the fresh-line curves when people sent
    code_settled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = report["buckets"]
    cfg = report["config"]
    x = [(b["t0"] + b["t1"]) / 2 / 60 for b in buckets]
    base = (report.get("baseline") or {}).get("best") or {}
    phases = report.get("phases") or {}
    baseline_s = float(phases.get("baseline_s") or 0.0)
    duration_s = float(cfg.get("duration_s", 60 * cfg["minutes"]))
    learning_s = float(phases.get("learning_s") or duration_s - baseline_s)
    comparison = report.get("phase_comparison") or {}
    reference = (
        (comparison.get("all") or {}).get("reference") or {}
        if comparison.get("reference") == "baseline_phase"
        else {}
    )
    fresh = bool(buckets) and "fresh_shown_per_request" in buckets[0]
    panels = [  # what people keep first; the accept rate is secondary
        (
            "kept chars / 100 requests",
            [("all", "retained_chars_per_100")]
            + ([("fresh lines", "fresh_retained_chars_per_100")] if fresh else []),
            base.get("retained_chars_per_100"),
        ),
        (
            "shown per request",
            [("all", "shown_per_request"), ("def/class (always rejected)", "family_shown_rate")],
            base.get("shown_per_request"),
        ),
        (
            "reward per request (decision part)",
            [("all", "reward_per_request")],
            base.get("reward_per_request"),
        ),
        (
            "accept rate of shown",
            [("all", "accept_rate_of_shown")]
            + ([("fresh lines", "fresh_accept_rate_of_shown")] if fresh else []),
            base.get("accept_rate_of_shown"),
        ),
    ]
    fifth_label = "fifth of the learning phase" if baseline_s > 0 else "fifth of the run"
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 10), sharex=True)
    for ax, (title, series, baseline) in zip(axes, panels, strict=True):
        if baseline_s > 0:
            ax.axvspan(
                0,
                baseline_s / 60,
                color="grey",
                alpha=0.12,
                label="baseline phase (trainer paused)",
            )
        for i, (label, key) in enumerate(series):
            ys = [b[key] if b.get(key) is not None else math.nan for b in buckets]
            (line,) = ax.plot(
                x,
                ys,
                marker="o",
                markersize=3,
                linewidth=1,
                alpha=0.8,
                label=f"{label}, per {cfg['bucket_s']:g} s",
                color="tab:purple" if key.startswith("fresh_") else None,
            )
            parts = (report.get("fifths") or {}).get("parts")
            if parts and key in parts[0]:  # each fifth's mean, the figures the targets compare
                xs = [(baseline_s + k * learning_s / 5) / 60 for k in range(6)]
                ys5 = [p[key] if p[key] is not None else math.nan for p in parts]
                ax.step(
                    xs,
                    ys5 + ys5[-1:],
                    where="post",
                    color=line.get_color(),
                    linewidth=2.5,
                    alpha=0.45,
                    label=None if i else fifth_label,
                )
            if reference.get(key) is not None:
                ax.axhline(
                    reference[key],
                    color=line.get_color(),
                    linestyle=":",
                    linewidth=1.2,
                    label="baseline phase mean" if i == 0 else None,
                )
        if baseline is not None:
            ax.axhline(
                baseline,
                color="grey",
                linestyle="--",
                linewidth=1,
                label="base policy, best fixed threshold",
            )
        seen = set()
        for d in report.get("deployments") or []:
            if d["action"] not in _MARKS:
                continue
            color, style, label = _MARKS[d["action"]]
            ax.axvline(
                d["t"] / 60,
                color=color,
                linestyle=style,
                linewidth=0.8,
                alpha=0.7,
                label=None if d["action"] in seen else label,
            )
            seen.add(d["action"])
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes since the simulation started")
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(
        list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=8, frameon=False
    )
    phase = f"{baseline_s / 60:g} min baseline + " if baseline_s > 0 else ""
    fig.suptitle(
        f"tabloop simulate: {cfg['users']} users, {phase}{cfg['minutes']} min, seed {cfg['seed']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`python -m simulator.plot REPORT.json`: redraw the plot, optionally with another
    baseline (from `python -m simulator.baseline`), rewriting the report's comparison."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m simulator.plot", description=main.__doc__)
    p.add_argument("report", type=Path)
    p.add_argument("--baseline", type=Path, help="baseline JSON to put in the report")
    p.add_argument("--png", type=Path, help="default: learning_curve.png beside the report")
    p.add_argument("--json", type=Path, help="where to write the report (default: in place)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    report = json.loads(args.report.read_text())
    if args.baseline:
        report["baseline"] = json.loads(args.baseline.read_text())
        report["comparison"] = compare(report["fifths"], report["baseline"])
    (args.json or args.report).write_text(json.dumps(report, indent=1, default=str))
    plot(report, args.png or args.report.parent / "learning_curve.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
