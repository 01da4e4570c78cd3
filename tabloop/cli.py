"""The `tabloop` command. User-facing output goes to stdout; logs go to stderr."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from service.logs import LogFormat, setup_logging
from tabloop.core.config import Settings, load_settings

if TYPE_CHECKING:  # for annotations only; the commands import these where they use them
    import sqlalchemy as sa
    from fastapi import FastAPI

log = logging.getLogger("tabloop")

T = TypeVar("T")


def _settings(args: argparse.Namespace, log_format: LogFormat = "text") -> Settings:
    """The process's settings (flags over environment), and its logging set up: `log_format`
    unless TABLOOP_LOG_FORMAT or --log-format says otherwise."""
    overrides = {}
    for name in ("host", "port", "workers", "log_format"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    if getattr(args, "nproc", None) is not None:
        overrides["trainer_nproc"] = args.nproc
    settings = load_settings(**overrides)
    setup_logging(settings.log_level, settings.log_format or log_format)
    return settings


def _serve_metrics(settings: Settings) -> None:
    """Prometheus metrics for processes without the API (relay, trainer), if a port is set."""
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, addr=settings.host)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _listen(settings: Settings) -> socket.socket:
    """Take the API's port first, so a port in use ends the start with one clear line before
    anything is migrated, created or printed (a first key printed by a process that then
    exits would be confusing)."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    try:
        return socket.create_server((settings.host, settings.port), family=family)
    except OSError as e:
        raise SystemExit(
            f"tabloop: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}; "
            "stop whatever holds that port, or set TABLOOP_PORT"
        ) from None


