"""The supervised term on settled text: what people actually wrote after a request's cursor.

An opted-in editor reports, for any suggestion, what finally stands from the request's cursor to
the end of that line (`code_settled`). For each rollout with such a report, the target is what
the policy should have sampled after its own context: the healed bytes it re-emits, the settled
text and the newline that ends the line. `settled_passes` takes minibatch steps on the mean
token NLL of these targets (the model's distribution, temperature 1), each after its own
rollout's context and nowhere else, with PPO's pretraining mix: the next-token loss on windows
of generic code in every step, so that learning the people's code does not unlearn code in
general. The gate gets no gradient here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from tabloop.core.policy.actions import Action
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer

if TYPE_CHECKING:  # trainer/update/step.py imports this module
    from trainer.ranks import DataParallel
    from trainer.update.batch import Batch
    from trainer.update.config import UpdateConfig


def settled_targets(
    tokenizer: CodeTokenizer,
    actions: Sequence[Action],
    texts: Sequence[str | None],
    max_tokens: int,
) -> list[tuple[int, list[int]]]:
    """(index, target token ids) for each action that has a settled text: the tokens the policy
    should have sampled after its own context, i.e. the healed bytes it re-emits, the settled
    text and the newline that ends the line (cut to `max_tokens` and to the context's block)."""
    out = []
    for i, (a, text) in enumerate(zip(actions, texts, strict=True)):
        if text is None:
            continue
        ids = tokenizer.encode(a.heal_text + text.rstrip("\r\n") + "\n")[:max_tokens]
        if ids:
            out.append((i, ids))
    return out


def _kept(model: GPT, action: Action, ids: list[int]) -> list[int]:
    """The target tokens that fit in the model's block after the action's context."""
    return ids[: model.config.block_size - len(action.context_token_ids)]


def settled_tokens(
    model: GPT, actions: Sequence[Action], targets: Sequence[tuple[int, list[int]]]
) -> int:
    """How many target tokens settled_nll averages over."""
    return sum(len(_kept(model, actions[i], ids)) for i, ids in targets)


def settled_nll(
    model: GPT,
    actions: Sequence[Action],
    targets: Sequence[tuple[int, list[int]]],
    weights: Sequence[float] | None = None,
    tokens: int | None = None,
) -> torch.Tensor:
    """Mean token NLL (model distribution, temperature 1) of each target after its action's
    context, over all target tokens: the supervised loss on settled text, (). Differentiable.
    `weights`: one per target (mean 1 over all the examples a pass reads), each of its tokens'
    NLL multiplied by it, still divided by the token count (so a minibatch of light examples
    weighs little, as it should). `tokens`: divide by this count instead (a data-parallel
    rank's share of a minibatch divides by the minibatch's, so the shares add up to its NLL)."""
    assert targets, "no settled text"
    seqs, spans = [], []
    for i, ids in targets:
        ctx = list(actions[i].context_token_ids)
        ids = _kept(model, actions[i], ids)
        seqs.append(ctx + ids)
        spans.append((len(ctx), len(ids)))
    idx = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for b, seq in enumerate(seqs):
        idx[b, : len(seq)] = torch.tensor(seq)
    rows = [b for b, (_, n) in enumerate(spans) for _ in range(n)]
    cols = [c - 1 + j for c, n in spans for j in range(n)]
    tgt = torch.tensor([t for seq, (c, n) in zip(seqs, spans, strict=True) for t in seq[c : c + n]])
    logits = model.logits(model.hidden(idx)[rows, cols]).float()
    if weights is None and tokens is None:
        return F.cross_entropy(logits, tgt)
    nll = F.cross_entropy(logits, tgt, reduction="none")
    if weights is not None:
        nll = nll * torch.tensor([weights[b] for b in rows], dtype=torch.float32)
    return nll.mean() if tokens is None else nll.sum() / tokens


def settled_passes(
    model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    replay: Batch | None,
    optimizer: torch.optim.Optimizer,
    cfg: UpdateConfig,
    generic: torch.Tensor | None = None,
    group: DataParallel | None = None,
) -> dict[str, float]:
    """`cfg.settled_epochs` passes of minibatch steps on the settled-text NLL of `batch` and
    `replay` (each text is evidence only for the rollout whose cursor it follows), plus
    cfg.generic_mix times the next-token loss on cfg.generic_rows random windows of `generic`
    (N, T+1) when given. The learning rate is the optimizer's times settled_lr_mult for these
    steps; the gate gets no gradient. With a `group` (a data-parallel update) each rank takes
    its share of each minibatch's examples and windows (`_share_backward`)."""
    parts = [b for b in (batch, replay) if b is not None and b.settled is not None]
    examples = [
        (b.actions[i], ids, float(b.row_weights()[i]))
        for b in parts
        for i, ids in settled_targets(tokenizer, b.actions, b.settled or [], cfg.settled_max_tokens)
    ]
    if not examples or cfg.settled_epochs <= 0:
        return {"settled/examples": float(len(examples))}
    # the rows' weights (trainer/caps.py), to a mean of 1 over the examples read
    mean_weight = sum(w for _, _, w in examples) / len(examples)
    weighted = any(b.weights is not None for b in parts) and mean_weight > 0
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] *= cfg.settled_lr_mult
    lm = [p for n, p in model.named_parameters() if not n.startswith("gate.") and p.requires_grad]
    first = last = generic_total = 0.0
    n_steps = 0
    try:
        for epoch in range(cfg.settled_epochs):
            n = len(examples)
            order = (torch.randperm(n) if group is None else group.randperm(n)).tolist()
            total, steps = 0.0, 0
            for start in range(0, len(order), cfg.minibatch_size):
                mb = [examples[i] for i in order[start : start + cfg.minibatch_size]]
                weights = [w / mean_weight for _, _, w in mb] if weighted else None
                rows = None
                if generic is not None and cfg.generic_mix > 0:
                    draw = (
                        torch.randint(0, len(generic), (cfg.generic_rows,))
                        if group is None
                        else group.randint(len(generic), cfg.generic_rows)
                    )
                    rows = generic[draw]
                model.zero_grad(set_to_none=True)
                if group is None:
                    nll, generic_nll = _backward(model, mb, weights, rows, cfg.generic_mix)
                else:
                    nll, generic_nll = _share_backward(
                        model, mb, weights, rows, cfg.generic_mix, group
                    )
                total, steps = total + nll, steps + 1
                generic_total += generic_nll
                torch.nn.utils.clip_grad_norm_(lm, cfg.max_grad_norm or float("inf"))
                optimizer.step()
            if epoch == 0:
                first = total / steps
            last = total / steps
            n_steps += steps
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
    return {
        "settled/examples": float(len(examples)),
        "settled/nll_first": first,
        "settled/nll_last": last,
        "settled/generic_nll": generic_total / n_steps,
    }


