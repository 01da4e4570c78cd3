"""Row weights (trainer/caps.py) in the update, the settled-text term and the deploy check: a
capped person's rows count for their weight, no more."""

from __future__ import annotations

import copy

import pytest
import torch

from tabloop.core.policy.actions import Completion
from tabloop.core.policy.model import GPT
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.deploy_check import snis
from trainer.settled import settled_nll, settled_targets
from trainer.update import Batch, UpdateConfig, advantages, pg_loss, weighted_advantages

torch.set_num_threads(1)

PROMPTS = ["def add(a, b):\n    return a", "import json\n\n\ndef load(path):\n    return json."]


def _rollouts(model: GPT, tokenizer: CodeTokenizer, n: int) -> list[Completion]:
    with torch.no_grad():
        model.gate.features.weight.zero_()
        model.gate.features.bias.fill_(0.0)
    gen = torch.Generator().manual_seed(0)
    return [
        complete(
            model,
            tokenizer,
            PROMPTS[i % 2],
            "",
            6,
            temperature=0.8,
            top_p=0.95,
            generator=gen,
            stop_logprob=None,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("rewards", "weights", "baseline", "expected"),
    [
        pytest.param(
            [1.0, 2.0, 3.0, 6.0],
            [1.0] * 4,
            "loo",
            [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0],
            id="equal-weights-are-no-weights-loo",
        ),
        pytest.param(
            [1.0, 2.0, 3.0, 6.0],
            [1.0] * 4,
            "mean",
            [-2.0, -1.0, 0.0, 3.0],
            id="equal-weights-are-no-weights-mean",
        ),
        # weighted mean (3 * 1 + 1 * 0) / 4 = 0.75
        pytest.param([1.0, 0.0], [1.5, 0.5], "mean", [0.25, -0.75], id="weighted-mean"),
        # each against the weighted mean of the others: here the other one alone
        pytest.param([1.0, 0.0], [1.5, 0.5], "loo", [1.0, -1.0], id="weighted-loo-two"),
        # a loud person's 0.75s (weight 1/3 each) against one 0 and one -0.25 (weight 1 each):
        # the baseline is (0.75 + 0 - 0.25) / 3 = 1/6, not the plain mean 0.4
        pytest.param(
            [0.75, 0.75, 0.75, 0.0, -0.25],
            [1 / 3, 1 / 3, 1 / 3, 1.0, 1.0],
            "mean",
            [7 / 12, 7 / 12, 7 / 12, -1 / 6, -5 / 12],
            id="capped-loud-person",
        ),
        pytest.param([0.5], [1.0], "loo", [0.0], id="one-sample"),
    ],
)
def test_weighted_baselines(
    rewards: list[float], weights: list[float], baseline: str, expected: list[float]
) -> None:
    got = advantages(torch.tensor(rewards), baseline, False, torch.tensor(weights))
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_the_loss_scales_each_rows_advantage_by_its_weight(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    comps = _rollouts(tiny_model, tiny_tokenizer, 4)
    rewards, weights = [0.75, -0.25, 0.0, 0.5], [0.2, 1.6, 1.0, 1.2]
    cfg = UpdateConfig(kl_coef=0.0, entropy_coef=0.0, baseline="mean")
    weighted = Batch.of(comps, rewards, weights=weights)
    adv = weighted_advantages(weighted, cfg)
    mean = sum(r * w for r, w in zip(rewards, weights, strict=True)) / sum(weights)
    torch.testing.assert_close(
        adv, torch.tensor([(r - mean) * w for r, w in zip(rewards, weights, strict=True)])
    )

    def grads(batch: Batch, given: torch.Tensor | None) -> list[torch.Tensor]:
        model = copy.deepcopy(tiny_model)
        loss, _ = pg_loss(model, model, tiny_tokenizer, batch, cfg, adv=given)
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = Batch.of(comps, rewards)  # the same rows, no weights, given the weighted advantages
    for a, b in zip(grads(weighted, None), grads(plain, adv), strict=True):
        torch.testing.assert_close(a, b)
    assert weighted.select([1, 3]).weights.tolist() == pytest.approx([1.6, 1.2])


def test_settled_text_weighs_as_its_row(tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    comps = _rollouts(tiny_model, tiny_tokenizer, 2)
    targets = settled_targets(tiny_tokenizer, comps, ["a + b", "loads(f.read())"], 32)
    assert len(targets) == 2
    with torch.no_grad():
        each = [float(settled_nll(tiny_model, comps, [t])) for t in targets]
        tokens = [len(ids) for _, ids in targets]
        got = float(settled_nll(tiny_model, comps, targets, [2.0, 0.0]))
    # the first target's tokens at twice their NLL, the second's at none, over all tokens
    assert got == pytest.approx(2.0 * each[0] * tokens[0] / sum(tokens), rel=1e-5)


@pytest.mark.parametrize(
    ("log_ratio", "rewards", "row_weights", "estimate", "ess"),
    [
        pytest.param([0.0] * 4, [1.0, 0.0, 0.0, 0.0], None, 0.25, 4.0, id="no-weights"),
        pytest.param([0.0] * 4, [1.0, 0.0, 0.0, 0.0], [1.0] * 4, 0.25, 4.0, id="equal-weights"),
        # a loud person's three 1.0 rewards held to the weight of one
        pytest.param(
            [0.0] * 4, [1.0, 1.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3, 1.0], 0.5, 3.0, id="capped"
        ),
    ],
)
def test_snis_with_row_weights(
    log_ratio: list[float],
    rewards: list[float],
    row_weights: list[float] | None,
    estimate: float,
    ess: float,
) -> None:
    got_est, got_ess = snis(
        torch.tensor(log_ratio),
        torch.zeros(len(log_ratio)),
        torch.tensor(rewards),
        5.0,
        None if row_weights is None else torch.tensor(row_weights),
    )
    assert got_est == pytest.approx(estimate) and got_ess == pytest.approx(ess)
