"""Writing mode (`tabloop simulate --mode write`): a team writes the corpus's files top to bottom.

Each person takes the next file nobody has started and writes it line by line: at each non-blank
line they ask for a completion at a random column (tabloop.core.corpus.cursor_in_line), with the
file above as the prefix and no suffix. When every file has been started, the next person starts the
first one again (a second pass, whose lines were all sent before). No cursor's text was sent at
that place before; whether it was sent anywhere (then a memory could recall it) is the
simulation's to say (simulator.population.SentLines).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tabloop.core.corpus import CorpusLine, Cursor, cursor_in_line, read_text


@dataclass
class _Writing:
    path: Path
    lines: tuple[str, ...]
    next_line: int = 0  # the next line to write


class WritingSource:
    """The cursors of people writing files top to bottom (module docstring)."""

    def __init__(self, paths: Sequence[Path], seed: int | None = None) -> None:
        """With a `seed`, a line's column is drawn from the seed and the line alone (not the
        person's rng): whoever writes the line, in whichever run of that seed, asks there."""
        assert paths, "no files to write"
        self.paths = list(paths)
        self.seed = seed
        self.started = 0  # files started so far (all passes)
        self.writing: dict[str, _Writing] = {}  # person -> the file they are writing

    def _next_file(self) -> _Writing:
        path = self.paths[self.started % len(self.paths)]
        self.started += 1
        return _Writing(path, tuple(read_text(path).split("\n")))

    def draw(self, user_id: str, rng: random.Random) -> Cursor:
        """The person's next cursor."""
        w = self.writing.get(user_id)
        for _ in range(2 * len(self.paths) + 1):
            if w is None or w.next_line >= len(w.lines):
                w = self.writing[user_id] = self._next_file()
            while w.next_line < len(w.lines):
                i = w.next_line
                w.next_line += 1
                at = rng if self.seed is None else random.Random(f"{self.seed}:{w.path}:{i}")
                cur = cursor_in_line(CorpusLine(w.path, i, w.lines), at)
                if cur is None:
                    continue
                return Cursor(cur.path, i, cur.prefix, "", cur.rest_of_line, cur.suffix)
        raise AssertionError("no file has a line to complete")
