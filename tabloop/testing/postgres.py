"""A real PostgreSQL for the test suite: :class:`PostgresServer`.

The Debian ``postgresql`` package (newest ``/usr/lib/postgresql/*/bin``), installed by
``scripts/test.sh``; psycopg talks to it. When running as root the server runs as the
``postgres`` OS user; as any other user it runs as that user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tabloop.testing.procs import (
    LOCALHOST,
    ServiceError,
    _child_env,
    _children_of,
    _log_tail,
    _port_in_use,
    _Proc,
    _register,
    _unregister,
    _wait_pids_gone,
    free_port,
)

__all__ = ["PostgresServer"]

_IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


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
