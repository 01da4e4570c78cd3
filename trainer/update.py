"""The policy-gradient update on the full action (the sampled tokens and the show/abstain decision).

CleanRL's PPO, for one batch of finalized rollouts:

    advantage   A_i = r_i - baseline (batch mean, or the mean of the *other* rewards)
    ratio       rho_it = pi_theta(a_it) / mu(a_it) per part t of action i: each sampled token
                and the decision (mu = the serving policy's logged log-probs)
    policy      -mean_i sum_t min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i)
    KL          mean(k3(pi_theta, pi_ref)) on the sampled actions, toward the pretrained policy
    entropy     mean(H), H = summed token entropies + the decision's Bernoulli entropy
    loss        policy + kl_coef * KL - entropy_coef * entropy

log pi(a) is `score_actions(...).total`: the token log-probs under the distribution actually
sampled from (the logged temperature, top-p and healing mask) plus log p(decision), so for the
parameters that served the batch the ratio is 1 up to float error. Rollouts from an older
deployed version get rho != 1 and the clip bounds how far one batch can push on them.

The ratio is clipped per part, as PPO for language models clips per token, not once for the
whole action: unclipped, the gradient is the same (A_i times the gradient of the summed
log-probs), but a change in one part no longer silences the others. With one ratio for the
action, drift in the tokens' probabilities (the language model moves a little at every update
without learning much from a few hundred suggestions) pushed 42% of a late batch's actions
outside the clip range, and those rollouts taught the show/abstain decision nothing either.
A Batch without per-part behaviour log-probs falls back to one ratio per action.

Advantages are computed once over the whole batch (the baseline must not change with the
minibatch split), then `epochs` passes of shuffled minibatches, each a gradient step with
global-norm clipping. A batch may carry row weights (mean 1: trainer/caps.py caps each person's
and each key's share of them): the baseline is then the weighted mean, and each row's advantage
is multiplied by its weight. As the weights are >= 0, min(rho w A, clip(rho) w A) = w min(rho A,
clip(rho) A): a row's whole clipped term is scaled, and a minibatch's mean of them is an unbiased
share of the weighted batch loss. Dropout is off during the update: the ratio compares the same
function the server sampled from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.nn import functional as F

from service.policy.device import compute, model_device
from service.policy.model import GPT
from service.policy.sampling import Action, score_actions, was_copied
from service.policy.tokenizer import CodeTokenizer
from trainer.settled import settled_passes

if TYPE_CHECKING:  # trainer/distributed.py imports this module
    from trainer.distributed import DataParallel

EMBEDDINGS = ("wte.weight", "wpe.weight")  # token (tied to the output layer), position
LOG_RATIO_CLAMP = 10.0  # |log pi_ref/pi| above this is clamped in the k3 KL (keeps it finite)


@dataclass
class UpdateConfig:
    learning_rate: float = 1e-4  # AdamW's (make_optimizer); about the end of pretraining's cosine
    gate_lr_mult: float = 100.0  # the gate's bias and confidence weights: lr x this
    gate_hidden_lr_mult: float = 10.0  # the gate's hidden-state projection (192 inputs): lr x this
    clip_eps: float = 0.2  # PPO clip: ratios outside [1 - eps, 1 + eps] stop pushing
    kl_coef: float = 0.05  # weight of the KL toward the reference (pretrained) policy
    entropy_coef: float = 0.0  # weight of the entropy bonus (0: off; try <= 0.01)
    baseline: Literal["mean", "loo"] = "loo"  # batch mean, or leave-one-out mean of the others
    normalize_advantages: bool = False  # divide advantages by their std (batch-level)
    epochs: int = 1  # passes over the batch (1: purely on-policy, ratio only corrects staleness)
    minibatch_size: int = 256  # rollouts per gradient step
    max_grad_norm: float = 1.0  # global gradient-norm clip (0: off)
    train_gate_only: bool = False  # update only the show/abstain gate, the LM stays frozen
    # extra passes for the gate alone after the full epochs, on the updated model's hidden
    # states computed once (so they cost one forward pass), with the decision's clipped ratio
    gate_epochs: int = 0
    # set the gate by a reward-weighted logistic fit on the shown rollouts of this batch and up
    # to gate_fit_replay earlier ones (fit_gate_to_rewards) instead of the gate passes
    gate_fit: bool = False
    gate_fit_l2: float = 100.0  # L2 on the hidden-state weights (standardised inputs)
    gate_fit_replay: int = 2000  # shown rollouts of earlier batches the trainer adds to the fit
    gate_fit_sharpness: float = 1.0  # the fitted logit times this: p(show) nearer 0 or 1
    gate_fit_min_shown: int = 300  # fewer shown verdicts than this: the gate passes instead
    # above gate_fit_sharpness: the sharpness grows with the verdicts, as
    # sqrt(verdicts / gate_fit_min_shown), up to this (exploration fades as the evidence grows)
    gate_fit_sharpness_max: float = 0.0
    # the supervised term on settled text (settled_passes): after the policy-gradient epochs,
    # this many passes (0: off) over the batch's rollouts that have a settled text and the
    # earlier ones the caller replays, each step minimizing the mean token NLL of what the
    # person actually wrote after that rollout's cursor, at learning_rate x settled_lr_mult
    settled_epochs: int = 1
    settled_lr_mult: float = 1.0
    settled_replay: int = 4096  # earlier rollouts with a settled text the trainer replays
    settled_max_tokens: int = 32  # target tokens per settled text (serving's max_new_tokens)
    # PPO's pretraining mix: each settled-text step also minimizes generic_mix x the next-token
    # loss on generic_rows windows of generic code (the caller's sample), so that learning the
    # people's code does not unlearn code in general (0: off)
    generic_mix: float = 4.0
    generic_rows: int = 16
    # the token embeddings (tied to the output layer) and positions stay as pretrained: with
    # Adam every one of the 4096 output rows moves by about the learning rate at each step,
    # however small its gradient, and a few such steps raise generic code's loss by tenths of
    # a nat
    train_embeddings: bool = False


@dataclass
class Batch:
    actions: Sequence[Action]  # logged rollouts (service.policy.sampling.Completion or rows)
    behaviour_logp: torch.Tensor  # (B,) logged logprob_total of each action (the serving policy)
    rewards: torch.Tensor  # (B,) finalized rewards
    # the same per part, for per-part ratios: each action's token log-probs and its decision's
    behaviour_token_logp: Sequence[Sequence[float]] | None = None
    behaviour_decision_logp: torch.Tensor | None = None  # (B,)
    # what finally stood after each rollout's cursor (code_settled), None where nobody said
    settled: Sequence[str | None] | None = None
    # (B,) each row's weight, mean 1 (trainer/caps.py); None: all 1
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.actions)
        assert self.behaviour_logp.shape == (n,), f"behaviour_logp shape != ({n},)"
        assert self.rewards.shape == (n,), f"rewards shape != ({n},)"
        assert (self.behaviour_token_logp is None) == (self.behaviour_decision_logp is None), (
            "per-part behaviour log-probs come in pairs"
        )
        if self.behaviour_token_logp is not None:
            assert len(self.behaviour_token_logp) == n, "one token list per action"
            assert self.behaviour_decision_logp is not None
            assert self.behaviour_decision_logp.shape == (n,), "one decision log-prob per action"
        assert self.settled is None or len(self.settled) == n, "one settled text (or None) each"
        assert self.weights is None or self.weights.shape == (n,), f"weights shape != ({n},)"
        assert self.weights is None or bool((self.weights >= 0).all()), "weights must be >= 0"

    @classmethod
    def of(
        cls,
        actions: Sequence[Any],
        rewards: Sequence[float],
        settled: Sequence[str | None] | None = None,
        weights: Sequence[float] | None = None,
    ) -> Batch:
        """From logged rollouts (Completions or rollout rows): totals and per-part log-probs."""
        return cls(
            actions=actions,
            behaviour_logp=torch.tensor([float(a.logprob_total) for a in actions]),
            rewards=torch.tensor([float(r) for r in rewards]),
            behaviour_token_logp=[list(a.token_logprobs) for a in actions],
            behaviour_decision_logp=torch.tensor([float(a.decision_logprob) for a in actions]),
            settled=settled,
            weights=None if weights is None else torch.tensor([float(w) for w in weights]),
        )

    def to(self, device: torch.device) -> Batch:
        """The batch with its tensors on `device` (itself where they are there already)."""
        if self.behaviour_logp.device == device:
            return self
        return dataclasses.replace(
            self,
            behaviour_logp=self.behaviour_logp.to(device),
            rewards=self.rewards.to(device),
            behaviour_decision_logp=_to(self.behaviour_decision_logp, device),
            weights=_to(self.weights, device),
        )

    def row_weights(self) -> torch.Tensor:
        """(B,) the rows' weights (all 1 without any)."""
        return torch.ones(len(self.actions)) if self.weights is None else self.weights

    def select(self, idx: list[int]) -> Batch:
        """The actions at `idx` (a minibatch)."""
        parts = self.behaviour_token_logp
        return Batch(
            actions=[self.actions[i] for i in idx],
            behaviour_logp=self.behaviour_logp[idx],
            rewards=self.rewards[idx],
            behaviour_token_logp=None if parts is None else [parts[i] for i in idx],
            behaviour_decision_logp=(
                None if self.behaviour_decision_logp is None else self.behaviour_decision_logp[idx]
            ),
            settled=None if self.settled is None else [self.settled[i] for i in idx],
            weights=None if self.weights is None else self.weights[idx],
        )


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


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
    return -_clipped_terms(torch.exp(logp_new - logp_old), adv, clip_eps).mean()


