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
from typing import Any

import torch
from torch.nn import functional as F

from tabloop.core.person import PersonContext
from tabloop.core.policy.actions import (
    NEG_INF,
    Completion,
    bytes_to_text,
    completion_bytes,
    person_tensor,
    sample_token,
)
from tabloop.core.policy.context import MIN_PREFIX_TOKENS, context_overhead, prepare_context
from tabloop.core.policy.defaults import (
    DEFAULT_MAX_CONTEXT_TOKENS,
    DEFAULT_STOP_LOGPROB,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    STOP_LANGUAGE,
)
from tabloop.core.policy.device import compute, model_device
from tabloop.core.policy.model import GPT, RaggedKVCache, gate_features
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.recall import Proposal, recall_inputs


@dataclass(frozen=True)
class Prompt:
    """One request of a batch: the text around the cursor, its budget and its random stream."""

    prefix: str
    suffix: str
    max_new_tokens: int
    generator: torch.Generator | None = None
    proposal: Proposal | None = None  # what to copy here (tabloop.core.recall.propose)
    person: PersonContext | None = None  # the person and the moment (tabloop.core.person)


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
    # the extend draw, at the first token the confidence stop would cut: {"at": tokens kept
    # before it, "extended": True to go on to the end of the line, "logprob"}; None: not drawn
    extend: dict[str, Any] | None = None
    extend_lp: float = 0.0  # its log-prob
    extend_inputs: list[float] | None = None  # the person inputs it read


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
    person: PersonContext | None = None,
) -> Completion:
    """Sample the rest of the current line after `prefix`, then copy `proposal` or not, then the
    show/abstain decision (both reading `person`, the person and the moment, when given).

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
        [Prompt(prefix, suffix, max_new_tokens, generator, proposal, person)],
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
    # a backend that decodes one row per cache (tabloop.core.policy.hf) takes the rows in turn
    batches = [prompts] if model.ragged else [[p] for p in prompts]
    with torch.inference_mode(), compute(device):
        return [
            c
            for b in batches
            for c in _complete_batch(
                model, tokenizer, b, temperature, top_p, heal, max_context_tokens, stop_logprob
            )
        ]


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
    cache = model.new_cache(B, device, positions)
    longest = max(len(r.context_ids) for r in rows)
    padded = [r.context_ids + [0] * (longest - len(r.context_ids)) for r in rows]  # right
    ids = torch.tensor(padded, dtype=torch.long, device=device)
    lengths = torch.tensor([len(r.context_ids) for r in rows], device=device)
    h = model.hidden(ids, cache, last=lengths - 1)[:, 0]  # each row's last position
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
            if (
                stop_logprob is not None
                and r.extend is None
                and not remaining
                and model_lp < stop_logprob
                and not _extend(model, tokenizer, r, h[i], temperature)
            ):
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
    people = [_person_inputs(r.prompt, bytes_to_text(o)) for r, o in zip(rows, outs, strict=True)]
    gate_logits = (
        model.gate_logit(h, feats.to(device), person_tensor([g for g, _ in people], device))
        .float()
        .to(cpu)
    )
    inputs = [
        None if r.prompt.proposal is None else recall_inputs(r.prompt.proposal, bytes_to_text(o))
        for r, o in zip(rows, outs, strict=True)
    ]
    rows_with = [i for i, x in enumerate(inputs) if x is not None]
    copy_logits = iter(
        model.gate.copy(
            torch.tensor([inputs[i] for i in rows_with], device=device),
            h[rows_with],
            person_tensor([people[i][1] for i in rows_with], device),
        )
        .float()
        .to(cpu)[:, 0]
        .tolist()
        if rows_with
        else []
    )
    # how far to copy: the lines head on each proposal with lines after its first (drawn only
    # where it is copied), on the person with the longer text
    longer = [i for i, r in enumerate(rows) if r.prompt.proposal and r.prompt.proposal.more]
    lines: dict[int, tuple[float, list[float] | None]] = {}
    if longer:
        more_inputs = [_lines_inputs(rows[i].prompt) for i in longer]
        z = model.gate.lines(h[longer], person_tensor(more_inputs, device)).float().to(cpu)
        lines = dict(zip(longer, zip(z.tolist(), more_inputs, strict=True), strict=True))
    return [
        _decide(
            r,
            out,
            float(g),
            temperature,
            top_p,
            x,
            None if x is None else next(copy_logits),
            p,
            lines.get(i),
        )
        for i, (r, out, g, x, p) in enumerate(
            zip(rows, outs, gate_logits, inputs, people, strict=True)
        )
    ]


def _lines_inputs(prompt: Prompt) -> list[float] | None:
    """The lines head's person inputs: on the proposal with its lines (None: no person)."""
    assert prompt.proposal is not None
    return None if prompt.person is None else prompt.person.inputs(prompt.proposal.longer)


