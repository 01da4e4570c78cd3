"""docker-compose.yml and the Dockerfile, checked against the code they run.

No Docker engine is needed: the compose file is read with PyYAML, every command of our image is
parsed by the real `tabloop` argument parser, and every `TABLOOP_*` variable is checked against
`Settings` (names from its fields, values by building a Settings from the container's
environment). `docker compose config` also runs where a compose binary is installed.

`compose_problems` returns what is wrong instead of asserting, so the negative tests can show
that each kind of mistake is reported.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import ValidationError

from tabloop.cli import build_parser
from tabloop.core.config import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

PREFIX = Settings.model_config["env_prefix"]  # "TABLOOP_"
KNOWN_VARS = {PREFIX + name.upper() for name in Settings.model_fields}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
SERVER_COMMANDS = {"serve", "up"}  # listen on TABLOOP_PORT; the others on TABLOOP_METRICS_PORT

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, $VAR; $$ is a literal $.
_INTERP = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


# -- reading the files ---------------------------------------------------------------------


def interpolate(value: str, env: dict[str, str], problems: list[str], where: str) -> str:
    """Compose's variable substitution, with `env` as the shell environment / .env file."""

    def sub(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["bare"]
        op, arg = m["op"], m["arg"] or ""
        have = env.get(name)
        if op in (":-", "-"):
            return have if have or (op == "-" and have is not None) else arg
        if op in (":?", "?"):
            if not have and not (op == "?" and have is not None):
                # `docker compose` refuses to start anything, even `run --rm service tabloop keys`
                problems.append(f"{where}: ${{{name}}} is required ({arg or 'no message'})")
            return have or ""
        return have or ""

    return _INTERP.sub(sub, value)


def variables_used(text: str) -> set[str]:
    return {m["braced"] or m["bare"] for m in _INTERP.finditer(text) if not m["escaped"]}


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())  # resolves anchors and `<<` merge keys
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), path
    return data


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, line continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        op, _, args = line.partition(" ")
        out.append((op.upper(), args.strip()))
    return out


def dockerfile_image(text: str) -> dict[str, Any]:
    """What the Dockerfile gives a container: ENV, ENTRYPOINT/CMD (exec form), EXPOSE, COPY."""
    image: dict[str, Any] = {"env": {}, "entrypoint": [], "cmd": None, "expose": set(), "copy": []}
    for op, args in dockerfile_instructions(text):
        if op == "ENV":
            for part in re.findall(r'(\w+)=("[^"]*"|\S+)', args):
                image["env"][part[0]] = part[1].strip('"')
        elif op in ("ENTRYPOINT", "CMD"):
            try:
                argv = json.loads(args)
            except ValueError:
                argv = None  # shell form: a /bin/sh -c wrapper that swallows SIGTERM
            image["entrypoint" if op == "ENTRYPOINT" else "cmd"] = argv
        elif op == "EXPOSE":
            image["expose"] |= {int(p.split("/")[0]) for p in args.split()}
        elif op == "COPY":
            parts = [p for p in args.split() if not p.startswith("--")]
            image["copy"].extend(parts[:-1])
    return image