def _clipped_terms(ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """min(rho A, clip(rho, 1 - eps, 1 + eps) A), elementwise."""
    return torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)


def _clip_fraction(ratio: torch.Tensor, clip_eps: float) -> torch.Tensor:
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
    terms = _clipped_terms(ratios, a, clip_eps)
    owner = torch.cat([seg, torch.arange(len(lengths))])
    per_action = torch.zeros(len(lengths), dtype=terms.dtype).index_add(0, owner, terms)
    return -per_action.mean(), _clip_fraction(ratios, clip_eps)


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
        clipfrac = _clip_fraction(torch.exp(new.total - batch.behaviour_logp), cfg.clip_eps)
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


def make_optimizer(model: GPT, cfg: UpdateConfig) -> torch.optim.AdamW:
    """AdamW, no weight decay (the KL term is the regulariser), three groups: the language model
    at cfg.learning_rate; the gate's hidden-state projection at gate_hidden_lr_mult times that;
    its bias and confidence-feature weights at gate_lr_mult times that (with train_gate_only,
    the gate alone). Why: the gate is a logistic head whose threshold has to move by whole
    logits (p(show) 0.5 -> 0.9 is a bias shift of 2.2: 20,000 Adam steps at 1e-4), while one
    step on the 192-wide projection moves the logit by up to ~192 x its rate, so that part gets
    less. The PPO clip still bounds how far one batch moves each decision. Keep the state
    across batches (`carry_state`): a fresh Adam's first step moves every parameter by the full
    learning rate whatever its gradient, i.e. sign-SGD."""
    named = list(model.named_parameters())
    hidden = [p for n, p in named if n.startswith("gate.hidden")]
    threshold = [p for n, p in named if n.startswith("gate.") and not n.startswith("gate.hidden")]
    groups = [
        {"params": hidden, "lr": cfg.learning_rate * cfg.gate_hidden_lr_mult},
        {"params": threshold, "lr": cfg.learning_rate * cfg.gate_lr_mult},
    ]
    if not cfg.train_gate_only:
        lm = [p for n, p in named if not n.startswith("gate.")]
        groups.insert(0, {"params": lm, "lr": cfg.learning_rate})
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.99), weight_decay=0.0)


