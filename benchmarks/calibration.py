"""The frontier of reward specs: for each spec, the policy its reward's optimum implies, in
useful characters and wrong suggestions shown per request.

    python -m benchmarks.calibration --corpus DIR [--n 3000] [--seeds 0,1,2]
        [--eval DIR|stdlib ...] [--eval-n 800] [--checkpoint DIR]
        [--exponents 0.5,1] [--rejects 0.05,0.1,0.15,0.2,0.25] [--fit-heads]

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

`--fit-heads` measures how much a richer fit of the two decisions could add: for each spec,
every weight of the copy head and the gate (both heads' hidden-state weights included: what the
loop moves besides the language model) is fitted from that spec's calibration to
the largest expected reward on `--corpus`, with an L2 pull back to the calibration (`--l2`),
and printed in a second table on the same cursors. A held-out gain small beside the
calibration's says that the loop has little to learn in its heads under that spec.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from benchmarks.writing import DEFAULT_BASE
from tabloop.core.corpus import writing_files
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.model import Gate
from tabloop.core.reward_spec import RewardSpec
from trainer.pretrain.calibrate import (
    Calibration,
    Observation,
    apply,
    arrays,
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
    ap.add_argument("--fit-heads", action="store_true", help="also fit every head weight")
    ap.add_argument("--l2", type=float, default=1e-4, help="--fit-heads: the pull back")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok, manifest = load_checkpoint(args.checkpoint)
    done = manifest.summary.get("calibration")
    if done is not None:  # start from the heads as fitted, as the calibration did
        undo(model, Calibration(done["copy_shift"], done["show_shift"], done["sharpness"]))
    seeds = [int(s) for s in args.seeds.split(",")]

    def observations(corpus: Path | None, n: int) -> list[list[Observation]]:
        paths = writing_files(corpus)
        return [observe(model, tok, paths, n, seed, inputs=args.fit_heads) for seed in seeds]

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
    if args.fit_heads:
        print(f"\nevery head weight fitted from the spec's calibration (L2 {args.l2:g})")
        print("| " + " | ".join(["spec", name, *evals]) + " |")
        print("|" + "---|" * (2 + len(evals)))
        for label, cal, spec in rows[1:]:
            calibrated = copy.deepcopy(model)  # the heads as fitted, then calibrated
            apply(calibrated, cal)
            fitted = fit_heads(pooled, _heads(calibrated.gate), spec, args.l2)
            cells = [heads_cell(fit, fitted, spec)]
            cells += [heads_cell(runs, fitted, spec) for runs in evals.values()]
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


# -- --fit-heads: the two decisions as differentiable functions of every head weight ---------
Heads = dict[str, torch.Tensor]


def _tensors(obs: Sequence[Observation], spec: RewardSpec) -> dict[str, torch.Tensor]:
    """calibrate's arrays (presence, what showing each side is worth) as float tensors, with
    each side's inputs."""
    out = {k: torch.from_numpy(v.astype(np.float32)) for k, v in arrays(obs, spec).items()}
    for side in ("copy", "own"):
        options = [getattr(o, side) for o in obs]
        width = max((len(x.inputs) for x in options if x is not None), default=1)
        out[side + "_in"] = torch.tensor(
            [x.inputs if x is not None else (0.0,) * width for x in options]
        )
    return out


def _heads(g: Gate) -> Heads:
    return {
        "copy_w": torch.cat([g.copy.weight[0], g.copy.hidden[0]]).detach().clone(),
        "copy_b": g.copy.bias.detach().clone(),
        "own_w": torch.cat([g.hidden.weight[0], g.features.weight[0]]).detach().clone(),
        "own_b": g.features.bias.detach().clone(),
    }


def _shown(t: dict[str, torch.Tensor], heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
    p_copy = t["has_copy"] * torch.sigmoid(t["copy_in"] @ heads["copy_w"] + heads["copy_b"])
    p_show = torch.sigmoid(t["own_in"] @ heads["own_w"] + heads["own_b"])
    return p_copy, (1 - p_copy) * t["has_own"] * p_show


def fit_heads(
    obs: Sequence[Observation], start: Heads, spec: RewardSpec, l2: float, steps: int = 600
) -> Heads:
    """Every head weight, from `start`, to the largest expected reward under `spec` on `obs`,
    less `l2` times the squared distance from `start` (Adam, full batch)."""
    t = _tensors(obs, spec)
    heads = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    opt = torch.optim.Adam(list(heads.values()), lr=0.02)
    for _ in range(steps):
        p_copy, p_own = _shown(t, heads)
        reward = (p_copy * t["copy_reward"] + p_own * t["own_reward"]).mean()
        pull = sum(((heads[k] - start[k]) ** 2).sum() for k in heads)
        loss = -reward + l2 * pull
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in heads.items()}


def heads_cell(runs: list[list[Observation]], heads: Heads, spec: RewardSpec) -> str:
    """As `cell` for fitted heads: useful chars / 100 req, wrong shown / req, exact of shown."""
    figs = []
    for run in runs:
        t = _tensors(run, spec)
        with torch.no_grad():
            p_copy, p_own = _shown(t, heads)
        useful, wrong, whole = (
            float((p_copy * t["copy_" + k] + p_own * t["own_" + k]).sum())
            for k in ("useful", "wrong", "whole")
        )
        n, shown = max(1, len(run)), float((p_copy + p_own).sum())
        figs.append((100 * useful / n, wrong / n, whole / shown if shown else 0.0))
    useful_runs = [f[0] for f in figs]
    return (
        f"{statistics.mean(useful_runs):.1f} ({min(useful_runs):.1f}-{max(useful_runs):.1f}), "
        f"{statistics.mean(f[1] for f in figs):.3f}, {statistics.mean(f[2] for f in figs):.3f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
