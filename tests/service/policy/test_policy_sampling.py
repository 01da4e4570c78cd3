"""Sampling: the logged behaviour log-probs equal a fresh recomputation; stop and healing rules."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tabloop.core.person import PERSON_INPUTS, History, PersonContext, moment_of
from tabloop.core.policy.actions import Completion, constraint_steps, sampling_logprobs
from tabloop.core.policy.model import GPT, ExtendHead, KVCache, RaggedKVCache
from tabloop.core.policy.sampling import Prompt, complete, complete_batch
from tabloop.core.policy.scoring import action_logprob, batch_action_logprobs, score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.recall import Proposal


def _prompts(small_code: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = rng.choice(small_code)
        cut = rng.randint(0, len(text) - 1)
        out.append(text[:cut])
    return out


def _set_gate(model: GPT, bias: float) -> None:
    with torch.no_grad():
        model.gate.features.weight.zero_()
        model.gate.features.bias.fill_(bias)


SETTINGS = [(t, p) for t in (0.3, 0.7, 1.0, 1.6) for p in (None, 0.5, 0.9, 1.0)]


# +-1000: a fitted gate's logit can go past what math.exp takes (about 709)
@pytest.mark.parametrize(
    "gate_bias",
    [-1000.0, -30.0, 0.0, 30.0, 1000.0],
    ids=["abstain-far", "abstain", "mixed", "show", "show-far"],
)
def test_logged_logprob_equals_recomputed(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str], gate_bias: float
) -> None:
    _set_gate(tiny_model, gate_bias)
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(2)
    comps: list[Completion] = []
    for i, prefix in enumerate(_prompts(small_code, 64, seed=3)):
        temp, top_p = SETTINGS[i % len(SETTINGS)]
        comps.append(
            complete(tiny_model, tiny_tokenizer, prefix, "", rng.randint(1, 20), temp, top_p, gen)
        )
    with torch.no_grad():
        scores = score_actions(tiny_model, tiny_tokenizer, comps)
    logged = torch.tensor([c.logprob_total for c in comps])
    torch.testing.assert_close(scores.total, logged, atol=1e-4, rtol=0)
    per_token = torch.tensor([lp for c in comps for lp in c.token_logprobs])
    torch.testing.assert_close(scores.token_logprobs, per_token, atol=1e-4, rtol=0)
    decisions = torch.tensor([c.decision_logprob for c in comps])
    torch.testing.assert_close(scores.decision, decisions, atol=1e-5, rtol=0)
    shown = [c.shown for c in comps]
    if gate_bias > 0:
        assert all(s == bool(c.text) for s, c in zip(shown, comps, strict=True))
    elif gate_bias < 0:
        assert not any(shown)
    else:
        assert any(shown) and not all(shown)
    assert any(c.heal_text for c in comps)


def test_single_action_logprob_matches_batch(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    _set_gate(tiny_model, 0.0)
    gen = torch.Generator().manual_seed(5)
    comps = [
        complete(tiny_model, tiny_tokenizer, p, "", 12, 0.8, 0.9, gen)
        for p in _prompts(small_code, 6, seed=6)
    ]
    with torch.no_grad():
        batch = batch_action_logprobs(tiny_model, tiny_tokenizer, comps)
    for b, c in enumerate(comps):
        one = action_logprob(
            tiny_model,
            tiny_tokenizer,
            c.context_token_ids,
            c.token_ids,
            c.shown,
            c.temperature,
            c.top_p,
            c.heal_text,
            c.extend,
        )
        assert abs(one.item() - c.logprob_total) < 1e-4
        assert abs(one.item() - batch[b].item()) < 1e-4


def test_recomputed_logprob_is_differentiable(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    _set_gate(tiny_model, 0.0)
    gen = torch.Generator().manual_seed(7)
    comps = [
        complete(tiny_model, tiny_tokenizer, p, "", 10, 1.0, 0.95, gen)
        for p in _prompts(small_code, 8, seed=8)
    ]
    tiny_model.train()
    total = batch_action_logprobs(tiny_model, tiny_tokenizer, comps)
    total.sum().backward()
    assert tiny_model.wte.weight.grad is not None and tiny_model.wte.weight.grad.abs().sum() > 0
    assert tiny_model.gate.features.bias.grad is not None
    assert torch.isfinite(total).all()


def test_completion_is_the_rest_of_one_line(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    gen = torch.Generator().manual_seed(9)
    for prefix in _prompts(small_code, 40, seed=10):
        c = complete(tiny_model, tiny_tokenizer, prefix, "ignored suffix", 16, 1.0, None, gen)
        assert "\n" not in c.text
        assert 1 <= len(c.token_ids) <= 16
        assert len(c.context_token_ids) + len(c.token_ids) <= tiny_model.config.block_size
        generated = tiny_tokenizer.decode_bytes(c.token_ids)
        heal = c.heal_text.encode()
        assert generated.startswith(heal) or heal.startswith(generated)  # healing re-emitted first
        if c.stop_reason == "newline":
            assert b"\n" in generated[len(heal) :]
            assert (
                generated[len(heal) :].split(b"\n")[0].decode(errors="ignore").rstrip("\r")
                == c.text
            )
        if c.stop_reason == "length":
            assert len(c.token_ids) == 16
        assert c.shown_text == (c.text if c.shown else "")


def test_seeded_sampling_is_reproducible(tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    runs = [
        complete(
            tiny_model,
            tiny_tokenizer,
            "def f(x):\n    return ",
            "",
            20,
            1.0,
            0.9,
            torch.Generator().manual_seed(42),
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_greedy_is_deterministic_with_zero_logprob(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    a = complete(tiny_model, tiny_tokenizer, "import js", "", 8, 0.0, None, None)
    b = complete(tiny_model, tiny_tokenizer, "import js", "", 8, 0.0, None, None)
    assert a == b and a.logprob_total == 0.0
    with torch.no_grad():
        assert batch_action_logprobs(tiny_model, tiny_tokenizer, [a])[0].item() == 0.0


def test_empty_completion_is_never_shown(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    _set_gate(tiny_model, 30.0)  # p(show) ~ 1: only the empty-completion rule can abstain
    gen = torch.Generator().manual_seed(11)
    comps = [
        complete(tiny_model, tiny_tokenizer, p, "", 3, 2.0, None, gen)
        for p in _prompts(small_code, 40, seed=12)
    ]
    empty = [c for c in comps if not c.text]
    assert empty, "the seed should produce some immediate line ends"
    # no gate draw; the only decision drawn is the extend head's, where the stop came first
    assert all(not c.shown for c in empty)
    assert all(c.decision_logprob == 0.0 for c in empty if c.extend is None)
    assert all(c.shown for c in comps if c.text)
    with torch.no_grad():
        scores = score_actions(tiny_model, tiny_tokenizer, empty)
    assert (scores.gate_decision == 0).all()
    torch.testing.assert_close(scores.decision, torch.tensor([c.decision_logprob for c in empty]))


# --- sampling_logprobs, a pure function -------------------------------------------------
def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)
    lp = sampling_logprobs(logits, one, torch.tensor([0.8]))
    assert torch.isinf(lp[0, 2:]).all() and torch.isfinite(lp[0, :2]).all()
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    lp = sampling_logprobs(logits, one, torch.tensor([0.81]))
    assert torch.isfinite(lp[0, :3]).all() and torch.isinf(lp[0, 3])
    # the scored token is always kept
    lp = sampling_logprobs(logits, one, torch.tensor([0.5]), chosen=torch.tensor([3]))
    assert torch.isfinite(lp[0, 3]) and torch.isinf(lp[0, 1:3]).all()


def test_temperature_and_mask() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    lp = sampling_logprobs(logits, torch.tensor([2.0]), torch.ones(1))
    torch.testing.assert_close(lp, torch.log_softmax(logits / 2, -1))
    allowed = torch.tensor([[False, True, True]])
    lp = sampling_logprobs(logits, torch.ones(1), torch.ones(1), allowed)
    assert torch.isinf(lp[0, 0])
    torch.testing.assert_close(lp[0, 1:], torch.log_softmax(torch.tensor([1.0, 0.0]), -1))


def test_confidence_stop_keeps_the_part_the_model_is_sure_of(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """Same random stream with and without the stop: the stopped completion is the whole one up
    to (not including) its first unhealed token below the bar, and scores as it was logged
    (the extend head set never to go on past the stop)."""
    with torch.no_grad():
        tiny_model.gate.extend.bias.fill_(-30.0)
    prompts = _prompts(small_code, 40, seed=21) + [""]  # an empty prefix has nothing to heal

    def run(stop: float | None) -> list[Completion]:
        return [
            complete(
                tiny_model,
                tiny_tokenizer,
                p,
                "",
                12,
                1.0,
                None,
                torch.Generator().manual_seed(i),
                stop_logprob=stop,
            )
            for i, p in enumerate(prompts)
        ]

    whole = run(None)
    bar = sorted(lp for c in whole for lp in c.model_logprobs)[len(whole)]  # a low quantile
    stopped = run(bar)
    reasons = [c.stop_reason for c in stopped]
    assert 0 < reasons.count("confidence") < len(stopped), reasons
    for w, c in zip(whole, stopped, strict=True):
        n = len(c.token_ids)
        assert c.token_ids == w.token_ids[:n]
        free = [not r for r in constraint_steps(tiny_tokenizer, w.token_ids, c.heal_text.encode())]
        assert all(lp >= bar for lp, f in zip(c.model_logprobs, free, strict=False) if f)
        if c.stop_reason == "confidence":
            assert free[n] and w.model_logprobs[n] < bar
            assert w.text.startswith(c.text)
        else:
            assert c.token_ids == w.token_ids and c.stop_reason == w.stop_reason
    sure_of_nothing = run(0.0)  # every log-prob is below 0: only the healing steps are kept
    for c in sure_of_nothing:
        assert c.stop_reason == "confidence"
        assert all(constraint_steps(tiny_tokenizer, c.token_ids, c.heal_text.encode()))
    assert not sure_of_nothing[-1].token_ids, "with nothing healed, no token is kept"
    with torch.no_grad():  # actions with no token score too
        for comps in (stopped, sure_of_nothing):
            scores = score_actions(tiny_model, tiny_tokenizer, comps)
            logged = torch.tensor([c.logprob_total for c in comps])
            torch.testing.assert_close(scores.total, logged, atol=1e-4, rtol=0)


@pytest.mark.parametrize("stop_logprob", [None, -1.0], ids=["whole-line", "confidence-stop"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_batch_samples_what_each_request_samples_alone(
    tiny_model: GPT,
    tiny_tokenizer: CodeTokenizer,
    small_code: list[str],
    stop_logprob: float | None,
    temperature: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of different context lengths (short prefixes, and long ones cut to the budget) and
    budgets, decoded together, each from its own generator: the same tokens, decisions and
    log-probs as one request at a time, and the logged log-probs are the recomputed ones. Rows
    that finish leave the batch on the way (the cache keeps the others)."""
    _set_gate(tiny_model, 0.0)
    rng = random.Random(5)
    texts = _prompts(small_code, 24, seed=6)
    prompts = [
        Prompt(prefix, "", rng.randint(1, 24), torch.Generator().manual_seed(100 + i))
        for i, prefix in enumerate(texts)
    ]
    alone = [
        complete(
            tiny_model,
            tiny_tokenizer,
            p.prefix,
            p.suffix,
            p.max_new_tokens,
            temperature,
            0.9,
            torch.Generator().manual_seed(100 + i),
            stop_logprob=stop_logprob,
        )
        for i, p in enumerate(prompts)
    ]
    kept: list[int] = []  # the rows left each time finished rows leave the batch
    keep = RaggedKVCache.keep
    monkeypatch.setattr(
        RaggedKVCache, "keep", lambda self, rows: (kept.append(len(rows)), keep(self, rows))[1]
    )
    together = complete_batch(
        tiny_model, tiny_tokenizer, prompts, temperature, 0.9, stop_logprob=stop_logprob
    )
    assert kept and kept == sorted(kept, reverse=True) and kept[0] <= len(prompts) // 2
    assert len({len(c.context_token_ids) for c in together}) > 5  # ragged for real
    assert len({len(c.token_ids) for c in together}) > 3
    for a, b in zip(alone, together, strict=True):
        assert (b.token_ids, b.text, b.shown, b.stop_reason) == (
            a.token_ids,
            a.text,
            a.shown,
            a.stop_reason,
        )
        assert b.context_token_ids == a.context_token_ids
        torch.testing.assert_close(
            torch.tensor(b.token_logprobs), torch.tensor(a.token_logprobs), atol=1e-4, rtol=0
        )
        assert b.gate_prob_show == pytest.approx(a.gate_prob_show, abs=1e-4)
        assert b.logprob_total == pytest.approx(a.logprob_total, abs=1e-4)
    with torch.no_grad():
        scores = score_actions(tiny_model, tiny_tokenizer, together)
    torch.testing.assert_close(
        scores.total, torch.tensor([c.logprob_total for c in together]), atol=1e-4, rtol=0
    )


