"""The frontier of reward specs: for each spec, the policy its reward's optimum implies, in
useful characters and wrong suggestions shown per request.

    python -m benchmarks.calibration --corpus DIR [--n 3000] [--seeds 0,1,2]
        [--eval DIR|stdlib ...] [--eval-n 800] [--checkpoint DIR]
        [--exponents 0.5,1] [--rejects 0.05,0.1,0.15,0.2,0.25]

A team writes `--corpus`'s files top to bottom (as in benchmarks/writing.py). At each cursor the
checkpoint's copy proposal and its own sampled completion are observed once, with each head's
logit and whether the text is right (trainer/pretrain/calibrate.py). For each spec (the default
spec with `chars_exponent` and `reject_penalty` from the lists), the calibration whose reward is
largest on the pooled seeds of `--corpus` is found, and the policy it gives is printed: on
`--corpus` itself, then on each `--eval` corpus (its own cursors, `--eval-n` a seed), against
the checkpoint's heads as fitted (the `as fitted` row). The spec marked `default` is RewardSpec()'s.

`tabloop pretrain --calibrate` writes the default spec's calibration into a checkpoint. A
checkpoint calibrated already (the shipped base) is measured from its heads as fitted: its
recorded calibration is undone first, so `as fitted` is the base before it and the default spec's
row is the shipped base.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.writing import DEFAULT_BASE
from tabloop.core.corpus import writing_files
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.reward_spec import RewardSpec
from trainer.pretrain.calibrate import (
    Calibration,
    Observation,
    best_calibration,
    expected,
    observe,
    undo,
)


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _corpus(arg: str) -> Path | None:
    return None if arg == "stdlib" else Path(arg)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=_corpus, required=True, help="the package to calibrate on")
    ap.add_argument("--n", type=int, default=3000, help="cursors per seed (about)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eval", type=_corpus, action="append", default=[], metavar="DIR|stdlib")
    ap.add_argument("--eval-n", type=int, default=800)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_BASE)
    ap.add_argument("--exponents", type=_floats, default=[0.5, 1.0])
    ap.add_argument("--rejects", type=_floats, default=[0.05, 0.1, 0.15, 0.2, 0.25])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok, manifest = load_checkpoint(args.checkpoint)
    done = manifest.summary.get("calibration")
    if done is not None:  # start from the heads as fitted, as the calibration did
        undo(model, Calibration(done["copy_shift"], done["show_shift"], done["sharpness"]))
    seeds = [int(s) for s in args.seeds.split(",")]

    def observations(corpus: Path | None, n: int) -> list[list[Observation]]:
        paths = writing_files(corpus)
        return [observe(model, tok, paths, n, seed) for seed in seeds]

    fit = observations(args.corpus, args.n)
    pooled = [o for run in fit for o in run]
    evals = {("stdlib" if c is None else c.name): observations(c, args.eval_n) for c in args.eval}
    default = RewardSpec()
    specs = [
        RewardSpec(chars_exponent=e, reject_penalty=r) for e in args.exponents for r in args.rejects
    ]
    if default not in specs:
        specs.append(default)
    name = "stdlib" if args.corpus is None else args.corpus.name
    print(
        f"{len(pooled)} cursors of {name} ({len(seeds)} seeds); per corpus: useful chars / 100 "
        "req, wrong shown / req, exact of shown (mean over seeds, min-max of useful)"
    )
    header = ["spec", "copy shift", "show shift", name, *evals]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))

    def cell(runs: list[list[Observation]], cal: Calibration, spec: RewardSpec) -> str:
        figs = [expected(run, cal, spec) for run in runs]
        useful = [f["useful_per_100"] for f in figs]
        return (
            f"{statistics.mean(useful):.1f} ({min(useful):.1f}-{max(useful):.1f}), "
            f"{statistics.mean(f['wrong'] for f in figs):.3f}, "
            f"{statistics.mean(f['exact_of_shown'] for f in figs):.3f}"
        )

    rows = [("as fitted", Calibration(), default)] + [
        (
            f"exponent {s.chars_exponent:g}, reject {s.reject_penalty:g}"
            + (" (default)" if s == default else ""),
            best_calibration(pooled, s),
            s,
        )
        for s in specs
    ]
    for label, cal, spec in rows:
        cells = [cell(fit, cal, spec)] + [cell(runs, cal, spec) for runs in evals.values()]
        shifts = [f"{cal.copy_shift:+g}", f"{cal.show_shift:+g}"]
        if label == "as fitted":
            shifts = ["", ""]
        print(f"| {label} | " + " | ".join(shifts + cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
