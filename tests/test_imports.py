"""The import contract: the trainer and the simulator build on the shared core of `service/`
(policy, rewards, tables and storage, stream, registry store, privacy and retention rules) and
never on the API's internals (the app, endpoints, request schemas, serving); they talk to the
API over HTTP. The API never imports the trainer. Read from the source with `ast`, so a
function-level import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# what the trainer and the simulator may import from service/ (a module or a package)
SHARED_CORE = (
    "service.config",
    "service.db",
    "service.events.settled",  # reading code_settled texts (the trainer's supervised term)
    "service.policy",
    "service.privacy",
    "service.registry.store",
    "service.retention",
    "service.rewards.core",
    "service.rewards.store",
    "service.stream",
    "service.tables",
    "service.training.status",  # the trainer's status row, as GET /admin/training reads it
)


def imported(path: Path) -> set[str]:
    """The absolute modules `path` imports: `import a.b` and `from a.b import c` give a.b;
    `from service import x` gives service.x."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "service":
                out.update(f"service.{a.name}" for a in node.names)
            else:
                out.add(node.module)
    return out


def outside_core(path: Path) -> list[str]:
    """The modules of service/ that `path` imports and that are not the shared core."""
    return sorted(
        m
        for m in imported(path)
        if m.startswith("service.")
        and not any(m == c or m.startswith(c + ".") for c in SHARED_CORE)
    )


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", ["trainer", "simulator"])
def test_the_trainer_and_the_simulator_import_only_the_shared_core(package: str) -> None:
    found = {str(p.relative_to(ROOT)): bad for p in sources(package) if (bad := outside_core(p))}
    assert found == {}, f"imports of the API's internals: {found}"


def test_the_api_never_imports_the_trainer_or_the_simulator() -> None:
    found = {
        str(p.relative_to(ROOT)): sorted(
            m for m in imported(p) if m.split(".")[0] in ("trainer", "simulator")
        )
        for p in sources("service")
    }
    assert {k: v for k, v in found.items() if v} == {}


@pytest.mark.parametrize(
    "line",
    [
        "from service.app import create_app",
        "import service.app",
        "from service.events.endpoints import router",
        "from service.completions import serving",
        "from service.events.schemas import parse_event",
        "from service import app",
    ],
)
def test_the_contract_fails_on_an_api_internal(tmp_path: Path, line: str) -> None:
    module = tmp_path / "module.py"
    module.write_text(f"from service.policy.model import GPT\n{line}\n")
    assert outside_core(module), line
