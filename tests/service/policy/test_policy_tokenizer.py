"""Tokenizer round trips and token healing."""

from __future__ import annotations

import random

import pytest

from tabloop.core.policy.context import prepare_context
from tabloop.core.policy.tokenizer import EOF_TOKEN, CodeTokenizer

SAMPLES = [
    "",
    "x",
    "def f(a, b):\n    return a + b\n",
    "    if self._closed:\n        raise ValueError('I/O operation on closed file')",
    "s = 'naïve – ünïcödé ✓ 漢字'\n",
    "\t\tmixed\ttabs  \r\n  and CRLF\r\n",
    f"literal {EOF_TOKEN} in user code",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tiny_tokenizer: CodeTokenizer, text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer.decode_bytes(ids) == text.encode("utf-8")


def test_special_token_text_is_plain_text(tiny_tokenizer: CodeTokenizer) -> None:
    assert tiny_tokenizer.eof_id not in tiny_tokenizer.encode(f"a {EOF_TOKEN} b")
    assert tiny_tokenizer.token_bytes[tiny_tokenizer.eof_id] == b""


def test_round_trip_random_text(tiny_tokenizer: CodeTokenizer) -> None:
    rng = random.Random(0)
    alphabet = "abcXYZ_01 ()[]{}:.,'\"\n\t#=+-*/é漢"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


def test_json_round_trip(tiny_tokenizer: CodeTokenizer) -> None:
    again = CodeTokenizer.from_json(tiny_tokenizer.to_json())
    assert again.encode(SAMPLES[3]) == tiny_tokenizer.encode(SAMPLES[3])
    assert again.vocab_size == tiny_tokenizer.vocab_size


@pytest.mark.parametrize(
    "prefix",
    ["        return sel", "    def __ini", "x = ", "import o", "foo(", "a\n", "    ", "json.dum"],
)
def test_healing_backs_off_and_reconstructs(tiny_tokenizer: CodeTokenizer, prefix: str) -> None:
    h = tiny_tokenizer.encode_healed(prefix)
    assert h.constraint, "a non-empty prefix is always healed by at least one token"
    assert tiny_tokenizer.decode_bytes(h.context_ids) + h.constraint == prefix.encode()
    assert len(tiny_tokenizer.encode(prefix)) - len(h.context_ids) <= 3


def test_healing_takes_the_whole_last_word(tiny_tokenizer: CodeTokenizer) -> None:
    h = tiny_tokenizer.encode_healed("        return self.assertEqu")
    assert h.constraint.decode().endswith("Equ")
    assert not h.constraint.startswith(b".")  # stops at the word boundary


def test_healing_empty_prefix(tiny_tokenizer: CodeTokenizer) -> None:
    h = tiny_tokenizer.encode_healed("")
    assert h.context_ids == [] and h.constraint == b""


@pytest.mark.parametrize(
    "remaining", [b" ", b"sel", b" self", b"\n    ", b"__init__", b"\xc3", b"\xff", b"a\xff"]
)
def test_allowed_tokens_are_consistent(tiny_tokenizer: CodeTokenizer, remaining: bytes) -> None:
    allowed = set(tiny_tokenizer.allowed_tokens(remaining))
    tb = tiny_tokenizer.token_bytes
    want = {
        i for i, b in enumerate(tb) if b and (remaining.startswith(b) or b.startswith(remaining))
    }
    assert allowed == want
    assert tiny_tokenizer.eof_id not in allowed


def test_prepare_context_bounds_and_eof(
    tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    short = prepare_context(tiny_tokenizer, "import os\nx = o", block_size=64, max_new_tokens=16)
    assert short.context_ids[0] == tiny_tokenizer.eof_id  # start of file is marked
    assert (
        tiny_tokenizer.decode_bytes(short.context_ids[1:]) + short.constraint == b"import os\nx = o"
    )
    long_prefix = small_code[0] + "\n    return sel"
    long = prepare_context(tiny_tokenizer, long_prefix, block_size=64, max_new_tokens=16)
    assert len(long.context_ids) == 64 - 16
    assert tiny_tokenizer.eof_id not in long.context_ids
    text = tiny_tokenizer.decode_bytes(long.context_ids) + long.constraint
    assert long_prefix.encode().endswith(text)
