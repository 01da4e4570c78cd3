"""Where the policy computes (tabloop/core/policy/device.py). The machines that run these tests have
no GPU: the device names are checked here, and the bf16 path (what a GPU runs) on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tabloop.core.policy.device import DeviceError, activation_dtype, compute, precision, resolve
from tabloop.core.policy.model import GPT, KVCache, ModelConfig
from tabloop.core.policy.sampling import Prompt, complete_batch
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer
from tests.service.conftest import make_settings

PROMPTS = ["def add(a, b):\n    return ", "import os\nimport ", "for i in range(", "x = "]


def test_auto_is_the_cpu_where_torch_sees_no_gpu_and_a_gpu_where_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve("auto") == torch.device("cpu")
    assert resolve("CPU ") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve("auto") == torch.device("cuda")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_torch_does_not_see_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="torch sees no CUDA GPU"):
        resolve(name)


@pytest.mark.parametrize("name", ["gpu", "tpu", "mps", "cuda:x", ""])
def test_other_names_are_refused(name: str) -> None:
    with pytest.raises(DeviceError, match="auto, cpu, cuda or cuda:N"):
        resolve(name)


def test_the_setting_is_checked_at_start(tmp_path: Path) -> None:
    assert make_settings(tmp_path, device="cuda:1").device == "cuda:1"
    with pytest.raises(ValidationError, match="device"):
        make_settings(tmp_path, device="gpu")


def test_on_the_cpu_compute_changes_nothing_unless_asked_for_bf16() -> None:
    cpu = torch.device("cpu")
    assert precision(cpu) == "fp32" and precision(torch.device("cuda")) == "bf16 autocast"
    with compute(cpu):
        assert not torch.is_autocast_enabled("cpu")
        assert activation_dtype(cpu) == torch.float32
    with compute(cpu, bf16=True):
        assert torch.is_autocast_enabled("cpu")
        assert activation_dtype(cpu) == torch.bfloat16
        assert KVCache(_cfg(), 2, cpu).k.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def _cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=8)


def test_bf16_sampling_logs_what_bf16_scoring_recomputes(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """What a GPU runs, on the CPU: sampling in bf16 autocast (a bf16 KV cache) logs log-probs
    that scoring in bf16 recomputes, and that stay near float32's."""
    prompts = [Prompt(p, "", 6, torch.Generator().manual_seed(i)) for i, p in enumerate(PROMPTS)]
    with compute(torch.device("cpu"), bf16=True):
        sampled = complete_batch(tiny_model, tiny_tokenizer, prompts, stop_logprob=None)
        scores = score_actions(tiny_model, tiny_tokenizer, sampled)
    assert all(c.token_ids for c in sampled)
    assert scores.total.dtype == torch.float32 and scores.gate_logit.dtype == torch.float32
    logged = torch.tensor([c.logprob_total for c in sampled])
    torch.testing.assert_close(scores.total, logged, atol=2e-2, rtol=0)
    full = score_actions(tiny_model, tiny_tokenizer, sampled)  # float32
    torch.testing.assert_close(full.total, logged, atol=0.2, rtol=0)
