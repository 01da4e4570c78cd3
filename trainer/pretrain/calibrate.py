"""Calibrate a checkpoint's two decisions, the copy head and the show/abstain gate, to a reward
spec, on a team writing a package's files top to bottom (`tabloop pretrain --calibrate`).

Each head gives a logit; the calibration moves both by a shift and scales them by a sharpness:

    logit p(copy) -> k * (copy logit + copy_shift)
    logit p(show) -> k * (gate logit + show_shift)

It observes, at each writing cursor (tabloop.core.corpus.writing_cursors), the copy proposal
and the model's own sampled completion, each head's logit, and whether each text is right
(`usefulness`: a prefix of the true rest of the line). For a (shift, shift) pair the expected
reward per request under the spec follows exactly from those observations: the policy copies
with p(copy), else shows its own completion with p(show); a right suggestion is accepted whole
(`accept_reward * size_scale(useful characters)`), a wrong one costs `reject_penalty`. The
pair on a grid with the largest expected reward is written into the heads, so that the base
starts where the loop's reward would take it, rather than the loop spending its first
policies getting there. The same figures (useful characters, wrong suggestions shown) are what
`benchmarks/calibration.py` tabulates for several specs.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import track

from tabloop.core.corpus import usefulness, writing_cursors, writing_files
from tabloop.core.policy.checkpoint import load_checkpoint, rewrite_checkpoint
from tabloop.core.policy.model import GPT
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.recall import MIN_MATCH_REQUEST, propose, recall_inputs, team_memories
from tabloop.core.reward_spec import RewardSpec, size_scale

log = logging.getLogger(__name__)

SHARPNESS = 2.0  # k: sharper than the fits, so that the draws follow the calibration, yet
# still drawn (a decision the policy always takes the same way teaches the loop nothing)
SHIFTS = tuple(x / 4 for x in range(-16, 17))  # the grid of each shift, in logits: -4 .. 4


@dataclass(frozen=True)
class Option:
    """One text the policy could show at a cursor: its head's logit and what it is worth."""

    logit: float  # the head's logit before calibration
    useful: int  # useful characters if shown (0: wrong)
    whole: bool  # it is the whole rest of the line
    # what the head read, when observed with `inputs`: the copy head's RECALL_INPUTS then the
    # hidden state, or the gate's hidden state then its confidence features
    inputs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Observation:
    """A cursor: the copy proposal (None: none) and the model's own completion (None: empty)."""

    copy: Option | None
    own: Option | None


@dataclass(frozen=True)
class Calibration:
    copy_shift: float = 0.0
    show_shift: float = 0.0
    sharpness: float = 1.0


def _logit(p: float) -> float:
    p = min(max(p, 1e-9), 1.0 - 1e-9)
    return math.log(p / (1.0 - p))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 1.0 / (1.0 + np.exp(-np.clip(x, -60.0, 60.0)))
    return out


def observe(
    model: GPT,
    tokenizer: CodeTokenizer,
    paths: Sequence[Path],
    n: int,
    seed: int,
    progress: bool = True,
    inputs: bool = False,
) -> list[Observation]:
    """The observations at about `n` writing cursors of `paths` (seeded), sampled as serving
    samples (its temperature, top-p and confidence stop), one thread's work. `inputs`: keep
    what each head read too (the gate's is scored again from the logged completion)."""
    memory = team_memories(paths)
    out: list[Observation] = []
    cursors = writing_cursors(paths, n, seed)
    rng = random.Random(seed)
    model.eval()
    bar = track(
        cursors,
        description="calibration cursors",
        disable=not progress,
        console=Console(stderr=True),
        transient=True,
    )
    for cur, _ in bar:
        g = torch.Generator().manual_seed(rng.getrandbits(63))
        c = complete(model, tokenizer, cur.prefix, "", 32, generator=g)
        p = propose(cur.prefix, (), memory[cur.path], MIN_MATCH_REQUEST)
        scored = None  # what the heads read at the end of the completion, scored again
        if p is not None or (inputs and c.text.strip()):
            with torch.no_grad():
                scored = score_actions(model, tokenizer, [c])
        own = None
        if c.text.strip():
            useful, whole = usefulness(c.text, cur.rest_of_line)
            read: tuple[float, ...] = ()
            if inputs and scored is not None:
                read = (*scored.gate_hidden[0].tolist(), *scored.gate_inputs[0].tolist())
            own = Option(_logit(c.gate_prob_show), useful, whole, read)
        copy = None
        if p is not None and scored is not None:
            x = torch.tensor([recall_inputs(p, c.text)], dtype=torch.float32)
            h = scored.gate_hidden
            with torch.no_grad():
                logit = float(model.gate.copy(x, h)[0, 0])
            useful, whole = usefulness(p.text, cur.rest_of_line)
            read_copy = (*x[0].tolist(), *h[0].tolist()) if inputs else ()
            copy = Option(logit, useful, whole, read_copy)
        out.append(Observation(copy, own))
    return out


def expected(obs: Sequence[Observation], cal: Calibration, spec: RewardSpec) -> dict[str, float]:
    """What the calibrated policy gives in expectation over the observations: useful
    characters per 100 requests, whole rest of line and wrong suggestions shown per request,
    exact of shown, shown per request, and the spec's reward per request."""
    return _figures(arrays(obs, spec), cal)


