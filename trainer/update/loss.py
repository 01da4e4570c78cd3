"""The policy-gradient loss and its pure helpers: advantages, the clipped surrogate per part,
the KL to the reference policy, the entropy."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from tabloop.core.policy.model import GPT
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.update.batch import Batch
from trainer.update.config import UpdateConfig

LOG_RATIO_CLAMP = 10.0  # |log pi_ref/pi| above this is clamped in the k3 KL (keeps it finite)


# --- pure helpers ------------------------------------------------------------------------
def advantages(
    rewards: torch.Tensor, baseline: str, normalize: bool, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Reward minus a baseline, (B,) -> (B,).

    "mean": r_i - mean(r). "loo": r_i - mean_{j != i} r_j = B/(B-1) (r_i - mean(r)), unbiased
    because the baseline does not depend on the action it is subtracted from. One sample has
    no baseline to compare with: its advantage is 0. `normalize` divides by the std (when it is
    not ~0, so an all-equal batch stays all zeros). With `weights` (>= 0) the means are weighted
    (a capped person's rewards move the baseline only as much as their weight); the advantages
    are not multiplied by them here (`weighted_advantages` does).
    """
    assert rewards.dim() == 1 and rewards.is_floating_point(), "rewards must be 1-D floats"
    assert baseline in ("mean", "loo"), f"unknown baseline {baseline!r}"
    n = rewards.numel()
    if n == 0:
        raise ValueError("empty batch: no advantages")
    r = rewards.double()
    if n == 1:
        return torch.zeros_like(rewards)
    if weights is None:
        adv = r - r.mean()
        if baseline == "loo":
            adv = adv * n / (n - 1)
    else:
        assert weights.shape == rewards.shape, "one weight per reward"
        w = weights.double()
        total, weighted = w.sum(), (w * r).sum()
        if baseline == "mean":
            adv = r - weighted / total
        else:  # the weighted mean of the others; nothing to compare with when they weigh 0
            others = total - w
            safe = others.clamp(min=1e-12)
            adv = torch.where(others > 1e-12, r - (weighted - w * r) / safe, torch.zeros_like(r))
    if normalize:
        std = adv.std()
        if std > 1e-8:
            adv = adv / std
    return adv.to(rewards.dtype)


def weighted_advantages(batch: Batch, cfg: UpdateConfig) -> torch.Tensor:
    """The advantages the loss uses: `advantages` with the batch's weights, times them."""
    adv = advantages(batch.rewards, cfg.baseline, cfg.normalize_advantages, batch.weights)
    return adv if batch.weights is None else adv * batch.weights.to(adv.dtype)


