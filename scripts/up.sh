#!/usr/bin/env bash
# First run on a fresh machine: make .venv, install tabloop into it, start it embedded
# (SQLite under ./.tabloop, the outbox table as the event log). Extra args go to `tabloop up`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
# a Hugging Face model as the policy (TABLOOP_BASE_MODEL) needs the hf extra
target=.
[ -n "${TABLOOP_BASE_MODEL:-}" ] && target=".[hf]"
stamp=.venv/.tabloop-install
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $target"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing tabloop into .venv (first time: a minute or two)"
  if ! out="$(.venv/bin/python -m pip install -q --disable-pip-version-check -e "$target" 2>&1)"; then
    grep -v '^WARNING: Location .* is ignored' <<<"$out" >&2 || true
    echo "==> pip install failed" >&2
    exit 1
  fi
  echo "$want" >"$stamp"
fi
exec .venv/bin/tabloop up "$@"
