"""The decision critic (trainer/critic.py) and the gate passes it scores (trainer/update.py):
the fit on synthetic inputs, the expected surrogate by value, and, on a tiny model, a hidden
completion learned from what the critic remembers rather than from its own sample."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from service.policy.model import GATE_FEATURES, GPT
from service.policy.sampling import Completion, complete, score_actions
from service.policy.tokenizer import CodeTokenizer
from trainer.critic import DecisionCritic, fit_critic
from trainer.update import Batch, UpdateConfig, expected_gate_surrogate, make_optimizer, update

torch.set_num_threads(1)
BYTES = GATE_FEATURES.index("log1p_bytes")


def _synthetic(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted exactly when the hidden state's first coordinate is positive; an accept is worth
    more the longer the completion (0.1 per unit of log1p(bytes)), a rejection -0.25."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 8, generator=g)
    feats = torch.randn(n, len(GATE_FEATURES), generator=g)
    feats[:, BYTES] = torch.rand(n, generator=g) * 3 + 0.5
    accepted = hidden[:, 0] > 0
    rewards = torch.where(accepted, 0.1 * feats[:, BYTES], torch.tensor(-0.25))
    return hidden, feats, rewards


def test_fit_recovers_the_accept_rule_and_the_values() -> None:
    hidden, feats, rewards = _synthetic(400)
    fit = fit_critic(hidden, feats, rewards, l2=1.0)
    assert fit is not None
    assert (fit.n_shown, fit.n_accepted) == (400, int((rewards > 0).sum()))
    h2, f2, r2 = _synthetic(400, seed=1)  # fresh draws
    p = fit.p_accept(h2, f2)
    assert ((p > 0.5) == (r2 > 0)).float().mean() > 0.95
    assert fit.reject_value == pytest.approx(-0.25)
    assert fit.accept_value == pytest.approx((0.0, 0.1), abs=1e-5)
    q = fit.q_show(h2, f2)
    assert (q[r2 > 0] > 0).float().mean() > 0.9  # wrong only near the boundary
    assert (q[r2 < 0] < 0).float().mean() > 0.9


@pytest.mark.parametrize("accepted", [0, 10], ids=["none-accepted", "all-accepted"])
def test_fit_needs_both_outcomes(accepted: int) -> None:
    hidden, feats, _ = _synthetic(10)
    rewards = torch.tensor([0.5] * accepted + [-0.25] * (10 - accepted))
    assert fit_critic(hidden, feats, rewards, l2=1.0) is None


@pytest.mark.parametrize("p_old", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("delta", [0.3, -0.2])
def test_expected_surrogate_gradient_is_the_advantage_of_showing(
    p_old: float, delta: float
) -> None:
    """At p_new = p_old: d/dp_new = Q(show) - Q(abstain); the push ends once both p(show) and
    p(abstain) have left the clip range in the direction delta favours (as PPO's clip on a
    sampled binary decision: whichever was sampled, its ratio bounds the move)."""
    p = torch.tensor([p_old], requires_grad=True)
    expected_gate_surrogate(p, torch.tensor([p_old]), torch.tensor([delta]), 0.2).sum().backward()
    assert p.grad is not None and p.grad.item() == pytest.approx(delta)
    # past both clips: p(show) x (1 + eps) and p(abstain) x (1 - eps), or the reverse
    if delta > 0:
        far = max(p_old * 1.2, 1 - (1 - p_old) * 0.8) + 0.01
    else:
        far = min(p_old * 0.8, 1 - (1 - p_old) * 1.2) - 0.01
    if 0 < far < 1:
        q = torch.tensor([far], requires_grad=True)
        expected_gate_surrogate(q, torch.tensor([p_old]), torch.tensor([delta]), 0.2).backward()
        assert q.grad is not None and q.grad.item() == pytest.approx(0.0)


FAMILY_A = [
    f"# note {i}: this comment explains the plan\n# and continues here\n# " for i in range(4)
]
FAMILY_B = [f"def f{i}(x, y):\n    z = x + y * {i}\n    return " for i in range(4)]


def _logged(
    model: GPT, tokenizer: CodeTokenizer, prompts: list[str], shown: bool, seed: int
) -> list[Completion]:
    """Completions logged at p(show) = 1/2 with the given decision (non-empty ones only)."""
    gen = torch.Generator().manual_seed(seed)
    comps = [
        complete(model, tokenizer, p, "", 6, 1.0, None, gen) for p in prompts for _ in range(4)
    ]
    comps = [dataclasses.replace(c, shown=shown) for c in comps if c.text]
    with torch.no_grad():
        s = score_actions(model, tokenizer, comps)
    return [
        dataclasses.replace(c, decision_logprob=float(d), logprob_total=float(t))
        for c, d, t in zip(comps, s.decision, s.total, strict=True)
    ]


@pytest.mark.parametrize("context", ["gate", "hidden"])
def test_hidden_completions_learn_from_the_critics_memory(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, context: str
) -> None:
    """A batch of abstentions only (every reward 0: no sampled advantage) moves the gate with a
    critic that remembers an earlier batch where family B was accepted and A rejected (worth
    as much either way, so only the context tells the decisions apart): p(show)
    rises on B and falls on A. Without the critic the same batch leaves the gate alone. With
    the "gate" context the critic reads the gate's projection of the hidden state, here one
    that already tells the families apart a little (as the policy gradient teaches it)."""
    with torch.no_grad():
        tiny_model.gate.features.weight.zero_()
        tiny_model.gate.features.bias.zero_()
        h = {
            f: score_actions(
                tiny_model, tiny_tokenizer, _logged(tiny_model, tiny_tokenizer, prompts, True, 9)
            ).gate_hidden
            for f, prompts in (("A", FAMILY_A), ("B", FAMILY_B))
        }
        direction = h["B"].mean(0) - h["A"].mean(0)
        tiny_model.gate.hidden.weight.copy_(1e-3 * direction / direction.norm())
    a_shown = _logged(tiny_model, tiny_tokenizer, FAMILY_A, True, 0)
    b_shown = _logged(tiny_model, tiny_tokenizer, FAMILY_B, True, 1)
    earlier = Batch.of(a_shown + b_shown, [-0.5] * len(a_shown) + [0.5] * len(b_shown))
    a_hidden = _logged(tiny_model, tiny_tokenizer, FAMILY_A, False, 2)
    b_hidden = _logged(tiny_model, tiny_tokenizer, FAMILY_B, False, 3)
    now = Batch.of(a_hidden + b_hidden, [0.0] * (len(a_hidden) + len(b_hidden)))

    def p_show(model: GPT) -> tuple[float, float]:
        with torch.no_grad():
            return tuple(  # type: ignore[return-value]
                torch.sigmoid(score_actions(model, tiny_tokenizer, c).gate_logit).mean().item()
                for c in (a_hidden, b_hidden)
            )

    before = p_show(tiny_model)
    assert before == pytest.approx((0.5, 0.5), abs=1e-3)
    after = {}
    for use_critic in (False, True):
        model = copy.deepcopy(tiny_model)
        cfg = UpdateConfig(
            learning_rate=1e-4,
            kl_coef=0.0,
            gate_epochs=8,
            minibatch_size=8,
            gate_critic=use_critic,
            critic_context=context,  # type: ignore[arg-type]
            train_gate_only=True,
        )
        critic = DecisionCritic(batches=2, context=context)
        critic.remember(earlier.actions, earlier.rewards)
        torch.manual_seed(0)
        m = update(
            model,
            copy.deepcopy(tiny_model),
            tiny_tokenizer,
            now,
            make_optimizer(model, cfg),
            cfg,
            critic,
        )
        assert ("critic/shown" in m) == use_critic
        after[use_critic] = p_show(model)
    assert after[False] == pytest.approx(before, abs=1e-4)
    (a0, b0), (a, b) = before, after[True]
    assert a < a0 - 0.02 and b > b0 + 0.03, (before, after)
