"""Copy proposals: the longest earlier match of the text before the cursor, and what followed it.

Code repeats itself within a file and within a project. Given the text before the cursor, find
the longest tail of it that occurred earlier, in the request itself (the file above, the lines
below, the editor's snippets: at least MIN_MATCH_REQUEST bytes) or in the workspace's memory
(other files and other people's: at least MIN_MATCH bytes), and
propose what followed the earlier occurrences, up to the end of their line. When the occurrences
go on differently, the proposal is the part they agree on (their common prefix): a
`self.assertEqual(x, ` seen with `1)` and `2)` proposes nothing, seen twice with `1)` proposes
`1)`. Where the proposal is the whole rest of their line, the lines that followed it (up to
MORE_LINES, up to a blank line) are offered too, as far as the occurrences agree on whole lines
(`Proposal.more`): the policy draws whether to show them (tabloop.core.policy.sampling).

A Text is searched by a suffix array of its reversed UTF-8 bytes (pydivsufsort, libdivsufsort):
the longest tail of the query that occurs in the text is the longest common prefix of the
reversed query with a suffix of the reversed text, and the suffixes sharing it sit next to the
query's insertion point in the array. One binary search (about log2(n) comparisons of at most
MAX_MATCH bytes) finds them: a lookup costs microseconds whatever the size of the text; building
costs about 30 ms per MB, and 5 bytes of RAM per byte of text (the text twice and the int32
array).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydivsufsort import divsufsort

MIN_MATCH = 16  # bytes of the cursor's tail that must match in the workspace's memory
# ... and in the request's own text (the file above, the lines below, the editor's snippets):
# the person's own file, where a shorter match is as good a guide (docs/MODEL.md)
MIN_MATCH_REQUEST = 10
MAX_MATCH = 256  # bytes of the tail compared at most (a longer match counts as this long)
MAX_OCCURRENCES = 64  # occurrences of the longest match read at most
SEPARATOR = b"\x00"  # between documents: never in a request (NUL is refused) so never matched
END = b"\n\x00"  # a continuation's first line stops at the end of its line or of its document
# lines after the first a continuation goes on with at most (up to a blank line or the end of its
# document), and the bytes looked at for them
MORE_LINES = 4
MORE_BYTES = 1024

# the sources of a proposal, in the order a tie in match length is broken
SOURCES = ("prefix", "context", "memory")


@dataclass(frozen=True)
class Match:
    """The longest earlier match of a query's tail in one text."""

    length: int  # bytes of the tail matched (MIN_MATCH..MAX_MATCH)
    # what followed each occurrence: to the end of its line, then (after b"\n") up to MORE_LINES
    # more lines, up to a blank line or the end of its document
    continuations: tuple[bytes, ...]


@dataclass(frozen=True)
class Proposal:
    """What to copy at the cursor, and the evidence for it (the mixer's and the gate's inputs)."""

    text: str  # the proposed rest of the line (non-empty)
    source: str  # one of SOURCES
    match_bytes: int  # length of the matched tail
    occurrences: int  # earlier occurrences of that tail
    agreeing: int  # of them, how many go on with `text` (or longer)
    more: str = ""  # the lines after `text` the occurrences agree on ("" none), without its b"\n"

    @property
    def longer(self) -> str:
        """The proposal with its following lines."""
        return f"{self.text}\n{self.more}" if self.more else self.text

    def features(self) -> list[float]:
        """The numbers the policy reads (tabloop.core.recall.FEATURES names them)."""
        return [
            math.log(self.match_bytes / MIN_MATCH),
            math.log(len(self.text.encode("utf-8"))),
            math.log(self.occurrences),
            self.agreeing / self.occurrences,
            float(self.source == "prefix"),
            float(self.source == "memory"),
        ]


FEATURES = (
    "log_match",  # log(match bytes / MIN_MATCH): 0 at the shortest match
    "log_chars",  # log(bytes proposed)
    "log_occurrences",
    "agreement",  # share of the occurrences that go on with the proposal
    "from_prefix",  # the file above the cursor
    "from_memory",  # the workspace's memory (neither: the request's suffix or snippets)
)


# the copy head's inputs (tabloop.core.policy.model.Gate.copy): the proposal's features,
# then how the language model's sampled completion agrees with it
RECALL_INPUTS = (*FEATURES, "model_agrees", "model_empty")

