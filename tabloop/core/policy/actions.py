"""The action and its parts: a sampled `Completion`, what a logged rollout holds of it
(`Action`), the log-probabilities of each part (`ActionScores`), and the pure helpers that
sampling and recomputation share: the sampling distribution, one token's draw, the healing
constraint, the completion's bytes (tabloop/core/policy/sampling.py says how they fit)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.nn import functional as F

from tabloop.core.person import PERSON_INPUTS
from tabloop.core.policy.tokenizer import CodeTokenizer

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
    # the person and the moment as the decisions read them (tabloop.core.person), when the
    # request had them: {"gate": the gate's inputs, "copy": the copy head's (None without a
    # proposal), "history": what they were computed from}
    person: dict[str, Any] | None = None
    # how far it suggested: at the first token the confidence stop would cut, {"at": tokens
    # kept before it, "extended": True to go on to the end of the line, "logprob": the draw's};
    # None where the stop
    # never came (or there is none, or temperature 0: the stop holds as a rule)
    extend: dict[str, Any] | None = None

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


def person_inputs(action: Action, head: str) -> list[float] | None:
    """The logged person inputs of one head ("gate", "copy", "extend" or "lines"); None where
    none were read (an action logged without them: the heads read 0 there, as when serving it)."""
    person = getattr(action, "person", None)
    return None if not person else person.get(head)


def person_tensor(rows: Sequence[list[float] | None], device: torch.device) -> torch.Tensor | None:
    """(B, len(PERSON_INPUTS)) of person inputs, 0 for rows without any (what a head reads
    when nothing is known); None when no row has any."""
    if all(r is None for r in rows):
        return None
    zero = [0.0] * len(PERSON_INPUTS)
    return torch.tensor([zero if r is None else r for r in rows], device=device)


def extend_drawn(action: Action) -> dict[str, Any] | None:
    """The action's extend draw ({"at", "extended"}), None where none was drawn."""
    extend: dict[str, Any] | None = getattr(action, "extend", None)
    return extend


def lines_drawn(action: Action) -> dict[str, Any] | None:
    """The action's lines draw ({"more", "logprob"}: after a copy with lines after its first),
    None where none was drawn."""
    return None if not action.recall else action.recall.get("lines")


def was_copied(action: Action) -> bool:
    """The action showed its copy proposal (the gate was not drawn)."""
    return bool(action.recall and action.recall["copied"])


@dataclass
class ActionScores:
    """Differentiable log-probs of a batch of actions under the current model."""

    total: torch.Tensor  # (B,) log pi(action) = tokens + decision
    tokens: torch.Tensor  # (B,) sum of token log-probs under the sampling distribution
    # (B,) log p(extend or not) + log p(copy or not) + log p(more lines or not)
    # + log p(gate's decision) (0: deterministic)
    decision: torch.Tensor
    gate_decision: torch.Tensor  # (B,) the gate's part (0 where it was not drawn)
    gate_logit: torch.Tensor  # (B,) logit p(show)
    token_logprobs: torch.Tensor  # (N,) every token's log-prob, rollouts concatenated
    entropy: torch.Tensor  # (B,) summed entropy of the sampling distributions over the steps
    lengths: list[int]  # tokens per rollout (to split token_logprobs)
    gate_hidden: torch.Tensor  # (B, C) the gate's hidden-state input
    gate_inputs: torch.Tensor  # (B, 4) the gate's confidence features (detached)
    gate_person: torch.Tensor  # (B, len(PERSON_INPUTS)) the gate's person inputs (0: none)


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
