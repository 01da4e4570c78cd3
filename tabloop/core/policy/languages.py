"""Language ids: what a request is written in, and what a policy was trained on.

Ids are VS Code's language identifiers (`python`, `javascript`, `typescriptreact`, `rust`,
`plaintext`, ...), which is what Tabby's and other editors' plugins send. A checkpoint's
manifest lists the ids of the code it was pretrained on (`tabloop pretrain` derives them from
file extensions, `EXTENSION_LANGUAGES`); a request in another language is not sent to the model
(docs/MODEL.md, Languages).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import PurePath

PYTHON = "python"
# What a manifest without a `languages` field was trained on: every such checkpoint was
# pretrained on the Python standard library.
DEFAULT_LANGUAGES: tuple[str, ...] = (PYTHON,)

# File extension (lower case, no dot) -> language id. An extension not listed here is still
# code to train on; it just names no language.
EXTENSION_LANGUAGES: dict[str, str] = {
    "py": PYTHON,
    "pyi": PYTHON,
    "pyw": PYTHON,
    "js": "javascript",
    "mjs": "javascript",
    "cjs": "javascript",
    "jsx": "javascriptreact",
    "ts": "typescript",
    "mts": "typescript",
    "cts": "typescript",
    "tsx": "typescriptreact",
    "rs": "rust",
    "go": "go",
    "java": "java",
    "kt": "kotlin",
    "kts": "kotlin",
    "scala": "scala",
    "c": "c",
    "h": "c",
    "cpp": "cpp",
    "cc": "cpp",
    "cxx": "cpp",
    "hpp": "cpp",
    "hh": "cpp",
    "hxx": "cpp",
    "cs": "csharp",
    "m": "objective-c",
    "mm": "objective-cpp",
    "swift": "swift",
    "rb": "ruby",
    "php": "php",
    "pl": "perl",
    "lua": "lua",
    "r": "r",
    "jl": "julia",
    "dart": "dart",
    "ex": "elixir",
    "exs": "elixir",
    "erl": "erlang",
    "hs": "haskell",
    "ml": "ocaml",
    "fs": "fsharp",
    "clj": "clojure",
    "zig": "zig",
    "sh": "shellscript",
    "bash": "shellscript",
    "zsh": "shellscript",
    "ps1": "powershell",
    "sql": "sql",
    "html": "html",
    "htm": "html",
    "css": "css",
    "scss": "scss",
    "less": "less",
    "vue": "vue",
    "svelte": "svelte",
    "json": "json",
    "yaml": "yaml",
    "yml": "yaml",
    "toml": "toml",
    "xml": "xml",
    "md": "markdown",
    "tex": "latex",
    "txt": "plaintext",
}
# Files known by their name rather than an extension.
FILENAME_LANGUAGES: dict[str, str] = {"dockerfile": "dockerfile", "makefile": "makefile"}
# Names some clients send for a VS Code id (besides the extensions above: "py", "rs", ...).
ALIASES: dict[str, str] = {
    "python3": PYTHON,
    "golang": "go",
    "c++": "cpp",
    "c#": "csharp",
    "shell": "shellscript",
    "bash": "shellscript",
    "typescript-react": "typescriptreact",
    "text": "plaintext",
}
# The ids a metric label may carry (anything else is counted as "other": a client chooses
# the string, and a label's values must stay few).
KNOWN_LANGUAGES: frozenset[str] = frozenset(
    [*EXTENSION_LANGUAGES.values(), *FILENAME_LANGUAGES.values(), *ALIASES.values()]
)


def normalize_language(language: str) -> str:
    """A client's language name as a VS Code id: lower case, aliases and extensions mapped."""
    lang = language.strip().lower()
    return ALIASES.get(lang) or EXTENSION_LANGUAGES.get(lang) or lang


def language_of_path(path: str) -> str | None:
    """The language a file's extension (or name) says; None when it says none."""
    p = PurePath(path.replace("\\", "/"))
    by_name = FILENAME_LANGUAGES.get(p.name.lower())
    if by_name is not None:
        return by_name
    return EXTENSION_LANGUAGES.get(p.suffix.lower().removeprefix("."))


def request_language(language: str | None, file_path: str | None) -> str | None:
    """What a request is written in: its `language` when given, else what its file's extension
    says; None when neither tells (such a request is served)."""
    if language is not None and language.strip():
        return normalize_language(language)
    if file_path:
        return language_of_path(file_path)
    return None


def supports(languages: Collection[str], language: str | None) -> bool:
    """A policy trained on `languages` completes a request in `language` (None: unknown, served)."""
    return language is None or language in languages


def languages_of_paths(paths: Iterable[PurePath | str]) -> list[str]:
    """The sorted language ids the files' extensions name (files naming none add nothing)."""
    found = {language_of_path(str(p)) for p in paths}
    return sorted(lang for lang in found if lang is not None)


def metric_label(language: str) -> str:
    """The language as a metric label: a known id, or "other"."""
    return language if language in KNOWN_LANGUAGES else "other"