def carry_state(optimizer: torch.optim.Optimizer, state: dict[str, Any] | None) -> None:
    """Load Adam's moments from an earlier update into `optimizer` (built by make_optimizer for
    a copy of the same architecture), keeping this optimizer's learning rates. The moments are
    gradient statistics, so they carry over to the next candidate whichever parent it has."""
    if state is None:
        return
    groups = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in state["param_groups"]]:
        return  # another parameter layout (gate-only vs full): start fresh
    optimizer.load_state_dict(state)
    for group, fresh in zip(optimizer.param_groups, groups, strict=True):
        group["lr"] = fresh["lr"]


@contextlib.contextmanager
def _updating(
    model: GPT, ref_model: GPT, gate_only: bool, freeze_embeddings: bool = False
) -> Iterator[None]:
    """Dropout off for both models, with gate_only the LM frozen, with freeze_embeddings the
    token and position embeddings; restored afterwards."""
    modes = (model.training, ref_model.training)
    frozen = [
        p
        for n, p in model.named_parameters()
        if (gate_only and not n.startswith("gate.")) or (freeze_embeddings and n in EMBEDDINGS)
    ]
    frozen = [p for p in frozen if p.requires_grad]
    model.eval()
    ref_model.eval()
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
        model.train(modes[0])
        ref_model.train(modes[1])


