"""The show/abstain gate's own passes: its inputs, the passes on shown rollouts and the fit of
the gate to the rewards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from tabloop.core.person import PERSON_INPUTS
from tabloop.core.policy.actions import Action, extend_drawn, lines_drawn, was_copied
from tabloop.core.policy.model import GPT
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.update.batch import Batch
from trainer.update.config import UpdateConfig
from trainer.update.loss import clip_fraction, clipped_terms

if TYPE_CHECKING:
    from trainer.ranks import DataParallel


def gate_inputs(
    model: GPT,
    tokenizer: CodeTokenizer,
    actions: Sequence[Action],
    group: DataParallel | None = None,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate's inputs for `actions`, without gradient: the hidden states (B, C), the
    confidence features (B, 4), the person inputs (B, len(PERSON_INPUTS); 0 where none were
    logged) and the gate's decisions' log-probs (B,) (score_actions), `chunk` actions per forward
    pass. With a `group` each rank scores its share and all get them all."""
    n = len(actions)
    mine = list(range(n)) if group is None else group.shard(torch.arange(n)).tolist()
    c, f = model.config.n_embd, model.gate.features.in_features
    width = c + f + len(PERSON_INPUTS)
    rows = [torch.zeros(0, width + 1)]
    with torch.no_grad():
        for i in range(0, len(mine), chunk):
            s = score_actions(model, tokenizer, [actions[j] for j in mine[i : i + chunk]])
            rows.append(
                torch.cat(
                    [s.gate_hidden, s.gate_inputs, s.gate_person, s.gate_decision[:, None]], 1
                )
            )
    both = torch.cat(rows) if group is None else group.gather_rows(torch.cat(rows), n)
    return both[:, :c], both[:, c : c + f], both[:, c + f : width], both[:, width]


def gate_passes(
    model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    adv: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    cfg: UpdateConfig,
    group: DataParallel | None = None,
) -> dict[str, float]:
    """`cfg.gate_epochs` passes of minibatch steps on the show/abstain gate alone.

    The gate is a logistic head on the last hidden state and the confidence features. With the
    language model fixed for these passes, both are computed once, so a pass costs a few small
    matrix products instead of a forward and backward pass of the transformer. Each step
    minimizes PPO's clipped surrogate of the decision: -mean_i min(rho_i A_i, clip(rho_i) A_i),
    rho_i = p_theta(decision_i) / mu(decision_i), over the decisions that were sampled. The clip
    is what bounds how far these passes move any one decision from the serving policy's (to
    1 +- clip_eps). The optimizer is the update's (Adam's moments for the gate carry on); the
    language model's parameters get no gradient here, so it does not step them.
    With a `group` the ranks share the forward pass; the steps, on the gathered inputs, are
    every rank's own (a few small matrix products).
    """
    if batch.behaviour_decision_logp is None:
        return {}
    # the gate's part of the logged decision: without the copy, lines and extend draws'
    # (tabloop.core.policy.sampling)
    old = batch.behaviour_decision_logp - torch.tensor(
        [
            (float(a.recall["logprob"]) if a.recall else 0.0)
            + float((lines_drawn(a) or {}).get("logprob", 0.0))
            + float((extend_drawn(a) or {}).get("logprob", 0.0))
            for a in batch.actions
        ]
    )
    n = len(batch.actions)
    hidden, feats, person, decision = gate_inputs(model, tokenizer, batch.actions, group, chunk=n)
    sampled = decision != 0  # score_actions: 0 where the decision was not sampled
    shown = torch.tensor([bool(a.shown) for a in batch.actions])
    gate = [p for n, p in model.named_parameters() if n.startswith("gate.") and p.requires_grad]
    clipped, steps = 0.0, 0
    for _ in range(cfg.gate_epochs):
        order = torch.randperm(n) if group is None else group.randperm(n)
        for start in range(0, n, cfg.minibatch_size):
            idx = order[start : start + cfg.minibatch_size]
            z = model.gate_logit(hidden[idx], feats[idx], person[idx])
            new = torch.where(shown[idx], F.logsigmoid(z), F.logsigmoid(-z))
            ratio = torch.exp(new - old[idx])
            terms = clipped_terms(ratio, adv[idx], cfg.clip_eps) * sampled[idx]
            loss = -terms.mean()
            model.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gate, cfg.max_grad_norm or float("inf"))
            optimizer.step()
            keep = sampled[idx]
            clipped += float(clip_fraction(ratio[keep], cfg.clip_eps)) if keep.any() else 0.0
            steps += 1
    with torch.no_grad():
        p_show = torch.sigmoid(model.gate_logit(hidden, feats, person)).mean().item()
    return {"gate/clipfrac": clipped / max(steps, 1), "gate/p_show": p_show, "gate/steps": steps}