def environment_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def depends_on(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def is_ours(svc: dict[str, Any]) -> bool:
    """Built from this repository's Dockerfile."""
    build = svc.get("build")
    context = build if isinstance(build, str) else (build or {}).get("context")
    return context in (".", "./")


@contextmanager
def container_environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ as the container would have it, as far as TABLOOP_* goes."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith(PREFIX)}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        yield


# -- the checks ----------------------------------------------------------------------------


def command_problems(
    name: str, argv: list[str], env: dict[str, str], problems: list[str]
) -> tuple[Settings | None, str | None]:
    """Parse argv with the CLI's parser and build the process's Settings as `tabloop` would."""
    if not argv or argv[0] != "tabloop":
        problems.append(f"{name}: command {argv!r} does not run `tabloop`")
        return None, None
    try:
        with redirect_stderr(io.StringIO()):  # argparse prints its usage before exiting
            args = build_parser().parse_args(argv[1:])
    except SystemExit:
        problems.append(f"{name}: `{' '.join(argv)}` is refused by the tabloop argument parser")
        return None, None
    if not hasattr(args, "fn"):
        problems.append(f"{name}: `{' '.join(argv)}` is not a subcommand a container can run")
        return None, None
    unknown = sorted(k for k in env if k.upper().startswith(PREFIX) and k.upper() not in KNOWN_VARS)
    for var in unknown:
        problems.append(f"{name}: {var} is not a tabloop setting (tabloop.core.config.Settings)")
    overrides = {k: getattr(args, k) for k in ("host", "port", "workers") if getattr(args, k, None)}
    try:
        with container_environment(env):
            settings = Settings(**overrides)
    except ValidationError as e:
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            what = f"{PREFIX}{field.upper()}" if field else "settings"
            problems.append(f"{name}: {what}: {err['msg']}")
        return None, args.command
    return settings, args.command


def compose_problems(compose: dict[str, Any], dockerfile: str) -> list[str]:
    problems: list[str] = []
    shell_env: dict[str, str] = {}  # no .env: every variable takes its default
    services: dict[str, dict[str, Any]] = compose["services"]
    declared = set(compose.get("volumes") or {})
    image = dockerfile_image(dockerfile)

    # The Dockerfile: exec-form CMD that is itself a valid command, files that exist.
    if image["entrypoint"] is None or image["cmd"] is None:
        problems.append("Dockerfile: ENTRYPOINT/CMD must be in exec (JSON) form")
    else:
        default_argv = image["entrypoint"] + image["cmd"]
        command_problems("Dockerfile CMD", default_argv, dict(image["env"]), problems)
    for src in image["copy"]:
        if not (ROOT / src).exists():
            problems.append(f"Dockerfile: COPY source {src} does not exist")
    for var in image["env"]:
        if var.startswith(PREFIX) and var not in KNOWN_VARS:
            problems.append(f"Dockerfile: ENV {var} is not a tabloop setting")

    # Every ${VAR} naming a tabloop setting must name a real one.
    for var in sorted(variables_used(yaml.safe_dump(compose))):
        if var.startswith(PREFIX) and var not in KNOWN_VARS:
            problems.append(f"compose: ${{{var}}} is not a tabloop setting")

    one_shot = {
        dep
        for svc in services.values()
        for dep, cond in depends_on(svc).items()
        if cond == "service_completed_successfully"
    }
    listening: dict[str, int] = {}  # our API services: name -> port
    hosts: dict[str, str] = {}  # and the address each binds
    trainer_targets: list[tuple[str, str, int | None]] = []  # trainer -> (API host, port)
    for name, svc in services.items():
        # depends_on: targets exist, conditions make sense for them.
        for dep, cond in depends_on(svc).items():
            if dep not in services:
                problems.append(f"{name}: depends_on {dep!r}, which is not a service")
            elif cond not in CONDITIONS:
                problems.append(f"{name}: depends_on {dep} with unknown condition {cond!r}")
            elif cond == "service_healthy" and "healthcheck" not in services[dep]:
                problems.append(f"{name}: waits for {dep} to be healthy; it has no healthcheck")

        # Volumes: named ones are declared at the top level.
        for vol in svc.get("volumes") or []:
            source = vol.get("source") if isinstance(vol, dict) else str(vol).split(":")[0]
            kind = vol.get("type", "volume") if isinstance(vol, dict) else None
            is_path = not source or source.startswith((".", "/", "~", "$"))
            if kind in (None, "volume") and not is_path and source not in declared:
                problems.append(f"{name}: volume {source!r} is not declared under volumes:")

        # Health and restart: every long-running service has both; one-shots neither restart.
        restart = str(svc.get("restart", "no"))
        health = svc.get("healthcheck") or {}
        if name in one_shot:
            if restart not in ("no", "on-failure"):
                problems.append(f"{name}: a one-shot with restart: {restart}")
        else:
            if not health.get("test") or health.get("disable"):
                problems.append(f"{name}: a long-running service without a healthcheck")
            if restart == "no":
                problems.append(f"{name}: a long-running service without a restart policy")

        if not is_ours(svc):
            continue
        # Our image: the command is real and its environment makes valid Settings.
        where = f"{name}.environment"
        env = {**image["env"]}
        env.update(
            {k: interpolate(v, shell_env, problems, where) for k, v in environment_of(svc).items()}
        )
        raw = svc.get("command", image["cmd"])
        if isinstance(raw, str):
            problems.append(f"{name}: command must be a list (exec form), got {raw!r}")
            continue
        argv = image["entrypoint"] + [interpolate(str(a), shell_env, problems, name) for a in raw]
        settings, command = command_problems(name, argv, env, problems)
        if settings is None:
            continue
        if command in SERVER_COMMANDS:
            listening[name], hosts[name] = settings.port, settings.host
            ports = {settings.port}
        else:
            ports = {settings.metrics_port} if settings.metrics_port else set()
        if name not in one_shot:
            if command not in SERVER_COMMANDS and not settings.metrics_port:
                problems.append(f"{name}: nothing to health-check; set TABLOOP_METRICS_PORT")
            test = " ".join(map(str, health.get("test") or []))
            for port in re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", test):
                if int(port) not in ports:
                    problems.append(
                        f"{name}: healthcheck probes port {port}; it listens on {ports}"
                    )
        for mapping in svc.get("ports") or []:
            target = int(interpolate(str(mapping), shell_env, problems, name).split(":")[-1])
            if target not in ports:
                problems.append(f"{name}: publishes container port {target}; it listens on {ports}")
        if command == "train" and settings.trainer_api_url:
            url = urlsplit(settings.trainer_api_url)
            trainer_targets.append((name, url.hostname or "", url.port))

    # The trainer reaches an API service, on its port, bound to every interface.
    for name, api, port in trainer_targets:
        if api not in listening:
            problems.append(f"{name}: TABLOOP_TRAINER_API_URL names {api!r}, not an API service")
        elif listening[api] != port:
            problems.append(
                f"{name}: TABLOOP_TRAINER_API_URL port {port}; {api} listens on {listening[api]}"
            )
        elif hosts[api] in ("127.0.0.1", "localhost"):
            problems.append(f"{api}: binds {hosts[api]}, unreachable from {name}")

    used = {
        (v.get("source") if isinstance(v, dict) else str(v).split(":")[0])
        for svc in services.values()
        for v in svc.get("volumes") or []
    }
    for vol in sorted(declared - used):
        problems.append(f"volume {vol!r} is declared but no service uses it")
    return problems


# -- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_compose_file_matches_the_code(compose: dict[str, Any], dockerfile: str) -> None:
    assert compose_problems(compose, dockerfile) == []


def test_the_full_stack_is_there(compose: dict[str, Any]) -> None:
    services = compose["services"]
    commands = {name: svc["command"][1] for name, svc in services.items() if is_ours(svc)}
    assert sorted(commands.values()) == ["db", "relay", "serve", "train"]
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert services["postgres"]["image"].startswith("postgres:")
    serve = next(s for s in services.values() if is_ours(s) and s["command"][1] == "serve")
    argv = [interpolate(str(a), {}, [], "serve") for a in serve["command"]]
    assert int(build_parser().parse_args(argv[1:]).workers) > 1, "several uvicorn workers"
    assert {"pgdata", "kafkadata", "tabloopdata"} <= set(compose["volumes"])


def test_interpolation_takes_defaults_and_reports_required() -> None:
    problems: list[str] = []
    assert interpolate("a${X:-1}b${Y-2}$$c", {}, problems, "t") == "a1b2$c"
    assert interpolate("${X:-1}", {"X": "9"}, problems, "t") == "9"
    assert interpolate("${X:-1}/${X-1}", {"X": ""}, problems, "t") == "1/"
    assert problems == []
    interpolate("${KEY:?set it}", {}, problems, "t")
    assert problems == ["t: ${KEY} is required (set it)"]


DELETE = object()


def _mutate(compose: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy with `a.b.c` set to value, or deleted."""
    data = copy.deepcopy(compose)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        # a setting that does not exist (a typo) is ignored by pydantic-settings: must be caught
        ("services.service.environment.TABLOOP_WORKRES", "4", "TABLOOP_WORKRES is not a tabloop"),
        ("services.service.environment.TABLOOP_KAFKA_TOPIC_PARTITIONS", "0", "greater than"),
        ("services.relay.environment.TABLOOP_DATABASE_URL", "mysql://x/y", "sqlite:// or post"),
        ("services.relay.environment.TABLOOP_KAFKA_BOOTSTRAP_SERVERS", "", "settings: Value"),
        ("services.service.command", ["tabloop", "serve", "--wokers", "4"], "refused by the"),
        ("services.service.command", ["tabloop", "serve", "--workers", "99"], "TABLOOP_WORKERS"),
        ("services.relay.command", ["tabloop", "rely"], "refused by the tabloop"),
        ("services.migrate.command", ["tabloop", "pretrain"], "not a subcommand a container"),
        ("services.service.command", "tabloop serve", "must be a list"),
        ("services.trainer.environment.TABLOOP_METRICS_PORT", DELETE, "set TABLOOP_METRICS_PORT"),
        ("services.trainer.environment.TABLOOP_TRAINER_API_URL", "http://api:8000", "not an API"),
        ("services.service.environment.TABLOOP_HOST", "127.0.0.1", "unreachable from trainer"),
        ("services.service.environment.TABLOOP_PORT", "8080", "healthcheck probes port 8000"),
        ("services.relay.healthcheck", DELETE, "relay: a long-running service without a health"),
        ("services.kafka.restart", DELETE, "kafka: a long-running service without a restart"),
        ("services.trainer.volumes", ["modeldata:/data"], "'modeldata' is not declared"),
        ("services.relay.depends_on.migrate", {"condition": "service_healthy"}, "no healthcheck"),
        ("services.trainer.depends_on.api", {"condition": "service_healthy"}, "'api', which is"),
        ("volumes.extra", None, "'extra' is declared but no service uses it"),
    ],
)
def test_mistakes_are_reported(
    compose: dict[str, Any], dockerfile: str, path: str, value: Any, expected: str
) -> None:
    problems = compose_problems(_mutate(compose, path, value), dockerfile)
    assert any(expected in p for p in problems), problems


def test_dockerfile_mistakes_are_reported(compose: dict[str, Any], dockerfile: str) -> None:
    bad_cmd = dockerfile.replace('CMD ["tabloop", "serve"]', 'CMD ["tabloop", "serv"]')
    assert bad_cmd != dockerfile
    assert any("Dockerfile CMD" in p for p in compose_problems(compose, bad_cmd))
    shell = dockerfile.replace('CMD ["tabloop", "serve"]', "CMD tabloop serve")
    assert any("exec (JSON) form" in p for p in compose_problems(compose, shell))
    missing = dockerfile.replace("COPY trainer ./trainer", "COPY trainers ./trainer")
    assert any("trainers does not exist" in p for p in compose_problems(compose, missing))


def _compose_binary() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        ok = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if ok.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    """The compose implementation's own validation (no engine needed for `config`)."""
    binary = _compose_binary()
    if binary is None:
        pytest.skip("no `docker compose` plugin nor `docker-compose` binary on this machine")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TABLOOP_", "COMPOSE_"))}
    out = subprocess.run(
        [*binary, "--project-directory", str(ROOT), "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr


# -- the image a user builds ---------------------------------------------------------------


def test_the_image_has_every_package_cpu_torch_and_no_root() -> None:
    """Every package pyproject.toml installs is copied in; torch comes from PyTorch's CPU index
    at the pinned version (the default index's wheel is the CUDA build); the processes run as
    an unprivileged user that owns the data directory."""
    import tomllib

    text = DOCKERFILE.read_text()
    ops = dockerfile_instructions(text)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in found}
    copied = set(dockerfile_image(text)["copy"])
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    runs = [args for op, args in ops if op == "RUN"]
    torch_run = next((r for r in runs if torch_pin in r), None)
    assert torch_run and "--index-url https://download.pytorch.org/whl/cpu" in torch_run, runs
    assert runs.index(torch_run) < next(i for i, r in enumerate(runs) if "pip install ." in r)
    users = [args for op, args in ops if op == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    env = dockerfile_image(text)["env"]
    assert f"chown {users[-1]}:{users[-1]} {env['TABLOOP_DATA_DIR']}" in " ".join(runs)


# -- the operations guide ------------------------------------------------------------------

OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
_DOC_COMMAND = re.compile(r"\btabloop ((?:up|serve|relay|train|db|keys)\b[^`|#\n]*)")
_DOC_ROUTE = re.compile(r"\b(GET|POST|PUT|DELETE)(?:\|(?:GET|POST|PUT|DELETE))* (/[\w/{}.-]*)")


def test_operations_guide_commands_parse() -> None:
    """Every `tabloop ...` command line in docs/OPERATIONS.md is one the CLI accepts."""
    found = 0
    for m in _DOC_COMMAND.finditer(OPERATIONS.read_text()):
        text = m[1].strip().rstrip(".,;:)")
        if "..." in text or text.split()[0].endswith(":"):
            continue  # an elided example, or a quoted message
        # placeholders (N, ID, DIR) stand for values
        argv = ["1" if re.fullmatch(r"[A-Z]+", t) else t for t in text.split()]
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"docs/OPERATIONS.md: `tabloop {text}` is refused by the CLI")
        assert hasattr(args, "fn"), text
        found += 1
    assert found >= 8


def test_operations_guide_routes_exist(tmp_path: Path) -> None:
    """Every `METHOD /path` in docs/OPERATIONS.md is a route of the app."""
    from service.app import create_app

    with container_environment({}):
        app = create_app(Settings(data_dir=tmp_path))

    def normal(path: str) -> str:  # parameter names and converters do not matter
        return re.sub(r"\{[^}]*\}", "{}", path)

    routes = {
        (method.upper(), normal(path))
        for path, ops in app.openapi()["paths"].items()
        for method in ops
    }
    documented = set()
    for m in _DOC_ROUTE.finditer(OPERATIONS.read_text()):
        methods = re.findall(r"GET|POST|PUT|DELETE", m[0].split(" ")[0])
        documented |= {(method, normal(m[2].rstrip("."))) for method in methods}
    missing = sorted(documented - routes)
    assert len(documented) >= 10 and missing == [], missing

    # curl examples: `curl ... [-X METHOD] $API/path` (a body without -X is a POST)
    patterns = {(m, re.compile(re.escape(p).replace(r"\{\}", "[^/]+") + "$")) for m, p in routes}
    lines = OPERATIONS.read_text().replace("\\\n", " ").splitlines()  # continuations joined
    curls = [ln for ln in lines if "curl" in ln and "$API/" in ln]
    for line in curls:
        path = re.search(r"\$API(/[\w/.-]*)", line)[1]  # type: ignore[index]
        verb = re.search(r"-X (\w+)", line)
        method = verb[1] if verb else "POST" if re.search(r" -[Fd] ", line) else "GET"
        assert any(m == method and p.match(path) for m, p in patterns), line
    assert len(curls) >= 4
