"""Sampling a completion (the RL action) and recomputing its log-probability.

The action is the pair (tokens, decision): the sampled tokens up to and including the one that
ends the line (or `<|eof|>`, or the max_new_tokens-th), and the gate's show/abstain decision,
drawn *after* the tokens. Its log-probability, under the distribution actually sampled from, is

    log pi(action) = sum_t log q_t(token_t) + log p(decision)

where q_t is the model's next-token distribution at temperature T, restricted to the tokens
consistent with the token-healing constraint (while it lasts), then truncated to the top-p
nucleus and renormalised; p(decision) is sigmoid(gate logit) for show, 1 - that for abstain.
Abstaining still samples the tokens (the gate needs them), so the logged action is the same pair.

Two decisions are deterministic and contribute log-prob 0: an empty completion is never shown,
and at temperature 0 tokens are argmax and the gate shows iff p(show) >= 1/2 (greedy evaluation
only; RL needs temperature > 0). The nucleus always keeps the token being scored, so a logged
token can never get -inf under an updated policy (identical for the sampling policy itself).

A request can come with a copy proposal (tabloop.core.recall: what followed the longest earlier
match of the text before the cursor, in the request or the workspace's memory). Then the action
has one more part, drawn after the tokens and before the gate: copy, with probability
sigmoid(copy logit) from the gate's copy head on the proposal's evidence and on how the sampled
completion agrees with it. A copy is shown as is (the gate is not drawn); otherwise the gate
decides on the sampled completion as without a proposal. So

    log pi(action) = sum_t log q_t(token_t) + log p(copy or not) + log p(decision | not copied)

and the decision's part of a rollout (`decision_logprob`) is the last two together. The rollout
logs the proposal's text and the copy head's inputs (`recall`), so rescoring it never searches
again.

The gate reads the completion's *model* log-probs (temperature 1, healing constraint applied, no
top-p) so its confidence features do not depend on the sampling temperature; they are inputs
(detached), the gradient of log p(decision) flows through the gate and the hidden state.

The context is `tabloop.core.policy.context.prepare_context`: the prefix alone, or for a checkpoint
trained for fill-in-the-middle the prefix and the following lines in PSM order; a Completion
logs its ids, and recomputation reads only those. See docs/MODEL.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.nn import functional as F

from tabloop.core.policy.context import MIN_PREFIX_TOKENS, context_overhead, prepare_context
from tabloop.core.policy.defaults import (
    DEFAULT_MAX_CONTEXT_TOKENS,
    DEFAULT_STOP_LOGPROB,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    STOP_LANGUAGE,
)
from tabloop.core.policy.device import compute, model_device
from tabloop.core.policy.model import GPT, KVCache, RaggedKVCache, gate_features
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.recall import Proposal, recall_inputs

NEG_INF = float("-inf")


@dataclass
class Completion:
    """One rollout: what the policy saw, sampled and decided, with behaviour log-probs."""

    text: str  # the sampled rest of the line (after the healed text); shown only if `shown`
    token_ids: list[int]  # sampled tokens, including the re-emitted healed text and the stop
    token_logprobs: list[float]  # log q_t(token_t) under the sampling distribution
    context_token_ids: list[int]  # what the model saw (tabloop.core.policy.context)
    heal_text: str  # prefix text backed off by token healing, re-emitted by token_ids first
    temperature: float  # sampling temperature used
    top_p: float | None  # nucleus used (None: no truncation)
    gate_prob_show: float  # p(show) from the gate
    shown: bool  # the decision
    decision_logprob: float  # log p(decision) (0 when it was deterministic)
    logprob_total: float  # sum(token_logprobs) + decision_logprob
    stop_reason: str  # "newline", "eof", "length", "confidence" or STOP_LANGUAGE
    model_logprobs: list[float] = field(default_factory=list)  # T=1 log-probs fed to the gate
    # the copy proposal, when there was one: {"text", "inputs" (the copy head's), "copied",
    # "logprob" (of copying or not)}; `text` above is the proposal's when copied
    recall: dict[str, Any] | None = None

    @property
    def shown_text(self) -> str:
        return self.text if self.shown else ""

    @property
    def copied(self) -> bool:
        return bool(self.recall and self.recall["copied"])


class Action(Protocol):
    """What batch_action_logprobs needs from a logged rollout (a Completion is one)."""

    @property
    def context_token_ids(self) -> Sequence[int]: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def heal_text(self) -> str: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def shown(self) -> bool: ...
    @property
    def recall(self) -> dict[str, Any] | None: ...


def was_copied(action: Action) -> bool:
    """The action showed its copy proposal (the gate was not drawn)."""
    return bool(action.recall and action.recall["copied"])


@dataclass
class ActionScores:
    """Differentiable log-probs of a batch of actions under the current model."""

    total: torch.Tensor  # (B,) log pi(action) = tokens + decision
    tokens: torch.Tensor  # (B,) sum of token log-probs under the sampling distribution
    decision: torch.Tensor  # (B,) log p(copy or not) + log p(gate's decision) (0: deterministic)
    gate_decision: torch.Tensor  # (B,) the gate's part (0 where it was not drawn)
    gate_logit: torch.Tensor  # (B,) logit p(show)
    token_logprobs: torch.Tensor  # (N,) every token's log-prob, rollouts concatenated
    entropy: torch.Tensor  # (B,) summed entropy of the sampling distributions over the steps
    lengths: list[int]  # tokens per rollout (to split token_logprobs)
    gate_hidden: torch.Tensor  # (B, C) the gate's hidden-state input
    gate_inputs: torch.Tensor  # (B, 4) the gate's confidence features (detached)


# --- pure helpers ------------------------------------------------------------------------
def sampling_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    allowed: torch.Tensor | None = None,
    chosen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs (N, V) of the distribution sampled from: logits/T, healing mask, top-p.

    temperature (N,) > 0; top_p (N,) in (0, 1] (1: no truncation); allowed (N, V) bool;
    chosen (N,): tokens always kept in the nucleus.
    """
    x = logits.float() / temperature.unsqueeze(-1)
    if allowed is not None:
        x = x.masked_fill(~allowed, NEG_INF)
    if bool((top_p < 1.0).any()):
        with torch.no_grad():
            probs = torch.softmax(x, dim=-1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
            drop_sorted = before >= top_p.unsqueeze(-1)
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            if chosen is not None:
                drop[torch.arange(len(chosen)), chosen] = False
        x = x.masked_fill(drop, NEG_INF)
    return F.log_softmax(x, dim=-1)


def sample_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    allowed: torch.Tensor | None,
    generator: torch.Generator | None,
    top_k_first: int = 64,
) -> tuple[int, float]:
    """Draw one token from the distribution `sampling_logprobs` describes; (token, log-prob).

    The nucleus is found in the top `top_k_first` probabilities when it fits there (the usual
    case) and by a full sort otherwise; the kept set is the same either way.
    """
    x = logits.float() / temperature
    if allowed is not None:
        x = x.masked_fill(~allowed, NEG_INF)
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        vals, idx = probs.topk(min(top_k_first, probs.numel()))
        cum = vals.cumsum(0)
        if float(cum[-1]) < top_p and vals.numel() < probs.numel():  # nucleus is wider
            vals, idx = probs.sort(descending=True)
            cum = vals.cumsum(0)
        n = int(((cum - vals) < top_p).sum())  # `before` is non-decreasing: keep the first n
        vals, idx, cum = vals[:n], idx[:n], cum[:n]
    else:
        idx = torch.arange(probs.numel(), device=probs.device)
        vals, cum = probs, probs.cumsum(0)
    u = torch.rand(1, generator=generator, device=probs.device) * cum[-1]
    j = min(int(torch.searchsorted(cum, u, right=True)), len(idx) - 1)
    tok = int(idx[j])
    return tok, float(x[tok] - torch.logsumexp(x[idx], dim=0))


