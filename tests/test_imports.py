"""The import contract, stated once (`LAYERS`) and checked transitively.

Three layers: the shared core (`tabloop.core`: the policy, the reward, the tables and database,
the stream, the registry store, the privacy and retention rules, the trainer's status, the
workspace memory); the API (`service`), the trainer (`trainer`) and the simulator
(`simulator`), which use the core and talk to each other over HTTP and the log; and the command
line (`tabloop.cli`), which starts any of them. Each test imports every module of a package in a
fresh interpreter and reads `sys.modules`, so an import made by an import, or inside a function
that runs at import time, counts too. `scripts/lint.sh` takes the core's module list (for mypy
--strict) from `core_modules()` here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the top-level packages and modules it must never load, directly or not
LAYERS: dict[str, tuple[str, ...]] = {
    "tabloop.core": ("fastapi", "starlette", "service", "trainer", "simulator", "tabloop.cli"),
    "trainer": ("fastapi", "starlette", "service", "simulator", "tabloop.cli"),
    "simulator": ("fastapi", "starlette", "service", "trainer", "tabloop.cli"),
    "service": ("trainer", "simulator", "tabloop.cli"),
}

PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if not info.name.endswith(".__main__"):  # a program, run when imported
        importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded(package: str) -> list[str]:
    """Every module in `sys.modules` after a fresh interpreter imported all of `package`."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, package],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def forbidden(modules: list[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == b or m.startswith(b + ".") for b in banned))


def core_modules() -> list[str]:
    """The core's source files, for `mypy --strict` (scripts/lint.sh)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tabloop" / "core").rglob("*.py"))


@pytest.mark.parametrize("package", list(LAYERS))
def test_a_layer_never_loads_what_is_above_it_or_beside_it(package: str) -> None:
    assert forbidden(loaded(package), LAYERS[package]) == []


def test_the_check_fails_when_a_core_module_imports_fastapi(tmp_path: Path) -> None:
    """The same probe, on a copy of the core with one module that imports FastAPI."""
    fake = tmp_path / "tabloop"
    core = fake / "core"
    core.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "tables.py").write_text("import sqlalchemy\n")
    (core / "leaky.py").write_text("from fastapi import FastAPI\n")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "tabloop.core"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "tabloop.core.leaky" in modules
    assert "fastapi" in forbidden(modules, LAYERS["tabloop.core"])


if __name__ == "__main__":  # scripts/lint.sh: the core's files, one per line
    print("\n".join(core_modules()))
