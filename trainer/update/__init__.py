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

from trainer.update.batch import Batch, UpdateInputs
from trainer.update.config import UpdateConfig
from trainer.update.gate import fit_gate_to_rewards, gate_inputs, gate_passes
from trainer.update.loss import (
    PG_METRICS,
    advantages,
    bernoulli_entropy,
    clipped_surrogate,
    kl_to_reference,
    per_part_surrogate,
    pg_loss,
    weighted_advantages,
)
from trainer.update.step import carry_state, make_optimizer, update

__all__ = [
    "PG_METRICS",
    "Batch",
    "UpdateConfig",
    "UpdateInputs",
    "advantages",
    "bernoulli_entropy",
    "carry_state",
    "clipped_surrogate",
    "fit_gate_to_rewards",
    "gate_inputs",
    "gate_passes",
    "kl_to_reference",
    "make_optimizer",
    "per_part_surrogate",
    "pg_loss",
    "update",
    "weighted_advantages",
]