def update(
    model: GPT,
    ref_model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    cfg: UpdateConfig,
    replay: Batch | None = None,
    settled_replay: Batch | None = None,
    generic: torch.Tensor | None = None,
    group: DataParallel | None = None,
) -> dict[str, float]:
    """`cfg.epochs` passes of shuffled minibatches over `batch`; the mean metrics of the steps.
    Then the settled-text passes (`cfg.settled_epochs`, on `batch` and `settled_replay`: earlier
    rollouts with the text people settled on), then the gate passes, or with `cfg.gate_fit` the
    gate's fit on the shown rollouts of `batch` and `replay` (earlier batches' rollouts with
    their rewards). `generic`: windows of generic code for the settled passes' pretraining mix.
    Unless cfg.train_embeddings, the token and position embeddings get no update.

    The optimizer (and its learning rate) is the caller's, kept across batches (`make_optimizer`
    builds the usual one); ref_model is only read, never differentiated. Advantages use the
    whole batch's baseline.

    `group` (trainer/distributed.py): one of the ranks of a data-parallel update, each calling
    this with the same arguments (rank 0's). Each computes the losses of its share of every
    minibatch and the gradients are summed over the ranks before each step, so every rank takes
    the steps one process takes here (up to float rounding); shuffles are rank 0's.
    """
    n = len(batch.actions)
    assert n > 0, "empty batch"
    assert cfg.epochs >= 1 and cfg.minibatch_size >= 1, "epochs and minibatch_size must be >= 1"
    device = model_device(model)  # the CPU, or a GPU in bf16 autocast (service/policy/device.py)
    batch = batch.to(device)
    replay = None if replay is None else replay.to(device)
    settled_replay = None if settled_replay is None else settled_replay.to(device)
    generic = _to(generic, device)
    with compute(device):
        adv = weighted_advantages(batch, cfg)
        totals: dict[str, float] = defaultdict(float)
        steps = 0
        with _updating(model, ref_model, cfg.train_gate_only, not cfg.train_embeddings):
            for _ in range(cfg.epochs):
                order = torch.randperm(n) if group is None else group.randperm(n)
                for start in range(0, n, cfg.minibatch_size):
                    idx = order[start : start + cfg.minibatch_size]
                    model.zero_grad(set_to_none=True)  # also parameters the optimizer lacks
                    if group is None:
                        mb = batch.select(idx.tolist())
                        loss, metrics = pg_loss(model, ref_model, tokenizer, mb, cfg, adv=adv[idx])
                        loss.backward()
                    else:
                        metrics = _pg_share(
                            model, ref_model, tokenizer, batch, adv, idx, cfg, group
                        )
                    params = [p for p in model.parameters() if p.grad is not None]
                    norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))
                    optimizer.step()
                    metrics["charts/grad_norm"] = float(norm)
                    for k, v in metrics.items():
                        totals[k] += v
                    steps += 1
            settled: dict[str, float] = {}
            if cfg.settled_epochs and not cfg.train_gate_only:
                settled = settled_passes(
                    model, tokenizer, batch, settled_replay, optimizer, cfg, generic, group
                )
            gate: dict[str, float] = {}
            if cfg.gate_fit:
                gate = fit_gate_to_rewards(
                    model,
                    tokenizer,
                    batch,
                    replay,
                    cfg.gate_fit_l2,
                    cfg.gate_fit_sharpness,
                    cfg.gate_fit_min_shown,
                    cfg.gate_fit_sharpness_max,
                    group,
                )
            if cfg.gate_epochs and not gate.get("gate_fit/fitted"):
                gate.update(gate_passes(model, tokenizer, batch, adv, optimizer, cfg, group))
            if group is not None and (cfg.gate_fit or cfg.gate_epochs):
                group.broadcast_params(model.gate.parameters())  # the ranks' own fits: rank 0's
        model.zero_grad(set_to_none=True)  # no gradients left behind in the model (or its copies)
        return {**{k: v / steps for k, v in totals.items()}, **settled, **gate}


