"""The decision critic: what showing a completion is expected to earn, learned from every judged
suggestion of the last few batches, so the gate can be stepped on *every* decision of a batch.

The policy gradient on sampled decisions learns only from what was shown: a completion the gate
already hides gets an advantage of about minus the batch baseline, close to zero, so once the
gate hides a region (most long completions, which are mostly rejected) nothing brings the few
long ones worth showing back. An actor-critic step on a binary action does not need the sample:
with Q(show) estimated for every rollout and Q(abstain) known, the decision's expected clipped
surrogate (`trainer.update.expected_gate_surrogate`) pushes p(show) up wherever showing is
expected to gain and down wherever it is expected to lose, hidden or not.

    p(accept | completion)  logistic regression, L2, on the gate's inputs (the last hidden
                            state and the four confidence features, standardised), fit on the
                            shown rollouts of the last `batches` batches; label: reward > 0
    value of an accept      least squares on [1, log1p(bytes)] over the accepted ones (the
                            reward grows with the accepted size, DESIGN.md's size term)
    value of a rejection    the mean reward of the shown rollouts that were not accepted
    Q(show)                 p * value_of_accept(bytes) + (1 - p) * value_of_rejection

Everything is fitted from the finalized rewards alone (no reward spec is read), so the critic
follows whatever spec the operator sets. The hidden states are recomputed with the model being
updated each time, so old batches are read through the current language model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from service.policy.model import GATE_FEATURES, GPT
from service.policy.sampling import score_actions
from service.policy.tokenizer import CodeTokenizer

BYTES = GATE_FEATURES.index("log1p_bytes")


@dataclass
class CriticFit:
    """A fitted critic: q_show(hidden, features) -> (B,) expected reward of showing."""

    mean: torch.Tensor  # (D,) standardisation of [hidden, features]
    std: torch.Tensor  # (D,)
    weight: torch.Tensor  # (D,) logistic p(accept)
    bias: float
    accept_value: tuple[float, float]  # accepted reward = a + b * log1p(bytes)
    reject_value: float
    n_shown: int
    n_accepted: int

    def p_accept(self, context: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = (torch.cat([context, features], dim=-1) - self.mean) / self.std
        return torch.sigmoid(x @ self.weight + self.bias)

    def q_show(self, context: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        p = self.p_accept(context, features)
        a, b = self.accept_value
        accepted = a + b * features[:, BYTES]
        return p * accepted + (1.0 - p) * self.reject_value

    def summary(self) -> dict[str, float]:
        return {
            "critic/shown": float(self.n_shown),
            "critic/accepted": float(self.n_accepted),
            "critic/reject_value": self.reject_value,
        }


def fit_critic(
    context: torch.Tensor, features: torch.Tensor, rewards: torch.Tensor, l2: float
) -> CriticFit | None:
    """Fit on shown rollouts (hidden (N, C), features (N, 4), rewards (N,)); None without both
    an accepted and a not-accepted suggestion to learn from."""
    accepted = rewards > 0
    n_acc = int(accepted.sum())
    if n_acc == 0 or n_acc == len(rewards):
        return None
    x = torch.cat([context, features], dim=-1).double()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    x = (x - mean) / std
    y = accepted.double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.logit(y.mean()).clone().requires_grad_(True)  # start at the base rate
    opt = torch.optim.LBFGS([w, b], max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w + b, y, reduction="sum")
        loss = loss + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    size = features[accepted, BYTES].double()
    value = rewards[accepted].double()
    if n_acc >= 3 and float(size.std()) > 1e-6:
        design = torch.stack([torch.ones_like(size), size], dim=-1)
        coef = torch.linalg.lstsq(design, value[:, None]).solution.squeeze(-1)
        accept_value = (float(coef[0]), float(coef[1]))
    else:
        accept_value = (float(value.mean()), 0.0)
    return CriticFit(
        mean=mean.float(),
        std=std.float(),
        weight=w.detach().float(),
        bias=float(b.detach()),
        accept_value=accept_value,
        reject_value=float(rewards[~accepted].mean()),
        n_shown=len(rewards),
        n_accepted=n_acc,
    )


class DecisionCritic:
    """The shown rollouts (and their rewards) of the last `batches` batches, refitted per update.

    Kept by the trainer across updates, like Adam's moments: what people accept is a property of
    the people, not of one candidate."""

    def __init__(self, batches: int = 4, l2: float = 1.0, context: str = "gate"):
        assert batches >= 1, "the critic needs at least the current batch"
        assert context in ("gate", "hidden"), f"unknown critic context {context!r}"
        self.l2, self.mode = l2, context
        self._memory: deque[tuple[list[Any], list[float]]] = deque(maxlen=batches)

    def remember(self, actions: Sequence[Any], rewards: torch.Tensor) -> None:
        """Keep this batch's judged suggestions (shown ones; an empty completion is never shown)."""
        keep = [i for i, a in enumerate(actions) if a.shown]
        self._memory.append(([actions[i] for i in keep], [float(rewards[i]) for i in keep]))

    def fit(self, model: GPT, tokenizer: CodeTokenizer) -> CriticFit | None:
        actions = [a for acts, _ in self._memory for a in acts]
        rewards = torch.tensor([r for _, rs in self._memory for r in rs])
        if not actions:
            return None
        with torch.no_grad():
            s = score_actions(model, tokenizer, actions)
        context = self.context(model, s.gate_hidden.detach())
        return fit_critic(context, s.gate_inputs.detach(), rewards, self.l2)

    def context(self, model: GPT, hidden: torch.Tensor) -> torch.Tensor:
        """What the critic reads of the context: the gate's own projection of the hidden state
        (its learned context score, one number: "gate") or the whole hidden state ("hidden")."""
        if self.mode == "hidden":
            return hidden
        with torch.no_grad():
            return model.gate.hidden(hidden)
