"""Copy proposals: the longest earlier match of the text before the cursor, and what followed."""

from __future__ import annotations

import random

import pytest

from tabloop.core.recall import (
    MIN_MATCH,
    MIN_MATCH_REQUEST,
    RECALL_INPUTS,
    Proposal,
    Text,
    agreed,
    agreed_more,
    match_in,
    propose,
    recall_inputs,
)

FILE = (
    "class Foo(object):\n"
    "    def __init__(self, name, path):\n"
    "        self.name = name\n"
    "        with open(path, encoding='utf-8') as f:\n"
    "            self.text = f.read()\n"
)


def brute_longest(haystack: bytes, tail: bytes, limit: int) -> int:
    """The longest k with tail[-k:] occurring in haystack ending at or before `limit`."""
    best = 0
    for k in range(1, len(tail) + 1):
        if haystack.rfind(tail[-k:], 0, limit) >= 0:
            best = k
    return best


def test_the_prefix_proposes_what_followed_its_earlier_match() -> None:
    prefix = FILE + "\n    def load(self, path):\n        with open(path"
    p = propose(prefix)
    assert p is not None
    assert (p.text, p.source) == (", encoding='utf-8') as f:", "prefix")
    assert p.match_bytes >= MIN_MATCH_REQUEST and p.occurrences == 1 and p.agreeing == 1


def test_the_request_needs_a_shorter_match_than_the_memory() -> None:
    # the match " = getter(name" is 14 bytes: enough in the person's own request, not in the
    # memory (other files and other people's text: tabloop/core/memory.py)
    earlier = "    x = getter(name, default)\n"
    prefix = "y = 0\n    z = getter(name"
    assert MIN_MATCH_REQUEST <= len(" = getter(name") < MIN_MATCH
    p = propose(earlier + prefix)
    assert p is not None and (p.text, p.source) == (", default)", "prefix")
    assert propose(prefix, (), Text(earlier.encode("utf-8"))) is None
    assert propose(prefix, [earlier]) == Proposal(", default)", "context", 14, 1, 1)


def test_the_cursor_itself_is_not_an_earlier_match() -> None:
    assert propose("x = compute_something_long(a)\n") is None  # only the cursor's own text
    assert propose("    return self.") is None  # shorter than MIN_MATCH


def test_occurrences_that_disagree_propose_only_what_they_share() -> None:
    # two earlier files, each starting with the line: the same match, two continuations
    memory = Text(b"self.assertEqual(value, 1)\n\x00self.assertEqual(value, 2)\n")
    assert agreed([b"1)", b"2)"]) == (b"", 0)
    p = propose("self.assertEqual(val", (), memory)
    assert p is not None and p.text == "ue, " and (p.occurrences, p.agreeing) == (2, 2)
    assert agreed([b"1)", b"1)", b"2)"]) == (b"1)", 2)  # a majority wins


def test_the_suffix_and_snippets_are_searched_and_the_longest_match_wins() -> None:
    snippet = "def helper(config, *, retries=3, timeout=10.0):\n"
    p = propose("x = 1\nresult = helper(config, *, retries", [snippet])
    assert p is not None and p.source == "context" and p.text.startswith("=3, timeout=10.0)")
    memory = Text(b"unrelated\x00result = helper(config, *, retries=5)\n")
    p = propose("x = 1\nresult = helper(config, *, retries", [snippet], memory)
    assert p is not None and (p.source, p.text) == ("memory", "=5)")  # a longer match


def test_a_memory_never_matches_across_documents_nor_at_their_end() -> None:
    memory = Text(b"a long line that goes on(1)\x00a long line that goes on(2)\nend")
    m = memory.match(b"x = a long line that goes on(")
    assert m is not None and sorted(m.continuations) == [b"1)", b"2)"]  # each stops at its end
    # a match where a document ends (a person's file as last sent) has nothing to propose
    assert (
        Text(b"the end of a document is here\x00next").match(b"the end of a document is here")
        is None
    )


@pytest.mark.parametrize("seed", range(5))
def test_the_index_finds_the_longest_match_a_brute_force_finds(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab(\n"
    text = "".join(rng.choice(alphabet) for _ in range(3000)).encode()
    index = Text(text)
    for _ in range(50):
        tail = "".join(rng.choice(alphabet) for _ in range(40)).encode()
        want = brute_longest(text, tail, len(text))
        got = index.match(tail, min_length=1)
        assert (got.length if got else 0) == want
        small = match_in(text.decode(), tail.decode(), min_length=1)
        assert (small.length if small else 0) == want


def test_recall_inputs_name_every_input_and_read_the_models_agreement() -> None:
    p = propose(FILE + "\n    def load(self, path):\n        with open(path")
    assert p is not None
    agree = recall_inputs(p, ", encoding=")
    disagree = recall_inputs(p, ") as g:")
    empty = recall_inputs(p, "")
    assert len(agree) == len(RECALL_INPUTS)
    i, j = RECALL_INPUTS.index("model_agrees"), RECALL_INPUTS.index("model_empty")
    assert (agree[i], agree[j]) == (1.0, 0.0)
    assert (disagree[i], disagree[j]) == (0.0, 0.0)
    assert (empty[i], empty[j]) == (0.0, 1.0)


def test_a_whole_line_copy_offers_the_lines_after_it_as_far_as_they_agree() -> None:
    block = "def area(w, h):\n    s = w * h\n    return s\n    # unreachable\n\nx = 1\n"
    p = propose(block + "def area(w, h):\n    s =")
    assert p is not None and (p.text, p.more) == (" w * h", "    return s\n    # unreachable")
    assert p.longer == " w * h\n    return s\n    # unreachable"  # up to the blank line
    assert propose(block + "def area(w, h):\n    s =", more_lines=False).more == ""  # type: ignore[union-attr]
    # occurrences that go on differently offer the whole lines they share, the majority's
    # lines when there is one, nothing past a partial first line
    assert agreed_more([b"a\nb\nc", b"a\nb\nd"], b"a") == b"b"
    assert agreed_more([b"a\nb\nc", b"a\nb\nc", b"a\nbx"], b"a") == b"b\nc"
    assert agreed_more([b"a\nb", b"a\nc"], b"a") == b""
    assert agreed_more([b"ab\nc", b"ax\nc"], b"a") == b""
    # a document's last line, not ended by a newline, is not whole (a person's file as sent
    # ends at their cursor); nor is a line the memory's document ends in
    m = Text(b"for i in range(10):\n    total += i\n    print(to\x00").match(b"for i in range(10")
    assert m is not None and m.continuations == (b"):\n    total += i",)