def _serve(app: FastAPI, settings: Settings, sock: socket.socket) -> None:
    """Run uvicorn in this process on `sock` (from _listen); SIGTERM/SIGINT stop it gracefully
    and return here (uvicorn itself would re-raise the signal and skip our own clean-up)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {
                s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)
            }
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,  # service.logs writes the access line, with the request id
        log_config=None,  # uvicorn's loggers go through our handler and format
    )
    Server(config).run(sockets=[sock])


def _ensure_first_admin_key(settings: Settings) -> None:
    from tabloop.core import audit
    from tabloop.core.db import make_engine
    from tabloop.core.keys import SCOPES, create_key, has_any_key

    engine = make_engine(settings)
    try:
        with engine.begin() as conn:
            if has_any_key(conn, "admin"):
                return
            key, token = create_key(conn, name="first-admin", scopes=frozenset(SCOPES))
            audit.record_key(conn, audit.SERVICE, "key.create", key)
    finally:
        engine.dispose()
    print("tabloop: created the first API key (scopes admin, deploy, ingest). It is shown once:")
    print(token, flush=True)


def _device(settings: Settings) -> str:
    """TABLOOP_DEVICE resolved for this machine ("cpu", "cuda", ...); exits with a one-line
    error where it names a GPU torch does not see."""
    from tabloop.core.policy.device import DeviceError, precision, resolve

    try:
        device = resolve(settings.device)
    except DeviceError as e:
        raise SystemExit(f"tabloop: TABLOOP_DEVICE: {e}") from None
    log.info("the policy computes on %s (%s)", device, precision(device))
    return str(device)


def _bootstrap_policy(settings: Settings) -> None:
    """First start: register the shipped base policy and make it live (no-op afterwards)."""
    from tabloop.core.db import make_engine
    from tabloop.core.policy.checkpoint import MANIFEST_FILE
    from tabloop.core.registry import bootstrap

    base = settings.base_checkpoint
    if settings.base_model is not None:
        base = settings.data_dir / "base-model"
        if not (base / MANIFEST_FILE).is_file():
            _import_model(settings.base_model, base)
    elif not (base / MANIFEST_FILE).is_file():
        raise SystemExit(
            f"tabloop: no base policy at {base}; build one with "
            f"`tabloop pretrain --out {base}` or set TABLOOP_BASE_CHECKPOINT"
        )
    engine = make_engine(settings)
    try:
        with engine.begin() as conn:
            version = bootstrap(conn, base)
    finally:
        engine.dispose()
    if version is not None:
        log.info("registered the base policy from %s as v%d and made it live", base, version)


def _import_model(model_dir: Path, out: Path, lora_r: int = 8) -> None:
    """A Hugging Face model directory as a base checkpoint in `out`; exits with a one-line
    error where it cannot be."""
    from tabloop.core.policy.checkpoint import CheckpointError, import_model

    try:
        import_model(model_dir, out, overwrite=True, lora_r=lora_r)
    except ImportError as e:
        raise SystemExit(
            f"tabloop: {e.name} is missing: a Hugging Face model needs `pip install 'tabloop[hf]'`"
        ) from None
    except CheckpointError as e:
        raise SystemExit(f"tabloop: cannot import {model_dir}: {e}") from None
    log.info("imported the Hugging Face model in %s as a base policy in %s", model_dir, out)


def cmd_models_import(args: argparse.Namespace) -> int:
    if args.lora_rank < 1:
        raise SystemExit(f"tabloop: --lora-rank must be at least 1, got {args.lora_rank}")
    _import_model(args.model_dir, args.out, 0 if args.full else args.lora_rank)
    print(f"tabloop: base policy written to {args.out}", flush=True)
    return 0


def _start_relay(settings: Settings, stop: threading.Event) -> threading.Thread:
    from service.relay import Relay
    from tabloop.core.db import make_engine

    relay = Relay(settings, make_engine(settings))
    thread = threading.Thread(target=relay.run, args=(stop,), name="tabloop-relay", daemon=True)
    thread.start()
    return thread


def _trainer_key(settings: Settings) -> str:
    """A fresh deploy-scoped key for the in-process trainer of `tabloop up` (old ones revoked)."""
    import sqlalchemy as sa

    from tabloop.core import audit
    from tabloop.core.db import make_engine
    from tabloop.core.keys import create_key, revoke_key
    from tabloop.core.tables import api_keys

    engine = make_engine(settings)
    try:
        with engine.begin() as conn:
            old = conn.execute(
                sa.select(api_keys.c.id).where(
                    api_keys.c.name == "embedded-trainer", api_keys.c.revoked_at.is_(None)
                )
            ).scalars()
            for key_id in list(old):
                revoked = revoke_key(conn, key_id)
                if revoked is not None:
                    audit.record_key(conn, audit.SERVICE, "key.revoke", revoked)
            key, token = create_key(conn, name="embedded-trainer", scopes=frozenset({"deploy"}))
            audit.record_key(conn, audit.SERVICE, "key.create", key)
            return token
    finally:
        engine.dispose()


def _start_trainer(
    settings: Settings, url: str, token: str, stop: threading.Event
) -> threading.Thread:
    from tabloop.core.db import make_engine
    from trainer.client import ServiceClient
    from trainer.loop import Trainer

    def run() -> None:
        # A supervisor, as a process manager would be for `tabloop train`: the API keeps
        # serving, the error is logged, and the trainer starts again from the database.
        while not stop.is_set():
            try:
                Trainer(settings, make_engine(settings), ServiceClient(url, token)).run(stop)
            except Exception:
                log.exception("the trainer stopped with an error; restarting in 5 s")
                stop.wait(5.0)

    thread = threading.Thread(target=run, name="tabloop-trainer", daemon=True)
    thread.start()
    return thread


def cmd_up(args: argparse.Namespace) -> int:
    from service.app import create_app
    from tabloop.core.db import upgrade

    settings = _settings(args)
    _device(settings)
    sock = _listen(settings)
    upgrade(settings)
    _ensure_first_admin_key(settings)
    _bootstrap_policy(settings)
    stop = threading.Event()
    threads = []
    if not settings.embedded:
        threads.append(_start_relay(settings, stop))
    threads.append(
        _start_trainer(settings, f"http://127.0.0.1:{settings.port}", _trainer_key(settings), stop)
    )
    mode = "embedded (SQLite, outbox log)" if settings.embedded else "full (broker)"
    print(
        f"tabloop: serving on http://{settings.host}:{settings.port} — {mode}, "
        f"data in {settings.data_dir.resolve()}",
        flush=True,
    )
    try:
        _serve(create_app(settings), settings, sock)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=15)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    settings = _settings(args, "json")
    _device(settings)
    sock = _listen(settings)
    _bootstrap_policy(settings)
    if settings.workers == 1:
        from service.app import create_app

        _serve(create_app(settings), settings, sock)
    else:  # each worker builds its own app (and settings) from the environment
        sock.close()  # the check is done; uvicorn binds the port for its workers itself
        with _multiprocess_metrics():
            uvicorn.run(
                "service.app:app_from_env",
                factory=True,
                host=settings.host,
                port=settings.port,
                workers=settings.workers,
                log_level=settings.log_level.lower(),
                access_log=False,
                log_config=None,  # each worker sets up logging in app_from_env
            )
    return 0


@contextlib.contextmanager
def _multiprocess_metrics() -> Iterator[None]:
    """prometheus_client's multiprocess mode for the workers: each writes its samples to files in
    PROMETHEUS_MULTIPROC_DIR and every worker's /metrics sums them all (service/health.py), so a
    scrape that reaches any worker sees the whole server. A fresh, empty directory per start
    (stale files would add a previous run's counts), removed at exit; one the operator set is
    used as it is and kept."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    directory = tempfile.mkdtemp(prefix="tabloop-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # the workers inherit it
    try:
        yield
    finally:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(directory, ignore_errors=True)


def cmd_relay(args: argparse.Namespace) -> int:
    from service.relay import Relay
    from tabloop.core.db import make_engine

    settings = _settings(args, "json")
    if settings.embedded:
        print(
            "tabloop relay: no broker configured (set TABLOOP_KAFKA_BOOTSTRAP_SERVERS); "
            "in embedded mode the outbox table is the log and no relay is needed",
            file=sys.stderr,
        )
        return 2
    stop = _stop_on_signals()
    _serve_metrics(settings)
    Relay(settings, make_engine(settings)).run(stop)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from tabloop.core.db import make_engine
    from trainer.client import ServiceClient
    from trainer.distributed import UpdatePool, worker_loop
    from trainer.loop import Trainer

    settings = _settings(args, "json")
    _device(settings)
    pool = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun: rank 0 trains
        if int(os.environ.get("RANK", "0")) != 0:
            worker_loop(settings.torch_threads)
            return 0
        pool = UpdatePool.from_env()
    if not settings.trainer_api_key:
        print(
            "tabloop train: set TABLOOP_TRAINER_API_KEY to a deploy-scoped key "
            "(tabloop keys create --scope deploy --name trainer)",
            file=sys.stderr,
        )
        return 2
    url = settings.trainer_api_url or f"http://127.0.0.1:{settings.port}"
    stop = _stop_on_signals()
    _serve_metrics(settings)
    client = ServiceClient(url, settings.trainer_api_key)
    Trainer(settings, make_engine(settings), client, pool=pool).run(stop)
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from tabloop.core.db import upgrade

    settings = _settings(args)
    upgrade(settings, args.revision)
    print(f"tabloop: database at {args.revision}", file=sys.stderr)
    return 0


def _with_engine(settings: Settings, fn: Callable[[sa.Connection], T]) -> T:
    """Run `fn` in one transaction on the database; a database that was never migrated is a
    clear message and exit status 2, not a traceback."""
    from sqlalchemy import inspect

    from tabloop.core.db import make_engine

    engine = make_engine(settings)
    try:
        if not inspect(engine).has_table("alembic_version"):
            where = engine.url.render_as_string(hide_password=True)
            print(
                f"tabloop: the database {where} has no tabloop tables yet: run `tabloop db "
                "upgrade` first (`tabloop up` migrates by itself)",
                file=sys.stderr,
            )
            raise SystemExit(2)
        with engine.begin() as conn:
            return fn(conn)
    finally:
        engine.dispose()


def cmd_keys_create(args: argparse.Namespace) -> int:
    from tabloop.core import audit
    from tabloop.core.keys import ApiKey, create_key, parse_scopes

    settings = _settings(args)
    try:
        scopes = parse_scopes(args.scope)
    except ValueError as e:
        print(f"tabloop keys create: {e}", file=sys.stderr)
        return 2

    def create(c: sa.Connection) -> tuple[ApiKey, str]:
        key, token = create_key(
            c, name=args.name, scopes=scopes, no_train=args.no_train, workspace=args.workspace
        )
        audit.record_key(c, audit.CLI, "key.create", key)  # in the same transaction
        return key, token

    _key, token = _with_engine(settings, create)
    print(token, flush=True)  # alone on stdout, so scripts can capture it
    return 0


def _workspace_name(value: str) -> str:
    if not 1 <= len(value) <= 200 or "\x00" in value:
        raise argparse.ArgumentTypeError("a workspace name has 1 to 200 characters, no NUL")
    return value


def cmd_keys_list(args: argparse.Namespace) -> int:
    from tabloop.core.keys import list_keys

    settings = _settings(args)
    keys = _with_engine(settings, list_keys)
    for k in keys:
        state = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "active"
        privacy = "no-train" if k.no_train else "-"
        scopes = ",".join(sorted(k.scopes))
        print(f"{k.id}\t{k.name}\t{scopes}\t{state}\t{privacy}\tworkspace {k.workspace}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from tabloop.core import audit
    from tabloop.core.keys import ApiKey, revoke_key

    def revoke(c: sa.Connection) -> ApiKey | None:
        key = revoke_key(c, args.id)
        if key is not None:
            audit.record_key(c, audit.CLI, "key.revoke", key)
        return key

    settings = _settings(args)
    key = _with_engine(settings, revoke)
    if key is None:
        print(f"tabloop keys revoke: no key {args.id!r}", file=sys.stderr)
        return 1
    print(f"revoked {args.id}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tabloop",
        description="Online RL for Tab-style code completion. Settings come from TABLOOP_* "
        "environment variables (see README); flags override them.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def log_flags(sp: argparse.ArgumentParser, default: str) -> argparse.ArgumentParser:
        sp.add_argument(
            "--log-format",
            choices=("json", "text"),
            help=f"log lines as JSON objects or text (TABLOOP_LOG_FORMAT, default {default})",
        )
        return sp

    def server_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--host", help="bind address (TABLOOP_HOST, default 127.0.0.1)")
        sp.add_argument("--port", type=int, help="port (TABLOOP_PORT, default 8000)")

    up = sub.add_parser("up", help="embedded: migrate, make a first admin key, start everything")
    server_flags(up)
    log_flags(up, "text")
    up.set_defaults(fn=cmd_up)

    serve = sub.add_parser("serve", help="full mode: the HTTP API")
    server_flags(serve)
    log_flags(serve, "json")
    serve.add_argument("--workers", type=int, help="uvicorn worker processes (TABLOOP_WORKERS)")
    serve.set_defaults(fn=cmd_serve)

    relay = sub.add_parser("relay", help="full mode: publish the outbox to Kafka")
    log_flags(relay, "json").set_defaults(fn=cmd_relay)
    train = sub.add_parser("train", help="the trainer: join, reward, update, gate, deploy")
    log_flags(train, "json").set_defaults(fn=cmd_train)
    train.add_argument(
        "--nproc",
        type=int,
        help="processes each policy-gradient update runs on, data-parallel over gloo "
        "(TABLOOP_TRAINER_NPROC; under torchrun, its ranks)",
    )

    # Handled in main(): listed here for `tabloop --help`.
    sub.add_parser("pretrain", help="train the base policy on real code (see --help)")
    sub.add_parser("simulate", help="simulated editors against a running service (see --help)")

    db = sub.add_parser("db", help="database migrations").add_subparsers(
        dest="db_cmd", required=True
    )
    upg = db.add_parser("upgrade", help="run Alembic migrations")
    upg.add_argument("revision", nargs="?", default="head")
    upg.set_defaults(fn=cmd_db_upgrade)

    models = sub.add_parser("models", help="bring your own model").add_subparsers(
        dest="models_cmd", required=True
    )
    mi = models.add_parser(
        "import",
        help="a Hugging Face causal LM's directory as a base policy checkpoint (its LoRA "
        "adapter and heads); use it as TABLOOP_BASE_CHECKPOINT or POST it to /admin/policies",
    )
    mi.add_argument("model_dir", type=Path, help="config.json, *.safetensors, tokenizer.json")
    mi.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    mi.add_argument("--lora-rank", type=int, default=8, help="the LoRA adapter's rank (8)")
    mi.add_argument(
        "--full",
        action="store_true",
        help="no adapter: the whole model trains and every version stores all of it (small "
        "models: a checkpoint must fit TABLOOP_MAX_CHECKPOINT_BYTES)",
    )
    mi.set_defaults(fn=cmd_models_import)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys_cmd", required=True)
    kc = keys.add_parser("create", help="make a key; prints its token once, alone on stdout")
    kc.add_argument(
        "--scope",
        action="append",
        required=True,
        help="ingest, deploy or admin; repeat or comma-separate for several",
    )
    kc.add_argument("--name", required=True, help="who or what uses the key, e.g. vscode")
    kc.add_argument(
        "--no-train",
        action="store_true",
        help="privacy mode: its requests are served, but none of their code is stored and "
        "they are never trained on (docs/PRIVACY.md)",
    )
    kc.add_argument(
        "--workspace",
        type=_workspace_name,
        help="the workspace the key belongs to: its requests read and feed that workspace's "
        "memory of code, and no other (default: the key's own)",
    )
    kc.set_defaults(fn=cmd_keys_create)
    keys.add_parser("list", help="list keys (never their secrets)").set_defaults(fn=cmd_keys_list)
    kr = keys.add_parser("revoke", help="revoke a key by id")
    kr.add_argument("id")
    kr.set_defaults(fn=cmd_keys_revoke)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pretrain"]:  # its own parser owns all of its flags, --help included
        from trainer.pretrain import main as pretrain_main

        return pretrain_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from simulator.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    from service.memory import fix_mmap_threshold

    fix_mmap_threshold()  # before any policy is loaded (service/memory.py)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
