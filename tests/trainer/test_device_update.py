"""The update in bf16 autocast, what it runs on a GPU (tabloop/core/policy/device.py), here on the
CPU: the job of tests/trainer/test_distributed.py (settled-text passes with generic code, the
gate fit, replay, carried Adam moments) steps like the float32 update, and the weights and the
moments stay float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tabloop.core.policy.device import compute
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer
from tests.trainer.test_distributed import CASES, make_job, run


@pytest.fixture
def job(tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]) -> dict[str, Any]:
    return make_job(tiny_model, tiny_tokenizer, small_code)


def flat(model: GPT) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("case", ["pg", "settled", "gate-fit"])
def test_a_bf16_update_steps_like_the_float32_one(job: dict[str, Any], case: str) -> None:
    fp32, expected, _ = run(job, CASES[case], None)
    with compute(torch.device("cpu"), bf16=True):
        bf16, metrics, state = run(job, CASES[case], None)
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert all(
        t.dtype == torch.float32
        for s in state["state"].values()
        for t in s.values()
        if t.is_floating_point() and t.dim()
    )
    assert metrics.keys() == expected.keys()
    assert all(v == v and abs(v) != float("inf") for v in metrics.values())
    start = flat(job["model"])
    moved, apart = flat(fp32) - start, flat(bf16) - flat(fp32)
    print(f"{case}: float32 update moved {moved.norm():.4f}, bf16 ends {apart.norm():.4f} away")
    assert apart.norm() < 0.5 * moved.norm()
    cos = torch.nn.functional.cosine_similarity(flat(bf16) - start, moved, dim=0)
    assert cos > 0.9