def _set_copy(model: GPT, bias: float, hidden_std: float = 0.0) -> None:
    with torch.no_grad():
        model.gate.copy.weight.zero_()
        model.gate.copy.bias.fill_(bias)
        model.gate.copy.hidden.normal_(0.0, hidden_std)


@pytest.mark.parametrize(
    ("copy_bias", "hidden_std"),
    [(-30.0, 0.0), (0.0, 0.0), (30.0, 0.0), (0.0, 1.0)],
    ids=["never", "mixed", "always", "by-context"],
)
def test_a_copy_proposal_is_part_of_the_action_and_its_logprob_is_recomputed(
    tiny_model: GPT,
    tiny_tokenizer: CodeTokenizer,
    small_code: list[str],
    copy_bias: float,
    hidden_std: float,
) -> None:
    """by-context: the copy head reads the hidden state too, so whether to copy depends on
    the context; the served decision's log-prob is recomputed exactly all the same."""
    _set_gate(tiny_model, 0.0)
    _set_copy(tiny_model, copy_bias, hidden_std)
    proposal = Proposal("open(path) as f:", "memory", 24, 2, 2)
    prompts = [
        Prompt(prefix, "", 12, torch.Generator().manual_seed(i), proposal if i % 4 else None)
        for i, prefix in enumerate(_prompts(small_code, 48, seed=5))
    ]
    comps = complete_batch(tiny_model, tiny_tokenizer, prompts, 0.9, 0.95)
    with torch.no_grad():
        scores = score_actions(tiny_model, tiny_tokenizer, comps)
    torch.testing.assert_close(scores.total, torch.tensor([c.logprob_total for c in comps]))
    torch.testing.assert_close(scores.decision, torch.tensor([c.decision_logprob for c in comps]))
    copied = [c.copied for c in comps]
    for c, p in zip(comps, prompts, strict=True):
        assert (c.recall is None) == (p.proposal is None)
        if c.copied:  # shown as proposed; the gate was not drawn
            assert (c.text, c.shown) == (proposal.text, True)
    gate_drawn = scores.gate_decision != 0
    assert not any(g and c for g, c in zip(gate_drawn.tolist(), copied, strict=True))
    if copy_bias > 0:
        assert copied == [p.proposal is not None for p in prompts]
    elif copy_bias < 0:
        assert not any(copied)
    else:
        assert any(copied) and not all(
            c for c, p in zip(copied, prompts, strict=True) if p.proposal
        )
    # each rollout alone samples what it sampled in the batch
    alone = complete(
        tiny_model,
        tiny_tokenizer,
        prompts[1].prefix,
        "",
        12,
        0.9,
        0.95,
        torch.Generator().manual_seed(1),
        proposal=proposal,
    )
    assert (alone.text, alone.copied) == (comps[1].text, comps[1].copied)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_prompt_pass_for_the_last_positions_only_is_the_full_pass_there(
    tiny_model: GPT, batch: int
) -> None:
    """`hidden(..., last=)` (the prefill of sampling) computes the final block at each row's
    last real position only: the same hidden states there as the full pass, the same cache."""
    cfg = tiny_model.config
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, 20))
    last = torch.tensor([19, 7, 12][:batch])
    cache_class = RaggedKVCache if batch > 1 else KVCache
    full_cache, cache = cache_class(cfg, batch, None, 24), cache_class(cfg, batch, None, 24)
    with torch.inference_mode():
        full = tiny_model.hidden(ids, full_cache)[torch.arange(batch), last]
        part = tiny_model.hidden(ids, cache, last=last)
    assert part.shape == (batch, 1, cfg.n_embd)
    torch.testing.assert_close(part[:, 0], full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.k, full_cache.k)
    torch.testing.assert_close(cache.v, full_cache.v)
    assert cache.pos == full_cache.pos == 20


