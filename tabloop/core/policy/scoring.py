"""Recomputing a logged action's log-probability under the current parameters: every part of
it (the tokens, the extend, copy and lines draws, the decision) exactly as sampled
(tabloop/core/policy/sampling.py), in one forward pass per batch of actions. The trainer's
update, the deploy check and the tests of served rollouts use it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn import functional as F

from tabloop.core.person import PERSON_INPUTS
from tabloop.core.policy.actions import (
    NEG_INF,
    Action,
    ActionScores,
    Completion,
    bytes_to_text,
    completion_bytes,
    constraint_steps,
    extend_drawn,
    lines_drawn,
    person_inputs,
    person_tensor,
    sampling_logprobs,
    was_copied,
)
from tabloop.core.policy.device import compute, model_device
from tabloop.core.policy.model import GPT, gate_features
from tabloop.core.policy.tokenizer import CodeTokenizer


# --- recomputation -----------------------------------------------------------------------
def score_actions(model: GPT, tokenizer: CodeTokenizer, actions: Sequence[Action]) -> ActionScores:
    """Recompute the log-probs of logged actions with one padded forward pass (differentiable).
    On the model's device (bf16 autocast on a GPU); log-probs in float32."""
    with compute(model_device(model)):
        return _score_actions(model, tokenizer, actions)


