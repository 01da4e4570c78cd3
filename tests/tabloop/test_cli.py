"""The `tabloop` command as a person runs it: real processes, real sockets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import torch

from tabloop.core.config import Settings
from tabloop.core.db import make_engine
from tabloop.core.keys import authenticate
from tabloop.testing.factories import event
from tabloop.testing.procs import free_port, wait_http_ready

# every test runs the `tabloop` program in a subprocess (tests/conftest.py, the marker)
pytestmark = pytest.mark.integration

TABLOOP = str(Path(sys.executable).parent / "tabloop")
TRAINER_METRICS = (
    "tabloop_trainer_batch_fill",
    "tabloop_trainer_updates_total",
    "tabloop_trainer_gate_results_total",
    "tabloop_trainer_join_lag_seconds",
    "tabloop_trainer_late_events_total",
    "tabloop_trainer_canary_verdicts_total",
    "tabloop_trainer_purged_rollouts_total",
)


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TABLOOP_")}
    env.update(TABLOOP_DATA_DIR=str(tmp_path / "data"), **extra)
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TABLOOP, *args], env=env, capture_output=True, text=True, timeout=120)


def test_keys_create_prints_the_token_alone(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    assert run(["db", "upgrade"], env).returncode == 0
    out = run(["keys", "create", "--scope", "ingest", "--scope", "deploy", "--name", "vscode"], env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tlk_")
    engine = make_engine(Settings(data_dir=tmp_path / "data"))
    with engine.connect() as conn:
        key = authenticate(conn, lines[0])
    engine.dispose()
    assert key is not None and key.name == "vscode" and key.scopes == {"ingest", "deploy"}

    listed = run(["keys", "list"], env)
    assert key.id in listed.stdout and lines[0] not in listed.stdout
    assert run(["keys", "revoke", key.id], env).returncode == 0
    assert "revoked" in run(["keys", "list"], env).stdout
    assert run(["keys", "revoke", "nosuchkey"], env).returncode == 1


def test_keys_on_a_database_never_migrated_say_what_to_run(tmp_path: Path) -> None:
    """A newcomer's first command on a fresh data directory: a clear message and status 2."""
    env = env_for(tmp_path)
    for args in (["keys", "create", "--scope", "ingest", "--name", "x"], ["keys", "list"]):
        out = run(args, env)
        assert out.returncode == 2, out.stderr
        assert "tabloop db upgrade" in out.stderr and "Traceback" not in out.stderr
        assert out.stdout == ""
    assert "alembic.runtime.plugins" not in run(["db", "upgrade"], env).stderr


