"""Fill-in-the-middle rows for pretraining, in the layout serving reads.

Bavarian et al. 2022 ("Efficient Training of Language Models to Fill in the Middle"): a share of
the training sequences (`fim_rate`; 0.5 there and here) is put in prefix-suffix-middle (PSM)
order with sentinel tokens, the rest stays left to right, and the model learns to fill in the
middle at little cost to its left-to-right quality.

The middle is what serving asks for: a cursor in a random non-blank line of a training file (a
column from its indentation to its last character), the middle the rest of that line with its
newline, the prefix the file before the cursor, the suffix the file after it. The context is
`tabloop.core.policy.context.prepare_context` on them — exactly what serving builds, token healing
and the suffix's share of the budget included — for a context budget drawn uniformly from
[MIN_BUDGET, block_size - max_new_tokens] (serving's is 96). The target follows it: the healed
bytes again, the rest of the line and the newline (at most max_new_tokens), as the settled-text
targets are built. Then the start of a random training file, after its `<|eof|>`, fills the row
to the block, as packed documents do. A row is trained on every position except where the
target is a FIM sentinel, so the model never learns to emit one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tabloop.core.policy.context import prepare_context
from tabloop.core.policy.tokenizer import CodeTokenizer

MIN_BUDGET = 32  # smallest context budget of a training row, in tokens


def line_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the text's non-blank lines, without the newline."""
    out, pos = [], 0
    for line in text.split("\n"):
        if line.strip():
            out.append((pos, pos + len(line)))
        pos += len(line) + 1
    return out


def cursor_columns(line: str) -> tuple[int, int]:
    """The cursor columns a row may use in a non-blank line: [indentation, last character]."""
    indent = len(line) - len(line.lstrip())
    return indent, len(line.rstrip()) - 1


def split_at(text: str, start: int, end: int, col: int) -> tuple[str, str, str]:
    """(prefix, middle, suffix) for a cursor at `col` of the line text[start:end]: the middle is
    the rest of the line and its newline, the suffix everything after the cursor (the context
    reads the lines after the cursor's line, as it does for a request)."""
    cursor = start + col
    return text[:cursor], text[cursor:end] + "\n", text[cursor:]


def fim_tokens(
    tokenizer: CodeTokenizer,
    prefix: str,
    middle: str,
    suffix: str,
    block_size: int,
    budget: int,
    max_new_tokens: int,
) -> tuple[list[int], list[int]]:
    """(context ids, target ids) of one FIM example: the context serving would build with this
    budget, and the tokens generation should produce after it (the healed bytes, the middle)."""
    assert tokenizer.fim_ids is not None, "a FIM row needs a tokenizer with the sentinels"
    healing = prepare_context(tokenizer, prefix, block_size, block_size - budget, suffix=suffix)
    target = tokenizer.encode(healing.constraint.decode("utf-8") + middle)[:max_new_tokens]
    return healing.context_ids, target


class FimSource:
    """The training files, as text (for the cursors) and as the token stream (for the fill)."""

    def __init__(
        self,
        tokenizer: CodeTokenizer,
        texts: Sequence[str],
        stream: np.ndarray,
        file_starts: np.ndarray,
        max_new_tokens: int = 32,
    ) -> None:
        assert tokenizer.fim_ids is not None, "FIM rows need a tokenizer with the sentinels"
        self.tokenizer, self.texts, self.stream = tokenizer, list(texts), stream
        self.file_starts = file_starts
        self.max_new_tokens = max_new_tokens
        spans = [(f, a, b) for f, t in enumerate(self.texts) for a, b in line_spans(t)]
        assert spans, "no non-blank line to place a cursor in"
        self.lines = np.array(spans, dtype=np.int64)  # (file, start, end) per non-blank line
        self.sentinels = np.array(tokenizer.fim_ids, dtype=np.int64)

    def row(self, block_size: int, gen: torch.Generator) -> np.ndarray:
        """One FIM row of block_size + 1 tokens (module docstring), drawn with `gen`."""
        max_new = min(self.max_new_tokens, block_size // 2)
        f, start, end = (int(v) for v in self.lines[_draw(len(self.lines), gen)])
        text = self.texts[f]
        lo, hi = cursor_columns(text[start:end])
        col = lo + _draw(hi - lo + 1, gen)
        top = block_size - max_new
        low = min(MIN_BUDGET, top)
        budget = low + _draw(top - low + 1, gen)
        prefix, middle, suffix = split_at(text, start, end, col)
        context, target = fim_tokens(
            self.tokenizer, prefix, middle, suffix, block_size, budget, max_new
        )
        ids = np.array(context + target, dtype=np.int64)
        fill = block_size + 1 - len(ids)
        assert fill >= 1, f"a FIM row of {len(ids)} tokens does not fit the block"
        s = int(self.file_starts[_draw(len(self.file_starts), gen)])
        s = min(s, len(self.stream) - fill)
        return np.concatenate([ids, self.stream[s : s + fill].astype(np.int64)])

    def mask_targets(self, y: torch.Tensor) -> torch.Tensor:
        """Targets with the sentinels replaced by -1 (ignored by the loss)."""
        return y.masked_fill(torch.isin(y, torch.from_numpy(self.sentinels)), -1)


def _draw(n: int, gen: torch.Generator) -> int:
    """A uniform integer in [0, n) from `gen` (so a resumed run draws the same rows)."""
    return int(torch.randint(n, (1,), generator=gen))
