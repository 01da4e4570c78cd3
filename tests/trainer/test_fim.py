"""Fill-in-the-middle pretraining rows: the layout serving reads, their lengths, determinism and
the share of rows they take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tabloop.core.policy.context import prepare_context
from tabloop.core.policy.tokenizer import CodeTokenizer, train_tokenizer
from trainer.fim import (
    MIN_BUDGET,
    FimSource,
    cursor_columns,
    fim_tokens,
    line_spans,
    split_at,
)
from trainer.pretrain.data import get_batch, tokenize_texts

BLOCK = 64


@pytest.fixture(scope="module")
def fim_tokenizer(small_code: list[str]) -> CodeTokenizer:
    return train_tokenizer(small_code, vocab_size=400, fim=True)


@pytest.fixture(scope="module")
def source(fim_tokenizer: CodeTokenizer, small_code: list[str]) -> FimSource:
    data = tokenize_texts(fim_tokenizer, small_code)
    return FimSource(fim_tokenizer, small_code, data.tokens, data.starts, max_new_tokens=16)


@pytest.mark.parametrize(
    ("text", "spans"),
    [
        ("a\n\n  bc  \nd", [(0, 1), (3, 9), (10, 11)]),
        ("", []),
        ("\n\n", []),  # blank lines only
        ("x = 1\n", [(0, 5)]),
        ("  \n\tif x:\n", [(3, 9)]),  # whitespace-only lines are blank
    ],
)
def test_line_spans(text: str, spans: list[tuple[int, int]]) -> None:
    assert line_spans(text) == spans
    assert all(text[a:b].strip() and "\n" not in text[a:b] for a, b in spans)


@pytest.mark.parametrize(
    ("line", "columns"),
    [("x", (0, 0)), ("    return x", (4, 11)), ("\tpass  ", (1, 4)), ("a = 1  ", (0, 4))],
)
def test_cursor_columns(line: str, columns: tuple[int, int]) -> None:
    assert cursor_columns(line) == columns


def test_split_at_cuts_the_rest_of_the_line() -> None:
    text = "def f(x):\n    return x + 1\n\nprint(f(2))\n"
    start = text.index("    return")
    end = text.index("\n", start)
    prefix, middle, suffix = split_at(text, start, end, 11)
    assert prefix == "def f(x):\n    return "
    assert middle == "x + 1\n"
    assert suffix == "x + 1\n\nprint(f(2))\n"  # the text after the cursor, as a request's
    assert prefix + suffix == text
    last = text.index("print")
    assert split_at(text.rstrip("\n"), last, last + 11, 6)[1] == "f(2))\n"  # no final newline


def test_fim_tokens_are_what_serving_builds_then_the_middle(fim_tokenizer: CodeTokenizer) -> None:
    tok = fim_tokenizer
    assert tok.fim_ids is not None
    pre, suf, mid = tok.fim_ids
    prefix, middle, suffix = (
        "import os\n\ndef read(path):\n    return open(pa",
        "th).read()\n",
        ("th).read()\n\n\ndef write(path, text):\n    pass\n"),
    )
    for budget in (MIN_BUDGET, 40, BLOCK - 16):
        context, target = fim_tokens(tok, prefix, middle, suffix, BLOCK, budget, 16)
        serving = prepare_context(tok, prefix, BLOCK, BLOCK - budget, suffix=suffix)
        assert context == serving.context_ids  # token for token the serving context
        assert context[0] == pre and context[-1] == mid and context.count(suf) == 1
        assert len(context) <= budget and len(target) <= 16
        # the target re-emits the healed bytes, then the rest of the line and its newline
        want = serving.constraint + middle.encode()
        assert tok.decode_bytes(target) == want[: len(tok.decode_bytes(target))]
        assert not set(target) & tok.special_ids
    _, target = fim_tokens(tok, prefix, middle, suffix, BLOCK, MIN_BUDGET, 32)
    assert tok.decode(target).endswith(middle)  # short enough: whole, newline included


def test_rows_fill_the_block_and_are_deterministic(
    source: FimSource, fim_tokenizer: CodeTokenizer
) -> None:
    assert fim_tokenizer.fim_ids is not None
    pre, suf, mid = fim_tokenizer.fim_ids
    a = [source.row(BLOCK, torch.Generator().manual_seed(7)) for _ in range(3)]
    gen = torch.Generator().manual_seed(7)
    b = [source.row(BLOCK, gen) for _ in range(20)]
    assert all(np.array_equal(x, a[0]) for x in a)  # the same seed draws the same row
    assert np.array_equal(a[0], b[0])
    assert len({r.tobytes() for r in b}) > 15  # and a stream of different ones
    for r in b:
        assert r.shape == (BLOCK + 1,) and r.dtype == np.int64
        assert r[0] == pre and list(r).count(suf) == 1 and list(r).count(mid) == 1
        end = list(r).index(mid)
        assert end < BLOCK  # at least one middle token follows, inside the row
        filler = r[end + 1 :]
        assert fim_tokenizer.eof_id in filler  # then a training file's start packs the row


def _old_get_batch(data: np.ndarray, block: int, batch: int, gen: torch.Generator):
    """Left-to-right windows as pretraining drew them before FIM rows existed."""
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen).tolist()
    x = torch.from_numpy(np.stack([data[i : i + block] for i in ix]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + block] for i in ix]).astype(np.int64))
    return x, y


def test_rate_zero_is_left_to_right_exactly(source: FimSource) -> None:
    x0, y0 = _old_get_batch(source.stream, BLOCK, 16, torch.Generator().manual_seed(3))
    for fim in (None, source):  # no source, or a source at rate 0: the same draws
        x, y = get_batch(source.stream, BLOCK, 16, torch.Generator().manual_seed(3), fim, 0.0)
        assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.parametrize(("rate", "low", "high"), [(1.0, 1.0, 1.0), (0.5, 0.4, 0.6)])
def test_the_rate_is_the_share_of_fim_rows(
    source: FimSource, fim_tokenizer: CodeTokenizer, rate: float, low: float, high: float
) -> None:
    assert fim_tokenizer.fim_ids is not None
    pre, suf, mid = fim_tokenizer.fim_ids
    gen = torch.Generator().manual_seed(11)
    batches = [get_batch(source.stream, BLOCK, 25, gen, source, rate) for _ in range(16)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    share = float((x[:, 0] == pre).float().mean())  # 400 rows: +-0.1 is four sigma at 0.5
    assert low <= share <= high
    assert x.shape == y.shape == (400, BLOCK)
    # every target is trained on except the sentinels: the model never learns to emit one
    sentinels = torch.tensor([pre, suf, mid])
    assert not torch.isin(y, sentinels).any()
    masked = y[:, :-1] == -1
    assert torch.equal(masked, torch.isin(x[:, 1:], sentinels))  # y is x shifted by one ...
    assert torch.equal(y[:, :-1][~masked], x[:, 1:][~masked])  # ... elsewhere unchanged
