"""`update()`: the optimizer and the gradient steps of one update, on one process or on the
ranks of a data-parallel group (trainer/distributed.py)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from tabloop.core.policy.device import compute, model_device
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.settled import settled_passes
from trainer.update.batch import Batch, UpdateInputs, _to
from trainer.update.config import UpdateConfig
from trainer.update.gate import fit_gate_to_rewards, gate_passes
from trainer.update.lines import fit_lines_to_blocks
from trainer.update.loss import PG_METRICS, pg_loss, weighted_advantages

if TYPE_CHECKING:
    from trainer.ranks import DataParallel


# the heads' weights on the hidden state: the gate's, the copy head's, the extend and lines heads'
HIDDEN_PROJECTIONS = (
    "gate.hidden.weight",
    "gate.copy.hidden",
    "gate.extend.hidden",
    "gate.lines.hidden",
)


def make_optimizer(model: GPT, cfg: UpdateConfig) -> torch.optim.AdamW:
    """AdamW, no weight decay (the KL term is the regulariser), three groups: the language model
    at cfg.learning_rate; the gate's and the copy head's hidden-state projections at
    gate_hidden_lr_mult times that; the heads' other weights and biases at gate_lr_mult times
    that (with train_gate_only, the gate alone). Why: the gate is a logistic head whose
    threshold has to move by whole logits (p(show) 0.5 -> 0.9 is a bias shift of 2.2: 20,000
    Adam steps at 1e-4), while one step on a 192-wide projection moves the logit by up to ~192
    x its rate, so that part gets less. The PPO clip still bounds how far one batch moves each
    decision. Keep the state across batches (`carry_state`): a fresh Adam's first step moves
    every parameter by the full learning rate whatever its gradient, i.e. sign-SGD."""
    named = list(model.named_parameters())
    hidden = [p for n, p in named if n in HIDDEN_PROJECTIONS]
    threshold = [p for n, p in named if n.startswith("gate.") and n not in HIDDEN_PROJECTIONS]
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
        if (gate_only and not n.startswith("gate."))
        or (freeze_embeddings and n in model.embedding_names)
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


def update(inputs: UpdateInputs, group: DataParallel | None = None) -> dict[str, float]:
    """`cfg.epochs` passes of shuffled minibatches over `inputs.batch`; the mean metrics of the
    steps.
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
    model, ref_model, tokenizer = inputs.model, inputs.ref_model, inputs.tokenizer
    batch, optimizer, cfg = inputs.batch, inputs.optimizer, inputs.cfg
    replay, settled_replay, generic = inputs.replay, inputs.settled_replay, inputs.generic
    n = len(batch.actions)
    assert n > 0, "empty batch"
    assert cfg.epochs >= 1 and cfg.minibatch_size >= 1, "epochs and minibatch_size must be >= 1"
    device = model_device(
        model
    )  # the CPU, or a GPU in bf16 autocast (tabloop/core/policy/device.py)
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
            if cfg.lines_fit:
                gate.update(fit_lines_to_blocks(model, tokenizer, batch, replay, cfg, group))
            if group is not None and (cfg.gate_fit or cfg.gate_epochs or cfg.lines_fit):
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
