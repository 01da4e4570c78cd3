"""The code corpus: the Python standard library of the running interpreter, or a directory of an
operator's own code (`tabloop pretrain --corpus DIR`), split by file.

Which files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, except
- tests: any path part `test`, `tests` or `idle_test` (this covers `idlelib/idle_test` and
  `lib2to3/tests`), and files named `test_*.py`;
- third-party code: anything under `site-packages` / `dist-packages`;
- generated data rather than code: files over `MAX_FILE_BYTES` (200 KB: `pydoc_data/topics.py`,
  `_pydecimal.py`), and files where at least `DATA_LINE_FRACTION` of the non-blank, non-comment
  lines are a bare literal (a string/number table entry such as `'\\x00'  # 0x00 -> NULL` or
  `'AElig': 'Æ',`) and there are at least `DATA_MIN_LINES` such lines: the `encodings/` charmap
  tables, `html/entities.py`, `stringprep.py`, `locale.py`'s alias tables, `_sysconfigdata*`.

The split is by file and deterministic: a file is held out when the SHA-256 of its path relative
to the stdlib root (POSIX form) falls in the first `HELDOUT_PER_MILLE` of 1000 buckets (~5%).
Held-out files are for evaluation and simulation only; pretraining asserts it never reads one.

A directory corpus (`directory_files`) takes every text file under it, whatever its extension,
except: files in VCS, virtual-environment, cache and dependency directories (`SKIPPED_DIRS`, and
any directory holding a `pyvenv.cfg`) and in any hidden directory; hidden files (`.env` and the
like); lock files and minified bundles (`SKIPPED_SUFFIXES`); files over `MAX_FILE_BYTES`; binary
files (a NUL byte, or not UTF-8, in the first `SNIFF_BYTES`). Its split is the same hash of the
path relative to DIR; when no file falls in the held-out buckets (a corpus of a few dozen files
or fewer), the file with the lowest bucket is held out, so there is always something to
evaluate on.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import random
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Literal

Split = Literal["train", "heldout"]

HELDOUT_PER_MILLE = 50  # ~5% of files are held out
MAX_FILE_BYTES = 200_000  # larger files are generated data or too atypical
DATA_LINE_FRACTION = 0.6  # share of bare-literal lines that marks a data table ...
DATA_MIN_LINES = 100  # ... when there are at least this many of them
FILE_SEPARATOR = "\n<|eof|>\n"  # between files in read_corpus(); the tokenizer's <|eof|>
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})
# directory corpora: never code of the operator's own
SKIPPED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".venv",
        "venv",
        "node_modules",
        "__pycache__",
        "site-packages",
        "dist-packages",
        ".tox",
        ".nox",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        "bower_components",
    }
)
SKIPPED_SUFFIXES = (".lock", "-lock.json", "-lock.yaml", ".min.js", ".min.css", ".map")
SNIFF_BYTES = 8192  # bytes read to tell text from binary

# A line that is only a literal, optionally "key: value", a trailing comma and a comment.
_KEY = r"""(?:[rbuRBU]{0,2}(?P<q1>['"]).*?(?P=q1)|0x[0-9a-fA-F]+|-?\d+(?:\.\d*)?|None|[()\[\]{}])"""
_VALUE = r"""(?:[rbuRBU]{0,2}(?P<q2>['"]).*?(?P=q2)|0x[0-9a-fA-F]+|-?\d+(?:\.\d*)?|None|\(.*\))"""
_LITERAL_LINE = re.compile(rf"^\s*{_KEY}\s*(?::\s*{_VALUE})?\s*,?\s*(?:#.*)?$")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded_path(rel: PurePosixPath) -> bool:
    """Tests and third-party code, by path alone."""
    if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
        return True
    return rel.name.startswith("test_") or rel.suffix != ".py"


def is_data_file(text: str) -> bool:
    """Generated tables rather than code: too big, or mostly bare literal lines."""
    if len(text.encode("utf-8", errors="replace")) > MAX_FILE_BYTES:
        return True
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    literal = sum(1 for ln in lines if _LITERAL_LINE.match(ln))
    return literal >= DATA_MIN_LINES and literal >= DATA_LINE_FRACTION * len(lines)


def heldout_bucket(rel: PurePosixPath | str) -> int:
    """The relative path's bucket in [0, 1000): sha256 of its POSIX form."""
    digest = hashlib.sha256(str(PurePosixPath(rel)).encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000


def is_heldout(rel: PurePosixPath | str) -> bool:
    """Deterministic ~5% file-level split on the hash of the relative path."""
    return heldout_bucket(rel) < HELDOUT_PER_MILLE


def read_text(path: Path) -> str:
    # stdlib sources are UTF-8; a stray byte must not stop training
    return path.read_text(encoding="utf-8", errors="replace")


@cache
def _all_files(root: Path) -> tuple[tuple[Path, bool], ...]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = PurePosixPath(path.relative_to(root).as_posix())
        if not path.is_file() or is_excluded_path(rel) or is_data_file(read_text(path)):
            continue
        out.append((path, is_heldout(rel)))
    return tuple(out)


def corpus_files(split: Split, root: Path | None = None) -> list[Path]:
    """The split's files, sorted by path (stable across runs and machines)."""
    assert split in ("train", "heldout"), f"unknown split {split!r}"
    want = split == "heldout"
    return [p for p, held in _all_files(root or stdlib_root()) if held == want]


def is_text_file(path: Path) -> bool:
    """No NUL byte and valid UTF-8 in the first SNIFF_BYTES (a character cut at the end is fine)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def is_skipped_file(name: str) -> bool:
    """Hidden files, lock files and minified bundles of a directory corpus."""
    return name.startswith(".") or name.endswith(SKIPPED_SUFFIXES)


@cache
def _directory_files(root: Path) -> tuple[tuple[Path, bool], ...]:
    found: list[Path] = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIPPED_DIRS
            and not d.startswith(".")
            and not (Path(here) / d / "pyvenv.cfg").exists()  # a virtual environment by any name
        ]
        for name in names:
            path = Path(here) / name
            if is_skipped_file(name) or path.is_symlink() or not path.is_file():
                continue
            if path.stat().st_size > MAX_FILE_BYTES or not is_text_file(path):
                continue
            found.append(path)
    rels = {p: PurePosixPath(p.relative_to(root).as_posix()) for p in found}
    held = {p for p in found if is_heldout(rels[p])}
    if not held and len(found) >= 2:  # a small corpus: hold out the lowest bucket
        held = {min(found, key=lambda p: (heldout_bucket(rels[p]), str(rels[p])))}
    return tuple((p, p in held) for p in sorted(found))


def directory_files(split: Split, root: Path) -> list[Path]:
    """A directory corpus's split: its text files (module docstring), sorted by path."""
    assert split in ("train", "heldout"), f"unknown split {split!r}"
    want = split == "heldout"
    return [p for p, held in _directory_files(Path(root).resolve()) if held == want]


def writing_files(corpus: Path | None = None) -> list[Path]:
    """The files a team writes in the writing benchmarks, in writing order: the standard
    library's held-out files, or every non-test `*.py` file under `corpus` (a package)."""
    if corpus is None:
        return sorted(corpus_files("heldout"))
    return sorted(
        p
        for p in directory_files("heldout", corpus) + directory_files("train", corpus)
        if p.suffix == ".py"
    )


def read_corpus(split: Split, root: Path | None = None) -> str:
    """All of a split's files as one string, joined with FILE_SEPARATOR."""
    return FILE_SEPARATOR.join(read_text(p) for p in corpus_files(split, root))


@dataclass(frozen=True)
class CorpusLine:
    """One line of a corpus file with its surroundings (lines share the file's tuple)."""

    path: Path  # the file
    line_no: int  # 0-based index of `line` in the file
    lines: tuple[str, ...]  # every line of the file, without line endings

    @property
    def line(self) -> str:
        return self.lines[self.line_no]

    @property
    def prefix_lines(self) -> tuple[str, ...]:
        return self.lines[: self.line_no]

    @property
    def suffix_lines(self) -> tuple[str, ...]:
        return self.lines[self.line_no + 1 :]


@dataclass(frozen=True)
class Cursor:
    """An editing position inside a real line: what an editor would send, and the truth."""

    path: Path  # the file
    line_no: int  # 0-based line of the cursor
    prefix: str  # file text before the cursor
    suffix: str  # file text after the cursor (starting with the rest of the line)
    rest_of_line: str  # the true completion: suffix up to (not including) the newline
    # the true text after the cursor where `suffix` (what is sent) holds none of it: writing
    # new code; "" where the suffix is that text (`truth_after`)
    ahead: str = ""

    def truth_after(self, lines: int = 0) -> str:
        """What really follows the cursor: the rest of its line and the next `lines` lines."""
        if not lines:
            return self.rest_of_line
        return "\n".join((self.ahead or self.suffix).split("\n")[: lines + 1])


def exact_match(completion: str, rest_of_line: str) -> bool:
    """The completion is the rest of the line (trailing whitespace ignored)."""
    return completion.rstrip() == rest_of_line.rstrip()


def prefix_match(completion: str, rest_of_line: str) -> bool:
    """A non-empty completion the user could accept as is: exact, or a prefix of the truth."""
    if not completion.strip():
        return False
    return rest_of_line.startswith(completion) or exact_match(completion, rest_of_line)


def usefulness(text: str, rest_of_line: str) -> tuple[int, bool]:
    """(useful characters, whole line) of a shown suggestion: all of it when it is the rest of
    the line (trailing whitespace aside), its length when it is a prefix of it, else 0."""
    if not text.strip():
        return 0, False
    if text.rstrip() == rest_of_line.rstrip():
        return len(text.rstrip()), True
    return (len(text), False) if rest_of_line.startswith(text) else (0, False)


def iter_lines(split: Split = "heldout", root: Path | None = None) -> Iterator[CorpusLine]:
    """Every non-blank line of the split's files, in file order."""
    return lines_of(corpus_files(split, root))


def lines_of(paths: Iterable[Path]) -> Iterator[CorpusLine]:
    """Every non-blank line of the given files, in order."""
    for path in paths:
        lines = tuple(read_text(path).split("\n"))
        for i, line in enumerate(lines):
            if line.strip():
                yield CorpusLine(path, i, lines)


def heldout_lines(root: Path | None = None) -> Iterator[CorpusLine]:
    """Held-out lines as (file, line_no, prefix_lines, line, suffix_lines) carriers."""
    return iter_lines("heldout", root)


def cursor_in_line(cl: CorpusLine, rng: random.Random) -> Cursor | None:
    """A cursor at a random column after the indentation and before the last character.

    None when the line has fewer than two non-indent characters (nothing to complete).
    """
    line = cl.line.rstrip()
    indent = len(line) - len(line.lstrip())
    if len(line) - indent < 2:
        return None
    col = rng.randint(indent + 1, len(line) - 1)
    before = "\n".join(cl.prefix_lines + (cl.line[:col],))
    after = "\n".join((cl.line[col:],) + cl.suffix_lines)
    return Cursor(cl.path, cl.line_no, before, after, cl.line[col:])


def sample_cursors(split: Split, n: int, seed: int, root: Path | None = None) -> list[Cursor]:
    """n cursors at random points inside random non-blank lines of the split (seeded)."""
    return cursors_from(corpus_files(split, root), n, seed)


def cursors_from(paths: Iterable[Path], n: int, seed: int) -> list[Cursor]:
    """n cursors at random points inside random non-blank lines of these files (seeded)."""
    rng = random.Random(seed)
    candidates: Sequence[CorpusLine] = list(lines_of(paths))
    assert candidates, "no lines to place a cursor in"
    out: list[Cursor] = []
    while len(out) < n:
        cur = cursor_in_line(rng.choice(candidates), rng)
        if cur is not None:
            out.append(cur)
    return out


def writing_cursors(paths: Sequence[Path], n: int, seed: int) -> list[tuple[Cursor, bool]]:
    """Cursors of people writing `paths` top to bottom, in that order, with no suffix, each with
    whether its line was sent before.

    Every non-blank line is a candidate: nobody sent the cursor's line at this place before.
    A line whose text (stripped) is a line of an earlier file or of the file above is marked
    `True` (repeated): a memory could recall it; the others were never sent in any form. Each
    cursor is at a random column inside its line (`cursor_in_line`); its prefix is the file
    above and the line up to the cursor, its suffix empty. About `n` cursors, spread over the
    files in proportion to their lines (seeded), in writing order."""
    seen: set[str] = set()
    candidates: list[tuple[CorpusLine, bool]] = []
    for path in paths:
        lines = tuple(read_text(path).split("\n"))
        for i, line in enumerate(lines):
            key = line.strip()
            if key:
                candidates.append((CorpusLine(path, i, lines), key in seen))
            seen.add(key)
    rng = random.Random(seed)
    share = min(1.0, n / max(1, len(candidates)))
    out: list[tuple[Cursor, bool]] = []
    for cl, repeated in candidates:
        if rng.random() < share:
            cur = cursor_in_line(cl, rng)
            if cur is not None:
                out.append(
                    (
                        Cursor(cur.path, cur.line_no, cur.prefix, "", cur.rest_of_line, cur.suffix),
                        repeated,
                    )
                )
    return out
