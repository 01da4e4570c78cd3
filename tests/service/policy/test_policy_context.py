"""The context the model sees: a left-to-right checkpoint ignores the suffix exactly as before;
a fill-in-the-middle one reads the following lines in PSM order within the same budget, and its
sampled actions rescore exactly from the logged ids."""

from __future__ import annotations

import random

import pytest
import torch

from tabloop.core.policy.actions import Completion
from tabloop.core.policy.context import (
    SUFFIX_SHARE,
    following_lines,
    prepare_context,
)
from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer, train_tokenizer

PREFIX = "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.re"
SUFFIX = "ad()  # after the cursor\n\n\ndef write(path, text):\n    with open(path, 'w') as f:\n"


@pytest.fixture(scope="module")
def fim_tokenizer(small_code: list[str]) -> CodeTokenizer:
    return train_tokenizer(small_code, vocab_size=400, fim=True)


@pytest.fixture
def fim_model(fim_tokenizer: CodeTokenizer) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=fim_tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
    )
    return GPT(cfg).eval()


@pytest.mark.parametrize(
    ("suffix", "lines"),
    [
        ("", ""),
        ("rest of line", ""),  # no newline: nothing follows the cursor's line
        ("rest\nnext\nlast", "next\nlast"),
        ("\nnext", "next"),  # the cursor at the end of its line
        ("\n", ""),
    ],
)
def test_following_lines(suffix: str, lines: str) -> None:
    assert following_lines(suffix) == lines


def test_a_left_to_right_checkpoint_ignores_the_suffix(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    assert not tiny_tokenizer.fim
    plain = prepare_context(tiny_tokenizer, PREFIX, 64, 16)
    assert prepare_context(tiny_tokenizer, PREFIX, 64, 16, suffix=SUFFIX) == plain
    for seed in range(4):
        a, b = (
            complete(
                tiny_model,
                tiny_tokenizer,
                PREFIX,
                s,
                12,
                0.9,
                0.9,
                torch.Generator().manual_seed(seed),
                stop_logprob=None,
            )
            for s in ("", SUFFIX)
        )
        assert a == b


@pytest.mark.parametrize("budget", [5, 8, 24, 48])
def test_fim_layout_within_the_budget(fim_tokenizer: CodeTokenizer, budget: int) -> None:
    tok = fim_tokenizer
    assert tok.fim_ids is not None
    pre, suf, mid = tok.fim_ids
    h = prepare_context(tok, PREFIX, 64, 64 - budget, suffix=SUFFIX)
    ids = h.context_ids
    assert len(ids) <= budget
    assert ids[0] == pre and ids[-1] == mid and ids.count(suf) == 1
    read = ids[ids.index(suf) + 1 : -1]
    assert len(read) <= budget // SUFFIX_SHARE
    assert read == tok.encode(following_lines(SUFFIX))[: len(read)]  # the nearest lines first
    assert "after the cursor" not in tok.decode(read)  # never the rest of the cursor's line
    # the prefix gets the rest: the same healed tail a left-to-right context would end with
    prefix_ids = ids[1 : ids.index(suf)]
    assert len(prefix_ids) >= 2 and h.constraint == b"re"
    assert tok.decode(prefix_ids).endswith(" f.")
    if budget >= 24:
        assert len(ids) == budget  # a long prefix and suffix use it all


def test_fim_with_an_empty_suffix(fim_tokenizer: CodeTokenizer) -> None:
    assert fim_tokenizer.fim_ids is not None
    pre, suf, mid = fim_tokenizer.fim_ids
    ids = prepare_context(fim_tokenizer, "x = 1\ny = ", 64, 16, suffix="").context_ids
    assert ids[0] == pre and ids[1] == fim_tokenizer.eof_id  # the whole file prefix fits
    assert ids[-2:] == [suf, mid]


SETTINGS = [(0.0, None), (0.5, 0.9), (0.8, None), (1.0, 0.95), (1.4, 0.5)]


@pytest.mark.parametrize("gate_bias", [-30.0, 0.0, 30.0], ids=["abstain", "mixed", "show"])
def test_fim_rollouts_rescore_exactly(
    fim_model: GPT, fim_tokenizer: CodeTokenizer, small_code: list[str], gate_bias: float
) -> None:
    with torch.no_grad():
        fim_model.gate.features.weight.zero_()
        fim_model.gate.features.bias.fill_(gate_bias)
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(5)
    comps: list[Completion] = []
    for i in range(24):
        text = rng.choice(small_code)
        cut = rng.randint(0, len(text) - 1)
        temp, top_p = SETTINGS[i % len(SETTINGS)]
        comps.append(
            complete(
                fim_model,
                fim_tokenizer,
                text[:cut],
                text[cut:],
                rng.randint(1, 40),
                temp,
                top_p,
                gen,
                stop_logprob=None if i % 2 else -2.0,
            )
        )
    kept = [c for c in comps if c.token_ids]
    assert len(kept) > 12
    with torch.no_grad():
        scores = score_actions(fim_model, fim_tokenizer, kept)
    logged = torch.tensor([c.logprob_total for c in kept])
    torch.testing.assert_close(scores.total, logged, atol=1e-4, rtol=0)
    per_token = torch.tensor([lp for c in kept for lp in c.token_logprobs])
    torch.testing.assert_close(scores.token_logprobs, per_token, atol=1e-4, rtol=0)
    assert fim_tokenizer.fim_ids is not None
    assert all(c.context_token_ids[-1] == fim_tokenizer.fim_ids[2] for c in comps)
    # a control token (<|eof|> or a sentinel) ends a generation: never inside a completion
    assert not any(set(c.token_ids[:-1]) & fim_tokenizer.special_ids for c in comps)


def test_a_fim_checkpoint_reads_the_suffix(fim_model: GPT, fim_tokenizer: CodeTokenizer) -> None:
    """The same prefix with another suffix is another context."""
    a, b = (
        complete(fim_model, fim_tokenizer, PREFIX, s, 8, 0.0, None, None, stop_logprob=None)
        for s in (SUFFIX, "ad()\n\n\nclass Other:\n    pass\n")
    )
    assert fim_tokenizer.fim_ids is not None
    suf = fim_tokenizer.fim_ids[1]
    ca, cb = a.context_token_ids, b.context_token_ids
    assert ca != cb
    assert ca[: ca.index(suf)] == cb[: cb.index(suf)]  # the same prefix part
