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

from service.policy.model import GPT
from service.policy.sampling import Action
from service.policy.tokenizer import CodeTokenizer

if TYPE_CHECKING:  # update.py imports this module
    from trainer.update import Batch, UpdateConfig


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


def settled_nll(
    model: GPT,
    actions: Sequence[Action],
    targets: Sequence[tuple[int, list[int]]],
    weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """Mean token NLL (model distribution, temperature 1) of each target after its action's
    context, over all target tokens: the supervised loss on settled text, (). Differentiable.
    `weights`: one per target (mean 1 over all the examples a pass reads), each of its tokens'
    NLL multiplied by it, still divided by the token count (so a minibatch of light examples
    weighs little, as it should)."""
    assert targets, "no settled text"
    block = model.config.block_size
    seqs, spans = [], []
    for i, ids in targets:
        ctx = list(actions[i].context_token_ids)
        ids = ids[: block - len(ctx)]
        seqs.append(ctx + ids)
        spans.append((len(ctx), len(ids)))
    idx = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for b, seq in enumerate(seqs):
        idx[b, : len(seq)] = torch.tensor(seq)
    rows = [b for b, (_, n) in enumerate(spans) for _ in range(n)]
    cols = [c - 1 + j for c, n in spans for j in range(n)]
    tgt = torch.tensor([t for seq, (c, n) in zip(seqs, spans, strict=True) for t in seq[c : c + n]])
    logits = model.logits(model.hidden(idx)[rows, cols]).float()
    if weights is None:
        return F.cross_entropy(logits, tgt)
    per_token = torch.tensor([weights[b] for b in rows], dtype=torch.float32)
    return (F.cross_entropy(logits, tgt, reduction="none") * per_token).mean()


def settled_passes(
    model: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    replay: Batch | None,
    optimizer: torch.optim.Optimizer,
    cfg: UpdateConfig,
    generic: torch.Tensor | None = None,
) -> dict[str, float]:
    """`cfg.settled_epochs` passes of minibatch steps on the settled-text NLL of `batch` and
    `replay` (each text is evidence only for the rollout whose cursor it follows), plus
    cfg.generic_mix times the next-token loss on cfg.generic_rows random windows of `generic`
    (N, T+1) when given. The learning rate is the optimizer's times settled_lr_mult for these
    steps; the gate gets no gradient."""
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
            order = torch.randperm(len(examples)).tolist()
            total, steps = 0.0, 0
            for start in range(0, len(order), cfg.minibatch_size):
                mb = [examples[i] for i in order[start : start + cfg.minibatch_size]]
                loss = settled_nll(
                    model,
                    [a for a, _, _ in mb],
                    [(j, ids) for j, (_, ids, _) in enumerate(mb)],
                    [w / mean_weight for _, _, w in mb] if weighted else None,
                )
                total, steps = total + loss.item(), steps + 1
                if generic is not None and cfg.generic_mix > 0:
                    rows = generic[torch.randint(0, len(generic), (cfg.generic_rows,))]
                    _, generic_loss = model(rows[:, :-1], rows[:, 1:])
                    assert generic_loss is not None
                    loss = loss + cfg.generic_mix * generic_loss
                    generic_total += generic_loss.item()
                model.zero_grad(set_to_none=True)
                loss.backward()
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
