"""Ingestion throughput and latency of POST /v1/events. Prints the figures in docs/BENCHMARKS.md.

    python benchmarks/ingest.py [--duration 15] [--connections 16] [--workers 1]
                                [--modes embedded,full,naive] [--profile DIR]
                                [--users 10000] [--person-share F]
                                [--compare REF [--rounds 2]]

Everything runs on this machine, on 127.0.0.1 only. The servers are separate processes started
here; this process only generates load (benchmarks/loadgen.py: 100-event batches of the five
types over `--users` people, every event_id fresh; `--person-share` sets the share of
model_switch and churn, which name a person and are checked against the rollouts). Per mode,
after a warm-up:

1. peak: `--connections` connections posting back to back (closed loop) for `--duration`
   seconds (or `--max-requests` batches): events/s accepted, batch latency p50/p99;
2. 70%: batches started on a fixed schedule at 70% of the peak event rate (open loop, latency
   counted from the scheduled start): p50/p99.

Modes:
- embedded: the API of `tabloop up` (SQLite in WAL mode, the outbox is the log, no broker),
  run as `tabloop serve` without the in-process trainer that `tabloop up` adds;
- full: PostgreSQL (tabloop/testing/postgres.PostgresServer, fast=False: fsync, synchronous_commit
  and full_page_writes on, so a 202 is durable) + Tansu (tabloop/testing/kafka.KafkaBroker,
  in-memory storage), `tabloop serve` (TABLOOP_WORKERS=--workers) and `tabloop relay` draining
  the outbox;
- naive: benchmarks/naive_ingest.py on the same PostgreSQL and broker (per event: one ORM
  insert + commit and one synchronous Kafka send). The full / naive ratio is the headline.

After each embedded and full run, every accepted event is checked to be stored once (the events
table) and, in full mode, published once (the feedback topic, read back from the broker).

`--compare REF` measures a checkout of the git revision REF (`git archive`, run from its own
directory with its own code and migrations) against the working tree in one run: `--rounds`
rounds of each mode, the two trees alternating (REF first in odd rounds, the working tree first
in even ones), each run on a fresh database and, in full mode, a fresh broker; both are printed.

The per-key rate limit is lifted for the run (TABLOOP_RATE_LIMIT_PER_S / _BURST). CPU use of
every process during the peak phase is printed, with what the rest of the machine used
("other": anything above a few percent means the figures are skewed by other work).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import orjson

from benchmarks.loadgen import BATCH, HOST, USERS, Load, Stats, closed_loop, open_loop

ROOT = Path(__file__).resolve().parents[1]

NAIVE = Path(__file__).resolve().parent / "naive_ingest.py"


# -- processes -----------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TABLOOP_") and "proxy" not in k.lower()
    }
    env.update(extra)
    return env


def parse_pairs(items: list[str]) -> dict[str, Any]:
    """`name=value` command-line pairs, values parsed as JSON where they parse."""
    out: dict[str, Any] = {}
    for item in items:
        name, _, raw = item.partition("=")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def sim_reward_spec(pairs: list[str]) -> dict[str, Any]:
    """The sim profile's reward spec with `--reward name=value` pairs changed, validated as the
    service validates a PUT; a clear exit on a bad field."""
    from tabloop.core.reward_spec import RewardSpec

    try:
        return RewardSpec.from_dict({**RewardSpec.sim().to_dict(), **parse_pairs(pairs)}).to_dict()
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--reward: {e}") from e


def tabloop(*args: str, env: dict[str, str], tree: Path = ROOT) -> str:
    """Run a short `tabloop` command of the code in `tree`; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "tabloop.cli", *args],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"tabloop {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


