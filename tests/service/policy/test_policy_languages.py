"""Language ids: what a request is written in, and whether a policy serves it."""

from __future__ import annotations

import pytest

from tabloop.core.policy.languages import (
    language_of_path,
    languages_of_paths,
    metric_label,
    normalize_language,
    request_language,
    supports,
)


@pytest.mark.parametrize(
    ("path", "language"),
    [
        ("pkg/mod.py", "python"),
        ("types.pyi", "python"),
        ("web/app.js", "javascript"),
        ("web/App.jsx", "javascriptreact"),
        ("web/app.ts", "typescript"),
        ("web/App.TSX", "typescriptreact"),  # extensions are case-insensitive
        ("src/main.rs", "rust"),
        ("cmd/main.go", "go"),
        ("Main.java", "java"),
        ("lib.c", "c"),
        ("lib.h", "c"),
        ("lib.cpp", "cpp"),
        ("lib.hpp", "cpp"),
        ("lib.cc", "cpp"),
        ("app.rb", "ruby"),
        ("run.sh", "shellscript"),
        ("C:\\work\\mod.py", "python"),  # a Windows path
        ("Makefile", "makefile"),
        ("docker/Dockerfile", "dockerfile"),
        ("data.unknownext", None),
        ("LICENSE", None),
        ("", None),
    ],
)
def test_language_of_path(path: str, language: str | None) -> None:
    assert language_of_path(path) == language


@pytest.mark.parametrize(
    ("name", "language"),
    [
        ("python", "python"),
        ("Python", "python"),
        (" python ", "python"),
        ("py", "python"),
        ("python3", "python"),
        ("rs", "rust"),
        ("typescriptreact", "typescriptreact"),
        ("c++", "cpp"),
        ("golang", "go"),
        ("plaintext", "plaintext"),
        ("klingon", "klingon"),  # unknown ids stay as they are (and are not python)
    ],
)
def test_normalize_language(name: str, language: str) -> None:
    assert normalize_language(name) == language


@pytest.mark.parametrize(
    ("language", "file_path", "resolved"),
    [
        ("rust", "pkg/mod.py", "rust"),  # the language field wins
        (None, "pkg/mod.py", "python"),  # absent: the extension
        ("", "src/main.rs", "rust"),  # empty counts as absent
        ("  ", "src/main.rs", "rust"),
        (None, "notes.unknownext", None),  # an extension naming no language: unknown
        (None, None, None),  # nothing says
        (None, "", None),
    ],
)
def test_request_language(
    language: str | None, file_path: str | None, resolved: str | None
) -> None:
    assert request_language(language, file_path) == resolved


@pytest.mark.parametrize(
    ("languages", "language", "served"),
    [
        (("python",), "python", True),
        (("python",), None, True),  # unknown: served
        (("python",), "rust", False),
        (("python",), "plaintext", False),
        ((), "python", False),  # a base whose files named no language
        ((), None, True),
        (("rust", "typescript"), "typescript", True),
    ],
)
def test_supports(languages: tuple[str, ...], language: str | None, served: bool) -> None:
    assert supports(languages, language) is served


def test_languages_of_paths_are_sorted_and_unique() -> None:
    paths = ["a.py", "b/c.py", "x.rs", "y.unknownext", "README", "z.tsx"]
    assert languages_of_paths(paths) == ["python", "rust", "typescriptreact"]
    assert languages_of_paths([]) == []


@pytest.mark.parametrize(
    ("language", "label"),
    [("rust", "rust"), ("plaintext", "plaintext"), ("klingon", "other"), ("", "other")],
)
def test_metric_label_keeps_the_label_set_small(language: str, label: str) -> None:
    assert metric_label(language) == label