def _figures(a: dict[str, np.ndarray], cal: Calibration) -> dict[str, float]:
    k = cal.sharpness
    p_copy = np.where(a["has_copy"], _sigmoid(k * (a["copy_logit"] + cal.copy_shift)), 0.0)
    p_own = (1.0 - p_copy) * np.where(
        a["has_own"], _sigmoid(k * (a["own_logit"] + cal.show_shift)), 0.0
    )
    shown = p_copy + p_own
    n = max(1, len(shown))

    def total(key: str) -> float:
        return float((p_copy * a["copy_" + key] + p_own * a["own_" + key]).sum())

    whole = total("whole")
    return {
        "useful_per_100": 100.0 * total("useful") / n,
        "whole": whole / n,
        "exact_of_shown": whole / float(shown.sum()) if shown.sum() else 0.0,
        "shown": float(shown.sum()) / n,
        "wrong": total("wrong") / n,
        "reward": total("reward") / n,
    }


def arrays(obs: Sequence[Observation], spec: RewardSpec) -> dict[str, np.ndarray]:
    """Per side ("copy", "own"): whether it is there, and its logit, useful characters, whole
    line, wrong and reward under `spec` if shown, one entry per observation."""
    out: dict[str, np.ndarray] = {}
    for side in ("copy", "own"):
        options = [getattr(o, side) for o in obs]
        out["has_" + side] = np.array([x is not None for x in options])
        out[side + "_logit"] = np.array([x.logit if x else 0.0 for x in options])
        useful = np.array([x.useful if x else 0 for x in options], dtype=np.float64)
        out[side + "_useful"] = useful
        out[side + "_whole"] = np.array([bool(x and x.whole) for x in options], dtype=np.float64)
        out[side + "_wrong"] = (useful == 0).astype(np.float64)
        out[side + "_reward"] = np.array(
            [
                spec.accept_reward * size_scale(int(u), spec) if u else -spec.reject_penalty
                for u in useful
            ]
        )
    return out


def best_calibration(
    obs: Sequence[Observation], spec: RewardSpec, sharpness: float = SHARPNESS
) -> Calibration:
    """The shifts on the grid whose calibrated policy earns the most reward under `spec`."""
    a = arrays(obs, spec)
    return max(
        (Calibration(c, s, sharpness) for c in SHIFTS for s in SHIFTS),
        key=lambda cal: _figures(a, cal)["reward"],
    )


def apply(model: GPT, cal: Calibration) -> None:
    """Write the calibration into the heads: logit -> k * (logit + shift), for both."""
    gate, k = model.gate, cal.sharpness
    with torch.no_grad():
        gate.copy.bias.add_(cal.copy_shift).mul_(k)
        gate.copy.weight.mul_(k)
        gate.copy.hidden.mul_(k)
        gate.features.bias.add_(cal.show_shift).mul_(k)
        gate.features.weight.mul_(k)
        gate.hidden.weight.mul_(k)


def undo(model: GPT, cal: Calibration) -> None:
    """The inverse of `apply`: the heads as they were fitted (up to the weights' rounding)."""
    gate, k = model.gate, cal.sharpness
    with torch.no_grad():
        gate.copy.bias.div_(k).sub_(cal.copy_shift)
        gate.copy.weight.div_(k)
        gate.copy.hidden.div_(k)
        gate.features.bias.div_(k).sub_(cal.show_shift)
        gate.features.weight.div_(k)
        gate.hidden.weight.div_(k)


def calibrate(
    ckpt: Path,
    corpus: Path | None,
    cursors: int,
    seeds: Sequence[int],
    spec: RewardSpec | None = None,
    progress: bool = True,
) -> dict[str, object]:
    """Calibrate the heads of the checkpoint at `ckpt` to `spec` (default: the default reward
    spec) on `corpus` written top to bottom (default: the standard library's held-out files;
    use a package the benchmarks do not measure on), about `cursors` cursors for each of
    `seeds`, pooled; rewrite it in place with its version. The summary records the calibration
    and the figures before and after as `calibration`."""
    spec = spec or RewardSpec()
    model, tokenizer, manifest = load_checkpoint(ckpt)
    if "calibration" in manifest.summary:  # k * (k * ...) would sharpen it twice
        raise ValueError(f"{ckpt} is calibrated already: {manifest.summary['calibration']}")
    paths = writing_files(corpus)
    if not paths:
        raise ValueError(f"no *.py files to write under {corpus}: the calibration writes Python")
    obs = [o for seed in seeds for o in observe(model, tokenizer, paths, cursors, seed, progress)]
    cal = best_calibration(obs, spec)
    before, after = expected(obs, Calibration(), spec), expected(obs, cal, spec)
    apply(model, cal)
    record = {
        **asdict(cal),
        "corpus": None if corpus is None else corpus.name,
        "cursors": len(obs),
        "seeds": list(seeds),
        "spec": spec.to_dict(),
        "before": before,
        "after": after,
    }
    summary = {**manifest.summary, "calibration": record}
    rewrite_checkpoint(ckpt, model, tokenizer, manifest, summary)
    log.info("calibrated %s: %s", ckpt, record)
    return record