def _pg_share(
    model: GPT,
    ref_model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    adv: torch.Tensor,
    idx: torch.Tensor,
    cfg: UpdateConfig,
    group: DataParallel,
) -> dict[str, float]:
    """A data-parallel rank's part of the gradient step on the minibatch `idx`: the gradients
    of its share of the rows (`group.shard`), summed over the ranks; the minibatch's metrics.

    Every term of pg_loss is a mean over the rows (the policy term of per-action sums), so the
    share's loss times its share of the rows adds up over the ranks to the minibatch's loss.
    The metrics, means over rows, are the ranks' weighted by their rows (clipfrac by their
    parts: tokens and decisions), ratio_max their max, adv_std the minibatch's own.
    """
    share = group.shard(idx)
    values = torch.zeros(len(PG_METRICS), dtype=torch.float64)
    if len(share):  # none when the minibatch has fewer rows than this rank's number + 1
        mb = batch.select(share.tolist())
        loss, metrics = pg_loss(model, ref_model, tokenizer, mb, cfg, adv=adv[share])
        (loss * (len(share) / len(idx))).backward()
        values = torch.tensor([metrics[k] for k in PG_METRICS], dtype=torch.float64)
    group.all_reduce_grads(model.parameters())
    parts = len(share)
    if batch.behaviour_token_logp is not None and batch.behaviour_decision_logp is not None:
        parts += sum(len(batch.behaviour_token_logp[i]) for i in share.tolist())
    table = group.all_gather(torch.cat([torch.tensor([len(share), parts]).double(), values]))
    rows, by_parts = table[:, 0] / len(idx), table[:, 1] / table[:, 1].sum()
    metrics = {k: float((rows * table[:, 2 + i]).sum()) for i, k in enumerate(PG_METRICS)}
    metrics["charts/clipfrac"] = float(
        (by_parts * table[:, 2 + PG_METRICS.index("charts/clipfrac")]).sum()
    )
    metrics["charts/ratio_max"] = float(
        table[rows > 0, 2 + PG_METRICS.index("charts/ratio_max")].max()
    )
    metrics["charts/adv_std"] = adv[idx].std().item() if len(idx) > 1 else 0.0
    return metrics


