"""The policy-gradient update: pure helpers by table, then the loss and update() on a tiny model,
then a synthetic learning run: the gate learns to abstain where shown suggestions are
rejected and to show where they are accepted, from rollouts the model samples itself."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from tabloop.core.person import SHORT_CHARS, History, PersonContext, moment_of
from tabloop.core.policy.actions import Completion
from tabloop.core.policy.model import GPT
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.recall import Proposal
from trainer.settled import settled_nll, settled_targets
from trainer.update import (
    Batch,
    UpdateConfig,
    UpdateInputs,
    advantages,
    bernoulli_entropy,
    carry_state,
    clipped_surrogate,
    kl_to_reference,
    make_optimizer,
    pg_loss,
    update,
)

torch.set_num_threads(1)

PROMPTS = [
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    ret",
    "# parse the header\nfor line in lines:\n    if line.startswith('#'):\n        ",
]


def _set_gate(model: GPT, bias: float) -> None:
    """p(show) = sigmoid(bias) whatever the completion (the hidden-state weights start at 0)."""
    with torch.no_grad():
        model.gate.features.weight.zero_()
        model.gate.features.bias.fill_(bias)


def _rollouts(
    model: GPT, tokenizer: CodeTokenizer, prompts: list[str], per_prompt: int, seed: int = 0
) -> list[Completion]:
    gen = torch.Generator().manual_seed(seed)
    return [
        complete(
            model,
            tokenizer,
            p,
            "",
            6,
            temperature=0.8,
            top_p=0.95,
            generator=gen,
            stop_logprob=None,
        )  # an untrained model is sure of nothing: whole completions
        for p in prompts
        for _ in range(per_prompt)
    ]


def _batch(comps: list[Completion], rewards: list[float]) -> Batch:
    """Per-part behaviour log-probs, as the trainer builds its batches."""
    return Batch.of(comps, rewards)


def _grads(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _params(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _relogged(model: GPT, tokenizer: CodeTokenizer, comp: Completion) -> Completion:
    """The completion as if the current model had served it (its log-probs recomputed)."""
    with torch.no_grad():
        s = score_actions(model, tokenizer, [comp])
    return dataclasses.replace(
        comp, decision_logprob=s.decision.item(), logprob_total=s.total.item()
    )


def _shown_completion(model: GPT, tokenizer: CodeTokenizer, shown: bool) -> Completion:
    """A fixed non-empty completion with the requested decision, logged at p(show) = 1/2."""
    _set_gate(model, 30.0 if shown else -30.0)
    comp = _rollouts(model, tokenizer, PROMPTS[:1], 1, seed=3)[0]
    assert comp.text and comp.shown == shown
    _set_gate(model, 0.0)
    return _relogged(model, tokenizer, comp)


# --- advantages --------------------------------------------------------------------------
S14 = math.sqrt(14 / 3)  # std of [-2, -1, 0, 3]


@pytest.mark.parametrize(
    ("rewards", "baseline", "normalize", "expected"),
    [
        pytest.param([0.75], "mean", False, [0.0], id="one-sample-mean"),
        pytest.param([0.75], "loo", True, [0.0], id="one-sample-loo"),
        pytest.param([0.5, 0.5, 0.5], "mean", False, [0.0] * 3, id="all-equal-mean"),
        pytest.param([0.5, 0.5, 0.5], "loo", True, [0.0] * 3, id="all-equal-loo-normalized"),
        pytest.param([0.0, 1.0], "mean", False, [-0.5, 0.5], id="two-mean"),
        pytest.param([0.0, 1.0], "loo", False, [-1.0, 1.0], id="two-loo"),
        pytest.param([1.0, 2.0, 3.0, 6.0], "mean", False, [-2.0, -1.0, 0.0, 3.0], id="mean"),
        pytest.param(
            [1.0, 2.0, 3.0, 6.0], "loo", False, [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0], id="loo"
        ),
        pytest.param(
            [1.0, 2.0, 3.0, 6.0], "mean", True, [-2 / S14, -1 / S14, 0.0, 3 / S14], id="mean-norm"
        ),
        # loo = mean * B/(B-1): normalizing removes the factor
        pytest.param(
            [1.0, 2.0, 3.0, 6.0], "loo", True, [-2 / S14, -1 / S14, 0.0, 3 / S14], id="loo-norm"
        ),
        pytest.param(
            [-0.25, 0.0, 0.0, 0.75],
            "loo",
            False,
            [-0.5, -1 / 6, -1 / 6, 5 / 6],
            id="reject-abstain-accept",
        ),
    ],
)
def test_advantages(
    rewards: list[float], baseline: str, normalize: bool, expected: list[float]
) -> None:
    got = advantages(torch.tensor(rewards), baseline, normalize)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_advantages_empty_batch_raises() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        advantages(torch.tensor([]), "loo", False)


def test_loo_is_reward_minus_mean_of_the_others() -> None:
    r = torch.randn(9, generator=torch.Generator().manual_seed(0))
    others = torch.stack([torch.cat([r[:i], r[i + 1 :]]).mean() for i in range(len(r))])
    torch.testing.assert_close(advantages(r, "loo", False), r - others)


# --- surrogate, KL, entropy --------------------------------------------------------------
@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad"),
    [
        pytest.param(1.0, 1.0, -1.0, -1.0, id="on-policy"),
        pytest.param(1.1, 1.0, -1.1, -1.1, id="inside-clip"),
        pytest.param(1.5, 1.0, -1.2, 0.0, id="above-clip-positive-adv-clipped"),
        pytest.param(1.5, -1.0, 1.5, 1.5, id="above-clip-negative-adv-not-clipped"),
        pytest.param(0.5, -1.0, 0.8, 0.0, id="below-clip-negative-adv-clipped"),
        pytest.param(0.5, 1.0, -0.5, -0.5, id="below-clip-positive-adv-not-clipped"),
        pytest.param(3.0, 0.0, 0.0, 0.0, id="zero-adv"),
    ],
)
def test_clipped_surrogate(ratio: float, adv: float, loss: float, grad: float) -> None:
    # grad: d loss / d logp_new (loss = -ratio * adv unless clipped)
    logp_new = torch.tensor([math.log(ratio)], requires_grad=True)
    value = clipped_surrogate(logp_new, torch.tensor([0.0]), torch.tensor([adv]), 0.2)
    value.backward()
    assert value.item() == pytest.approx(loss, abs=1e-6)
    assert logp_new.grad is not None
    assert logp_new.grad.item() == pytest.approx(grad, abs=1e-6)


@pytest.mark.parametrize(
    ("logp_new", "logp_ref", "expected"),
    [
        pytest.param([-3.0, -1.0], [-3.0, -1.0], 0.0, id="same-policy"),
        pytest.param([-2.0], [-1.0], math.e - 2, id="ref-likelier"),
        pytest.param([-1.0], [-2.0], math.exp(-1), id="ref-less-likely"),
        pytest.param([-1.0, -1.0], [-2.0, -1.0], math.exp(-1) / 2, id="mean-over-batch"),
        pytest.param([-100.0], [-1.0], math.exp(10) - 11, id="clamped-log-ratio"),
    ],
)
def test_kl_to_reference(logp_new: list[float], logp_ref: list[float], expected: float) -> None:
    got = kl_to_reference(torch.tensor(logp_new), torch.tensor(logp_ref))
    assert got.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert got.item() >= 0.0


@pytest.mark.parametrize(
    ("logit", "expected"),
    [
        (0.0, math.log(2)),
        (200.0, 0.0),
        (-200.0, 0.0),
        (math.log(3), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))),
    ],
    ids=["even", "sure-show", "sure-abstain", "p=0.75"],
)
def test_bernoulli_entropy(logit: float, expected: float) -> None:
    assert bernoulli_entropy(torch.tensor(logit)).item() == pytest.approx(expected, abs=1e-6)


# --- the loss on a tiny model ------------------------------------------------------------
def test_unchanged_model_recomputes_logged_logprobs(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """The importance ratio against the serving policy's own log-probs is 1; KL to itself 0."""
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 4)
    assert any(c.shown for c in comps) and not all(c.shown for c in comps)
    assert any(c.heal_text for c in comps)
    batch = _batch(comps, [float(c.shown) for c in comps])
    ref = copy.deepcopy(tiny_model)
    _, m = pg_loss(tiny_model, ref, tiny_tokenizer, batch, UpdateConfig())
    assert m["charts/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["charts/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert m["charts/clipfrac"] == 0.0
    assert abs(m["charts/approx_kl"]) < 1e-6
    assert m["losses/kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["charts/p_show"] == pytest.approx(0.5, abs=1e-6)
    assert m["losses/entropy"] > math.log(2)  # tokens at T=0.8 plus the even decision


@pytest.mark.parametrize("shown", [True, False], ids=["shown", "abstained"])
@pytest.mark.parametrize("adv", [1.0, -1.0], ids=["positive-adv", "negative-adv"])
def test_advantage_sign_moves_the_action_logprob(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, shown: bool, adv: float
) -> None:
    comp = _shown_completion(tiny_model, tiny_tokenizer, shown)
    batch = _batch([comp], [0.0])
    before = score_actions(tiny_model, tiny_tokenizer, [comp])
    cfg = UpdateConfig(kl_coef=0.0, entropy_coef=0.0)
    loss, _ = pg_loss(tiny_model, tiny_model, tiny_tokenizer, batch, cfg, adv=torch.tensor([adv]))
    opt = torch.optim.SGD(tiny_model.parameters(), lr=1e-2)
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = score_actions(tiny_model, tiny_tokenizer, [comp])
    for part in ("total", "tokens", "decision"):
        moved = (getattr(after, part) - getattr(before, part)).item()
        assert moved * adv > 0, f"{part} log-prob moved by {moved} for advantage {adv}"


@pytest.mark.parametrize("gate_only", [False, True], ids=["full", "gate-only"])
@pytest.mark.parametrize(
    ("show_reward", "direction"), [(0.75, 1.0), (-0.25, -1.0)], ids=["accepted", "rejected"]
)
def test_update_moves_the_gate_toward_the_better_decision(
    tiny_model: GPT,
    tiny_tokenizer: CodeTokenizer,
    gate_only: bool,
    show_reward: float,
    direction: float,
) -> None:
    """The same completion shown and abstained: the LOO advantages (+a, -a) cancel on the
    tokens, so only the decision moves, toward whichever earned more."""
    shown = _shown_completion(tiny_model, tiny_tokenizer, True)
    abstained = _relogged(tiny_model, tiny_tokenizer, dataclasses.replace(shown, shown=False))
    batch = _batch([shown, abstained], [show_reward, 0.0])
    p_before = torch.sigmoid(score_actions(tiny_model, tiny_tokenizer, [shown]).gate_logit)
    cfg = UpdateConfig(learning_rate=1e-2, kl_coef=0.0, train_gate_only=gate_only)
    update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            batch,
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    with torch.no_grad():
        p_after = torch.sigmoid(score_actions(tiny_model, tiny_tokenizer, [shown]).gate_logit)
    assert (p_after - p_before).item() * direction > 0.01


@pytest.mark.parametrize(
    ("baseline", "normalize"),
    [("loo", False), ("loo", True), ("mean", False), ("mean", True)],
)
def test_zero_variance_batch_changes_nothing(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, baseline: str, normalize: bool
) -> None:
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    batch = _batch(comps, [0.5] * len(comps))
    before = _params(tiny_model)
    cfg = UpdateConfig(
        learning_rate=1e-2,
        kl_coef=0.0,
        entropy_coef=0.0,
        baseline=baseline,  # type: ignore[arg-type]
        normalize_advantages=normalize,
        epochs=2,
        minibatch_size=3,
    )
    m = update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            batch,
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    assert m["charts/grad_norm"] == 0.0
    after = _params(tiny_model)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(
    ("kl_coef", "entropy_coef"), [(0.05, 0.0), (0.0, 0.01)], ids=["kl", "entropy"]
)
def test_zero_variance_batch_still_feels_the_regularisers(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, kl_coef: float, entropy_coef: float
) -> None:
    """Contrast to the test above: the no-op there is the advantage, not a dead update."""
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    ref = copy.deepcopy(tiny_model)
    with torch.no_grad():
        ref.gate.features.bias.fill_(2.0)  # a different reference, so the KL pulls
    before = _params(tiny_model)
    cfg = UpdateConfig(learning_rate=1e-3, kl_coef=kl_coef, entropy_coef=entropy_coef)
    update(
        UpdateInputs(
            tiny_model,
            ref,
            tiny_tokenizer,
            _batch(comps, [0.5] * len(comps)),
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    after = _params(tiny_model)
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(
    ("ratio", "adv", "clipped"),
    [
        pytest.param(2.0, 1.0, True, id="ratio-2-positive-adv"),
        pytest.param(2.0, -1.0, False, id="ratio-2-negative-adv"),
        pytest.param(0.5, -1.0, True, id="ratio-half-negative-adv"),
        pytest.param(0.5, 1.0, False, id="ratio-half-positive-adv"),
        pytest.param(1.1, 1.0, False, id="ratio-inside-positive-adv"),
        pytest.param(1.1, -1.0, False, id="ratio-inside-negative-adv"),
    ],
)
def test_clipping_engages_where_it_should(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, ratio: float, adv: float, clipped: bool
) -> None:
    """Stale rollouts: the logged behaviour log-prob is shifted so pi/mu = ratio exactly."""
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    batch = Batch(
        actions=comps,
        behaviour_logp=torch.tensor([c.logprob_total - math.log(ratio) for c in comps]),
        rewards=torch.zeros(len(comps)),
    )
    cfg = UpdateConfig(kl_coef=0.0, entropy_coef=0.0, clip_eps=0.2)
    loss, m = pg_loss(
        tiny_model, tiny_model, tiny_tokenizer, batch, cfg, adv=torch.full((len(comps),), adv)
    )
    loss.backward()
    grad_sq = sum(float((p.grad**2).sum()) for p in tiny_model.parameters() if p.grad is not None)
    assert m["charts/ratio_mean"] == pytest.approx(ratio, rel=1e-3)
    assert m["charts/clipfrac"] == (1.0 if abs(ratio - 1) > 0.2 else 0.0)
    assert (grad_sq == 0.0) == clipped, f"squared gradient norm {grad_sq}"


def test_per_part_and_whole_action_ratios_give_the_same_gradient_when_nothing_is_clipped(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    adv = torch.linspace(-1.0, 1.0, len(comps))
    cfg = UpdateConfig(kl_coef=0.0, entropy_coef=0.0)
    grads = []
    for batch in (
        _batch(comps, [0.0] * len(comps)),
        Batch(comps, torch.tensor([c.logprob_total for c in comps]), torch.zeros(len(comps))),
    ):
        tiny_model.zero_grad(set_to_none=True)
        loss, m = pg_loss(tiny_model, tiny_model, tiny_tokenizer, batch, cfg, adv=adv)
        loss.backward()
        assert m["charts/clipfrac"] == 0.0
        grads.append(_grads(tiny_model))
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("per_part", [True, False], ids=["per-part", "whole-action"])
def test_token_drift_silences_the_decision_only_with_a_whole_action_ratio(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, per_part: bool
) -> None:
    """The serving policy's tokens were half as likely as they are now (the language model
    drifted); its decisions as likely. A positive advantage: every token ratio (2) is past the
    clip. Per part, the decision still learns; with one ratio for the action nothing does."""
    _set_gate(tiny_model, 0.0)
    comps = [c for c in _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2) if c.text]
    drifted = [[lp - math.log(2.0) for lp in c.token_logprobs] for c in comps]
    batch = Batch(
        actions=comps,
        behaviour_logp=torch.tensor(
            [sum(d) + c.decision_logprob for d, c in zip(drifted, comps, strict=True)]
        ),
        rewards=torch.zeros(len(comps)),
        behaviour_token_logp=drifted if per_part else None,
        behaviour_decision_logp=(
            torch.tensor([c.decision_logprob for c in comps]) if per_part else None
        ),
    )
    cfg = UpdateConfig(kl_coef=0.0, entropy_coef=0.0, clip_eps=0.2)
    loss, m = pg_loss(
        tiny_model, tiny_model, tiny_tokenizer, batch, cfg, adv=torch.ones(len(comps))
    )
    loss.backward()
    gate = {n: g for n, g in _grads(tiny_model).items() if n.startswith("gate.")}
    gate_moves = any(float(g.abs().sum()) > 0 for g in gate.values())
    assert gate_moves == per_part
    assert 0.0 < m["charts/clipfrac"] < 1.0 if per_part else m["charts/clipfrac"] == 1.0


@pytest.mark.parametrize(
    ("ref_differs", "positive"), [(False, False), (True, True)], ids=["model-is-ref", "ref-differs"]
)
def test_kl_term(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, ref_differs: bool, positive: bool
) -> None:
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    ref = copy.deepcopy(tiny_model)
    if ref_differs:
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.05 * torch.randn_like(p))
    cfg = UpdateConfig(kl_coef=1.0, entropy_coef=0.0)
    loss, m = pg_loss(tiny_model, ref, tiny_tokenizer, _batch(comps, [0.0] * len(comps)), cfg)
    loss.backward()  # all advantages 0: the loss is the KL alone
    grad_sq = sum(float((p.grad**2).sum()) for p in tiny_model.parameters() if p.grad is not None)
    assert loss.item() == pytest.approx(m["losses/kl"], abs=1e-7)
    assert (m["losses/kl"] > 1e-3) == positive
    assert (grad_sq > 0.0) == positive
    assert m["losses/kl"] >= 0.0
    assert all(p.grad is None for p in ref.parameters())


def test_update_minibatches_and_leaves_the_models_as_it_found_them(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    ref = copy.deepcopy(tiny_model)
    ref_before = _params(ref)
    tiny_model.train()
    cfg = UpdateConfig(learning_rate=1e-3, epochs=2, minibatch_size=3, entropy_coef=0.01)
    rewards = [0.75 if c.shown else 0.0 for c in comps]
    m = update(
        UpdateInputs(
            tiny_model,
            ref,
            tiny_tokenizer,
            _batch(comps, rewards),
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    assert {
        "losses/total",
        "losses/policy",
        "losses/kl",
        "losses/entropy",
        "charts/clipfrac",
        "charts/approx_kl",
        "charts/ratio_mean",
        "charts/adv_mean",
        "charts/grad_norm",
    } <= set(m)
    assert all(math.isfinite(v) for v in m.values())
    assert m["charts/grad_norm"] > 0.0
    assert tiny_model.training and not ref.training  # modes restored
    assert all(p.requires_grad for p in tiny_model.parameters())
    assert all(torch.equal(ref_before[n], p) for n, p in ref.named_parameters())
    assert all(p.grad is None for p in ref.parameters())


def test_train_gate_only_leaves_the_language_model_alone(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    rewards = [0.75 if c.shown else 0.0 for c in comps]
    before = _params(tiny_model)
    cfg = UpdateConfig(learning_rate=1e-2, train_gate_only=True)
    # an optimizer over every parameter (as the caller may build): the LM still must not move
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2, weight_decay=0.0)
    update(
        UpdateInputs(
            tiny_model, copy.deepcopy(tiny_model), tiny_tokenizer, _batch(comps, rewards), opt, cfg
        )
    )
    after = _params(tiny_model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(n.startswith("gate.") for n in changed), changed
    assert all(p.requires_grad for p in tiny_model.parameters())


def test_make_optimizer_gives_the_gate_its_own_learning_rate(tiny_model: GPT) -> None:
    cfg = UpdateConfig(learning_rate=1e-4, gate_lr_mult=100.0, gate_hidden_lr_mult=10.0)
    lm, hidden, threshold = make_optimizer(tiny_model, cfg).param_groups
    assert [g["lr"] for g in (lm, hidden, threshold)] == pytest.approx([1e-4, 1e-3, 1e-2])
    g = tiny_model.gate
    # the projections of the hidden state (192 inputs each): the gate's, the copy head's, the
    # extend and lines heads'
    assert [id(p) for p in hidden["params"]] == [
        id(g.hidden.weight),
        id(g.copy.hidden),
        id(g.extend.hidden),
        id(g.lines.hidden),
    ]
    # the confidence weights, the copy head and both heads' person weights: logistic heads whose
    # thresholds move by whole units
    heads = (
        g.features.weight,
        g.features.bias,
        g.copy.weight,
        g.copy.bias,
        g.person,
        g.copy.person,
        g.extend.bias,
        g.extend.person,
        g.lines.bias,
        g.lines.person,
    )
    assert {id(p) for p in threshold["params"]} == {id(p) for p in heads}
    gate_ids = {id(p) for p in g.parameters()}
    assert not gate_ids & {id(p) for p in lm["params"]}
    n = sum(1 for _ in tiny_model.parameters())
    assert len(lm["params"]) + 14 == n
    gate_cfg = dataclasses.replace(cfg, train_gate_only=True)
    groups = make_optimizer(tiny_model, gate_cfg).param_groups
    assert len(groups) == 2 and {id(p) for gr in groups for p in gr["params"]} == gate_ids


def test_carry_state_continues_adam_on_a_copy(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """The next candidate (a fresh copy) continues Adam's moments and step count, with its
    own learning rates; no state (first update) or another layout starts fresh."""
    _set_gate(tiny_model, 0.0)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    batch = _batch(comps, [0.75 if c.shown else -0.25 for c in comps])
    cfg = UpdateConfig(learning_rate=1e-3)
    first = make_optimizer(tiny_model, cfg)
    update(UpdateInputs(tiny_model, copy.deepcopy(tiny_model), tiny_tokenizer, batch, first, cfg))
    state = copy.deepcopy(first.state_dict())

    nxt = copy.deepcopy(tiny_model)
    slower = dataclasses.replace(cfg, learning_rate=1e-5)
    second = make_optimizer(nxt, slower)
    carry_state(second, state)
    assert [g["lr"] for g in second.param_groups] == pytest.approx([1e-5, 1e-4, 1e-3])
    p = dict(nxt.named_parameters())["h.0.ln_1.weight"]  # the embeddings stay as they are
    moved = second.state[p]
    assert float(moved["step"]) == 1.0
    was = first.state[dict(tiny_model.named_parameters())["h.0.ln_1.weight"]]
    assert torch.equal(moved["exp_avg"], was["exp_avg"])
    update(UpdateInputs(nxt, copy.deepcopy(tiny_model), tiny_tokenizer, batch, second, slower))
    assert float(second.state[p]["step"]) == 2.0

    fresh = make_optimizer(nxt, cfg)
    carry_state(fresh, None)
    assert not fresh.state
    gate_only = make_optimizer(nxt, dataclasses.replace(cfg, train_gate_only=True))
    carry_state(gate_only, state)  # 2 groups against 3: not loaded
    assert not gate_only.state


# --- synthetic learning ------------------------------------------------------------------------
# Family A: comment lines, where users reject every suggestion. Family B: code, where they
# accept it. Rewards follow RewardSpec(reject_penalty=0.25, chars_exponent=0.5), not today's
# defaults: reject -0.25, accept 0.75 * (min(chars, 60) / 20) ** 0.5, abstain 0.
FAMILY_A = [
    f"# note {i}: this comment explains the plan\n# and continues here, in prose\n# "
    for i in range(4)
]
FAMILY_B = [f"def f{i}(x, y):\n    z = x + y * {i}\n    return " for i in range(4)]


def _reward(comp: Completion, family: str) -> float:
    if not comp.shown:
        return 0.0
    if family == "A":
        return -0.25
    return 0.75 * (min(len(comp.text), 60) / 20) ** 0.5


def test_synthetic_learning_gate_follows_the_reward(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """On-policy loop: sample from the current model, reward, update(); p(show) on A must fall
    below 0.2 and on B rise above 0.8 (both start at 0.5) within 60 updates."""
    _set_gate(tiny_model, 0.0)
    ref = copy.deepcopy(tiny_model)
    # lr 3e-3 (pretraining's peak): the random-init tiny model's hidden states barely separate
    # the families, so the gate has to learn features; 1e-3 needs far more than 60 updates
    # one rate for all (the gate's multipliers are for the pretrained policy's sharp features)
    cfg = UpdateConfig(learning_rate=3e-3, gate_lr_mult=1.0, gate_hidden_lr_mult=1.0)
    optimizer = make_optimizer(tiny_model, cfg)
    gen = torch.Generator().manual_seed(0)

    def rollouts(prompts: list[str], n: int) -> list[Completion]:
        return [
            complete(tiny_model, tiny_tokenizer, p, "", 6, 1.0, None, gen, stop_logprob=None)
            for p in prompts
            for _ in range(n)
        ]

    def p_show(comps: list[Completion]) -> float:
        return sum(c.gate_prob_show for c in comps) / len(comps)

    history = []
    for _ in range(60):
        a, b = rollouts(FAMILY_A, 4), rollouts(FAMILY_B, 4)
        history.append((p_show(a), p_show(b)))
        if history[-1][0] < 0.1 and history[-1][1] > 0.9:  # margin over the noisy estimate
            break
        rewards = [_reward(c, "A") for c in a] + [_reward(c, "B") for c in b]
        m = update(
            UpdateInputs(tiny_model, ref, tiny_tokenizer, _batch(a + b, rewards), optimizer, cfg)
        )
        assert m["charts/ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # on-policy
    assert history[0] == pytest.approx((0.5, 0.5), abs=1e-6)
    final_a, final_b = p_show(rollouts(FAMILY_A, 8)), p_show(rollouts(FAMILY_B, 8))  # fresh samples
    assert final_a < 0.2, f"p(show) on A {final_a:.3f} after {len(history)} updates: {history}"
    assert final_b > 0.8, f"p(show) on B {final_b:.3f} after {len(history)} updates: {history}"


def proposal_rollouts(
    model: GPT, tokenizer: CodeTokenizer, proposal: Proposal, gen: torch.Generator
) -> Callable[[list[str], int], list[Completion]]:
    """Sampling `n` rollouts a prompt, each offered `proposal`, at temperature 1."""

    def rollouts(prompts: list[str], n: int) -> list[Completion]:
        return [
            complete(model, tokenizer, p, "", 6, 1.0, None, gen, None, proposal=proposal)
            for p in prompts
            for _ in range(n)
        ]

    return rollouts


def _learn_apart(
    model: GPT,
    tokenizer: CodeTokenizer,
    proposal: Proposal,
    drawn: Callable[[Completion], tuple[bool, float]],
    reward: Callable[[Completion, str], float],
) -> tuple[float, float, list[tuple[float, float]]]:
    """Up to 60 on-policy updates on FAMILY_A and FAMILY_B with the same `proposal`; `drawn`
    gives a rollout's decision and its logged log-prob. The mean probability of taking the
    decision on A and on B (fresh samples), and the history along the way."""
    ref = copy.deepcopy(model)
    cfg = UpdateConfig(learning_rate=3e-3, gate_lr_mult=1.0, gate_hidden_lr_mult=1.0)
    optimizer = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(0)

    rollouts = proposal_rollouts(model, tokenizer, proposal, gen)

    def p_yes(comps: list[Completion]) -> float:
        p = [(yes, math.exp(lp)) for yes, lp in map(drawn, comps)]
        return sum(q if yes else 1.0 - q for yes, q in p) / len(p)

    history = []
    for _ in range(60):
        a, b = rollouts(FAMILY_A, 4), rollouts(FAMILY_B, 4)
        history.append((p_yes(a), p_yes(b)))
        if history[-1][0] < 0.1 and history[-1][1] > 0.9:
            break
        rewards = [reward(c, "A") for c in a] + [reward(c, "B") for c in b]
        update(UpdateInputs(model, ref, tokenizer, _batch(a + b, rewards), optimizer, cfg))
    assert history[0] == pytest.approx((0.5, 0.5), abs=1e-6)
    return p_yes(rollouts(FAMILY_A, 8)), p_yes(rollouts(FAMILY_B, 8)), history


def test_synthetic_learning_copy_follows_the_context(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """The copy decision learns where copies are kept: both families get the same proposal
    (the same evidence), people reject the copy on A and accept it on B, and nothing else is
    shown. Only the copy head's weights on the hidden state can tell the families apart:
    p(copy) on A must fall below 0.2 and on B rise above 0.8 (both start at 0.5) within 60
    on-policy updates."""
    _set_gate(tiny_model, -30.0)  # the model's own completions are never shown
    with torch.no_grad():
        tiny_model.gate.copy.weight.zero_()
        tiny_model.gate.copy.bias.zero_()

    def copied(c: Completion) -> tuple[bool, float]:
        assert c.recall is not None
        return c.copied, float(c.recall["logprob"])

    final_a, final_b, history = _learn_apart(
        tiny_model, tiny_tokenizer, Proposal("value + offset", "memory", 24, 3, 3), copied, _reward
    )
    assert final_a < 0.2, f"p(copy) on A {final_a:.3f} after {len(history)} updates: {history}"
    assert final_b > 0.8, f"p(copy) on B {final_b:.3f} after {len(history)} updates: {history}"
    # the evidence's weights cannot have done it: both families' evidence is the same
    assert float(tiny_model.gate.copy.hidden.detach().abs().sum()) > 0


def test_synthetic_learning_more_lines_follow_the_context(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """How far to copy is learned where it pays: every request copies a proposal with lines
    after its first, people keep the longer copy on B and reject it on A (the first line alone
    is kept a little on both). Only the lines head's weights on the hidden state tell the
    families apart: p(more) on A must fall below 0.2 and on B rise above 0.8 (both start at
    0.5) within 60 on-policy updates."""
    _set_gate(tiny_model, -30.0)
    with torch.no_grad():
        tiny_model.gate.copy.weight.zero_()
        tiny_model.gate.copy.bias.fill_(30.0)  # always copied
        tiny_model.gate.lines.bias.zero_()
    proposal = Proposal("value + offset", "memory", 24, 3, 3, "    return value\n    pass")

    def more(c: Completion) -> tuple[bool, float]:
        assert c.recall is not None and "lines" in c.recall
        assert c.text == (proposal.longer if c.recall["lines"]["more"] else proposal.text)
        return bool(c.recall["lines"]["more"]), float(c.recall["lines"]["logprob"])

    def reward(c: Completion, family: str) -> float:
        if not more(c)[0]:
            return 0.2
        return -1.0 if family == "A" else 1.0

    final_a, final_b, history = _learn_apart(tiny_model, tiny_tokenizer, proposal, more, reward)
    assert final_a < 0.2, f"p(more) on A {final_a:.3f} after {len(history)} updates: {history}"
    assert final_b > 0.8, f"p(more) on B {final_b:.3f} after {len(history)} updates: {history}"


def test_gate_passes_move_the_gate_further_and_leave_the_language_model_alone(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """gate_epochs adds steps on the gate alone: the language model ends exactly where the
    full epochs left it, the decision moves further toward the better one."""
    shown = _shown_completion(tiny_model, tiny_tokenizer, True)
    abstained = _relogged(tiny_model, tiny_tokenizer, dataclasses.replace(shown, shown=False))
    batch = _batch([shown, abstained], [0.75, 0.0])
    after = {}
    for gate_epochs in (0, 8):
        model = copy.deepcopy(tiny_model)
        cfg = UpdateConfig(learning_rate=1e-4, kl_coef=0.0, gate_epochs=gate_epochs)
        torch.manual_seed(0)
        m = update(
            UpdateInputs(
                model,
                copy.deepcopy(tiny_model),
                tiny_tokenizer,
                batch,
                make_optimizer(model, cfg),
                cfg,
            )
        )
        assert m.get("gate/steps", 0) == gate_epochs
        after[gate_epochs] = model
    lm = [n for n, _ in tiny_model.named_parameters() if not n.startswith("gate.")]
    p0, p8 = _params(after[0]), _params(after[8])
    assert all(torch.equal(p0[n], p8[n]) for n in lm)
    with torch.no_grad():
        logit = {
            k: score_actions(m, tiny_tokenizer, [shown]).gate_logit.item() for k, m in after.items()
        }
    assert logit[8] > logit[0] + 0.05


@pytest.mark.parametrize("reward", [0.75, -0.25], ids=["accepted", "rejected"])
def test_gate_passes_stop_at_the_clip(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, reward: float
) -> None:
    """Many gate passes move a decision's probability to about 1 +- clip_eps times the serving
    policy's, not beyond: the clip, not the number of passes, bounds one update. (Steps small
    next to the clip range: Adam's momentum carries a few steps past where the gradient ends.)"""
    shown = _shown_completion(tiny_model, tiny_tokenizer, True)  # logged at p(show) = 1/2
    abstained = _relogged(tiny_model, tiny_tokenizer, dataclasses.replace(shown, shown=False))
    batch = _batch([shown, abstained], [reward, 0.0])
    cfg = UpdateConfig(learning_rate=2e-6, kl_coef=0.0, clip_eps=0.2, gate_epochs=400)
    update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            batch,
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    with torch.no_grad():
        p = torch.sigmoid(score_actions(tiny_model, tiny_tokenizer, [shown]).gate_logit).item()
    ratio = p / 0.5
    if reward > 0:
        assert 1.15 < ratio < 1.3, ratio
    else:
        assert 0.7 < ratio < 0.85, ratio


# --- the gate's fit (gate_fit) -----------------------------------------------------------
def _families(model: GPT, tokenizer: CodeTokenizer, seed: int) -> tuple[list[Completion], ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        [
            complete(model, tokenizer, p, "", 6, 1.0, None, gen, stop_logprob=None)
            for p in prompts
            for _ in range(6)
        ]
        for prompts in (FAMILY_A, FAMILY_B)
    )


def _p_show(model: GPT, tokenizer: CodeTokenizer, comps: list[Completion]) -> float:
    with torch.no_grad():
        return torch.sigmoid(score_actions(model, tokenizer, comps).gate_logit).mean().item()


def test_gate_fit_shows_where_showing_paid(tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    """One update with gate_fit sets the gate from the rewards of the shown rollouts: p(show)
    falls on family A (always rejected) and rises on B (always accepted), from 1/2 each, on
    fresh samples; the language model is untouched (train_gate_only)."""
    _set_gate(tiny_model, 0.0)
    a, b = _families(tiny_model, tiny_tokenizer, seed=0)
    rewards = [_reward(c, "A") for c in a] + [_reward(c, "B") for c in b]
    assert {c.shown for c in a} == {c.shown for c in b} == {True, False}
    before = _params(tiny_model)
    cfg = UpdateConfig(train_gate_only=True, gate_fit=True, gate_fit_l2=1.0, gate_fit_min_shown=0)
    m = update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            _batch(a + b, rewards),
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    assert m["gate_fit/fitted"] == 1.0
    assert m["gate_fit/shown"] == sum(c.shown and bool(c.text) for c in a + b)
    after = _params(tiny_model)
    assert all(torch.equal(before[n], after[n]) for n in before if not n.startswith("gate."))
    fresh_a, fresh_b = _families(tiny_model, tiny_tokenizer, seed=1)
    assert _p_show(tiny_model, tiny_tokenizer, fresh_a) < 0.2
    assert _p_show(tiny_model, tiny_tokenizer, fresh_b) > 0.8


def test_gate_fit_learns_from_the_replayed_verdicts(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """A batch that showed nothing teaches the fit nothing by itself (one class: the gate is
    kept); with earlier batches' shown rollouts replayed, the fit uses their verdicts."""
    _set_gate(tiny_model, 0.0)
    a, b = _families(tiny_model, tiny_tokenizer, seed=0)
    abstained = [
        _relogged(tiny_model, tiny_tokenizer, dataclasses.replace(c, shown=False)) for c in a + b
    ]
    now = _batch(abstained, [0.0] * len(abstained))
    shown = [c for c in a + b if c.shown]
    earlier = _batch(shown, [_reward(c, "A" if c in a else "B") for c in shown])
    cfg = UpdateConfig(train_gate_only=True, gate_fit=True, gate_fit_l2=1.0, gate_fit_min_shown=0)
    alone = copy.deepcopy(tiny_model)
    m = update(
        UpdateInputs(
            alone, copy.deepcopy(tiny_model), tiny_tokenizer, now, make_optimizer(alone, cfg), cfg
        )
    )
    assert m["gate_fit/fitted"] == 0.0 and m["gate_fit/shown"] == 0
    fresh_a, fresh_b = _families(tiny_model, tiny_tokenizer, seed=1)
    # the PG step on an all-abstain batch (all advantages 0) leaves the gate where it was
    assert _p_show(alone, tiny_tokenizer, fresh_a) == pytest.approx(0.5, abs=0.02)
    m = update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            now,
            make_optimizer(tiny_model, cfg),
            cfg,
            replay=earlier,
        )
    )
    assert m["gate_fit/fitted"] == 1.0 and m["gate_fit/shown"] == len(shown)
    assert _p_show(tiny_model, tiny_tokenizer, fresh_a) < 0.2
    assert _p_show(tiny_model, tiny_tokenizer, fresh_b) > 0.8


def test_gate_fit_sharpness_scales_the_logit(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """gate_fit_sharpness multiplies the fitted logit: the same fit, p(show) nearer 0 or 1."""
    _set_gate(tiny_model, 0.0)
    a, b = _families(tiny_model, tiny_tokenizer, seed=0)
    batch = _batch(a + b, [_reward(c, "A") for c in a] + [_reward(c, "B") for c in b])
    logits = {}
    for sharpness in (1.0, 3.0):
        model = copy.deepcopy(tiny_model)
        cfg = UpdateConfig(
            train_gate_only=True,
            gate_fit=True,
            gate_fit_l2=1.0,
            gate_fit_min_shown=0,
            gate_fit_sharpness=sharpness,
        )
        update(
            UpdateInputs(
                model,
                copy.deepcopy(tiny_model),
                tiny_tokenizer,
                batch,
                make_optimizer(model, cfg),
                cfg,
            )
        )
        with torch.no_grad():
            logits[sharpness] = score_actions(model, tiny_tokenizer, a + b).gate_logit
    torch.testing.assert_close(logits[3.0], 3.0 * logits[1.0], rtol=1e-3, atol=1e-3)


def test_gate_fit_sharpness_grows_with_the_verdicts(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """With gate_fit_sharpness_max the sharpness is gate_fit_sharpness * sqrt(verdicts /
    gate_fit_min_shown), capped at the max: the same fit, its logit scaled by that factor."""
    _set_gate(tiny_model, 0.0)
    a, b = _families(tiny_model, tiny_tokenizer, seed=0)
    batch = _batch(a + b, [_reward(c, "A") for c in a] + [_reward(c, "B") for c in b])
    shown = sum(c.shown and bool(c.text) for c in a + b)
    need = shown // 4
    grown = math.sqrt(shown / need)
    assert grown > 1.5
    logits, sharpness = {}, {}
    for cap in (0.0, 10.0, 1.5):
        model = copy.deepcopy(tiny_model)
        cfg = UpdateConfig(
            train_gate_only=True,
            gate_fit=True,
            gate_fit_l2=1.0,
            gate_fit_min_shown=need,
            gate_fit_sharpness_max=cap,
        )
        m = update(
            UpdateInputs(
                model,
                copy.deepcopy(tiny_model),
                tiny_tokenizer,
                batch,
                make_optimizer(model, cfg),
                cfg,
            )
        )
        sharpness[cap] = m["gate_fit/sharpness"]
        with torch.no_grad():
            logits[cap] = score_actions(model, tiny_tokenizer, a + b).gate_logit
    assert sharpness == {0.0: 1.0, 10.0: pytest.approx(grown), 1.5: 1.5}
    torch.testing.assert_close(logits[10.0], grown * logits[0.0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(logits[1.5], 1.5 * logits[0.0], rtol=1e-3, atol=1e-3)


def test_gate_fit_waits_for_enough_verdicts(tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    """Below gate_fit_min_shown shown verdicts the gate is not fit: the gate passes move it."""
    _set_gate(tiny_model, 0.0)
    a, b = _families(tiny_model, tiny_tokenizer, seed=0)
    batch = _batch(a + b, [_reward(c, "A") for c in a] + [_reward(c, "B") for c in b])
    shown = sum(c.shown and bool(c.text) for c in a + b)
    for need, fitted in ((shown, 1.0), (shown + 1, 0.0)):
        model = copy.deepcopy(tiny_model)
        cfg = UpdateConfig(
            train_gate_only=True, gate_fit=True, gate_fit_min_shown=need, gate_epochs=2
        )
        m = update(
            UpdateInputs(
                model,
                copy.deepcopy(tiny_model),
                tiny_tokenizer,
                batch,
                make_optimizer(model, cfg),
                cfg,
            )
        )
        assert m["gate_fit/fitted"] == fitted
        assert ("gate/steps" in m) == (not fitted)


# --- settled text ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heal", "texts", "max_tokens", "expected"),
    [
        ("", [None], 32, []),  # nobody said what stands: nothing to learn
        ("", [""], 32, [(0, "\n")]),  # the line ended at the cursor: the stop alone
        ("js", ["on.dumps(x)"], 32, [(0, "json.dumps(x)\n")]),  # healed bytes re-emitted first
        ("", [None, "x)\r\n"], 32, [(1, "x)\n")]),  # one line ending, whatever the client's
    ],
    ids=["none", "empty", "healed", "index-and-line-ending"],
)
def test_settled_targets(
    tiny_model: GPT,
    tiny_tokenizer: CodeTokenizer,
    heal: str,
    texts: list[str | None],
    max_tokens: int,
    expected: list[tuple[int, str]],
) -> None:
    comp = dataclasses.replace(_shown_completion(tiny_model, tiny_tokenizer, True), heal_text=heal)
    got = settled_targets(tiny_tokenizer, [comp] * len(texts), texts, max_tokens)
    assert [(i, tiny_tokenizer.decode(ids)) for i, ids in got] == expected


def test_settled_targets_are_cut_to_max_tokens(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    comp = _shown_completion(tiny_model, tiny_tokenizer, True)
    [(_, ids)] = settled_targets(tiny_tokenizer, [comp], ["x = " + "a + " * 40 + "b"], 5)
    assert len(ids) == 5


def test_update_moves_tokens_toward_settled_text_and_away_from_rejected_suggestion(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """A shown suggestion the person rejected, then settled on other text: after one update the
    settled text is likelier after that context and the rejected tokens less likely."""
    rejected = _shown_completion(tiny_model, tiny_tokenizer, True)
    settled = "dumps(obj, indent=2)"
    assert not settled.startswith(rejected.text)
    others = _rollouts(tiny_model, tiny_tokenizer, PROMPTS[1:], 2, seed=5)
    comps = [rejected, *others]
    rewards = [-0.25] + [0.1] * len(others)
    batch = Batch.of(comps, rewards, [settled] + [None] * len(others))
    [(_, target)] = settled_targets(tiny_tokenizer, [rejected], [settled], 32)

    def logps() -> tuple[float, float]:
        with torch.no_grad():
            to_settled = -settled_nll(tiny_model, [rejected], [(0, target)]).item() * len(target)
            to_rejected = score_actions(tiny_model, tiny_tokenizer, [rejected]).tokens.item()
        return to_settled, to_rejected

    settled_before, rejected_before = logps()
    cfg = UpdateConfig(learning_rate=3e-3, kl_coef=0.0, settled_epochs=3)
    metrics = update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            batch,
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    settled_after, rejected_after = logps()
    assert metrics["settled/examples"] == 1
    assert settled_after > settled_before + 1.0
    assert rejected_after < rejected_before


def test_embeddings_stay_as_pretrained_unless_asked(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """Token and position embeddings get no update by default; train_embeddings moves them."""
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 2)
    batch = Batch.of(comps, [0.75 if c.shown else -0.25 for c in comps], ["x)"] * len(comps))
    for train_embeddings in (False, True):
        model = copy.deepcopy(tiny_model)
        before = _params(model)
        cfg = UpdateConfig(learning_rate=1e-2, train_embeddings=train_embeddings)
        update(
            UpdateInputs(model, tiny_model, tiny_tokenizer, batch, make_optimizer(model, cfg), cfg)
        )
        after = _params(model)
        assert not torch.equal(before["h.0.ln_1.weight"], after["h.0.ln_1.weight"])
        for name in ("wte.weight", "wpe.weight"):
            assert torch.equal(before[name], after[name]) != train_embeddings, name


def test_generic_mix_holds_generic_code_while_settled_text_is_learned(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """The pretraining mix: the same settled-text steps with generic code mixed in lose less
    on generic code than without, and still learn the settled text."""
    from tabloop.core.policy.model import heldout_loss
    from trainer.deploy_check import heldout_sample

    generic = heldout_sample(tiny_tokenizer, "\n".join(small_code), rows=32, length=48, seed=1)
    probe = heldout_sample(tiny_tokenizer, "\n".join(small_code), rows=8, length=48, seed=2)
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS, 4)
    texts = ["}}}{{{ ~~~ ^^^ ???? ;;;; @@@@"] * len(comps)
    [(_, target)] = settled_targets(tiny_tokenizer, comps[:1], texts[:1], 32)
    losses = {}
    for mix in (0.0, 1.0):
        torch.manual_seed(0)
        model = copy.deepcopy(tiny_model)
        cfg = UpdateConfig(
            learning_rate=3e-3,
            kl_coef=0.0,
            settled_epochs=6,
            minibatch_size=8,
            generic_mix=mix,
            generic_rows=16,
        )
        update(
            UpdateInputs(
                model,
                tiny_model,
                tiny_tokenizer,
                Batch.of(comps, [0.0] * len(comps), texts),
                make_optimizer(model, cfg),
                cfg,
                generic=generic,
            )
        )
        with torch.no_grad():
            learned = settled_nll(model, comps[:1], [(0, target)]).item()
        losses[mix] = (heldout_loss(model, probe), learned)
    with torch.no_grad():
        untrained = settled_nll(tiny_model, comps[:1], [(0, target)]).item()
    assert losses[1.0][0] < losses[0.0][0]
    assert losses[1.0][1] < untrained - 0.1


def test_settled_text_is_evidence_only_for_its_own_rollout(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """The supervised term reads each text after its own rollout's context: a rollout without
    one contributes nothing, and with train_gate_only the language model never moves."""
    comps = _rollouts(tiny_model, tiny_tokenizer, PROMPTS[:2], 1)
    batch = Batch.of(comps, [0.0, 0.0], [None, None])
    cfg = UpdateConfig(learning_rate=1e-2, kl_coef=0.0, settled_epochs=2)
    before = _params(tiny_model)
    metrics = update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            batch,
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    assert metrics["settled/examples"] == 0
    assert all(torch.equal(before[n], p) for n, p in _params(tiny_model).items())
    frozen = dataclasses.replace(cfg, train_gate_only=True)
    batch = Batch.of(comps, [0.0, 0.0], ["x = 1", "y = 2"])
    update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            batch,
            make_optimizer(tiny_model, frozen),
            frozen,
        )
    )
    assert all(torch.equal(before[n], p) for n, p in _params(tiny_model).items())


# Two populations at the same cursors, told apart only by what the service recorded of them:
# takers accept the short suggestions they are shown, refusers never take one (the telemetry's
# <= 5 characters); both take the longer ones.
TAKER = History(((3, True), (4, True), (30, True), (2, True), (45, False)), since_s=3.0)
REFUSER = History(((3, False), (4, False), (30, True), (2, False), (45, True)), since_s=3.0)


def _population_reward(comp: Completion, refuses_short: bool) -> float:
    if not comp.shown:
        return 0.0
    if refuses_short and len(comp.text.rstrip()) <= SHORT_CHARS:
        return -0.25
    return 0.75 * (min(len(comp.text), 60) / 20) ** 0.5


@pytest.mark.parametrize("reads_person", [True, False], ids=["person", "zeroed"])
def test_synthetic_learning_short_suggestions_follow_the_person(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, reads_person: bool
) -> None:
    """The same cursors for two populations; only the person inputs (their recorded outcomes)
    differ. Within 100 on-policy updates the gate shows short suggestions to the takers
    (p(show) > 0.8) and not to the refusers (< 0.2). With the person inputs zeroed it cannot:
    both populations then get the same p(show) for the same completion."""
    _set_gate(tiny_model, 0.0)
    ref = copy.deepcopy(tiny_model)
    cfg = UpdateConfig()  # the trainer's rates: the gate's weights at 100x the model's
    optimizer = make_optimizer(tiny_model, cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = FAMILY_A + FAMILY_B

    def rollouts(history: History, n: int) -> list[Completion]:
        return [
            complete(
                tiny_model,
                tiny_tokenizer,
                p,
                "",
                2,  # mostly short
                1.0,
                None,
                gen,
                stop_logprob=None,
                person=PersonContext(history, moment_of(p, "")) if reads_person else None,
            )
            for p in prompts
            for _ in range(n)
        ]

    def p_short(comps: list[Completion]) -> float:
        short = [c.gate_prob_show for c in comps if 0 < len(c.text.rstrip()) <= SHORT_CHARS]
        assert short, "short completions to judge"
        return sum(short) / len(short)

    history = []
    for _ in range(100):
        takers, refusers = rollouts(TAKER, 3), rollouts(REFUSER, 3)
        history.append((p_short(takers), p_short(refusers)))
        if history[-1][0] > 0.9 and history[-1][1] < 0.1:
            break
        rewards = [_population_reward(c, False) for c in takers] + [
            _population_reward(c, True) for c in refusers
        ]
        update(
            UpdateInputs(
                tiny_model, ref, tiny_tokenizer, _batch(takers + refusers, rewards), optimizer, cfg
            )
        )
    final = p_short(rollouts(TAKER, 6)), p_short(rollouts(REFUSER, 6))
    learned = final[0] > 0.8 and final[1] < 0.2
    if reads_person:
        assert learned, f"p(show) of short ones {final} after {len(history)} updates: {history}"
    else:
        assert not learned and abs(final[0] - final[1]) < 0.15, final


def test_gate_fit_reads_the_person(tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    """The gate's fit uses the person inputs too: at the same cursors, short suggestions shown to
    the takers paid and those shown to the refusers did not, so one fit shows short ones to the
    first and not to the second, on fresh samples."""
    _set_gate(tiny_model, 0.0)
    gen = torch.Generator().manual_seed(0)

    def rollouts(history: History) -> list[Completion]:
        return [
            complete(
                tiny_model,
                tiny_tokenizer,
                p,
                "",
                2,
                1.0,
                None,
                gen,
                stop_logprob=None,
                person=PersonContext(history, moment_of(p, "")),
            )
            for p in FAMILY_A + FAMILY_B
            for _ in range(6)
        ]

    takers, refusers = rollouts(TAKER), rollouts(REFUSER)
    rewards = [_population_reward(c, False) for c in takers] + [
        _population_reward(c, True) for c in refusers
    ]
    cfg = UpdateConfig(train_gate_only=True, gate_fit=True, gate_fit_l2=1.0, gate_fit_min_shown=0)
    m = update(
        UpdateInputs(
            tiny_model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            _batch(takers + refusers, rewards),
            make_optimizer(tiny_model, cfg),
            cfg,
        )
    )
    assert m["gate_fit/fitted"] == 1.0
    assert float(tiny_model.gate.person.detach().abs().sum()) > 0

    def p_short(comps: list[Completion]) -> float:
        short = [c for c in comps if 0 < len(c.text.rstrip()) <= SHORT_CHARS]
        return _p_show(tiny_model, tiny_tokenizer, short)

    assert p_short(rollouts(TAKER)) > 0.8 > 0.2 > p_short(rollouts(REFUSER))