def fit_gate_to_rewards(
    model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    replay: Batch | None,
    l2: float,
    sharpness: float = 1.0,
    min_shown: int = 0,
    sharpness_max: float = 0.0,
    group: DataParallel | None = None,
) -> dict[str, float]:
    """Set the show/abstain gate to where showing pays, fit on the rewards of shown rollouts.

    The decision is a contextual bandit with two arms: abstaining earns about the same in every
    context (r0: the mean reward of this batch's abstentions), showing earns r_i, observed where
    a rollout was shown. "Show iff E[r | x] > r0" is then a weighted classification (the
    cost-sensitive reduction of a bandit's decision): label y_i = [r_i > r0], weight |r_i - r0|
    (times the row's weight, trainer/caps.py; r0 is then the weighted mean).
    Its weighted logistic regression on the gate's own inputs x (the last hidden state, the
    confidence features and the person inputs) has logit ~ log(E[gain | x] / E[loss | x]):
    positive exactly where the expected reward of showing beats abstaining, and the further from
    zero the surer. The fit is to convergence (L-BFGS) on standardised inputs with L2 `l2` on
    the hidden-state weights (a few hundred verdicts against 192 of them), then written into the
    gate's weights times `sharpness`: p(show) = sigmoid(sharpness * logit) is near 0 or 1 where
    the fit is sure and stays near 1/2 where the evidence is even, so the gate keeps exploring at
    its boundary (it learns only from what it shows). With `sharpness_max` above `sharpness` (and
    `min_shown` > 0), the sharpness grows as sqrt(n / min_shown) with the n verdicts fit on, up
    to `sharpness_max`: the fitted logit's standard error shrinks as 1/sqrt(n), so p(show)
    keeps tracking how sure the evidence is that showing pays, and the exploration it buys
    fades as the evidence grows. Fewer than `min_shown` verdicts: no fit.

    Unlike the policy-gradient steps it uses every verdict seen, not just this batch's, and is
    not bounded by a clip: the deploy check (trainer.deploy_check) and the canary judge how far
    it moved.
    With the language model frozen the replayed rollouts' inputs are exactly what the server
    computes. Returns the fit's figures; the gate is left unchanged when there is nothing to fit.
    With a `group` the ranks share the forward passes and each fits on the gathered inputs.
    """
    actions = list(batch.actions) + ([] if replay is None else list(replay.actions))
    rewards = batch.rewards if replay is None else torch.cat([batch.rewards, replay.rewards])
    # the rows' weights (trainer/caps.py) weigh both the abstention baseline and each verdict
    row_w = (
        batch.row_weights()
        if replay is None
        else torch.cat([batch.row_weights(), replay.row_weights()])
    )
    in_batch = torch.arange(len(actions)) < len(batch.actions)
    # the gate's verdicts: shown by it (a shown copy was the copy head's choice, not the gate's);
    # never empty: the server hides those
    shown = torch.tensor([bool(a.shown) and not was_copied(a) for a in actions])
    abstained = in_batch & ~torch.tensor([bool(a.shown) for a in actions])
    r0 = 0.0
    if abstained.any() and float(row_w[abstained].sum()) > 0:
        r0 = float((rewards[abstained] * row_w[abstained]).sum() / row_w[abstained].sum())
    gain = rewards[shown] - r0
    y = (gain > 0).float()
    # too few verdicts for a fit on the hidden state, or one class (or none): nothing to separate
    if len(y) < min_shown or int(y.sum()) == 0 or int(y.sum()) == len(y):
        return {"gate_fit/shown": float(len(y)), "gate_fit/fitted": 0.0}
    # only once there is a fit to make; the fit's inputs besides the hidden state: the confidence
    # features and the person inputs
    h, feats, person, _ = gate_inputs(model, tokenizer, actions, group)
    x = torch.cat([feats, person], 1)
    w = gain.abs() * row_w[shown]
    w = w / w.mean()
    if sharpness_max > sharpness and min_shown > 0:
        sharpness = min(sharpness_max, sharpness * math.sqrt(len(y) / min_shown))
    scaled, bias = logistic_fit(torch.cat([h[shown], x[shown]], 1), y, w, h.shape[1], l2)
    scaled, bias = sharpness * scaled, sharpness * bias
    with torch.no_grad():
        model.gate.hidden.weight.copy_(scaled[: h.shape[1]].float()[None])
        f = h.shape[1] + feats.shape[1]
        model.gate.features.weight.copy_(scaled[h.shape[1] : f].float()[None])
        model.gate.person.copy_(scaled[f:].float()[None])
        model.gate.features.bias.fill_(float(bias))
        p_show = torch.sigmoid(model.gate_logit(h[in_batch], feats[in_batch], person[in_batch]))
    return {
        "gate_fit/shown": float(len(y)),
        "gate_fit/fitted": 1.0,
        "gate_fit/paid": float(y.mean()),
        "gate_fit/abstain_reward": r0,
        "gate_fit/sharpness": sharpness,
        "gate/p_show": float(p_show.mean()),
    }


def logistic_fit(
    inputs: torch.Tensor, y: torch.Tensor, w: torch.Tensor, ridged: int, l2: float
) -> tuple[torch.Tensor, float]:
    """A weighted logistic regression of `y` (0/1) on `inputs` (N, D), to convergence (L-BFGS)
    on standardised inputs with L2 `l2` on the first `ridged` columns' weights: the weights
    (D,) and the bias on the raw inputs (logit = weights . inputs + bias)."""
    x = inputs.double()
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = torch.cat([(x - mu) / sd, torch.ones(len(x), 1, dtype=torch.float64)], 1)
    ridge = torch.zeros(z.shape[1], dtype=torch.float64)
    ridge[:ridged] = l2
    coef = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([coef], max_iter=500, line_search_fn="strong_wolfe")
    yd, wd = y.double(), w.double()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (wd * F.binary_cross_entropy_with_logits(z @ coef, yd, reduction="none")).sum()
        loss = loss + 0.5 * (ridge * coef * coef).sum()
        loss.backward()
        return loss

    opt.step(closure)
    c = coef.detach()
    scaled = c[:-1] / sd
    return scaled, float(c[-1] - (scaled * mu).sum())
