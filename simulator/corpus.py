"""The code the simulated people edit: the standard library's held-out split (the default), or
every `*.py` file under a directory (`tabloop simulate --corpus DIR`).

A directory is read with the stdlib loader's rules (tabloop.core.corpus): tests (`test`, `tests`,
`idle_test` directories, `test_*.py` files) and generated data files are left out; both halves of
its split are used, since the project never trained on it. That is the point of `--corpus`:
measuring on code the base policy never saw, e.g. a third-party package in site-packages.
"""

from __future__ import annotations

from pathlib import Path

from tabloop.core.corpus import CorpusLine, corpus_files, heldout_lines, lines_of


class CorpusError(ValueError):
    """A --corpus that is not a directory of Python code."""


def corpus_paths(root: Path) -> list[Path]:
    """The `*.py` files under `root` (recursively) the people edit, sorted by path."""
    return sorted(corpus_files("train", root) + corpus_files("heldout", root))


def load_lines(corpus: Path | None = None) -> list[CorpusLine]:
    """Every non-blank line of the people's code: `corpus`'s files, or the stdlib's held-out split
    when None. CorpusError when `corpus` is not a directory with a line of code."""
    if corpus is None:
        return list(heldout_lines())
    root = corpus.resolve()
    if not root.is_dir():
        raise CorpusError(f"--corpus {corpus}: not a directory")
    lines = list(lines_of(corpus_paths(root)))
    if not lines:
        raise CorpusError(f"--corpus {corpus}: no non-test *.py file with code under it")
    return lines