class Proc:
    """A server process in its own process group, logging to a file."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, cwd: Path = ROOT
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self.popen.pid

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(5)

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])


def wait_ready(port: int, path: str, proc: Proc, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=f"http://{HOST}:{port}", trust_env=False, timeout=2) as c:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise SystemExit(f"{proc.name} exited during start:\n{proc.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if c.get(path).status_code == 200:
                    return
            time.sleep(0.1)
    raise SystemExit(f"{proc.name} not ready on :{port} after {timeout_s}s:\n{proc.tail()}")


def _stat_fields(pid: int) -> list[bytes]:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rindex(b")") + 2 :].split()


def cpu_seconds(root: int | None) -> float:
    """CPU time of a process and its live descendants (plus the children it has reaped)."""
    if root is None:
        return 0.0
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                kids.setdefault(int(_stat_fields(int(d.name))[1]), []).append(int(d.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        with contextlib.suppress(OSError, ValueError, IndexError):
            f = _stat_fields(pid)
            total += int(f[11]) + int(f[12]) + (int(f[13]) + int(f[14]) if pid == root else 0)
    return total / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(limit_s: float) -> bool:
    """Wait (up to `limit_s`) until the rest of the machine is nearly idle; False if it never is."""
    deadline = time.monotonic() + limit_s
    while True:
        busy0, t0 = machine_busy(), time.monotonic()
        time.sleep(2)
        share = (machine_busy() - busy0) / (time.monotonic() - t0) / (os.cpu_count() or 1)
        if share < 0.15:
            return True
        if time.monotonic() > deadline:
            return False


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def base_checkpoint(work: Path) -> Path:
    """The policy the API processes load at start. Ingestion does not use it, so when the
    shipped base policy is not there a tiny random-init one stands in."""
    from tabloop.core.config import Settings
    from tabloop.core.policy.checkpoint import MANIFEST_FILE

    shipped = Path(
        os.environ.get("TABLOOP_BASE_CHECKPOINT")
        or Settings.model_fields["base_checkpoint"].default
    )
    if (shipped / MANIFEST_FILE).is_file():
        return shipped
    import sysconfig

    import torch

    from tabloop.core.policy.checkpoint import save_checkpoint
    from tabloop.core.policy.model import GPT, ModelConfig
    from tabloop.core.policy.tokenizer import train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = train_tokenizer([(stdlib / "textwrap.py").read_text()], vocab_size=300)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32)
    return save_checkpoint(
        work / "tiny-policy",
        GPT(cfg).eval(),
        tok,
        version=0,
        parent=None,
        summary={"note": "stand-in for the ingestion benchmark"},
    )


def free_port() -> int:
    from tabloop.testing.procs import free_port as fp

    return fp()


# -- the run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """The code a run measures: the working tree, or a checkout of a git revision."""

    label: str
    path: Path


WORK = Tree("working tree", ROOT)


def shipped_base(tree: Path) -> Path:
    """The base policy a tree ships (its place moved with the shared core, tabloop/core)."""
    for place in ("tabloop/core/policy/base", "service/policy/base"):
        if (tree / place).is_dir():
            return tree / place
    raise SystemExit(f"{tree}: no shipped base policy")


def checkout(ref: str, into: Path) -> Tree:
    """The tree of git revision `ref` (`git archive`), unpacked under `into`."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--short", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if sha.returncode != 0:
        raise SystemExit(f"--compare: {ref!r} is not a commit of this repository")
    path = into / f"ref-{sha.stdout.strip()}"
    path.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(ROOT), "archive", "--format=tar", sha.stdout.strip()],
        stdout=subprocess.PIPE,
    )
    subprocess.run(["tar", "-x", "-C", str(path)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"--compare: git archive {ref} failed")
    short = sha.stdout.strip()
    return Tree(ref if short.startswith(ref) or ref.startswith(short) else f"{ref} ({short})", path)


@dataclass
class Result:
    mode: str
    peak: Stats
    cpu: dict[str, float]  # component -> share of one core during the peak phase, percent
    at70: Stats | None = None
    notes: list[str] = field(default_factory=list)
    # full mode: the peak phase's events over the time until the relay had published them all
    end_to_end: float | None = None
    tree: str = WORK.label

    def per_event(self, component: str) -> float:
        """CPU microseconds per accepted event during the peak phase."""
        rate = self.peak.rate
        return self.cpu[component] / 100 * 1e6 / rate if rate else float("nan")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = Path(tempfile.mkdtemp(prefix="tabloop-ingest-bench-"))
        self.cleanup = [self.base]
        self.procs: list[Proc] = []
        self.pg: Any = None
        self.broker: Any = None
        self.run_brokers: list[Any] = []  # full runs' own brokers, closed on the way out
        self.stand_in: Path | None = None
        self.seed = 0
        self.runs = 0  # embedded and full runs so far: each gets its own database
        self.accepted = 0  # events the servers answered as accepted in the current run
        self.loadmix = Load(args.users, args.person_share)

    def pg_and_broker(self) -> tuple[Any, Any]:
        """PostgreSQL with durable commits and a Tansu broker (the naive mode's; a full run
        starts its own)."""
        from tabloop.testing.kafka import KafkaBroker
        from tabloop.testing.postgres import PostgresServer

        if self.pg is None:
            # its own mkdtemp: the `postgres` OS user must be able to reach it (see PostgresServer)
            pg_dir = Path(tempfile.mkdtemp(prefix="tabloop-ingest-bench-pg-"))
            self.cleanup.append(pg_dir)
            self.pg = PostgresServer(pg_dir, fast=False).start()
            self.broker = KafkaBroker(self.base / "kafka", durable=False).start()
        return self.pg, self.broker

    def spawn(self, name: str, argv: list[str], env: dict[str, str], tree: Tree = WORK) -> Proc:
        p = Proc(name, argv, env, self.base, cwd=tree.path)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        for b in self.run_brokers:
            b.close()
        if self.broker is not None:
            self.broker.close()
        if self.pg is not None:
            self.pg.close()
        for d in self.cleanup:
            shutil.rmtree(d, ignore_errors=True)

    def checkpoint(self, tree: Tree) -> Path:
        """The tree's own shipped base policy, else a tiny stand-in (see base_checkpoint)."""
        from tabloop.core.policy.checkpoint import MANIFEST_FILE

        shipped = shipped_base(tree.path)
        if tree != WORK and (shipped / MANIFEST_FILE).is_file():
            return shipped
        if self.stand_in is None:
            self.stand_in = base_checkpoint(self.base)
        return self.stand_in

    def tabloop_env(self, tree: Tree, **extra: str) -> dict[str, str]:
        """The environment of the tree's `tabloop` processes: its code first on the path."""
        return clean_env(
            PYTHONPATH=str(tree.path),
            TABLOOP_RATE_LIMIT_PER_S="1000000",
            TABLOOP_RATE_LIMIT_BURST="1000000",
            TABLOOP_LOG_LEVEL="WARNING",
            TABLOOP_BASE_CHECKPOINT=str(self.checkpoint(tree)),
            **extra,
        )

    def load(
        self, port: int, token: str | None, duration: float, rate_rps: float | None = None
    ) -> Stats:
        a = self.args
        self.seed += 1
        if rate_rps is None:
            stats = asyncio.run(
                closed_loop(
                    port, token, a.connections, duration, a.max_requests, self.seed, self.loadmix
                )
            )
        else:
            stats = asyncio.run(
                open_loop(
                    port,
                    token,
                    a.connections,
                    rate_rps,
                    duration,
                    a.max_requests,
                    self.seed,
                    self.loadmix,
                )
            )
        self.accepted += stats.accepted
        return stats

    def measure(
        self,
        mode: str,
        port: int,
        token: str | None,
        components: dict[str, int | None],
        *,
        at70: bool,
        before_phase: Callable[[str], None] | None = None,
        after_phase: Callable[[str, Result], None] | None = None,
        between: Callable[[], None] | None = None,
    ) -> Result:
        """Warm up, then the peak phase and (`at70`) the 70% phase; the hooks run around each
        phase (named "peak" and "70%"), `between` before each (e.g. to drain a backlog)."""
        if between:
            between()
        if self.args.quiet_wait and not wait_quiet(self.args.quiet_wait):
            print(
                f"  the machine stayed busy for {self.args.quiet_wait:.0f} s; measuring anyway",
                flush=True,
            )
        self.load(port, token, self.args.warmup)
        if between:
            between()
        before = {name: cpu_seconds(pid) for name, pid in components.items()}
        before["loadgen"], busy0 = self_cpu(), machine_busy()
        if before_phase:
            before_phase("peak")
        peak = self.load(port, token, self.args.duration)
        after = {name: cpu_seconds(pid) for name, pid in components.items()}
        after["loadgen"] = self_cpu()
        cpu = {k: 100 * (after[k] - before[k]) / peak.elapsed for k in after}
        cpu["other"] = 100 * (machine_busy() - busy0) / peak.elapsed - sum(cpu.values())
        result = Result(mode, peak, cpu)
        print(
            f"  peak: {peak.rate:,.0f} events/s, p50 {peak.pct(0.5):.1f} ms, "
            f"p99 {peak.pct(0.99):.1f} ms, {len(peak.latencies)} batches"
            + (f", other answers {peak.statuses}" if peak.statuses else ""),
            flush=True,
        )
        print(
            "  cpu, % of one core: "
            + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items())
            + "; µs per event: "
            + ", ".join(f"{k} {result.per_event(k):.0f}" for k in cpu if k != "other"),
            flush=True,
        )
        if after_phase:
            after_phase("peak", result)
        if at70 and peak.rate > 0:
            if between:
                between()
            if before_phase:
                before_phase("70%")
            s = result.at70 = self.load(port, token, self.args.duration, 0.7 * peak.rate / BATCH)
            print(
                f"  70%: {s.rate:,.0f} events/s (offered {0.7 * peak.rate:,.0f}), "
                f"p50 {s.pct(0.5):.1f} ms, p99 {s.pct(0.99):.1f} ms"
                + (f", other answers {s.statuses}" if s.statuses else ""),
                flush=True,
            )
            if after_phase:
                after_phase("70%", result)
        return result

    def check_stored(self, result: Result, stored: int, distinct: int, where: str) -> None:
        """Every event answered as accepted is in `where` once (`stored` rows, `distinct` event
        ids among them); a note, and a loud line if not."""
        ok = stored == distinct == self.accepted
        note = f"{where}: {stored:,} events, {distinct:,} distinct, {self.accepted:,} accepted" + (
            "" if ok else " -- MISMATCH"
        )
        result.notes.append(note)
        print(f"  {note}", flush=True)

    # -- modes

    def embedded(self, tree: Tree = WORK) -> Result:
        import sqlite3

        self.runs += 1
        self.accepted = 0
        data = self.base / f"embedded-{self.runs}"
        env = self.tabloop_env(tree, TABLOOP_DATA_DIR=str(data))
        tabloop("db", "upgrade", env=env, tree=tree.path)
        token = tabloop(
            "keys", "create", "--scope", "ingest", "--name", "bench", env=env, tree=tree.path
        ).strip()
        port = free_port()
        server = self.spawn(
            "embedded",
            [sys.executable, "-m", "tabloop.cli", "serve", "--port", str(port)],
            env,
            tree,
        )
        wait_ready(port, "/readyz", server)
        result = self.measure("embedded", port, token, {"server": server.pid}, at70=True)
        server.stop()
        with contextlib.closing(sqlite3.connect(data / "tabloop.db")) as db:
            # event_id is the primary key: a row per event at most, so the count says it all
            (stored,) = db.execute("SELECT count(*) FROM events").fetchone()
        self.check_stored(result, stored, stored, "database")
        return result

    def full(self, tree: Tree = WORK) -> Result:
        from tabloop.core.stream.topics import FEEDBACK
        from tabloop.testing.kafka import KafkaBroker, consume_all

        pg, _ = self.pg_and_broker()
        self.runs += 1
        self.accepted = 0
        name = f"tabloop_bench_{self.runs}"
        url = pg.create_database(name)
        broker = KafkaBroker(self.base / f"kafka-{self.runs}", durable=False)
        self.run_brokers.append(broker)
        broker.start()
        env = self.tabloop_env(
            tree,
            TABLOOP_DATABASE_URL=url,
            TABLOOP_KAFKA_BOOTSTRAP_SERVERS=broker.bootstrap,
            TABLOOP_DATA_DIR=str(self.base / f"full-{self.runs}"),
            TABLOOP_WORKERS=str(self.args.workers),
        )
        tabloop("db", "upgrade", env=env, tree=tree.path)
        token = tabloop(
            "keys", "create", "--scope", "ingest", "--name", "bench", env=env, tree=tree.path
        ).strip()
        port = free_port()
        server = self.spawn(
            "serve", [sys.executable, "-m", "tabloop.cli", "serve", "--port", str(port)], env, tree
        )
        relay = self.spawn("relay", [sys.executable, "-m", "tabloop.cli", "relay"], env, tree)
        wait_ready(port, "/readyz", server)
        state: dict[str, Any] = {}

        def outbox() -> tuple[int, int]:
            """(rows waiting for the relay, highest outbox id)"""
            with pg.connect(name, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE published_at IS NULL), "
                    "coalesce(max(id), 0) FROM outbox"
                ).fetchone()
                return int(row[0]), int(row[1])

        def drain(timeout_s: float = 120) -> None:
            """Wait for the relay to empty the outbox (it has the machine to itself meanwhile)."""
            t0, (left0, _) = time.monotonic(), outbox()
            while (left := outbox()[0]) > 0 and time.monotonic() - t0 < timeout_s:
                time.sleep(0.1)
            if left0 > 10_000:
                state["drain"] = (left0 - left) / (time.monotonic() - t0)
            if left:
                print(f"  relay: {left} rows still unpublished after {timeout_s:.0f} s", flush=True)

        def before_phase(phase: str) -> None:
            state[phase] = time.monotonic(), outbox()
            if phase == "peak" and self.args.profile:
                self.profile(server=server.pid, relay=relay.pid)

        def after_phase(phase: str, result: Result) -> None:
            # did the relay keep up? rows it stamped published during the phase
            t0, (waiting0, max0) = state[phase]
            waiting1, max1 = outbox()
            published = (max1 - max0) - (waiting1 - waiting0)
            result.notes.append(
                f"{phase}: relay published {published / (time.monotonic() - t0):,.0f} rows/s; "
                f"{waiting1} rows waiting at the end"
            )
            print(f"  {result.notes[-1]}", flush=True)
            if phase == "peak":  # stored and published: the peak's events, once all are out
                t1 = time.monotonic()
                drain()
                s = result.peak
                result.end_to_end = s.accepted / (s.elapsed + time.monotonic() - t1)
                print(f"  peak, end to end: {result.end_to_end:,.0f} events/s", flush=True)

        components = {
            "server": server.pid,
            "relay": relay.pid,
            "postgres": pg.pid,
            "broker": broker.pid,
        }
        result = self.measure(
            "full",
            port,
            token,
            components,
            at70=True,
            before_phase=before_phase,
            after_phase=after_phase,
            between=drain,
        )
        if "drain" in state:
            result.notes.append(f"relay alone (no load) drained {state['drain']:,.0f} rows/s")
        server.stop()
        drain()
        relay.stop()
        with pg.connect(name, autocommit=True) as conn:
            (stored,) = conn.execute("SELECT count(*) FROM events").fetchone()
        self.check_stored(result, stored, stored, "PostgreSQL")
        published = [
            orjson.loads(r.value)["event_id"]
            for r in consume_all(broker.bootstrap, FEEDBACK, timeout_s=300)
        ]
        self.check_stored(result, len(published), len(set(published)), f"topic {FEEDBACK}")
        broker.close()
        self.run_brokers.remove(broker)
        return result

    def naive(self, tree: Tree = WORK) -> Result:
        from tabloop.testing.kafka import create_topics

        pg, broker = self.pg_and_broker()
        url = pg.create_database("naive_bench")
        create_topics(broker.bootstrap, "bench.naive", partitions=6)
        port = free_port()
        server = self.spawn(
            "naive", [sys.executable, str(NAIVE), str(port), url, broker.bootstrap], clean_env()
        )
        wait_ready(port, "/healthz", server)
        components = {"server": server.pid, "postgres": pg.pid, "broker": broker.pid}
        result = self.measure("naive", port, None, components, at70=False)
        server.stop()
        return result

    def profile(self, **pids: int) -> None:
        """py-spy the peak phase: collapsed stacks (flamegraph.pl and speedscope read them) of
        the thread holding the GIL, sampled without pausing the process."""
        out = Path(self.args.profile)
        out.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        for name, pid in pids.items():
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--subprocesses",
                    "--nonblocking",
                    "--gil",
                    "--rate",
                    "100",
                    "--duration",
                    str(int(self.args.duration)),
                    "--format",
                    "raw",
                    "-o",
                    str(out / f"{name}-{self.runs}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        "?",
    )
    mem = next(
        (
            int(ln.split()[1])
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemTotal")
        ),
        0,
    )
    python = sys.version.split()[0]
    return f"{os.cpu_count()} CPUs ({model}), {mem / 2**20:.0f} GiB RAM, Python {python}"


