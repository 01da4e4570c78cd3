"""Fixtures for the Tabby API: a policy that knows one snippet, and tabby-agent itself.

The policy is the tiny test model after a few dozen steps on SNIPPET: asked to go on after
`PREFIX_ADD` it says the rest of that line, and its gate always shows. The suggestions are then
plain code that a Tabby client keeps as it is (its post-processing drops text that looks broken).

tabby-agent 1.5.0 is the npm package, unmodified, fetched by scripts/test.sh into
.test-clients/. It runs under node with a temporary HOME holding its config file, and with a
preload script that refuses any request to a host other than this machine (and reports it).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tabloop.core.policy.checkpoint import save_checkpoint
from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.testing.procs import stop_process

REPO = Path(__file__).resolve().parents[3]
AGENT_VERSION = "1.5.0"
AGENT_CLI = REPO / ".test-clients" / f"tabby-agent-{AGENT_VERSION}" / "package" / "dist" / "cli.js"

SNIPPET = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
PREFIX_ADD = "def add(a, b):\n    return a"
PREFIX_MUL = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a"

# The config file of docs/EDITORS.md, as a person writes it (endpoint and token filled in).
CONFIG_TOML = """\
[server]
endpoint = "{endpoint}"
token = "{token}"

[anonymousUsageTracking]
disable = true
"""
# Node's fetch is what tabby-agent sends every request with: anything not for this machine is
# refused and written to stderr, where the tests look for it.
GUARD_JS = """\
const allowed = new Set(["127.0.0.1", "localhost", "[::1]"]);
const realFetch = globalThis.fetch;
globalThis.fetch = async (input, init) => {
  const url = new URL(typeof input === "string" || input instanceof URL ? input : input.url);
  if (!allowed.has(url.hostname)) {
    process.stderr.write(`OUTBOUND REQUEST BLOCKED: ${url.origin}\\n`);
    throw new TypeError(`outbound request blocked: ${url.origin}`);
  }
  return realFetch(input, init);
};
"""
BLOCKED = "OUTBOUND REQUEST BLOCKED"


@pytest.fixture(scope="session")
def snippet_checkpoint(
    tiny_tokenizer: CodeTokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny model fitted to SNIPPET (about 5 s on a CPU), its gate set to always show."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tiny_tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
    )
    model = GPT(cfg)
    ids = torch.tensor([[tiny_tokenizer.eof_id, *tiny_tokenizer.encode(SNIPPET)]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(80):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        model.gate.hidden.weight.zero_()
        model.gate.features.weight.zero_()
        model.gate.features.bias.fill_(20.0)  # p(show) ~ 1: every suggestion is shown
    out = tmp_path_factory.mktemp("snippet-ckpt")
    return save_checkpoint(
        out,
        model,
        tiny_tokenizer,
        version=0,
        parent=None,
        summary={"fitted_to": "SNIPPET"},
        overwrite=True,
    )


@pytest.fixture
def served_overrides(snippet_checkpoint: Path) -> dict[str, Any]:
    """`served` (tests/service/conftest.py) with the snippet policy live."""
    return {"base_checkpoint": snippet_checkpoint}


@pytest.fixture
def tabby(served: Any, key_factory: Any) -> Iterator[httpx.Client]:
    """An HTTP client on the service's Tabby API, with an ingest key named "tabby-user"."""
    token = key_factory("ingest", name="tabby-user")
    with httpx.Client(
        base_url=served.url + "/tabby", headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as c:
        yield c


# ------------------------------------------------------------------------- tabby-agent


def agent_cli() -> Path:
    node = shutil.which("node")
    assert node, "node is not installed; scripts/test.sh installs it (Debian nodejs)"
    assert AGENT_CLI.is_file(), (
        f"{AGENT_CLI.relative_to(REPO)} is missing: scripts/test.sh fetches tabby-agent "
        f"{AGENT_VERSION} from npm (npm pack tabby-agent@{AGENT_VERSION}) before the tests"
    )
    return AGENT_CLI


class Agent:
    """tabby-agent as a child process, with the files a failure message needs."""

    def __init__(
        self, home: Path, endpoint: str, token: str, *args: str, extra_config: str = ""
    ) -> None:
        self.home = home
        config = home / ".tabby-client" / "agent" / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        # debug logs go to ~/.tabby-client/agent/logs/, for the failure messages
        config.write_text(
            CONFIG_TOML.format(endpoint=endpoint, token=token)
            + '\n[logs]\nlevel = "debug"\n'
            + extra_config
        )
        guard = home / "guard.js"
        guard.write_text(GUARD_JS)
        self.stderr_path = home / "agent.stderr"
        self._stderr = self.stderr_path.open("wb")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
        self.proc = subprocess.Popen(
            ["node", "--require", str(guard), str(agent_cli()), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=home,
            env=env,
        )

    def outbound_attempts(self) -> list[str]:
        return [
            line
            for line in self.stderr_path.read_text(errors="replace").splitlines()
            if BLOCKED in line
        ]

    def diagnostics(self) -> str:
        """The agent's stderr and the end of its debug log."""
        logs = sorted((self.home / ".tabby-client" / "agent" / "logs").glob("*.log"))
        log_tail = logs[-1].read_text(errors="replace")[-6000:] if logs else "(no log file)"
        stderr = self.stderr_path.read_text(errors="replace")[-3000:]
        return f"--- agent stderr ---\n{stderr}\n--- agent log (end) ---\n{log_tail}"

    def close(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc, timeout_s=10)
        self._stderr.close()


class JsonLinesAgent(Agent):
    """tabby-agent's own protocol, as vim-tabby speaks it: one JSON array per line on stdio.
    A request is `[id, {"func": name, "args": [...]}]`, its answer `[id, result]`; `[0, event]`
    lines are the agent's events (status changes and the like)."""

    def __init__(self, home: Path, endpoint: str, token: str, extra_config: str = "") -> None:
        super().__init__(home, endpoint, token, extra_config=extra_config)
        self._answers: queue.Queue[list[Any]] = queue.Queue()
        self.events: list[Any] = []
        self._next_id = 1
        self._reader = threading.Thread(target=self._read, name="tabby-agent-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue  # not protocol output
            if isinstance(message, list) and len(message) == 2 and message[0] == 0:
                self.events.append(message[1])
            elif isinstance(message, list) and len(message) == 2:
                self._answers.put(message)

    def call(self, func: str, *args: Any, timeout_s: float = 60) -> Any:
        request_id, self._next_id = self._next_id, self._next_id + 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            (json.dumps([request_id, {"func": func, "args": list(args)}]) + "\n").encode()
        )
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                state = "exited" if self.proc.poll() is not None else f"no answer in {timeout_s} s"
                raise AssertionError(f"tabby-agent {func}: {state}\n{self.diagnostics()}")
            try:
                answer_id, result = self._answers.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if answer_id == request_id:
                return result


class LspAgent(Agent):
    """`tabby-agent --lsp --stdio`: the Language Server Protocol (Content-Length framing), as
    Helix, Neovim's LSP client or Emacs's speak it."""

    def __init__(self, home: Path, endpoint: str, token: str) -> None:
        super().__init__(home, endpoint, token, "--lsp", "--stdio")
        self._messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self._next_id = 1
        self._reader = threading.Thread(target=self._read, name="tabby-lsp-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            length = None
            while True:  # headers, up to an empty line
                line = out.readline()
                if not line:
                    return
                if not line.strip():
                    break
                name, _, value = line.decode("ascii", errors="replace").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if length is not None:
                self._messages.put(json.loads(out.read(length)))

    def _send(self, message: dict[str, Any]) -> None:
        body = json.dumps({"jsonrpc": "2.0", **message}).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        self.proc.stdin.flush()

    def notify(self, method: str, params: dict[str, Any]) -> None:
        self._send({"method": method, "params": params})

    def request(self, method: str, params: dict[str, Any], timeout_s: float = 60) -> Any:
        request_id, self._next_id = self._next_id, self._next_id + 1
        self._send({"id": request_id, "method": method, "params": params})
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                state = "exited" if self.proc.poll() is not None else f"no answer in {timeout_s} s"
                raise AssertionError(f"tabby-agent --lsp {method}: {state}\n{self.diagnostics()}")
            try:
                message = self._messages.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if "method" in message and "id" in message:  # a request of the server's: no answer
                self._send({"id": message["id"], "result": None})
            elif message.get("id") == request_id:
                assert "error" not in message, (message, self.diagnostics())
                return message.get("result")


@pytest.fixture
def agent_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home
