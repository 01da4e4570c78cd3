"""What the model sees of a request: the context token ids, built from the prefix and suffix.

Left to right (a tokenizer without FIM sentinels, such as the shipped base's): the tail of the
prefix, healed, starting at a line boundary, with `<|eof|>` in front when the whole file prefix
fits. The suffix is not read.

Fill-in-the-middle (a tokenizer with the sentinels), PSM order (Bavarian et al. 2022):

    <|fim_prefix|> prefix tail <|fim_suffix|> head of the following lines <|fim_middle|>

then generation re-emits the healed bytes and goes on with the rest of the line. The suffix the
model reads is the *following lines*: the text after the cursor's line, since a completion is
the rest of that line and pretraining cut the middle at the end of a line (trainer/fim.py). The
suffix gets at most a quarter of the context budget (its first tokens, the nearest code), the
prefix the rest. The context is built by one function for serving and for pretraining, and a
rollout logs exactly these ids, so rescoring a logged rollout never tokenizes text again.
"""

from __future__ import annotations

from tabloop.core.policy.tokenizer import CodeTokenizer, Healing

CHARS_PER_TOKEN_BOUND = 8  # characters kept per context token before encoding
SUFFIX_SHARE = 4  # the suffix gets at most 1 / SUFFIX_SHARE of the context budget
MIN_PREFIX_TOKENS = 2  # the smallest prefix context (the healed tail needs room)


def context_overhead(tokenizer: CodeTokenizer) -> int:
    """Context tokens that are not text: the three sentinels of a FIM tokenizer."""
    return 3 if tokenizer.fim else 0


def following_lines(suffix: str) -> str:
    """The lines after the cursor's line: the text after the suffix's first newline."""
    i = suffix.find("\n")
    return "" if i < 0 else suffix[i + 1 :]


def prepare_context(
    tokenizer: CodeTokenizer,
    prefix: str,
    block_size: int,
    max_new_tokens: int,
    heal: bool = True,
    max_context_tokens: int | None = None,
    suffix: str = "",
) -> Healing:
    """The context ids the model sees (and the healed bytes it must re-emit first).

    The budget is `block_size - max_new_tokens`, capped by `max_context_tokens` (prefill time
    is about linear in it). A left-to-right tokenizer ignores `suffix`; a FIM tokenizer lays
    out prefix and suffix in PSM order within the same budget (module docstring).
    """
    budget = block_size - max_new_tokens
    if max_context_tokens is not None:
        budget = min(budget, max_context_tokens)
    if tokenizer.fim_ids is None:
        return prefix_context(tokenizer, prefix, budget, heal)
    pre, suf, mid = tokenizer.fim_ids
    room = max(0, min(budget // SUFFIX_SHARE, budget - 3 - MIN_PREFIX_TOKENS))
    suffix_ids = tokenizer.encode(following_lines(suffix)[: room * CHARS_PER_TOKEN_BOUND])[:room]
    healing = prefix_context(tokenizer, prefix, budget - 3 - len(suffix_ids), heal)
    return Healing([pre, *healing.context_ids, suf, *suffix_ids, mid], healing.constraint)


def prefix_context(tokenizer: CodeTokenizer, prefix: str, budget: int, heal: bool) -> Healing:
    """Encode the prefix tail, heal its end, keep the last `budget` tokens.

    `<|eof|>` (the file separator seen in training) is prepended when the whole prefix fits,
    so the model knows it is at the start of a file.
    """
    assert budget >= MIN_PREFIX_TOKENS, f"a context budget of {budget} leaves no room"
    tail = prefix[-budget * CHARS_PER_TOKEN_BOUND :]
    whole = len(tail) == len(prefix)
    if not whole and "\n" in tail:
        tail = tail[tail.index("\n") + 1 :]  # start on a line boundary, tokenized as in training
    healing = tokenizer.encode_healed(tail) if heal else Healing(tokenizer.encode(tail), b"")
    try:
        healing.constraint.decode("utf-8")
    except UnicodeDecodeError:  # healed bytes cut a character: don't heal
        healing = Healing(tokenizer.encode(tail), b"")
    ids = healing.context_ids
    if whole and len(ids) + 1 <= budget:
        ids = [tokenizer.eof_id] + ids
    return Healing(ids[-budget:], healing.constraint)