def _backward(
    model: GPT,
    mb: Sequence[tuple[Action, list[int], float]],
    weights: Sequence[float] | None,
    rows: torch.Tensor | None,
    mix: float,
) -> tuple[float, float]:
    """The gradient of one settled-text step's loss: the NLL of the minibatch `mb` plus `mix`
    times the next-token loss on the generic windows `rows` (if any); (NLL, generic NLL)."""
    loss = settled_nll(
        model, [a for a, _, _ in mb], [(j, ids) for j, (_, ids, _) in enumerate(mb)], weights
    )
    nll, generic_nll = loss.item(), 0.0
    if rows is not None:
        _, generic_loss = model(rows[:, :-1], rows[:, 1:])
        assert generic_loss is not None
        loss = loss + mix * generic_loss
        generic_nll = generic_loss.item()
    loss.backward()
    return nll, generic_nll


def _share_backward(
    model: GPT,
    mb: Sequence[tuple[Action, list[int], float]],
    weights: Sequence[float] | None,
    rows: torch.Tensor | None,
    mix: float,
    group: DataParallel,
) -> tuple[float, float]:
    """`_backward` on a data-parallel rank: the gradient of its share of the examples (their
    NLL summed over their tokens, divided by the minibatch's token count) and of the windows
    (their mean next-token loss times their share of the target tokens), summed over the
    ranks: both losses are means over tokens, so the shares add up to the whole step's."""
    targets = [(j, ids) for j, (_, ids, _) in enumerate(mb)]
    actions = [a for a, _, _ in mb]
    mine = group.shard(torch.arange(len(mb))).tolist()
    loss = torch.zeros(())
    if mine:
        loss = settled_nll(
            model,
            actions,
            [targets[j] for j in mine],
            None if weights is None else [weights[j] for j in mine],
            tokens=settled_tokens(model, actions, targets),
        )
    figures = torch.zeros(2, dtype=torch.float64)
    figures[0] = loss.item()
    my_rows = None if rows is None else rows[group.rank :: group.world]
    if rows is not None and my_rows is not None and len(my_rows):
        share = float((my_rows[:, 1:] != -1).sum() / (rows[:, 1:] != -1).sum())
        _, generic_loss = model(my_rows[:, :-1], my_rows[:, 1:])
        assert generic_loss is not None
        loss = loss + mix * share * generic_loss
        figures[1] = share * generic_loss.item()
    if loss.requires_grad:
        loss.backward()
    group.all_reduce_grads(model.parameters())
    nll, generic_nll = group.all_reduce(figures).tolist()
    return nll, generic_nll