def test_keys_create_no_train_makes_a_privacy_mode_key(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    assert run(["db", "upgrade"], env).returncode == 0
    private = run(["keys", "create", "--scope", "ingest", "--name", "laptop", "--no-train"], env)
    plain = run(["keys", "create", "--scope", "ingest", "--name", "desktop"], env)
    assert private.returncode == 0 and plain.returncode == 0, private.stderr + plain.stderr
    engine = make_engine(Settings(data_dir=tmp_path / "data"))
    with engine.connect() as conn:
        keys = {t: authenticate(conn, t) for t in (private.stdout.strip(), plain.stdout.strip())}
    engine.dispose()
    assert [k.no_train for k in keys.values() if k] == [True, False]
    listed = dict(line.split("\t")[1::3] for line in run(["keys", "list"], env).stdout.splitlines())
    assert listed == {"laptop": "no-train", "desktop": "-"}


def test_bad_input_gets_a_clear_message(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    bad_scope = run(["keys", "create", "--scope", "root", "--name", "x"], env)
    assert bad_scope.returncode == 2 and "scopes must be among" in bad_scope.stderr
    bad_port = run(["db", "upgrade"], env_for(tmp_path, TABLOOP_PORT="eighty"))
    assert bad_port.returncode != 0 and "TABLOOP_PORT" in bad_port.stderr
    pg_no_broker = run(
        ["db", "upgrade"], env_for(tmp_path, TABLOOP_DATABASE_URL="postgresql://x/y")
    )
    assert pg_no_broker.returncode != 0 and "TABLOOP_KAFKA_BOOTSTRAP_SERVERS" in pg_no_broker.stderr
    relay = run(["relay"], env)
    assert relay.returncode == 2 and "embedded mode" in relay.stderr


def test_up_on_a_port_in_use_says_so_before_anything_else(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = run(["up"], env_for(tmp_path, TABLOOP_PORT=str(port), TABLOOP_HOST="127.0.0.1"))
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "TABLOOP_PORT" in out.stderr
    assert "tlk_" not in out.stdout  # no first key printed by a process that is not serving
    assert not (tmp_path / "data" / "tabloop.db").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
@pytest.mark.parametrize("command", ["up", "serve", "train"])
def test_a_gpu_asked_for_where_there_is_none_is_a_one_line_error(
    tmp_path: Path, command: str
) -> None:
    out = run([command], env_for(tmp_path, TABLOOP_DEVICE="cuda"))
    assert out.returncode != 0
    assert "TABLOOP_DEVICE: device 'cuda' asked for, but torch sees no CUDA GPU" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "data" / "tabloop.db").exists()  # before anything else


def test_up_serves_events_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    env = env_for(tmp_path, TABLOOP_PORT=str(port))
    proc = subprocess.Popen(
        [TABLOOP, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "first API key" in banner, banner
        token = proc.stdout.readline().strip()
        assert token.startswith("tlk_")
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, proc, timeout_s=60)
        r = httpx.post(
            url + "/v1/events",
            json={"events": [event("accept"), event("churn")]},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 202 and r.json()["accepted"] == 2
        # embedded: the trainer runs in this process, so its metrics are on the API's /metrics
        metrics = httpx.get(url + "/metrics").text
        assert 'tabloop_ingest_events_total{outcome="accepted",type="accept"} 1.0' in metrics
        for name in TRAINER_METRICS:
            assert f"\n{name}" in metrics, name
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    engine = make_engine(Settings(data_dir=tmp_path / "data"))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM events")).scalar_one() == 2
    engine.dispose()

    # A second start keeps the existing key and prints none.
    again = subprocess.Popen([TABLOOP, "up"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
    finally:
        again.send_signal(signal.SIGTERM)
        out, _ = again.communicate(timeout=30)
    assert "tlk_" not in out


def test_log_lines_are_json_objects_when_asked(tmp_path: Path) -> None:
    out = run(["db", "upgrade"], env_for(tmp_path, TABLOOP_LOG_FORMAT="json"))
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert lines[-1] == "tabloop: database at head"  # the command's own output stays text
    logged = [json.loads(line) for line in lines[:-1]]
    assert logged and {"time", "level", "logger", "message"} <= set(logged[-1])
    assert logged[-1]["message"] == "database at revision head"


def test_log_format_flag_on_the_long_running_commands() -> None:
    from tabloop.cli import build_parser

    for command in ("up", "serve", "relay", "train"):
        args = build_parser().parse_args([command, "--log-format", "text"])
        assert args.log_format == "text"


def test_train_serves_its_metrics_on_the_metrics_port(tmp_path: Path) -> None:
    port = free_port()
    env = env_for(
        tmp_path,
        TABLOOP_METRICS_PORT=str(port),
        TABLOOP_TRAINER_API_KEY="tlk_x_y",
        TABLOOP_LOG_FORMAT="json",
    )
    assert run(["db", "upgrade"], env).returncode == 0
    proc = subprocess.Popen([TABLOOP, "train"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
                break
            except httpx.TransportError:
                assert proc.poll() is None, "tabloop train exited"
                assert time.monotonic() < deadline, "no metrics endpoint within 60 s"
                time.sleep(0.2)
        for name in TRAINER_METRICS:
            assert f"\n{name}" in metrics, name
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert all(json.loads(line)["level"] for line in err.splitlines())  # JSON lines only


def _series(metrics: str, prefix: str) -> float:
    """The value of the one series starting with `prefix` (0 when absent)."""
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    assert len(lines) <= 1, lines
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_serve_with_workers_sums_every_workers_metrics(tmp_path: Path) -> None:
    """`tabloop serve --workers 2`: whichever worker answers a scrape, the counters count the
    requests of both (prometheus_client's multiprocess mode), and the directory the workers
    wrote them to is gone after a clean stop."""
    port = free_port()
    env = env_for(tmp_path, TABLOOP_PORT=str(port), TABLOOP_LOG_FORMAT="json")
    assert run(["db", "upgrade"], env).returncode == 0
    proc = subprocess.Popen(
        [TABLOOP, "serve", "--workers", "2"], env=env, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    healthz = (
        'tabloop_http_request_duration_seconds_count{method="GET",route="/healthz",status="200"}'
    )
    dirs = set(Path(tempfile.gettempdir()).glob("tabloop-metrics-*"))
    try:
        wait_http_ready(url, proc, timeout_s=120)
        before = _series(httpx.get(url + "/metrics").text, healthz)
        for _ in range(40):  # fresh connections: uvicorn's workers share the socket
            assert httpx.get(url + "/healthz").status_code == 200
        scrapes = []
        for _ in range(10):
            metrics = httpx.get(url + "/metrics").text
            scrapes.append(_series(metrics, healthz) - before)
        assert scrapes == [40.0] * 10
        assert "pid=" not in metrics  # every series is the whole server's, not one worker's
        new = set(Path(tempfile.gettempdir()).glob("tabloop-metrics-*")) - dirs
        assert len(new) == 1 and any(next(iter(new)).glob("*.db"))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not new & set(Path(tempfile.gettempdir()).glob("tabloop-metrics-*"))


def _tiny_hf_model(tmp_path: Path) -> Path:
    from tabloop.testing.hf_models import make_model_dir

    code = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    return make_model_dir(tmp_path / "qwen2", "qwen2", code)


def test_models_import_writes_a_base_policy_and_refuses_what_is_not_a_model(
    tmp_path: Path,
) -> None:
    model = _tiny_hf_model(tmp_path)
    env = env_for(tmp_path)
    out = run(["models", "import", str(model), "--out", str(tmp_path / "ckpt")], env)
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["config"]["backend"] == "hf" and manifest["config"]["base_dir"] == str(model)
    assert "python" in manifest["languages"] and "rust" in manifest["languages"]
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    out = run(["models", "import", str(model), "--out", str(tmp_path / "again")], env)
    assert out.returncode != 0 and "safetensors" in out.stderr and "Traceback" not in out.stderr
    out = run(["models", "import", str(tmp_path), "--out", str(tmp_path / "again")], env)
    assert out.returncode != 0 and "no config.json" in out.stderr


def test_up_with_a_hugging_face_base_model_serves_it(tmp_path: Path) -> None:
    port = free_port()
    env = env_for(
        tmp_path, TABLOOP_PORT=str(port), TABLOOP_BASE_MODEL=str(_tiny_hf_model(tmp_path))
    )
    proc = subprocess.Popen(
        [TABLOOP, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert "first API key" in proc.stdout.readline()
        token = proc.stdout.readline().strip()
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, proc, timeout_s=60)
        r = httpx.post(
            url + "/v1/complete",
            json={
                "user_id": "u",
                "prefix": "import json\n\ndef f(x):\n    return ",
                "suffix": "\n",
            },
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200 and r.json()["policy_version"] == 1, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    manifest = json.loads((tmp_path / "data" / "base-model" / "manifest.json").read_text())
    assert manifest["config"]["backend"] == "hf"