# the copy head's initial weights (RECALL_INPUTS order, then the bias): a logistic fit of "the
# proposal is a prefix of the true rest of the line", weighted by its length, on the `rich`
# package's files written top to bottom (code the base never trained on, and that the benchmarks
# do not measure on); shifted to copy where that is 1 in 4 or likelier, and doubled. Made by
#     python -m benchmarks.writing --fit --corpus "$(dirname of rich)" --n 3000 --seeds 0
# for the proposals as made now. A checkpoint without a copy head starts from it; the shipped
# base holds a head of its own, an earlier fit of the same kind (docs/MODEL.md)
COPY_INIT = (3.446, -2.332, 2.394, 1.355, 0.28, -0.28, 0.864, 0.43, 3.166)


def recall_inputs(proposal: Proposal, model_text: str) -> list[float]:
    """The copy head's inputs: the proposal's features, and whether the model's own completion
    agrees with it (one is a prefix of the other) or is empty."""
    lm = model_text.rstrip()
    agrees = bool(lm.strip()) and (proposal.text.startswith(lm) or lm.startswith(proposal.text))
    return [*proposal.features(), float(agrees), float(not lm.strip())]


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _continuation(text: bytes, start: int) -> bytes:
    """The bytes from `start` to the end of their line (or document), then up to MORE_LINES
    whole lines after it (within MORE_BYTES), each after its b"\n", up to a blank line: a line
    the document, or the bytes looked at, end in is not whole (a person's own file as sent ends
    at their cursor)."""
    end = len(text)
    for stop in END:
        j = text.find(bytes([stop]), start, end)
        if j >= 0:
            end = j
    if text[end : end + 1] != b"\n":
        return text[start:end]
    window = min(len(text), end + MORE_BYTES)
    doc = text.find(SEPARATOR, end, window)
    doc_end = window if doc < 0 else doc
    for _ in range(MORE_LINES):
        nxt = text.find(b"\n", end + 1, doc_end)
        if nxt < 0 or not text[end + 1 : nxt].strip():
            break
        end = nxt
    return text[start:end]


class Text:
    """A text searchable for the longest earlier match of a tail (module docstring).

    With `starts` (each document's first byte, ascending) and `owners` (who wrote each), a
    match's occurrences count once per owner: each owner's nearest one (a memory's per-person
    cap: tabloop/core/memory.py)."""

    def __init__(self, data: bytes, starts: Sequence[int] = (), owners: Sequence[int] = ()) -> None:
        assert len(starts) == len(owners), "one owner per document"
        self.data = data
        self.starts = np.asarray(starts, dtype=np.int64)
        self.owners = np.asarray(owners, dtype=np.int64)
        self.reversed = data[::-1]
        # int32 positions: a memory is capped far below 2 GiB (tabloop/core/memory.py)
        suffixes = (
            divsufsort(self.reversed).astype(np.int32, copy=False)
            if data
            else np.zeros(0, np.int32)
        )
        # a match that ends where its document ends has nothing after it to propose (a person's
        # own file as last sent ends at their previous cursor): such occurrences are left out,
        # so that the longest match is one that goes on (a sorted subset keeps the property
        # that the longest match sits next to the query's place)
        before = np.frombuffer(self.reversed, np.uint8)[np.maximum(suffixes - 1, 0)]
        self.suffixes = suffixes[(suffixes > 0) & (before != SEPARATOR[0])]

    def __len__(self) -> int:
        return len(self.data)

    def match(self, tail: bytes, min_length: int = MIN_MATCH) -> Match | None:
        """The longest match of a suffix of `tail` here, if at least `min_length` bytes."""
        rev, sa, n = self.reversed, self.suffixes, len(self.data)
        q = tail[-MAX_MATCH:][::-1]
        if len(q) < min_length or n == 0:
            return None
        lo, hi = 0, len(sa)
        while lo < hi:  # the first suffix >= q
            mid = (lo + hi) // 2
            s = int(sa[mid])
            if rev[s : s + len(q)] < q:
                lo = mid + 1
            else:
                hi = mid
        best = 0
        for i in (lo - 1, lo):
            if 0 <= i < len(sa):
                s = int(sa[i])
                best = max(best, _common_prefix(q, rev[s : s + len(q)]))
        if best < min_length:
            return None
        key = q[:best]
        found: list[int] = []
        i = lo - 1
        while i >= 0 and len(found) < MAX_OCCURRENCES and rev.startswith(key, int(sa[i])):
            found.append(int(sa[i]))
            i -= 1
        i = lo
        while i < len(sa) and len(found) < MAX_OCCURRENCES and rev.startswith(key, int(sa[i])):
            found.append(int(sa[i]))
            i += 1
        # s in the reversed text is the match ending at n - s in the text; nearest (latest) first
        ends = sorted((n - s for s in found), reverse=True)
        if len(self.owners):
            docs = np.searchsorted(self.starts, np.asarray(ends) - 1, side="right") - 1
            seen: set[int] = set()
            mine = []
            for end, doc in zip(ends, docs.tolist(), strict=True):
                owner = int(self.owners[doc])
                if owner not in seen:
                    seen.add(owner)
                    mine.append(end)
            ends = mine
        return Match(best, tuple(_continuation(self.data, e) for e in ends))