def constraint_steps(
    tokenizer: CodeTokenizer, token_ids: Sequence[int], constraint: bytes
) -> list[bytes]:
    """For each step, the constraint bytes still to re-emit before it (b"" once consumed)."""
    out, done = [], b""
    for t in token_ids:
        out.append(constraint[len(done) :] if len(done) < len(constraint) else b"")
        done += tokenizer.token_bytes[t]
    return out


def completion_bytes(
    tokenizer: CodeTokenizer, token_ids: Sequence[int], constraint: bytes
) -> bytes:
    """The generated bytes after the healed text, up to (not including) the first newline."""
    out = tokenizer.decode_bytes(t for t in token_ids if t != tokenizer.eof_id)
    return out[len(constraint) :].split(b"\n", 1)[0]


def bytes_to_text(b: bytes) -> str:
    # a length stop can cut a multibyte character: drop the partial bytes; no trailing \r
    return b.decode("utf-8", errors="ignore").rstrip("\r")


# --- sampling ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One request of a batch: the text around the cursor, its budget and its random stream."""

    prefix: str
    suffix: str
    max_new_tokens: int
    generator: torch.Generator | None = None
    proposal: Proposal | None = None  # what to copy here (tabloop.core.recall.propose)


@dataclass
class _Row:
    """A request being decoded in `complete_batch`."""

    prompt: Prompt
    context_ids: list[int]
    constraint: bytes
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    model_lps: list[float] = field(default_factory=list)
    done: bytes = b""
    stop: str = "length"
    active: bool = True


