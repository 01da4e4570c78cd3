"""The update's settings (`UpdateConfig`): the PPO terms, the optimizer, the gate's and the
settled-text passes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    # set the lines head by a cost-weighted logistic fit on block labels (fit_lines_to_blocks:
    # how much of each copy's next lines stands in what its person wrote, trainer/blocks.py)
    # of this batch and the replayed rollouts, once there are lines_fit_min of them; its logit
    # times a sharpness from lines_fit_sharpness, growing with the labels up to 3x that
    lines_fit: bool = True
    lines_fit_min: int = 20
    lines_fit_sharpness: float = 2.0
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