def match_in(haystack: str, tail: str, min_length: int = MIN_MATCH) -> Match | None:
    """Text.match for a small text searched once (a request's own): by repeated `str.find`,
    no index. The tail's occurrence at the very end of `haystack` (the cursor) does not count."""
    data, q = haystack.encode("utf-8"), tail.encode("utf-8")[-MAX_MATCH:]
    limit = len(data) - 1 if data.endswith(q) else len(data)  # ending before the cursor
    if len(q) < min_length or data.rfind(q[-min_length:], 0, limit) < 0:
        return None
    lo, hi = min_length, len(q)  # the longest k with q[-k:] found (monotone in k)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if data.rfind(q[-mid:], 0, limit) >= 0:
            lo = mid
        else:
            hi = mid - 1
    key, start = q[-lo:], limit
    ends: list[int] = []
    while len(ends) < MAX_OCCURRENCES:
        j = data.rfind(key, 0, start)
        if j < 0:
            break
        ends.append(j + lo)
        start = j + lo - 1
    return Match(lo, tuple(_continuation(data, e) for e in ends))


def agreed(continuations: Sequence[bytes]) -> tuple[bytes, int]:
    """The proposal from a match's continuations and how many agree with it.

    The most common non-empty first line when it is the majority, otherwise the longest
    common prefix of them all, cut back to whole UTF-8 characters."""
    nonempty = [c for c in (c.split(b"\n", 1)[0] for c in continuations) if c.strip()]
    if not nonempty:
        return b"", 0
    text, count = Counter(nonempty).most_common(1)[0]
    if 2 * count <= len(nonempty):
        text = nonempty[0][: min(_common_prefix(nonempty[0], c) for c in nonempty)]
        count = len(nonempty)
    text = text.decode("utf-8", errors="ignore").encode("utf-8")
    return (text, count) if text.strip() else (b"", 0)


def agreed_more(continuations: Sequence[bytes], first: bytes) -> bytes:
    """The lines after the proposal `first` that the continuations going on from all of it
    agree on: the most common when the majority, otherwise their common whole lines."""
    mores = [c[len(first) + 1 :] for c in continuations if c.startswith(first + b"\n")]
    if not mores:
        return b""
    text, count = Counter(mores).most_common(1)[0]
    if 2 * count <= len(mores):
        common = mores[0][: min(_common_prefix(mores[0], m) for m in mores)]
        whole = all(m == common or m.startswith(common + b"\n") for m in mores)
        text = common if whole else common[: max(0, common.rfind(b"\n"))]
    return text.decode("utf-8", errors="ignore").encode("utf-8")


def team_memories(paths: Sequence[Path]) -> dict[Path, Text]:
    """For each of `paths`, written in this order by one team, the memory when its writing
    starts: the earlier files, each ended by a NUL."""
    out, done = {}, b""
    for p in paths:
        out[p] = Text(done)
        done += p.read_bytes().replace(b"\x00", b"") + b"\x00"
    return out


def propose(
    prefix: str,
    context: Iterable[str] = (),
    memory: Text | None = None,
    min_request: int = MIN_MATCH_REQUEST,
    more_lines: bool = True,
) -> Proposal | None:
    """The copy proposal at the end of `prefix`: the longest match of its tail in the prefix
    itself, in the request's other text (`context`: the lines after the cursor, snippets) and
    in the workspace `memory`; the longest wins, earlier in SOURCES on a tie. `more_lines`:
    offer the lines after it too (not where text follows the cursor on its line)."""
    tail = prefix[-MAX_MATCH:]
    candidates: list[tuple[str, Match]] = []
    m = match_in(prefix, tail, min_request)
    if m is not None:
        candidates.append(("prefix", m))
    for text in context:
        m = match_in(text + "\n", tail, min_request)  # the context never holds the cursor
        if m is not None:
            candidates.append(("context", m))
    if memory is not None:
        m = memory.match(tail.encode("utf-8"))
        if m is not None:
            candidates.append(("memory", m))
    best: Proposal | None = None
    for source, m in sorted(candidates, key=lambda c: -c[1].length):
        proposed, count = agreed(m.continuations)
        if proposed:
            more = agreed_more(m.continuations, proposed) if more_lines else b""
            p = Proposal(
                proposed.decode("utf-8"),
                source,
                m.length,
                len(m.continuations),
                count,
                more.decode("utf-8"),
            )
            if best is None or p.match_bytes > best.match_bytes:
                best = p
    return best
