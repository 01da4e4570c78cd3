"""Tiny policy fixtures: a BPE trained on a few stdlib files and a random-init model."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from service.policy.model import GPT, ModelConfig
from service.policy.tokenizer import CodeTokenizer, train_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_SOURCES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py")


@pytest.fixture(scope="session")
def small_code() -> list[str]:
    return [(STDLIB / p).read_text(encoding="utf-8") for p in SMALL_SOURCES]


@pytest.fixture(scope="session")
def tiny_tokenizer(small_code: list[str]) -> CodeTokenizer:
    return train_tokenizer(small_code, vocab_size=400)


@pytest.fixture
def tiny_model(tiny_tokenizer: CodeTokenizer) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tiny_tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
    )
    return GPT(cfg).eval()
