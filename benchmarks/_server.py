"""Start `tabloop up` (embedded) in a subprocess for a benchmark; loopback only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tabloop.testing.procs import stop_process, wait_http_ready

TABLOOP = str(Path(sys.executable).parent / "tabloop")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    token: str  # admin + deploy + ingest
    data_dir: Path
    proc: subprocess.Popen[str]


@contextmanager
def tabloop_up(**env_overrides: str) -> Iterator[Server]:
    data_dir = Path(tempfile.mkdtemp(prefix="tabloop-bench-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TABLOOP_")}
    env.update(
        TABLOOP_DATA_DIR=str(data_dir),
        TABLOOP_PORT=str(port),
        TABLOOP_LOG_LEVEL="WARNING",
        TABLOOP_RATE_LIMIT_PER_S="100000",
        TABLOOP_RATE_LIMIT_BURST="100000",
        **env_overrides,
    )
    proc = subprocess.Popen([TABLOOP, "up"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        token = proc.stdout.readline().strip()
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, proc, timeout_s=120)
        yield Server(url, token, data_dir, proc)
    finally:
        stop_process(proc)
