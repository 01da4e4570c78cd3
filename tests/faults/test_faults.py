"""Faults under load, end to end (the short form of benchmarks/faults.py): a broker SIGKILL, a
relay SIGKILL, a PostgreSQL crash and a trainer SIGKILL while plugins send a few thousand
numbered events. Nothing acknowledged is lost or duplicated, no reward trains two candidates,
every 503 carries Retry-After, and the trainer is back. No timings are asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # benchmarks/faults.py --short: PostgreSQL, Tansu, the app

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_short_fault_run_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "faults.py"),
            "--short",
            "--json",
            str(out),
            "--keep",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    log = done.stdout[-6000:] + done.stderr[-3000:]
    assert out.exists(), log
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert [f["name"] for f in result["schedule"]] == [
        "broker-kill",
        "relay-kill",
        "pg-kill",
        "trainer-kill",
    ]
    assert checks["events_acked"] >= 2000, log
    assert checks["missing_in_db"] == 0, log
    assert checks["missing_in_topic"] == 0, log
    assert checks["duplicated_in_topic"] == 0, log
    assert checks["duplicated_outbox_ids"] == 0, log
    assert checks["rollouts_missing_in_topic"] == 0, log
    assert checks["rollouts_duplicated_in_topic"] == 0, log
    assert checks["reward_rows_per_suggestion_max"] <= 1, log
    assert checks["candidates_partial"] == [], log
    assert checks["candidate_rollouts"] <= checks["rewards_trained"], log
    assert checks["heartbeat_fresh"], log
    assert checks["rewards_into_untrained"] == 0, log
    assert result["no_retry_after"] == 0, log
    assert checks["trainer_running"], log
    assert result["failures"] == [], log
    assert done.returncode == 0, log
