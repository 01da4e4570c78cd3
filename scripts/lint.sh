#!/usr/bin/env bash
# Lint and type check: bash scripts/lint.sh   (scripts/test.sh runs it before pytest)
# ruff (pyproject.toml [tool.ruff]) over the repository, mypy over the packages and benchmarks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "==> ruff check"
.venv/bin/ruff check --quiet .
echo "==> mypy"
.venv/bin/mypy service trainer tabloop simulator benchmarks
