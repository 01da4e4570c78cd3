"""`tabloop simulate --corpus DIR`: the *.py files under a directory, read by the stdlib
loader's rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.cli import main
from simulator.corpus import CorpusError, load_lines

FILES = {
    "pkg/__init__.py": "",
    "pkg/a.py": "import os\n\ndef f(x):\n    return x + 1\n",
    "pkg/sub/b.py": "X = 1\n",
    "pkg/tests/helpers.py": "HELP = 1\n",  # a tests directory
    "pkg/test_c.py": "def test_c():\n    assert True\n",  # a test file
    "pkg/notes.txt": "not python\n",
    "pkg/table.py": "TABLE = [\n" + "    'x',\n" * 150 + "]\n",  # generated data
}


def tree(root: Path) -> Path:
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_every_python_file_but_tests_and_data(tmp_path: Path) -> None:
    lines = load_lines(tree(tmp_path))
    root = tmp_path.resolve()
    assert [(cl.path.relative_to(root).as_posix(), cl.line_no, cl.line) for cl in lines] == [
        ("pkg/a.py", 0, "import os"),
        ("pkg/a.py", 2, "def f(x):"),
        ("pkg/a.py", 3, "    return x + 1"),
        ("pkg/sub/b.py", 0, "X = 1"),
    ]
    assert lines[2].prefix_lines == ("import os", "", "def f(x):")  # the whole file around it


def test_the_default_is_the_stdlib_held_out_split() -> None:
    from tabloop.core.corpus import heldout_lines

    assert load_lines(None)[:50] == list(heldout_lines())[:50]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda root: root, id="empty-directory"),
        pytest.param(lambda root: tree(root) / "pkg" / "a.py", id="a-file"),
        pytest.param(lambda root: root / "missing", id="missing"),
    ],
)
def test_a_corpus_without_code_is_refused(tmp_path: Path, make: object) -> None:
    with pytest.raises(CorpusError):
        load_lines(make(tmp_path))  # type: ignore[operator]


def test_the_command_refuses_a_missing_corpus_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--api", "http://127.0.0.1:9", "--key", "k", "--corpus", str(tmp_path / "nope")])
    assert e.value.code == 2
    assert "not a directory" in capsys.readouterr().err