def complete(
    model: GPT,
    tokenizer: CodeTokenizer,
    prefix: str,
    suffix: str,
    max_new_tokens: int,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float | None = DEFAULT_TOP_P,
    generator: torch.Generator | None = None,
    heal: bool = True,
    max_context_tokens: int | None = DEFAULT_MAX_CONTEXT_TOKENS,
    stop_logprob: float | None = DEFAULT_STOP_LOGPROB,
    proposal: Proposal | None = None,
) -> Completion:
    """Sample the rest of the current line after `prefix`, then copy `proposal` or not, then the
    show/abstain decision.

    `suffix` is the text after the cursor: a checkpoint trained for fill-in-the-middle (its
    tokenizer has the sentinels) reads the lines after the cursor's line, a left-to-right one
    ignores it (tabloop.core.policy.context). `heal=False` turns token healing off (for measuring
    what it buys; serving keeps it on); `max_context_tokens` caps the context tokens the model
    sees (a latency/quality knob; None: all that fit).
    `stop_logprob`: the confidence stop. Sampling ends before the first token past the healed
    text whose model log-prob (temperature 1, as the gate reads them) is below it; that token
    is dropped and stop_reason is "confidence". The completion can then be empty (an
    abstention). None (or -inf) samples to the end of the line.
    """
    return complete_batch(
        model,
        tokenizer,
        [Prompt(prefix, suffix, max_new_tokens, generator, proposal)],
        temperature,
        top_p,
        heal=heal,
        max_context_tokens=max_context_tokens,
        stop_logprob=stop_logprob,
    )[0]


def complete_batch(
    model: GPT,
    tokenizer: CodeTokenizer,
    prompts: Sequence[Prompt],
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float | None = DEFAULT_TOP_P,
    heal: bool = True,
    max_context_tokens: int | None = DEFAULT_MAX_CONTEXT_TOKENS,
    stop_logprob: float | None = DEFAULT_STOP_LOGPROB,
) -> list[Completion]:
    """`complete` for several requests at once: one forward pass for all the prompts, then one
    per decoding step for every row still sampling (tabloop.core.policy.model.RaggedKVCache). Each
    row draws from its own generator in the same order as alone, so a row samples what
    `complete` samples with that generator, up to float rounding; its logged log-probs are its
    own distribution's either way.

    On a GPU (the model placed there, tabloop.core.policy.device) the passes run in bf16 autocast;
    each step's logits come back to the CPU in float32, where every row draws from its own
    generator."""
    device = model_device(model)
    with torch.inference_mode(), compute(device):
        return _complete_batch(
            model, tokenizer, prompts, temperature, top_p, heal, max_context_tokens, stop_logprob
        )