def _score_actions(model: GPT, tokenizer: CodeTokenizer, actions: Sequence[Action]) -> ActionScores:
    assert actions, "empty batch"
    assert all(a.context_token_ids for a in actions), (
        "an action without context (an unsupported language: nothing was sampled) has no score"
    )
    seqs = [list(a.context_token_ids) + list(a.token_ids) for a in actions]
    lengths = [len(a.token_ids) for a in actions]  # 0: the confidence stop came first
    longest = max(map(len, seqs))
    assert longest <= model.config.block_size, f"action of {longest} tokens > block_size"
    padded = [s + [0] * (longest - len(s)) for s in seqs]  # right padding: causal, unseen
    h = model.hidden(torch.tensor(padded, dtype=torch.long, device=model_device(model)))

    rows_b, rows_t, targets, temps, tops, remains, rollout = [], [], [], [], [], [], []
    for b, a in enumerate(actions):
        c = len(a.context_token_ids)
        rem = constraint_steps(tokenizer, a.token_ids, a.heal_text.encode("utf-8"))
        for j, tok in enumerate(a.token_ids):
            rows_b.append(b)
            rows_t.append(c - 1 + j)
            targets.append(tok)
            temps.append(a.temperature)
            tops.append(a.top_p if a.top_p is not None else 1.0)
            remains.append(rem[j])
            rollout.append(b)
    logits = model.logits(h[rows_b, rows_t])  # (N, V)
    tgt = torch.tensor(targets, dtype=torch.long)
    temp = torch.tensor(temps, dtype=torch.float32)
    greedy = temp == 0.0
    allowed = None
    if any(remains):
        allowed = torch.ones(len(targets), model.config.vocab_size, dtype=torch.bool)
        for i, r in enumerate(remains):
            if r:
                allowed[i] = tokenizer.allowed_mask(r)
    logp = sampling_logprobs(
        logits, temp.clamp(min=1e-6), torch.tensor(tops, dtype=torch.float32), allowed, tgt
    )
    tok_lp = logp.gather(-1, tgt[:, None]).squeeze(-1).masked_fill(greedy, 0.0)
    p = logp.exp()
    ent = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1).masked_fill(greedy, 0.0)
    with torch.no_grad():
        raw = logits.float() if allowed is None else logits.float().masked_fill(~allowed, NEG_INF)
        model_lp = F.log_softmax(raw, dim=-1).gather(-1, tgt[:, None]).squeeze(-1)

    B = len(actions)
    seg = torch.tensor(rollout, dtype=torch.long)
    tok_sum = torch.zeros(B).index_add(0, seg, tok_lp)
    ent_sum = torch.zeros(B).index_add(0, seg, ent)
    model_sum = torch.zeros(B).index_add(0, seg, model_lp)
    outs = [completion_bytes(tokenizer, a.token_ids, a.heal_text.encode()) for a in actions]
    n_bytes = [len(o) for o in outs]
    last = torch.tensor([len(s) - 1 for s in seqs])
    feats = gate_features(model_sum, torch.tensor(lengths), torch.tensor(n_bytes))
    h_last = h[torch.arange(B), last]
    people = person_tensor([person_inputs(a, "gate") for a in actions], h_last.device)
    gate_logit = model.gate_logit(h_last, feats, people).float()  # float32 under autocast too
    shown = torch.tensor([bool(a.shown) for a in actions])
    dec = torch.where(shown, F.logsigmoid(gate_logit), F.logsigmoid(-gate_logit))
    fixed = torch.tensor(
        [not bytes_to_text(o) or a.temperature == 0.0 for o, a in zip(outs, actions, strict=True)]
    )
    copied = torch.tensor([was_copied(a) for a in actions])
    gate_dec = dec.masked_fill(fixed | copied, 0.0)
    source = torch.zeros(B)
    with_recall = [i for i, a in enumerate(actions) if a.recall and a.temperature != 0.0]
    if with_recall:
        inputs = torch.tensor([actions[i].recall["inputs"] for i in with_recall])  # type: ignore[index]
        copy_people = person_tensor(
            [person_inputs(actions[i], "copy") for i in with_recall], h_last.device
        )
        z = model.gate.copy(inputs.to(h_last.device), h_last[with_recall], copy_people)
        z = z.float()[:, 0].cpu()
        lp = torch.where(copied[with_recall], F.logsigmoid(z), F.logsigmoid(-z))
        source = source.index_add(0, torch.tensor(with_recall), lp)
    drawn = [
        (i, e)
        for i, (a, e) in enumerate(zip(actions, map(extend_drawn, actions), strict=True))
        if e is not None and a.temperature != 0.0
    ]
    if drawn:  # how far to suggest: drawn at the last token kept before the stop would cut
        rows = torch.tensor([i for i, _ in drawn])
        at = torch.tensor([len(actions[i].context_token_ids) - 1 + int(e["at"]) for i, e in drawn])
        z = model.gate.extend(
            h[rows, at],
            person_tensor([person_inputs(actions[i], "extend") for i, _ in drawn], h.device),
        )
        z = z.float().cpu()
        yes = torch.tensor([bool(e["extended"]) for _, e in drawn])
        source = source.index_add(0, rows, torch.where(yes, F.logsigmoid(z), F.logsigmoid(-z)))
    more = [
        (i, d)
        for i, (a, d) in enumerate(zip(actions, map(lines_drawn, actions), strict=True))
        if d is not None and a.temperature != 0.0
    ]
    if more:  # how far to copy: drawn after the copy, on the last hidden state
        rows = torch.tensor([i for i, _ in more])
        z = model.gate.lines(
            h_last[rows],
            person_tensor([person_inputs(actions[i], "lines") for i, _ in more], h.device),
        )
        z = z.float().cpu()
        yes = torch.tensor([bool(d["more"]) for _, d in more])
        source = source.index_add(0, rows, torch.where(yes, F.logsigmoid(z), F.logsigmoid(-z)))
    dec = gate_dec + source
    return ActionScores(
        total=tok_sum + dec,
        tokens=tok_sum,
        decision=dec,
        gate_decision=gate_dec,
        gate_logit=gate_logit,
        token_logprobs=tok_lp,
        entropy=ent_sum,
        lengths=lengths,
        gate_hidden=h_last.float(),
        gate_inputs=feats,
        gate_person=torch.zeros(B, len(PERSON_INPUTS)) if people is None else people.float().cpu(),
    )


def batch_action_logprobs(
    model: GPT, tokenizer: CodeTokenizer, actions: Sequence[Action]
) -> torch.Tensor:
    """log pi(action) for each logged action, (B,), differentiable w.r.t. the model."""
    return score_actions(model, tokenizer, actions).total


def action_logprob(
    model: GPT,
    tokenizer: CodeTokenizer,
    context_token_ids: Sequence[int],
    token_ids: Sequence[int],
    shown: bool,
    temperature: float,
    top_p: float | None,
    heal_text: str,
    extend: dict[str, Any] | None = None,
) -> torch.Tensor:
    """log pi(action) of one logged action (a scalar tensor), by a fresh full forward pass;
    `extend`: its extend draw (None: none was drawn)."""
    act = Completion(
        text="",
        token_ids=list(token_ids),
        token_logprobs=[],
        context_token_ids=list(context_token_ids),
        heal_text=heal_text,
        temperature=temperature,
        top_p=top_p,
        gate_prob_show=0.0,
        shown=shown,
        decision_logprob=0.0,
        logprob_total=0.0,
        stop_reason="",
        extend=extend,
    )
    return batch_action_logprobs(model, tokenizer, [act])[0]
