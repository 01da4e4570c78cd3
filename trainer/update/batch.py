"""A batch of finalized rollouts as the update reads it (`Batch`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tabloop.core.policy.actions import Action
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.update.config import UpdateConfig


@dataclass
class Batch:
    actions: Sequence[Action]  # logged rollouts (tabloop.core.policy.actions.Completion or rows)
    behaviour_logp: torch.Tensor  # (B,) logged logprob_total of each action (the serving policy)
    rewards: torch.Tensor  # (B,) finalized rewards
    # the same per part, for per-part ratios: each action's token log-probs and its decision's
    behaviour_token_logp: Sequence[Sequence[float]] | None = None
    behaviour_decision_logp: torch.Tensor | None = None  # (B,)
    # what finally stood after each rollout's cursor (code_settled), None where nobody said
    settled: Sequence[str | None] | None = None
    # (B,) each row's weight, mean 1 (trainer/caps.py); None: all 1
    weights: torch.Tensor | None = None
    # how much of each copy's next lines stands in what its person wrote (trainer/blocks.py),
    # None where that is not known; None: not read
    blocks: Sequence[float | None] | None = None
    # (B,) the characters each rollout's person kept (accepted x retained); None: not read
    kept: torch.Tensor | None = None

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
        assert self.blocks is None or len(self.blocks) == n, "one block label (or None) each"
        assert self.kept is None or self.kept.shape == (n,), f"kept shape != ({n},)"

    @classmethod
    def of(
        cls,
        actions: Sequence[Any],
        rewards: Sequence[float],
        settled: Sequence[str | None] | None = None,
        weights: Sequence[float] | None = None,
        blocks: Sequence[float | None] | None = None,
        kept: Sequence[float] | None = None,
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
            blocks=blocks,
            kept=None if kept is None else torch.tensor([float(k) for k in kept]),
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
            kept=_to(self.kept, device),
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
            blocks=None if self.blocks is None else [self.blocks[i] for i in idx],
            kept=None if self.kept is None else self.kept[idx],
        )


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


@dataclass
class UpdateInputs:
    """One update's arguments (`update()`, and the ranks of a data-parallel one): the policy
    being updated, the reference it is held to, what it learns from, its optimizer and the
    settings. `replay`: earlier batches' rollouts with their rewards (the gate's fit);
    `settled_replay`: earlier rollouts with the text people settled on; `generic`: windows of
    generic code for the settled passes' pretraining mix."""

    model: GPT
    ref_model: GPT
    tokenizer: CodeTokenizer
    batch: Batch
    optimizer: torch.optim.Optimizer
    cfg: UpdateConfig
    replay: Batch | None = None
    settled_replay: Batch | None = None
    generic: torch.Tensor | None = None