def _histories() -> list[History]:
    """People the service knows more and less of: none, one who takes everything, one who takes
    only long suggestions, one who just rejected one."""
    return [
        History(),
        History(tuple((c, True) for c in (3, 12, 40, 80)), since_s=4.0),
        History(((3, False), (4, False), (30, True), (70, True)), since_s=60.0),
        History(((20, False),), since_s=0.5),
    ]


def test_the_person_is_part_of_the_decision_and_its_logprob_is_recomputed(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """Random weights on the person inputs of both heads: each served decision's log-prob is
    recomputed exactly from the logged inputs, with and without a proposal, and the same person
    weights make different people's p(show) differ."""
    _set_gate(tiny_model, 0.0)
    _set_copy(tiny_model, 0.0, 0.0)
    with torch.no_grad():
        tiny_model.gate.person.normal_(0.0, 1.0)
        tiny_model.gate.copy.person.normal_(0.0, 1.0)
    proposal = Proposal("open(path) as f:", "memory", 24, 2, 2)
    histories = _histories()
    prompts = []
    for i, prefix in enumerate(_prompts(small_code, 48, seed=7)):
        person = None if i % 5 == 0 else PersonContext(histories[i % 4], moment_of(prefix, ""))
        prompts.append(
            Prompt(
                prefix,
                "",
                12,
                torch.Generator().manual_seed(i),
                proposal if i % 3 else None,
                person,
            )
        )
    comps = complete_batch(tiny_model, tiny_tokenizer, prompts, 0.9, 0.95)
    with torch.no_grad():
        scores = score_actions(tiny_model, tiny_tokenizer, comps)
    torch.testing.assert_close(scores.total, torch.tensor([c.logprob_total for c in comps]))
    torch.testing.assert_close(scores.decision, torch.tensor([c.decision_logprob for c in comps]))
    for c, p in zip(comps, prompts, strict=True):
        assert (c.person is None) == (p.person is None)
        if c.person is not None:
            assert len(c.person["gate"]) == len(PERSON_INPUTS)
            assert (c.person["copy"] is None) == (p.proposal is None)
    # one prompt, four people: the gate reads who they are
    prefix = prompts[1].prefix
    shown = {
        complete(
            tiny_model,
            tiny_tokenizer,
            prefix,
            "",
            12,
            0.9,
            0.95,
            torch.Generator().manual_seed(1),
            person=PersonContext(h, moment_of(prefix, "")),
        ).gate_prob_show
        for h in histories
    }
    assert len(shown) == len(histories), shown
    with torch.no_grad():
        tiny_model.gate.person.zero_()
        tiny_model.gate.copy.person.zero_()


def test_a_person_known_as_nothing_decides_as_without_one(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """With the person weights at 0 (every checkpoint before the heads read the person), a
    request with a person samples and decides exactly what it does without one."""
    _set_gate(tiny_model, 0.0)
    proposal = Proposal("open(path) as f:", "memory", 24, 2, 2)
    for i, prefix in enumerate(_prompts(small_code, 8, seed=9)):
        history = _histories()[i % 4]

        def run(person: PersonContext | None, prefix: str = prefix, i: int = i) -> Completion:
            return complete(
                tiny_model,
                tiny_tokenizer,
                prefix,
                "",
                12,
                0.9,
                0.95,
                torch.Generator().manual_seed(i),
                proposal=proposal,
                person=person,
            )

        a, b = run(None), run(PersonContext(history, moment_of(prefix, "")))
        assert (a.text, a.shown, a.copied) == (b.text, b.shown, b.copied)
        assert a.logprob_total == pytest.approx(b.logprob_total, abs=1e-6)


def _randomise(head: ExtendHead) -> None:
    """A how-far head at even odds, with random weights on what it reads."""
    with torch.no_grad():
        head.bias.fill_(0.0)
        head.hidden.normal_(0.0, 0.5)
        head.person.normal_(0.0, 1.0)


def _people_prompts(
    small_code: list[str], seed: int, proposal: Callable[[int], Proposal | None]
) -> list[Prompt]:
    """48 prompts, two in three with a person (_histories), the i-th with proposal(i)."""
    histories = _histories()
    return [
        Prompt(
            prefix,
            "",
            16,
            torch.Generator().manual_seed(i),
            proposal(i),
            PersonContext(histories[i % 4], moment_of(prefix, "")) if i % 3 else None,
        )
        for i, prefix in enumerate(_prompts(small_code, 48, seed=seed))
    ]


def test_going_on_past_the_stop_is_a_drawn_decision_and_recomputes_exactly(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """At the first token the confidence stop would cut, the extend head draws: go on to the end
    of the line (the token is kept) or stop there. With random weights on its hidden-state and
    person inputs, every draw's log-prob is recomputed exactly from the logged rollout, and the
    rows that went on kept a token below the bar at the logged position."""
    _set_gate(tiny_model, 0.0)
    _randomise(tiny_model.gate.extend)
    prompts = _people_prompts(small_code, 23, lambda i: None)
    bar = -2.0
    comps = complete_batch(tiny_model, tiny_tokenizer, prompts, 1.0, 0.95, stop_logprob=bar)
    drawn = [c for c in comps if c.extend is not None]
    went_on = [c for c in drawn if c.extend["extended"]]  # type: ignore[index]
    assert went_on and len(went_on) < len(drawn), [c.extend for c in comps]
    for c in went_on:
        at = c.extend["at"]  # type: ignore[index]
        assert c.model_logprobs[at] < bar and c.stop_reason != "confidence"
    for c in drawn:
        if not c.extend["extended"]:  # type: ignore[index]
            assert c.stop_reason == "confidence" and len(c.token_ids) == c.extend["at"]  # type: ignore[index]
    with torch.no_grad():
        scores = score_actions(tiny_model, tiny_tokenizer, comps)
    torch.testing.assert_close(scores.total, torch.tensor([c.logprob_total for c in comps]))
    torch.testing.assert_close(scores.decision, torch.tensor([c.decision_logprob for c in comps]))
    # a row alone samples and decides what it did in the batch
    i = comps.index(went_on[0])
    alone = complete(
        tiny_model,
        tiny_tokenizer,
        prompts[i].prefix,
        "",
        16,
        1.0,
        0.95,
        torch.Generator().manual_seed(i),
        stop_logprob=bar,
        person=prompts[i].person,
    )
    assert (alone.token_ids, alone.extend) == (went_on[0].token_ids, went_on[0].extend)


def test_a_copys_next_lines_are_a_drawn_decision_and_recompute_exactly(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """A copied proposal with lines after its first: the lines head draws whether to show them
    too. With random weights on its hidden-state and person inputs, the rollouts that copy show
    either the first line or all of them, log the draw, and every log-prob is recomputed
    exactly; a proposal of one line, or one not copied, draws nothing."""
    _set_gate(tiny_model, 0.0)
    with torch.no_grad():
        tiny_model.gate.copy.bias.fill_(0.0)
    _randomise(tiny_model.gate.lines)
    prompts = _people_prompts(
        small_code,
        29,
        lambda i: Proposal("x = 1", "prefix", 20, 2, 2, "y = 2\nz = 3" if i % 2 else ""),
    )
    comps = complete_batch(tiny_model, tiny_tokenizer, prompts, 1.0, 0.95)
    copied = [(p, c) for p, c in zip(prompts, comps, strict=True) if c.copied]
    assert copied and len(copied) < len(comps)
    for p, c in zip(prompts, comps, strict=True):
        assert c.recall is not None
        lines = c.recall.get("lines")
        if not (c.copied and p.proposal and p.proposal.more):
            assert lines is None and "\n" not in c.text
            continue
        assert lines is not None and c.recall["more"] == p.proposal.more
        assert c.text == ("x = 1\ny = 2\nz = 3" if lines["more"] else "x = 1")
        assert (c.person is None) == (p.person is None)
        if c.person is not None:
            assert c.person["lines"] == p.person.inputs(p.proposal.longer)  # type: ignore[union-attr]
    drawn = [c.recall["lines"]["more"] for _, c in copied if c.recall and "lines" in c.recall]
    assert True in drawn and False in drawn, drawn
    with torch.no_grad():
        scores = score_actions(tiny_model, tiny_tokenizer, comps)
    torch.testing.assert_close(scores.total, torch.tensor([c.logprob_total for c in comps]))
    torch.testing.assert_close(scores.decision, torch.tensor([c.decision_logprob for c in comps]))
    # the draw moves with the head: pushed off, no copy shows more than its first line
    with torch.no_grad():
        tiny_model.gate.lines.bias.fill_(-30.0)
    again = complete_batch(tiny_model, tiny_tokenizer, prompts, 1.0, 0.95)
    assert not any("\n" in c.text for c in again)