def _complete_batch(
    model: GPT,
    tokenizer: CodeTokenizer,
    prompts: Sequence[Prompt],
    temperature: float,
    top_p: float | None,
    heal: bool,
    max_context_tokens: int | None,
    stop_logprob: float | None,
) -> list[Completion]:
    assert prompts, "an empty batch"
    assert temperature >= 0.0, "temperature must be >= 0"
    assert top_p is None or 0.0 < top_p <= 1.0, "top_p must be in (0, 1]"
    cfg = model.config
    room = cfg.block_size - MIN_PREFIX_TOKENS - context_overhead(tokenizer)
    rows: list[_Row] = []
    for p in prompts:
        assert p.max_new_tokens >= 1, "max_new_tokens must be >= 1"
        budget = min(p.max_new_tokens, room)
        healing = prepare_context(
            tokenizer, p.prefix, cfg.block_size, budget, heal, max_context_tokens, p.suffix
        )
        rows.append(_Row(p, list(healing.context_ids), healing.constraint, budget))

    B = len(rows)
    device = model_device(model)
    # the positions a row can fill: its context and its budget (less cache to zero and read)
    positions = min(cfg.block_size, max(len(r.context_ids) + r.max_new_tokens for r in rows))
    # one row: the plain cache (its decode step skips the ragged bookkeeping, ~7% of a request)
    cache = (
        RaggedKVCache(cfg, B, device, positions) if B > 1 else KVCache(cfg, 1, device, positions)
    )
    longest = max(len(r.context_ids) for r in rows)
    padded = [r.context_ids + [0] * (longest - len(r.context_ids)) for r in rows]  # right
    ids = torch.tensor(padded, dtype=torch.long, device=device)
    lengths = torch.tensor([len(r.context_ids) for r in rows], device=device)
    h = model.hidden(ids, cache)[torch.arange(B, device=device), lengths - 1]  # each row's last
    if isinstance(cache, RaggedKVCache):
        cache.lengths = lengths.clone()
    cpu = torch.device("cpu")
    live = list(range(B))  # the rows in the cache, in its order: h[i] is rows[live[i]]'s
    last: list[torch.Tensor | None] = [None] * B  # a finished row's last hidden state (the gate's)
    while True:
        done = [i for i, b in enumerate(live) if not rows[b].active]
        if isinstance(cache, RaggedKVCache) and done and 2 * len(done) >= len(live):
            # most rows in the batch have finished: drop them, so that the steps left compute
            # only the rows still sampling (each drop copies the cache, so not for every row)
            for i in done:
                last[live[i]] = h[i]
            keep = [i for i, b in enumerate(live) if rows[b].active]
            if not keep:
                live = []
                break
            at = torch.tensor(keep, device=device)
            cache.keep(at)
            h = h.index_select(0, at)
            live = [live[i] for i in keep]
        if not any(rows[b].active for b in live):
            break
        logits = model.logits(h).float().to(cpu)  # (W, V); a no-op on the CPU in float32
        step = torch.zeros((len(live), 1), dtype=torch.long, device=cpu)
        fed = torch.zeros(len(live), dtype=torch.bool, device=cpu)
        for i, b in enumerate(live):
            r = rows[b]
            if not r.active:
                continue
            remaining = r.constraint[len(r.done) :] if len(r.done) < len(r.constraint) else b""
            allowed = tokenizer.allowed_mask(remaining) if remaining else None
            if temperature == 0.0:
                masked = logits[i] if allowed is None else logits[i].masked_fill(~allowed, NEG_INF)
                tok, lp = int(masked.argmax(-1)), 0.0
            else:
                tok, lp = sample_token(
                    logits[i], temperature, top_p or 1.0, allowed, r.prompt.generator
                )
            raw = logits[i] if allowed is None else logits[i].masked_fill(~allowed, NEG_INF)
            model_lp = float(raw[tok] - torch.logsumexp(raw, dim=-1))
            if stop_logprob is not None and not remaining and model_lp < stop_logprob:
                r.stop, r.active = "confidence", False  # h stays at the last token kept
                continue
            r.model_lps.append(model_lp)
            r.tokens.append(tok)
            r.logprobs.append(lp)
            step[i, 0], fed[i] = tok, True
        if not bool(fed.any()):
            break
        fed_here = fed.to(device)
        if isinstance(cache, RaggedKVCache):
            cache.advance = fed_here
        h_new = model.hidden(step.to(device), cache)[:, -1]  # also the gate's input at the end
        h = torch.where(fed_here.unsqueeze(1), h_new, h)
        for i, b in enumerate(live):
            r = rows[b]
            if not fed[i]:
                continue
            tok = r.tokens[-1]
            if tok in tokenizer.special_ids:  # <|eof|> (or a FIM sentinel: nothing to say)
                r.stop, r.active = "eof", False
                continue
            r.done += tokenizer.token_bytes[tok]
            if len(r.done) > len(r.constraint) and b"\n" in r.done[len(r.constraint) :]:
                r.stop, r.active = "newline", False
            elif len(r.tokens) >= r.max_new_tokens:
                r.active = False
    for i, b in enumerate(live):
        last[b] = h[i]
    h = torch.stack([x for x in last if x is not None])
    assert len(h) == B, "every row's last hidden state"

    outs = [completion_bytes(tokenizer, r.tokens, r.constraint) for r in rows]
    feats = gate_features(
        torch.tensor([sum(r.model_lps) for r in rows]),
        torch.tensor([len(r.tokens) for r in rows]),
        torch.tensor([len(o) for o in outs]),
    )
    gate_logits = model.gate_logit(h, feats.to(device)).float().to(cpu)
    inputs = [
        None if r.prompt.proposal is None else recall_inputs(r.prompt.proposal, bytes_to_text(o))
        for r, o in zip(rows, outs, strict=True)
    ]
    with_proposal = [x for x in inputs if x is not None]
    copy_logits = iter(
        model.gate.copy(torch.tensor(with_proposal, device=device)).float().to(cpu)[:, 0].tolist()
        if with_proposal
        else []
    )
    return [
        _decide(r, out, float(g), temperature, top_p, x, None if x is None else next(copy_logits))
        for r, out, g, x in zip(rows, outs, gate_logits, inputs, strict=True)
    ]


