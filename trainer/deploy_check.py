"""The deploy check, before a candidate is deployed: no regression on held-out code, no drop in
estimated reward.

Two checks on a candidate against the live policy:
- held-out code likelihood (mean cross-entropy on a fixed sample of generic code) may not rise
  by more than `max_heldout_regression` nats/token against the live policy, nor by more than
  `max_heldout_regression_base` against the base policy: the language model learns from the
  people's code (settled text, rewards), and the second bound keeps the sum of many small
  steps from forgetting code in general;
- the candidate's reward estimated off-policy on recent logged rollouts — self-normalized
  importance sampling with clipped weights — may not fall below the live policy's on-policy
  mean by more than `max_reward_drop`. The effective sample size is reported with it;
- the candidate's kept characters per request, estimated the same way (an accept's characters
  times the retention its reward counted), may not fall below the live policy's beyond the
  noise: by more than `kept_tolerance` of live's and `kept_z` standard errors of the difference
  (`kept_drop`). A reward whose optimum is silence could otherwise pass a candidate that gives
  people less code.

The logged rollouts may carry weights (trainer/caps.py: no person or key holds more than a
capped share of them): both means are then weighted, and the effective sample size the estimate
needs is a share of the weights' own, (sum v)^2 / sum v^2, not of the row count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from tabloop.core.policy.actions import Action
from tabloop.core.policy.model import GPT, heldout_loss
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer


@dataclass(frozen=True)
class CheckConfig:
    max_heldout_regression: float = 0.05  # nats/token the candidate may lose on held-out code
    max_heldout_regression_base: float = 0.15  # ... and in all, against the base policy
    max_reward_drop: float = 0.02  # estimated reward the candidate may lose against live
    weight_clip: float = 5.0  # importance weights are clipped to [0, weight_clip]
    min_ess_fraction: float = 0.1  # the estimate needs an effective sample size of this share
    min_ess: float = 4.0  # ... and at least this many
    # kept chars/request may fall by this share of live's, and past it by at most kept_z
    # standard errors: a small drop that buys a better reward is a trade, not a regression
    kept_tolerance: float = 0.05
    kept_z: float = 1.64


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    reason: str
    heldout_loss_live: float
    heldout_loss_candidate: float
    reward_live: float
    reward_candidate_est: float
    ess: float
    n: int
    kept_live: float = float("nan")  # kept characters per request, live (on-policy)
    kept_candidate_est: float = float("nan")  # ... the candidate's, estimated off-policy
    kept_se: float = float("nan")  # the standard error of their difference

    def to_dict(self) -> dict[str, object]:
        """As JSON holds it: a figure that could not be estimated (nan) is null."""
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in asdict(self).items()
        }


def clipped_weights(
    logp_new: torch.Tensor,
    logp_behaviour: torch.Tensor,
    clip: float,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The importance weights exp(logp_new - logp_behaviour), clipped to [0, clip], each times
    its row's weight when given (float64)."""
    log_w = (logp_new - logp_behaviour).double().clamp(max=math.log(clip))
    w = torch.exp(log_w).clamp(max=clip)
    return w if row_weights is None else w * row_weights.double()


def snis(
    logp_new: torch.Tensor,
    logp_behaviour: torch.Tensor,
    rewards: torch.Tensor,
    clip: float,
    row_weights: torch.Tensor | None = None,
) -> tuple[float, float]:
    """Self-normalized IS estimate of the new policy's mean reward, and the effective sample
    size (sum w)^2 / sum w^2, with weights exp(logp_new - logp_behaviour) clipped to [0, clip],
    each times its row's weight when given."""
    if rewards.numel() == 0:
        return float("nan"), 0.0
    w = clipped_weights(logp_new, logp_behaviour, clip, row_weights)
    total, squares = float(w.sum()), float((w * w).sum())
    # a candidate that gives the logged actions ~no probability: weights (or their squares)
    # underflow to 0, and there is no evidence for it at all
    if total <= 0 or squares <= 0:
        return float("nan"), 0.0
    estimate = float((w * rewards.double()).sum()) / total
    return estimate, total**2 / squares


