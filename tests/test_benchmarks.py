"""Every benchmark script with options runs as the docs run it: `--help` prints its usage and
exits 0 (a script whose `__main__` guard is lost, or whose imports broke, says nothing or
fails). The helpers the scripts share (no options of their own) are left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.stem for p in (ROOT / "benchmarks").glob("*.py") if "ArgumentParser(" in p.read_text()
)

# one interpreter for them all: each module run as `__main__` with `--help`
PROBE = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [name, "--help"]
    code = None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("benchmarks." + name, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    print(name, code, "usage:" in out.getvalue())
"""


def test_every_benchmark_prints_its_usage() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS
    run = subprocess.run(
        [sys.executable, "-c", PROBE, *SCRIPTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line)
    assert sorted(results) == SCRIPTS, run.stdout
    broken = {name: r for name, r in results.items() if r not in ("0 True", "None True")}
    assert not broken, f"benchmarks without a working --help: {broken}"