def clipped_surrogate(
    logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """PPO's clipped policy loss: -mean(min(rho A, clip(rho, 1 - eps, 1 + eps) A))."""
    return -clipped_terms(torch.exp(logp_new - logp_old), adv, clip_eps).mean()


def clipped_terms(ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """min(rho A, clip(rho, 1 - eps, 1 + eps) A), elementwise."""
    return torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)


def clip_fraction(ratio: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """The share of ratios outside [1 - eps, 1 + eps] (no gradient)."""
    return ((ratio.detach() - 1.0).abs() > clip_eps).float().mean()


def per_part_surrogate(
    token_new: torch.Tensor,
    token_old: torch.Tensor,
    lengths: Sequence[int],
    decision_new: torch.Tensor,
    decision_old: torch.Tensor,
    adv: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped loss with a ratio per token and per decision (rollouts' tokens concatenated
    in token_new/token_old, `lengths` tokens each): -mean_i sum_t min(rho A_i, clip(rho) A_i).
    Also returns the share of parts whose ratio is outside the clip range."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ratios = torch.cat([torch.exp(token_new - token_old), torch.exp(decision_new - decision_old)])
    a = torch.cat([adv[seg], adv])
    terms = clipped_terms(ratios, a, clip_eps)
    owner = torch.cat([seg, torch.arange(len(lengths))])
    per_action = torch.zeros(len(lengths), dtype=terms.dtype).index_add(0, owner, terms)
    return -per_action.mean(), clip_fraction(ratios, clip_eps)


def kl_to_reference(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_ref) by the k3 estimator on actions sampled from pi, mean over the batch.

    k3 = exp(d) - 1 - d with d = log pi_ref(a) - log pi(a) (Schulman, "Approximating KL
    divergence"): unbiased, and >= 0 per sample, unlike -d. The samples come from the serving
    policy, which is pi up to bounded staleness. d is clamped to +-LOG_RATIO_CLAMP so one action
    the reference finds far likelier cannot overflow the loss.
    """
    d = torch.clamp(logp_ref - logp_new, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - 1.0 - d).mean()


def bernoulli_entropy(logit: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of a Bernoulli with the given logit, elementwise, stable for large |x|."""
    p_show, p_abstain = torch.sigmoid(logit), torch.sigmoid(-logit)
    return -(p_show * F.logsigmoid(logit) + p_abstain * F.logsigmoid(-logit))


# --- the loss ----------------------------------------------------------------------------
# pg_loss's metrics, in a fixed order (the ranks of a data-parallel update exchange them)
PG_METRICS = (
    "losses/total",
    "losses/policy",
    "losses/kl",
    "losses/entropy",
    "charts/clipfrac",
    "charts/approx_kl",
    "charts/ratio_mean",
    "charts/ratio_max",
    "charts/adv_mean",
    "charts/adv_std",
    "charts/reward_mean",
    "charts/p_show",
    "charts/shown_frac",
)


def pg_loss(
    model: GPT,
    ref_model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    cfg: UpdateConfig,
    adv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one (mini)batch and its metrics. `adv`: precomputed advantages (update()
    passes the full batch's), else `weighted_advantages` of this batch."""
    if adv is None:
        adv = weighted_advantages(batch, cfg)
    new = score_actions(model, tokenizer, batch.actions)
    with torch.no_grad():
        if model.holds_reference:
            # its reference is its own (a LoRA adapter's base: no second copy of a large
            # model); the heads are the policy's own, so the KL holds the language model only
            with model.reference():
                ref = score_actions(model, tokenizer, batch.actions).tokens + new.decision
        else:
            ref = score_actions(ref_model, tokenizer, batch.actions).total
    # the decision's entropy counts only where it was sampled (score_actions: 0 = deterministic)
    sampled = new.gate_decision != 0
    entropy = new.entropy + torch.where(sampled, bernoulli_entropy(new.gate_logit), 0.0)

    if batch.behaviour_token_logp is not None and batch.behaviour_decision_logp is not None:
        old_tokens = torch.tensor(
            [x for lps in batch.behaviour_token_logp for x in lps], dtype=new.token_logprobs.dtype
        )
        assert old_tokens.shape == new.token_logprobs.shape, "logged token log-probs per token"
        policy_loss, clipfrac = per_part_surrogate(
            new.token_logprobs,
            old_tokens,
            new.lengths,
            new.decision,
            batch.behaviour_decision_logp,
            adv,
            cfg.clip_eps,
        )
    else:
        policy_loss = clipped_surrogate(new.total, batch.behaviour_logp, adv, cfg.clip_eps)
        clipfrac = clip_fraction(torch.exp(new.total - batch.behaviour_logp), cfg.clip_eps)
    kl = kl_to_reference(new.total, ref)
    loss = policy_loss + cfg.kl_coef * kl - cfg.entropy_coef * entropy.mean()

    with torch.no_grad():
        shown = torch.tensor([bool(a.shown) for a in batch.actions], dtype=torch.float32)
        log_ratio = new.total - batch.behaviour_logp
        ratio = log_ratio.exp()
        metrics = {
            "losses/total": loss.item(),
            "losses/policy": policy_loss.item(),
            "losses/kl": kl.item(),
            "losses/entropy": entropy.mean().item(),
            "charts/clipfrac": clipfrac.item(),  # per part, or per action without parts
            "charts/approx_kl": ((ratio - 1.0) - log_ratio).mean().item(),  # vs behaviour
            "charts/ratio_mean": ratio.mean().item(),
            "charts/ratio_max": ratio.max().item(),
            "charts/adv_mean": adv.mean().item(),
            "charts/adv_std": adv.std().item() if adv.numel() > 1 else 0.0,
            "charts/reward_mean": batch.rewards.mean().item(),
            "charts/p_show": torch.sigmoid(new.gate_logit).mean().item(),
            "charts/shown_frac": shown.mean().item(),
        }
    return loss, metrics