def report(results: list[Result], args: argparse.Namespace) -> None:
    print()
    print(f"machine: {machine()}")
    mix = Load(args.users, args.person_share)
    person = sum(w for k, w in mix.mix.items() if k in ("model_switch", "churn"))
    print(
        f"load: {BATCH}-event batches from {args.users:,} people "
        f"({person:.0%} model_switch/churn), "
        f"{args.connections} connections, {args.duration:.0f} s or {args.max_requests:,} batches "
        f"per phase, loopback. full: PostgreSQL fsync=on synchronous_commit=on (durable), Tansu "
        f"in-memory, TABLOOP_WORKERS={args.workers}"
    )
    trees = list(dict.fromkeys(r.tree for r in results))
    width = max(len(t) for t in trees) + 2 if len(trees) > 1 else 0
    head = (
        f"{'mode':<10}{'code':<{width}}{'events/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'e2e ev/s':>10}"
        f"{'70% ev/s':>10}{'70% p50':>9}{'70% p99':>9}  non-202"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        s, t = r.peak, r.at70
        errors = {**s.statuses, **(t.statuses if t else {})}
        cells = (
            f"{t.rate:>10,.0f}{t.pct(0.5):>9.1f}{t.pct(0.99):>9.1f}"
            if t
            else f"{'-':>10}{'-':>9}{'-':>9}"
        )
        code = r.tree if width else ""
        e2e = f"{r.end_to_end:>10,.0f}" if r.end_to_end is not None else f"{'-':>10}"
        print(
            f"{r.mode:<10}{code:<{width}}{s.rate:>10,.0f}{s.pct(0.5):>9.1f}{s.pct(0.99):>9.1f}"
            f"{e2e}{cells}  {errors or '-'}"
        )
    if len(trees) > 1:
        for mode in dict.fromkeys(r.mode for r in results if r.mode != "naive"):
            runs = [r for r in results if r.mode == mode]
            for label, value in (("peak", lambda r: r.peak.rate), ("e2e", lambda r: r.end_to_end)):
                rates = {t: [value(r) for r in runs if r.tree == t] for t in trees}
                if any(x is None for xs in rates.values() for x in xs):
                    continue
                print(
                    f"{mode} {label} events/s by run: "
                    + "; ".join(
                        f"{t}: "
                        + ", ".join(f"{x:,.0f}" for x in xs)
                        + f" (median {median(xs):,.0f})"
                        for t, xs in rates.items()
                    )
                )
    by_mode = {r.mode: r for r in results if r.tree == WORK.label}
    if "full" in by_mode and "naive" in by_mode and by_mode["naive"].peak.rate:
        print(f"full / naive: {by_mode['full'].peak.rate / by_mode['naive'].peak.rate:.1f}x")
    for r in results:
        label = f"{r.mode}" + (f" [{r.tree}]" if width else "")
        print(
            f"{label} peak, cpu % of one core: "
            + ", ".join(f"{k} {v:.0f}" for k, v in r.cpu.items())
            + "; µs/event: "
            + ", ".join(f"{k} {r.per_event(k):.0f}" for k in r.cpu if k != "other")
        )
        for note in r.notes:
            print(f"{label}: {note}")
    if any("MISMATCH" in note for r in results for note in r.notes):
        print("an accepted event is missing or stored twice: see the MISMATCH lines above")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=15, help="seconds per measured phase")
    p.add_argument("--warmup", type=float, default=3, help="seconds of warm-up load per mode")
    p.add_argument("--connections", type=int, default=16, help="concurrent connections")
    p.add_argument("--max-requests", type=int, default=20_000, help="batches per phase, at most")
    p.add_argument("--workers", type=int, default=1, help="TABLOOP_WORKERS of `tabloop serve`")
    p.add_argument(
        "--modes",
        default="embedded,full,naive",
        help="comma-separated, among embedded, full, naive",
    )
    p.add_argument("--users", type=int, default=USERS, help="people who send the events")
    p.add_argument(
        "--person-share",
        type=float,
        metavar="F",
        help="share of model_switch and churn events, 0 to 1 (default: 3%%, the usual mix)",
    )
    p.add_argument(
        "--compare",
        metavar="REF",
        help="also measure git revision REF, alternating with the working tree",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="with --compare: runs of each tree per mode"
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0,
        metavar="S",
        help="before each mode, wait up to S seconds for the machine to be idle",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy the full-mode server and relay during the peak phase (DIR/NAME-RUN.txt)",
    )
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - {"embedded", "full", "naive"}:
        p.error(f"unknown modes {sorted(unknown)}")
    try:
        Load(args.users, args.person_share)
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    bench = Bench(args)
    results = []
    try:
        runs: list[tuple[str, Tree]] = []
        if args.compare:
            ref = checkout(args.compare, bench.base)
            for mode in modes:
                if mode == "naive":  # no tabloop code: once
                    runs.append((mode, WORK))
                    continue
                for n in range(args.rounds):
                    pair = (ref, WORK) if n % 2 == 0 else (WORK, ref)
                    runs.extend((mode, tree) for tree in pair)
        else:
            runs = [(mode, WORK) for mode in modes]
        for mode, tree in runs:
            print(f"{mode}" + (f" [{tree.label}]" if args.compare else "") + ":", flush=True)
            result = getattr(bench, mode)(tree)
            result.tree = tree.label
            results.append(result)
    finally:
        bench.close()
    report(results, args)


if __name__ == "__main__":
    main()
