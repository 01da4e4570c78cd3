"""Ports and process handling for the test services (tabloop/testing/postgres.py, kafka.py).

Every process is started in its own session/process group, with a parent-death
signal (``setpriv --pdeathsig``) so it dies with the Python process that started
it, and is registered for cleanup at interpreter exit and on SIGTERM. The cleanup
registry and its signal hooks live here, once per interpreter.

Also: ``wait_http_ready`` and ``stop_process`` for HTTP processes a test starts itself
(``tabloop up``, ``tabloop serve``, ...).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LOCALHOST",
    "ServiceError",
    "free_port",
    "wait_http_ready",
    "stop_process",
]

LOCALHOST = "127.0.0.1"


class ServiceError(RuntimeError):
    """A test service could not be started/stopped; the message has the log tail."""


# --------------------------------------------------------------------------- ports


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOCALHOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    return _free_ports(1)[0]


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((LOCALHOST, port)) == 0


# ----------------------------------------------------------------- process handling


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log at {path}: {e})"
    tail = text.splitlines()[-lines:]
    return f"--- last {len(tail)} lines of {path} ---\n" + "\n".join(tail)


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (orphans may never be reaped here)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2 : data.rindex(b")") + 3] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _children_of(pid: int) -> list[int]:
    kids = []
    for d in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(d, "rb") as f:
                data = f.read()
            ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            kids.append(int(d.split("/")[2]))
    return kids


def _wait_pids_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _pid_alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _child_env(drop: Iterable[str] = (), **extra: str) -> dict[str, str]:
    """Environment for a service: no proxies (everything is on 127.0.0.1), no RUST_LOG."""
    env = dict(os.environ)
    for key in list(env):
        if key.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy") or key in drop:
            del env[key]
    env.pop("RUST_LOG", None)  # tansu debug logging writes gigabytes
    env.update(extra)
    return env


_SETPRIV = shutil.which("setpriv") or next(
    (p for p in ("/usr/bin/setpriv", "/bin/setpriv") if os.access(p, os.X_OK)), None
)


class _Proc:
    """A service process in its own session, logging to a file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str],
        *,
        user: str | None = None,
        deathsig: str = "KILL",
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        # Parent-death signal: the service dies with the Python process even if that
        # one is SIGKILLed (it is tied to the *thread* that forks, hence main thread only).
        if _SETPRIV and threading.current_thread() is threading.main_thread():
            argv = [_SETPRIV, f"--pdeathsig={deathsig}", "--", *argv]
        kw: dict[str, Any] = {}
        if user is not None:
            pw = pwd.getpwnam(user)
            kw.update(
                user=pw.pw_uid, group=pw.pw_gid, extra_groups=os.getgrouplist(user, pw.pw_gid)
            )
        log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - kept by the child only
        try:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
                **kw,
            )
        finally:
            log.close()
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int, group: bool = True) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def wait(self, timeout_s: float) -> bool:
        try:
            self.popen.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def terminate(self, sig: int = signal.SIGTERM, grace_s: float = 5.0) -> None:
        """Send ``sig`` to the process group, SIGKILL it after ``grace_s``."""
        if self.alive():
            self.send(sig)
            if not self.wait(grace_s):
                self.send(signal.SIGKILL)
                self.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # stragglers left in the group

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        self.wait(10)


# Cleanup of everything still running at interpreter exit (and on SIGTERM).
_REGISTRY: list[Any] = []
_REGISTRY_LOCK = threading.Lock()
_OWNER_PID = os.getpid()
_HOOKS_INSTALLED = False


def _cleanup_all() -> None:
    if os.getpid() != _OWNER_PID:  # a forked child must not stop our services
        return
    with _REGISTRY_LOCK:
        items = list(reversed(_REGISTRY))
    for item in items:
        with contextlib.suppress(Exception):
            item._emergency_stop()


def _on_sigterm(signum: int, frame: Any) -> None:
    _cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _register(item: Any) -> None:
    global _HOOKS_INSTALLED
    with _REGISTRY_LOCK:
        if item not in _REGISTRY:
            _REGISTRY.append(item)
        if not _HOOKS_INSTALLED:
            _HOOKS_INSTALLED = True
            atexit.register(_cleanup_all)
            if threading.current_thread() is threading.main_thread():
                with contextlib.suppress(ValueError, OSError):
                    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                        signal.signal(signal.SIGTERM, _on_sigterm)


def _unregister(item: Any) -> None:
    with _REGISTRY_LOCK:
        if item in _REGISTRY:
            _REGISTRY.remove(item)


# ------------------------------------------------------------ HTTP processes


def wait_http_ready(url: str, proc: subprocess.Popen[Any], timeout_s: float = 120.0) -> None:
    """Poll `url`/readyz until it answers 200; ServiceError if `proc` exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise ServiceError(f"{proc.args!r} exited with {proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise ServiceError(f"{url} was not ready after {timeout_s:.0f} s")
        time.sleep(0.2)


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL if it has not exited within `timeout_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