def gate_inputs(
    model: GPT,
    tokenizer: CodeTokenizer,
    actions: Sequence[Action],
    group: DataParallel | None = None,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate's inputs for `actions`, without gradient: the hidden states (B, C), the
    confidence features (B, 4) and the gate's decisions' log-probs (B,) (score_actions), `chunk`
    actions per forward pass. With a `group` each rank scores its share and all get them all."""
    n = len(actions)
    mine = list(range(n)) if group is None else group.shard(torch.arange(n)).tolist()
    width = model.config.n_embd + model.gate.features.in_features
    rows = [torch.zeros(0, width + 1)]
    with torch.no_grad():
        for i in range(0, len(mine), chunk):
            s = score_actions(model, tokenizer, [actions[j] for j in mine[i : i + chunk]])
            rows.append(torch.cat([s.gate_hidden, s.gate_inputs, s.gate_decision[:, None]], 1))
    both = torch.cat(rows) if group is None else group.gather_rows(torch.cat(rows), n)
    return both[:, : model.config.n_embd], both[:, model.config.n_embd : width], both[:, width]


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
    # the gate's part of the logged decision: without the copy draw's (service.policy.sampling)
    old = batch.behaviour_decision_logp - torch.tensor(
        [float(a.recall["logprob"]) if a.recall else 0.0 for a in batch.actions]
    )
    n = len(batch.actions)
    hidden, feats, decision = gate_inputs(model, tokenizer, batch.actions, group, chunk=n)
    sampled = decision != 0  # score_actions: 0 where the decision was not sampled
    shown = torch.tensor([bool(a.shown) for a in batch.actions])
    gate = [p for n, p in model.named_parameters() if n.startswith("gate.") and p.requires_grad]
    clipped, steps = 0.0, 0
    for _ in range(cfg.gate_epochs):
        order = torch.randperm(n) if group is None else group.randperm(n)
        for start in range(0, n, cfg.minibatch_size):
            idx = order[start : start + cfg.minibatch_size]
            z = model.gate_logit(hidden[idx], feats[idx])
            new = torch.where(shown[idx], F.logsigmoid(z), F.logsigmoid(-z))
            ratio = torch.exp(new - old[idx])
            terms = _clipped_terms(ratio, adv[idx], cfg.clip_eps) * sampled[idx]
            loss = -terms.mean()
            model.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gate, cfg.max_grad_norm or float("inf"))
            optimizer.step()
            keep = sampled[idx]
            clipped += float(_clip_fraction(ratio[keep], cfg.clip_eps)) if keep.any() else 0.0
            steps += 1
    with torch.no_grad():
        p_show = torch.sigmoid(model.gate_logit(hidden, feats)).mean().item()
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
    Its weighted logistic regression on the gate's own inputs x (the last hidden state and the
    confidence features) has logit ~ log(E[gain | x] / E[loss | x]): positive exactly where the
    expected reward of showing beats abstaining, and the further from zero the surer. The fit is
    to convergence (L-BFGS) on standardised inputs with L2 `l2` on the hidden-state weights (a
    few hundred verdicts against 192 of them), then written into the gate's linear layers times
    `sharpness`: p(show) = sigmoid(sharpness * logit) is near 0 or 1 where the fit is sure and
    stays near 1/2 where the evidence is even, so the gate keeps exploring at its boundary
    (it learns only from what it shows). With `sharpness_max` above `sharpness` (and
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
    h, x, _ = gate_inputs(model, tokenizer, actions, group)  # only once there is a fit to make
    w = gain.abs() * row_w[shown]
    w = w / w.mean()
    inputs = torch.cat([h[shown], x[shown]], 1).double()
    mu, sd = inputs.mean(0), inputs.std(0) + 1e-6
    z = torch.cat([(inputs - mu) / sd, torch.ones(len(inputs), 1, dtype=torch.float64)], 1)
    ridge = torch.zeros(z.shape[1], dtype=torch.float64)
    ridge[: h.shape[1]] = l2
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
    if sharpness_max > sharpness and min_shown > 0:
        sharpness = min(sharpness_max, sharpness * math.sqrt(len(y) / min_shown))
    c = coef.detach()
    scaled = sharpness * c[:-1] / sd  # on raw inputs: logit = scaled . inputs + bias
    bias = sharpness * c[-1] - (scaled * mu).sum()
    with torch.no_grad():
        model.gate.hidden.weight.copy_(scaled[: h.shape[1]].float()[None])
        model.gate.features.weight.copy_(scaled[h.shape[1] :].float()[None])
        model.gate.features.bias.fill_(float(bias))
        p_show = torch.sigmoid(model.gate_logit(h[in_batch], x[in_batch]))
    return {
        "gate_fit/shown": float(len(y)),
        "gate_fit/fitted": 1.0,
        "gate_fit/paid": float(y.mean()),
        "gate_fit/abstain_reward": r0,
        "gate_fit/sharpness": sharpness,
        "gate/p_show": float(p_show.mean()),
    }
