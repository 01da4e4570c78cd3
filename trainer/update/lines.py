"""The lines head's fit: show a copy's next lines where that pays, from block labels."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tabloop.core.person import PERSON_INPUTS
from tabloop.core.policy.actions import lines_drawn, person_inputs
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.update.batch import Batch
from trainer.update.config import UpdateConfig
from trainer.update.gate import gate_inputs, logistic_fit

if TYPE_CHECKING:
    from trainer.ranks import DataParallel

# a block whose share (trainer.blocks.stands) is at least this stands. In paused runs of the
# simulated people (docs/RESULTS.md) showing a block's lines raised the reward above it, and not
# below it; what it is worth is weighed in the fit, this only draws the line
CLOSE = 0.6
LINES_FIT_CELL = 10  # labelled rows of each kind (stands or not, lines shown or not) for a fit


def fit_lines_to_blocks(
    model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    replay: Batch | None,
    cfg: UpdateConfig,
    group: DataParallel | None = None,
) -> dict[str, float]:
    """Set the lines head to where showing a copy's next lines pays, fit on block labels.

    The lines draw comes after a copy whose proposal goes on with whole lines: show them too, or
    not. The question is whether those lines are near what the person goes on to write. The
    block labels (trainer/blocks.py) say that for every such copy, shown with its lines or
    without, from what the person wrote afterwards: a block *stands* when its share (`stands`)
    is at least CLOSE. What a standing block, or one that does not, is worth shown or not is
    measured in what the loop is judged on, the characters people kept (accepted times
    retained; `batch.kept`), pooled over all the labelled rows: gain G = mean kept of standing
    blocks shown with their lines minus of those shown without; loss L = mean kept of the blocks
    that do not stand, shown without their lines minus with them; each less its standard error,
    so that a few lucky or unlucky accepts do not set the head. (Not the reward: the draw does
    not change what is shown, only how long it is, and the reward spec's size scale stops at 3
    chars_norm, 60 characters in the sim profile, where most blocks begin.) "Show iff
    P(stands | x) G > (1 - P) L" is then a weighted classification (as the gate's fit,
    trainer/update/gate.py): label stands, weight G or L. Its logistic regression on the head's
    own inputs (the last hidden state, L2 `cfg.gate_fit_l2` on its weights, and the person
    inputs on the longer text) over the labelled rows of the batch and the replay, times the
    rows' weights (trainer/caps.py), is written into the head times a sharpness from
    cfg.lines_fit_sharpness, growing as sqrt(labels / cfg.lines_fit_min) up to 3x that. The
    draw stays a draw, logged and recomputed exactly. No fit (the head left as it is) with
    fewer than cfg.lines_fit_min labels, fewer than LINES_FIT_CELL of each kind (standing or
    not, shown with lines or without), or where what was kept does not yet favour either
    choice anywhere (G and L both <= 0): the policy gradient moves it meanwhile.
    With a `group` every rank fits on the gathered inputs (and the caller broadcasts rank 0's).
    """
    parts = [
        b for b in (batch, replay) if b is not None and b.blocks is not None and b.kept is not None
    ]
    if not parts:  # no labels were read
        return {}
    rows = [
        (a, share >= CLOSE, bool((lines_drawn(a) or {}).get("more")), float(w), float(k))
        for b in parts
        for a, share, w, k in zip(
            b.actions,
            b.blocks or (),
            b.row_weights().tolist(),
            b.kept.tolist() if b.kept is not None else (),
            strict=True,
        )
        if share is not None
    ]
    out = {"lines_fit/labels": float(len(rows)), "lines_fit/fitted": 0.0}
    mean: dict[tuple[bool, bool], tuple[float, float]] = {}  # (mean kept, its variance)
    for cell in ((True, True), (True, False), (False, True), (False, False)):
        got = [(w, r) for _, y, more, w, r in rows if (y, more) == cell]
        total = sum(w for w, _ in got)
        if len(got) < LINES_FIT_CELL or total <= 0:
            return out
        m = sum(w * r for w, r in got) / total
        mean[cell] = (m, sum((w * (r - m)) ** 2 for w, r in got) / total**2)
    # each at its estimate less one standard error: the fit acts on what was kept beyond its
    # noise, and leaves the head to the policy gradient while that shows nothing either way
    gain = mean[True, True][0] - mean[True, False][0]
    gain -= math.sqrt(mean[True, True][1] + mean[True, False][1])
    loss = mean[False, False][0] - mean[False, True][0]
    loss -= math.sqrt(mean[False, False][1] + mean[False, True][1])
    out.update({"lines_fit/gain": gain, "lines_fit/loss": loss})
    if len(rows) < cfg.lines_fit_min or (gain <= 0 and loss <= 0):
        return out
    floor = 0.01 * (abs(gain) + abs(loss))  # a choice that never pays still weighs a little
    y = torch.tensor([float(r[1]) for r in rows])
    w = torch.tensor([r[3] * max(gain if r[1] else loss, floor) for r in rows])
    actions = [r[0] for r in rows]
    h, _, _, _ = gate_inputs(model, tokenizer, actions, group)
    zero = [0.0] * len(PERSON_INPUTS)
    person = torch.tensor([person_inputs(a, "lines") or zero for a in actions])
    scaled, bias = logistic_fit(
        torch.cat([h, person], 1), y, w / w.mean(), h.shape[1], cfg.gate_fit_l2
    )
    sharpness = cfg.lines_fit_sharpness * min(3.0, math.sqrt(len(rows) / cfg.lines_fit_min))
    head = model.gate.lines
    with torch.no_grad():
        head.hidden.copy_((sharpness * scaled[: h.shape[1]]).float()[None])
        head.person.copy_((sharpness * scaled[h.shape[1] :]).float()[None])
        head.bias.fill_(sharpness * bias)
        at = head.bias.device
        p_more = torch.sigmoid(head(h.to(at), person.to(at))).mean()
    return {
        **out,
        "lines_fit/fitted": 1.0,
        "lines_fit/stands": float(y.mean()),
        "lines_fit/sharpness": sharpness,
        "lines/p_more": float(p_more),
    }