def _draw(
    logit: float, temperature: float, generator: torch.Generator | None
) -> tuple[bool, float]:
    """A Bernoulli draw with p = sigmoid(logit) and its log-prob; at temperature 0, p >= 1/2."""
    if temperature == 0.0:
        return logit >= 0.0, 0.0
    yes = bool(torch.rand(1, generator=generator, device="cpu")[0] < 1.0 / (1.0 + math.exp(-logit)))
    return yes, float(F.logsigmoid(torch.tensor(logit if yes else -logit)))


def _decide(
    r: _Row,
    out: bytes,
    gate_logit: float,
    temperature: float,
    top_p: float | None,
    recall: list[float] | None = None,
    copy_logit: float | None = None,
) -> Completion:
    """The row's copy draw (when it has a proposal) and show/abstain draw (after its tokens,
    from its generator, in that order), and its Completion."""
    text = bytes_to_text(out)
    p_show = 1.0 / (1.0 + math.exp(-gate_logit))
    logged = None
    copied, dec_lp = False, 0.0
    proposal = r.prompt.proposal
    if proposal is not None and recall is not None and copy_logit is not None:
        copied, dec_lp = _draw(copy_logit, temperature, r.prompt.generator)
        logged = {"text": proposal.text, "inputs": recall, "copied": copied, "logprob": dec_lp}
        if copied:
            text = proposal.text
    if copied:
        shown = True  # a copy is shown as proposed: the gate is not drawn
    elif not text:
        shown = False
    else:
        shown, gate_lp = _draw(gate_logit, temperature, r.prompt.generator)
        dec_lp += gate_lp
    return Completion(
        text=text,
        token_ids=r.tokens,
        token_logprobs=r.logprobs,
        context_token_ids=r.context_ids,
        heal_text=r.constraint.decode("utf-8"),
        temperature=temperature,
        top_p=top_p,
        gate_prob_show=p_show,
        shown=shown,
        decision_logprob=dec_lp,
        logprob_total=sum(r.logprobs) + dec_lp,
        stop_reason=r.stop,
        model_logprobs=r.model_lps,
        recall=logged,
    )


def unsupported_language(temperature: float, top_p: float | None) -> Completion:
    """The rollout of a request in a language the policy was not trained on: nothing seen,
    nothing sampled, not shown. Its log-probs are those of a deterministic action (0), like an
    empty completion's; it is logged so its feedback joins, and never trained on."""
    return Completion(
        text="",
        token_ids=[],
        token_logprobs=[],
        context_token_ids=[],
        heal_text="",
        temperature=temperature,
        top_p=top_p,
        gate_prob_show=0.0,
        shown=False,
        decision_logprob=0.0,
        logprob_total=0.0,
        stop_reason=STOP_LANGUAGE,
    )


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
    gate_logit = model.gate_logit(h_last, feats).float()  # float32 under autocast too
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
        z = model.gate.copy(inputs.to(h_last.device)).float()[:, 0].cpu()
        lp = torch.where(copied[with_recall], F.logsigmoid(z), F.logsigmoid(-z))
        source = source.index_add(0, torch.tensor(with_recall), lp)
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
) -> torch.Tensor:
    """log pi(action) of one logged action (a scalar tensor), by a fresh full forward pass."""
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
    )
    return batch_action_logprobs(model, tokenizer, [act])[0]
