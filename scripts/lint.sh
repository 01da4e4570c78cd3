#!/usr/bin/env bash
# Lint and type check: bash scripts/lint.sh   (scripts/test.sh runs it before pytest)
# ruff check and ruff format --check (pyproject.toml [tool.ruff]) over the repository, the import
# circles (scripts/import_cycles.py), mypy over the packages and benchmarks, and mypy --strict over
# the shared core, the package tabloop/core (what the API, the trainer and the simulator build on;
# tests/test_imports.py checks that it loads none of them).
# `.venv/bin/ruff format .` fixes what the format check finds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "==> ruff check"
.venv/bin/ruff check --quiet .
echo "==> ruff format --check"
.venv/bin/ruff format --check --quiet . || {
  echo "==> not formatted: run .venv/bin/ruff format ." >&2
  exit 1
}
echo "==> import circles"
.venv/bin/python scripts/import_cycles.py
echo "==> mypy"
.venv/bin/mypy service trainer tabloop simulator benchmarks
echo "==> mypy --strict (the shared core: tabloop/core)"
.venv/bin/mypy --strict --follow-imports=silent tabloop/core