def _person_inputs(prompt: Prompt, text: str) -> tuple[list[float] | None, list[float] | None]:
    """The gate's and the copy head's person inputs for a row: on the sampled completion and on
    the proposal (None where the request has no person context, or no proposal)."""
    if prompt.person is None:
        return None, None
    copy = None if prompt.proposal is None else prompt.person.inputs(prompt.proposal.text)
    return prompt.person.inputs(text), copy


def _extend(
    model: GPT, tokenizer: CodeTokenizer, r: _Row, h: torch.Tensor, temperature: float
) -> bool:
    """At the first token the confidence stop would cut: go on to the end of the line (True) or
    stop (False). A drawn decision of the policy (the extend head on `h`, the hidden state at
    the last token kept, and on the person with the text kept so far), logged in `r.extend`;
    at temperature 0 the stop holds, as a rule."""
    if temperature == 0.0:
        return False
    kept = bytes_to_text(completion_bytes(tokenizer, r.tokens, r.constraint))
    x = None if r.prompt.person is None else r.prompt.person.inputs(kept)
    z = float(model.gate.extend(h[None], person_tensor([x], h.device))[0])
    go_on, r.extend_lp = _draw(z, temperature, r.prompt.generator)
    r.extend = {"at": len(r.tokens), "extended": go_on, "logprob": r.extend_lp}
    r.extend_inputs = x
    return go_on


def _sigmoid(x: float) -> float:
    """1 / (1 + e^-x) without overflow: a fitted gate's logit can be far past -709."""
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _draw(
    logit: float, temperature: float, generator: torch.Generator | None
) -> tuple[bool, float]:
    """A Bernoulli draw with p = sigmoid(logit) and its log-prob; at temperature 0, p >= 1/2."""
    if temperature == 0.0:
        return logit >= 0.0, 0.0
    yes = bool(torch.rand(1, generator=generator, device="cpu")[0] < _sigmoid(logit))
    return yes, float(F.logsigmoid(torch.tensor(logit if yes else -logit)))


def _decide(
    r: _Row,
    out: bytes,
    gate_logit: float,
    temperature: float,
    top_p: float | None,
    recall: list[float] | None = None,
    copy_logit: float | None = None,
    person: tuple[list[float] | None, list[float] | None] = (None, None),
    lines: tuple[float, list[float] | None] | None = None,
) -> Completion:
    """The row's copy draw (when it has a proposal), its lines draw (when it copies a proposal
    with lines after its first: `lines`, the lines head's logit and person inputs) and its
    show/abstain draw (when it does not copy), after its tokens, from its generator, in that
    order; and its Completion."""
    text = bytes_to_text(out)
    p_show = _sigmoid(gate_logit)
    logged = None
    copied, dec_lp = False, r.extend_lp
    proposal = r.prompt.proposal
    if proposal is not None and recall is not None and copy_logit is not None:
        copied, copy_lp = _draw(copy_logit, temperature, r.prompt.generator)
        dec_lp += copy_lp
        logged = {"text": proposal.text, "inputs": recall, "copied": copied, "logprob": copy_lp}
        if copied:
            text = proposal.text
        if copied and lines is not None:
            more, lines_lp = _draw(lines[0], temperature, r.prompt.generator)
            dec_lp += lines_lp
            logged["more"] = proposal.more
            logged["lines"] = {"more": more, "logprob": lines_lp}
            text = proposal.longer if more else text
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
        person=None
        if r.prompt.person is None
        else {
            "gate": person[0],
            "copy": person[1],
            "extend": r.extend_inputs,
            "lines": lines[1] if logged and "lines" in logged and lines else None,
            "history": r.prompt.person.history.to_dict(),
        },
        extend=r.extend,
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
