"""The corpus: what is excluded, the deterministic file split, cursors."""

from __future__ import annotations

import random
from pathlib import Path, PurePosixPath

import pytest

from tabloop.core.corpus import (
    CorpusLine,
    corpus_files,
    cursor_in_line,
    cursors_from,
    exact_match,
    is_data_file,
    is_excluded_path,
    is_heldout,
    prefix_match,
    stdlib_root,
)


@pytest.mark.parametrize(
    ("rel", "excluded"),
    [
        ("json/decoder.py", False),
        ("test/test_json/test_decode.py", True),
        ("idlelib/idle_test/test_config.py", True),
        ("lib2to3/tests/data/bom.py", True),
        ("test_whatever.py", True),
        ("site-packages/pip/__init__.py", True),
        ("unittest/mock.py", False),  # a module *about* testing is code
        ("json/tool.pyc", True),
    ],
)
def test_excluded_paths(rel: str, excluded: bool) -> None:
    assert is_excluded_path(PurePosixPath(rel)) == excluded


def test_data_files() -> None:
    table = (
        "decoding_table = (\n"
        + "".join(f"    '\\x{i:02x}'  # 0x{i:02x}\n" for i in range(200))
        + ")\n"
    )
    assert is_data_file(table)
    mapping = "m = {\n" + "".join(f"    'k{i}': 'v{i}',\n" for i in range(150)) + "}\n"
    assert is_data_file(mapping)
    code = "def f(x):\n    return x + 1\n" * 200
    assert not is_data_file(code)
    assert is_data_file("x = 1\n" * 40_000)  # > 200 KB


def test_split_is_deterministic_and_about_five_percent() -> None:
    names = [f"pkg{i}/mod{i}.py" for i in range(4000)]
    held = [n for n in names if is_heldout(n)]
    assert held == [n for n in names if is_heldout(PurePosixPath(n))]
    assert 0.035 < len(held) / len(names) < 0.065


def test_stdlib_splits_are_disjoint_and_clean() -> None:
    train, heldout = corpus_files("train"), corpus_files("heldout")
    assert train and heldout and not set(train) & set(heldout)
    root = stdlib_root()
    rels = {p.relative_to(root).as_posix() for p in train + heldout}
    assert "json/decoder.py" in rels
    assert not any("/test/" in f"/{r}" or "site-packages" in r for r in rels)
    assert "pydoc_data/topics.py" not in rels and "encodings/cp1252.py" not in rels
    assert all(is_heldout(r) for r in (p.relative_to(root).as_posix() for p in heldout))


def test_cursor_in_line() -> None:
    lines = ("import os", "    value = compute(x)", "")
    cl = CorpusLine(Path("m.py"), 1, lines)
    rng = random.Random(0)
    for _ in range(50):
        cur = cursor_in_line(cl, rng)
        assert cur is not None
        assert cur.prefix + cur.suffix == "\n".join(lines)
        assert cur.rest_of_line and lines[1].endswith(cur.rest_of_line)
        assert len(cur.rest_of_line) < len("value = compute(x)")  # after indent + 1 char
    assert cursor_in_line(CorpusLine(Path("m.py"), 0, ("  x",)), rng) is None


def test_cursors_are_seeded() -> None:
    files = corpus_files("heldout")[:3]
    assert cursors_from(files, 20, seed=1) == cursors_from(files, 20, seed=1)
    assert cursors_from(files, 20, seed=1) != cursors_from(files, 20, seed=2)


@pytest.mark.parametrize(
    ("completion", "rest", "exact", "prefix"),
    [
        ("foo(bar)", "foo(bar)", True, True),
        ("foo(", "foo(bar)", False, True),
        ("foo(bar)  ", "foo(bar)", True, True),  # trailing whitespace ignored for exact
        ("foo  ", "foo(bar)", False, False),  # would insert wrong spaces
        ("", "foo", False, False),  # nothing to accept
        ("   ", "   x", False, False),
        ("bar", "foo(bar)", False, False),
    ],
)
def test_match_rules(completion: str, rest: str, exact: bool, prefix: bool) -> None:
    assert exact_match(completion, rest) == exact
    assert prefix_match(completion, rest) == prefix