def kept_drop(
    logp_new: torch.Tensor,
    logp_behaviour: torch.Tensor,
    kept: torch.Tensor,
    clip: float,
    row_weights: torch.Tensor | None = None,
) -> tuple[float, float, float]:
    """Kept characters per request: (live's mean, the candidate's SNIS estimate, the standard
    error of the difference). Both means weigh the same rows, live's by the row weights v and
    the candidate's by w = the clipped importance weight times v, so the difference is
    sum (w_i / W - v_i / V) k_i, and its variance, each row's kept characters varying about
    live's mean, is sum (w_i / W - v_i / V)^2 (k_i - mean)^2."""
    if kept.numel() == 0:
        return float("nan"), float("nan"), float("nan")
    v = torch.ones_like(kept, dtype=torch.float64) if row_weights is None else row_weights.double()
    w = clipped_weights(logp_new, logp_behaviour, clip, v)
    if float(w.sum()) <= 0:
        return float(kept.double() @ v / v.sum()), float("nan"), float("nan")
    k = kept.double()
    live = float(k @ v / v.sum())
    a = w / w.sum() - v / v.sum()
    est = live + float(a @ k)
    return live, est, math.sqrt(float((a * a) @ ((k - live) ** 2)))


@torch.no_grad()
def check(
    candidate: GPT,
    live: GPT,
    tokenizer: CodeTokenizer,
    heldout: torch.Tensor,
    actions: Sequence[Action],
    behaviour_logp: torch.Tensor,
    rewards: torch.Tensor,
    cfg: CheckConfig,
    base: GPT | None = None,
    weights: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> CheckResult:
    """`weights`: the logged rollouts' weights (trainer/caps.py); None: all 1. `kept`: each
    logged rollout's kept characters (trainer/store.ROLLOUT_ROWS); None: not checked."""
    loss_live = heldout_loss(live, heldout)
    loss_cand = heldout_loss(candidate, heldout)
    if live.holds_reference:  # its base: the same model as its reference (an adapter's base)
        with live.reference():
            loss_base = heldout_loss(live, heldout)
    else:
        loss_base = loss_live if base is None or base is live else heldout_loss(base, heldout)
    v = torch.ones(len(actions), dtype=torch.float64) if weights is None else weights.double()
    reward_live = float((rewards.double() * v).sum() / v.sum()) if rewards.numel() else float("nan")
    logp_new = (
        score_actions(candidate, tokenizer, actions).total.cpu() if actions else torch.empty(0)
    )
    est, ess = snis(logp_new, behaviour_logp, rewards, cfg.weight_clip, weights)
    kept_live, kept_est, kept_se = (
        kept_drop(logp_new, behaviour_logp, kept, cfg.weight_clip, weights)
        if kept is not None
        else (float("nan"),) * 3
    )
    # what the weights alone leave of the sample: len(actions) when they are all equal
    sample = float(v.sum() ** 2 / (v * v).sum()) if len(actions) else 0.0

    def result(passed: bool, reason: str) -> CheckResult:
        return CheckResult(
            passed,
            reason,
            heldout_loss_live=loss_live,
            heldout_loss_candidate=loss_cand,
            reward_live=reward_live,
            reward_candidate_est=est,
            ess=ess,
            n=len(actions),
            kept_live=kept_live,
            kept_candidate_est=kept_est,
            kept_se=kept_se,
        )

    if loss_cand > loss_live + cfg.max_heldout_regression:
        return result(False, f"held-out loss {loss_cand:.3f} vs live {loss_live:.3f}")
    if loss_cand > loss_base + cfg.max_heldout_regression_base:
        return result(False, f"held-out loss {loss_cand:.3f} vs base {loss_base:.3f}")
    need = max(cfg.min_ess, cfg.min_ess_fraction * sample)
    if ess < need:
        return result(False, f"effective sample size {ess:.1f} < {need:.1f}")
    if est < reward_live - cfg.max_reward_drop:
        return result(False, f"estimated reward {est:.3f} vs live {reward_live:.3f}")
    # False when any is nan (nothing to estimate it on)
    if kept_est < kept_live * (1 - cfg.kept_tolerance) - cfg.kept_z * kept_se:
        return result(
            False,
            f"estimated kept chars/request {kept_est:.2f} vs live {kept_live:.2f} "
            f"(s.e. {kept_se:.2f})",
        )
    return result(True, "passed")


def heldout_sample(
    tokenizer: CodeTokenizer, text: str, rows: int, length: int, seed: int = 0
) -> torch.Tensor:
    """A fixed sample of `rows` windows of `length`+1 tokens, one from each of `rows` equal
    stretches of `text` (so it spans the whole corpus, not its first files), each window
    starting at a random line start in its stretch."""
    g = torch.Generator().manual_seed(seed)
    span = len(text) // rows
    windows = []
    for r in range(rows):
        stretch = text[r * span : (r + 1) * span]
        cut = int(torch.randint(0, max(1, len(stretch) - length * 8), (1,), generator=g))
        start = stretch.find("\n", cut) + 1
        ids = tokenizer.encode(stretch[start : start + length * 8])
        if len(ids) > length:
            windows.append(torch.tensor(ids[: length + 1], dtype=torch.long))
    assert windows, "held-out text too short for the gate sample"
    return torch.stack(windows)
