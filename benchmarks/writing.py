"""Writing new code top to bottom: what each policy would give people, offline, on the same cursors.

    python -m benchmarks.writing [--corpus DIR] [--n 1000] [--seeds 0,1,2]
        [--checkpoint DIR] [--policies model,copy,served] [--compare REF] [--min-request BYTES]

A team writes the corpus's files in path order (the standard library's held-out files by
default, or every non-test `*.py` under `--corpus`, e.g. a package the base never trained on).
Each request's prefix is the file above the cursor, there is no suffix, and every cursor is on a
line whose text was never sent before in any form (tabloop.core.corpus.writing_cursors). The
workspace memory holds the team's earlier files as they were written.

Policies, each on the same cursors:
- `model`: the language model alone, as served before the memory (the last tokens of the prefix,
  sampled, confidence stop, its gate);
- `copy`: the copy heuristic with no model at all: the longest earlier match (>= 16 bytes) of the
  text before the cursor in the file above, then in the team's earlier files; what followed it
  to the end of the line, always shown (tabloop.core.recall.propose);
- `served`: the policy as served now (tabloop.core.policy.sampling with the proposal);
- `request`: `served` with proposals from the request alone (no memory);
- `copies`: `served` showing only what its copy head copies, never the model's own text (a
  point of the trade between characters and exact of shown; not served);
- `copy-lines`: `copy` with the lines after the first where the occurrences agree on them
  (tabloop.core.recall.Proposal.longer);
- `lines`: `served` always showing a copy's lines after the first (its lines head always on; as
  shipped, the head shows them half the time, and the loop learns where they pay);
- `either`: the copy anchor's proposal where it has one, else `model`;
- `ceiling`: not a policy but a bound. The true rest of the line wherever the text sent before
  (the file above, the team's earlier files) holds it as the ending of a line, whatever
  precedes it: no copy of what was sent can show more whole lines than this.

With `--compare REF` the same cursors also go over HTTP, one at a time, to two services as
shipped: a checkout of git revision REF and the working tree, each `tabloop serve` on the embedded
default (SQLite) with its own shipped base policy and default settings (arms `http:REF` and
`http:working tree`; `--mode full`: PostgreSQL and a Kafka-protocol broker instead, with the
relay). Each file is written by one of 8 people of one workspace (file i by person
i mod 8), who send their requests at the cursors in writing order, and, when they finish a file,
one more request at its end (not counted), as an editor does while the last line is typed: the
workspace memory holds only what was sent. The latency is the client's, per request. The two
trees take turns per seed (REF first on the first seed, the working tree first on the next), so
neither always runs on a machine the other has just warmed or loaded.

Figures per policy: kept chars per 100 requests (what telemetry people are expected to keep:
`expected_kept`), useful chars per 100 requests (the characters of shown suggestions that are
a prefix of the true rest of the line, or of the true lines for one of several lines), whole
rest of line (shown and exact, per request), exact
of shown, shown per request, wrong shown per request, and p50 latency per request (one thread).
Every seed is printed, then the mean and the spread.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from simulator.population import (
    PersonParams,
    PopulationConfig,
    draw_person,
    in_reject_family,
    judge,
    matched_fraction,
)
from simulator.telemetry import (
    TelemetryConfig,
    TelemetryParams,
    accept_probability,
    draw_telemetry,
    in_comment,
)
from tabloop.core.corpus import Cursor, usefulness, writing_cursors, writing_files
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.sampling import complete
from tabloop.core.recall import (
    MIN_MATCH,
    MIN_MATCH_REQUEST,
    RECALL_INPUTS,
    Text,
    propose,
    recall_inputs,
    team_memories,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASE = ROOT / "tabloop" / "core" / "policy" / "base"
WRITERS = 8  # people of one team, over HTTP: file i is written by person i mod 8


@dataclass
class Tally:
    """What one policy gave on a run's cursors."""

    requests: int = 0
    shown: int = 0
    useful_chars: int = 0
    whole: int = 0
    wrong: int = 0
    latencies: list[float] = field(default_factory=list)

    kept: float = 0.0  # telemetry people's expected kept characters (expected_kept)

    def add(self, shown_text: str, cur: Cursor, seconds: float) -> None:
        self.requests += 1
        self.latencies.append(seconds)
        if not shown_text:
            return
        self.shown += 1
        truth = cur.truth_after(shown_text.count("\n"))
        useful, whole = usefulness(shown_text, truth)  # as the simulator's report counts it
        self.useful_chars += useful
        self.whole += whole
        self.wrong += useful == 0
        self.kept += expected_kept(shown_text, truth, cur.prefix)

    def figures(self) -> dict[str, float]:
        n = max(1, self.requests)
        return {
            "kept/100": 100 * self.kept / n,
            "useful/100": 100 * self.useful_chars / n,
            "whole": self.whole / n,
            "exact_of_shown": self.whole / max(1, self.shown),
            "shown": self.shown / n,
            "wrong/req": self.wrong / n,
            "p50_ms": 1000 * statistics.median(self.latencies or [0.0]),
        }


def _panel(n: int = 64, seed: int = 0) -> list[tuple[PersonParams, TelemetryParams]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        person = draw_person(PopulationConfig(), rng)
        out.append((person, draw_telemetry(TelemetryConfig(), rng)))
    return out


PANEL = _panel()  # the telemetry people expected_kept averages over


def expected_kept(text: str, truth: str, prefix: str) -> float:
    """The characters a telemetry person (simulator.telemetry, default ranges) is expected to
    keep of a shown suggestion, averaged over PANEL: P(accept) times what matches the truth
    times what survives later edits. Their momentum (+1 after an accept) and patience are left
    out: the figure compares policies on the same cursors, not a run's absolute level."""
    if in_reject_family(prefix):
        return 0.0
    total = 0.0
    for person, habits in PANEL:
        p = accept_probability(
            person,
            habits,
            judge(text, truth, person.close_similarity),
            len(text),
            text.count("\n") + 1,
            comment=in_comment(prefix),
        )
        survives = 1 - habits.edit_later * (1 - habits.kept_when_edited)
        total += p * len(text) * matched_fraction(text, truth) * survives
    return total / len(PANEL)


COPY_SHARPNESS = 2.0  # the fitted logit times this in COPY_INIT
Policy = Callable[[Cursor, Text | None, int], str]
PARTS = ("all", "unseen", "repeated")  # every cursor; lines never sent before; the others


def run(
    policies: dict[str, Policy], paths: Sequence[Path], n: int, seed: int
) -> dict[tuple[str, str], Tally]:
    cursors = writing_cursors(paths, n, seed)
    memory = team_memories(paths)
    tallies = {(name, part): Tally() for name in policies for part in PARTS}
    for i, (cur, repeated) in enumerate(cursors):
        for name, policy in policies.items():
            t0 = time.perf_counter()
            text = policy(cur, memory[cur.path], seed * 1_000_003 + i)
            seconds = time.perf_counter() - t0
            tallies[name, "all"].add(text, cur, seconds)
            tallies[name, "repeated" if repeated else "unseen"].add(text, cur, seconds)
        if (i + 1) % 200 == 0:
            print(f"  seed {seed}: {i + 1}/{len(cursors)} cursors", file=sys.stderr)
    return tallies


def over_http(
    tree: Any,
    paths: Sequence[Path],
    n: int,
    seeds: Sequence[int],
    work: Path,
    full: tuple[Any, Any] | None = None,
) -> dict[int, dict[str, Tally]]:
    """The service of `tree` (benchmarks.ingest.Tree) as shipped, embedded, on each seed's
    cursors over HTTP (module docstring); per seed, a Tally per part. A fresh data directory (and
    so an empty workspace memory) per seed. `full`: (PostgreSQL, broker) of tabloop.testing, for
    full mode instead (a database of its own per seed, and the relay running)."""
    import httpx

    from benchmarks.ingest import Proc, clean_env, free_port, shipped_base, tabloop, wait_ready

    out: dict[int, dict[str, Tally]] = {}
    for seed in seeds:
        data = work / f"{tree.path.name}-{seed}"
        extra = {}
        if full is not None:
            pg, broker = full
            extra = {
                "TABLOOP_DATABASE_URL": pg.create_database(
                    "writing_" + "".join(c if c.isalnum() else "_" for c in data.name)
                ),
                "TABLOOP_KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap,
            }
        env = clean_env(
            PYTHONPATH=str(tree.path),
            TABLOOP_DATA_DIR=str(data),
            TABLOOP_BASE_CHECKPOINT=str(shipped_base(tree.path)),
            TABLOOP_RATE_LIMIT_PER_S="1000000",
            TABLOOP_RATE_LIMIT_BURST="1000000",
            TABLOOP_LOG_LEVEL="WARNING",
            **extra,
        )
        tabloop("db", "upgrade", env=env, tree=tree.path)
        token = tabloop(
            "keys", "create", "--scope", "ingest", "--name", "writers", env=env, tree=tree.path
        ).strip()
        port = free_port()
        argv = [sys.executable, "-m", "tabloop.cli", "serve", "--port", str(port)]
        server = Proc(f"serve-{seed}", argv, env, work, cwd=tree.path)
        relay = None
        if full is not None:
            relay_argv = [sys.executable, "-m", "tabloop.cli", "relay"]
            relay = Proc(f"relay-{seed}", relay_argv, env, work, cwd=tree.path)
        tallies = {part: Tally() for part in PARTS}
        try:
            wait_ready(port, "/readyz", server)
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {token}"},
                trust_env=False,
                timeout=60,
            ) as client:

                def ask(path: Path, prefix: str) -> tuple[str, float]:
                    body = {
                        "user_id": f"writer-{paths.index(path) % WRITERS}",
                        "workspace_id": "team",
                        "language": "python",
                        "file_path": path.name,
                        "prefix": prefix,
                    }
                    t0 = time.perf_counter()
                    r = client.post("/v1/complete", json=body)
                    seconds = time.perf_counter() - t0
                    r.raise_for_status()
                    got = r.json()
                    return (got["text"] if got["shown"] else ""), seconds

                cursors = writing_cursors(paths, n, seed)
                for i, (cur, repeated) in enumerate(cursors):
                    text, seconds = ask(cur.path, cur.prefix)
                    tallies["all"].add(text, cur, seconds)
                    tallies["repeated" if repeated else "unseen"].add(text, cur, seconds)
                    if i + 1 == len(cursors) or cursors[i + 1][0].path != cur.path:
                        ask(cur.path, cur.path.read_text(errors="replace").replace("\x00", ""))
                    if (i + 1) % 200 == 0:
                        done = f"{i + 1}/{len(cursors)}"
                        print(f"  {tree.label} seed {seed}: {done}", file=sys.stderr)
        finally:
            server.stop()
            if relay is not None:
                relay.stop()
        out[seed] = tallies
    return out


def fit(model_policy: Policy, paths: Sequence[Path], n: int, seed: int, min_request: int) -> int:
    """Fit the copy head, p(the proposal is a prefix of the true rest of the line), by logistic
    regression on the corpus's cursors with a proposal, each weighted by the characters it
    proposes (a long right proposal is worth more, a long wrong one costs more reading); print
    it as COPY_INIT."""
    memory = team_memories(paths)
    xs, ys, ws = [], [], []
    for i, (cur, _) in enumerate(writing_cursors(paths, n, seed)):
        p = propose(cur.prefix, (), memory[cur.path], min_request)
        if p is not None:
            lm = model_policy(cur, None, seed * 1_000_003 + i)
            xs.append(recall_inputs(p, lm))
            ys.append(float(cur.rest_of_line.startswith(p.text)))
            ws.append(float(len(p.text)))
    x = torch.cat(
        [torch.tensor(xs, dtype=torch.float64), torch.ones(len(xs), 1, dtype=torch.float64)], 1
    )
    y = torch.tensor(ys, dtype=torch.float64)
    w = torch.tensor(ws, dtype=torch.float64)
    w = w / w.mean()
    coef = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([coef], max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ coef, y, w) + 1e-3 * (coef[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    # copy where p(right) >= 1/4 (a right suggestion worth three wrong ones, Cursor's 0.75 /
    # -0.25), twice as sharp as the fit: the loop then learns from the copies it shows
    shifted = coef.detach().clone()
    shifted[-1] += math.log(3.0)
    c = [round(float(v), 3) for v in COPY_SHARPNESS * shifted]
    acc = float((((x @ coef.detach()) > 0).double() == y).double().mean())
    print(f"{len(ys)} proposals, {sum(ys) / len(ys):.1%} right; fit accuracy {acc:.1%}")
    print(f"COPY_INIT = {tuple(c)}  # {', '.join(RECALL_INPUTS)}, bias")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--corpus", type=Path, help="a directory of Python code (default: stdlib held-out)"
    )
    ap.add_argument("--n", type=int, default=1000, help="cursors per seed (about)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_BASE)
    ap.add_argument("--policies", default="model,copy,request,served")
    ap.add_argument(
        "--compare",
        metavar="REF",
        help="also serve the cursors over HTTP from git revision REF and the working tree",
    )
    ap.add_argument(
        "--mode",
        choices=("embedded", "full"),
        default="embedded",
        help="with --compare: the services' mode (full: PostgreSQL and a Kafka-protocol broker)",
    )
    ap.add_argument(
        "--min-request",
        type=int,
        default=MIN_MATCH_REQUEST,
        metavar="BYTES",
        help="offline policies and --fit: the shortest match in the request's own text that "
        "proposes "
        f"(default {MIN_MATCH_REQUEST}, as served; the memory's stays {MIN_MATCH})",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="fit the copy head's initial weights on this corpus instead (prints COPY_INIT)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok, _ = load_checkpoint(args.checkpoint)
    model.eval()

    def model_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        g = torch.Generator().manual_seed(seed)
        return complete(model, tok, cur.prefix, "", 32, generator=g).shown_text

    def copy_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        p = propose(cur.prefix, (), memory, MIN_MATCH)
        return "" if p is None else p.text

    def either_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        p = propose(cur.prefix, (), memory, MIN_MATCH)
        return model_policy(cur, memory, seed) if p is None else p.text

    def served_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        g = torch.Generator().manual_seed(seed)
        p = propose(cur.prefix, (), memory, args.min_request)
        return complete(model, tok, cur.prefix, "", 32, generator=g, proposal=p).shown_text

    eager = copy.deepcopy(model)  # the lines head always on
    with torch.no_grad():
        eager.gate.lines.bias.fill_(30.0)

    def lines_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        g = torch.Generator().manual_seed(seed)
        p = propose(cur.prefix, (), memory, args.min_request)
        return complete(eager, tok, cur.prefix, "", 32, generator=g, proposal=p).shown_text

    def copy_lines_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        p = propose(cur.prefix, (), memory, MIN_MATCH)
        return "" if p is None else p.longer

    def request_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        return served_policy(cur, None, seed)

    def copies_policy(cur: Cursor, memory: Text | None, seed: int) -> str:
        g = torch.Generator().manual_seed(seed)
        p = propose(cur.prefix, (), memory, args.min_request)
        c = complete(model, tok, cur.prefix, "", 32, generator=g, proposal=p)
        return c.text if c.copied else ""

    def ceiling(cur: Cursor, memory: Text | None, seed: int) -> str:
        rest = cur.rest_of_line
        sent = memory.data if memory is not None else b""
        ends = (f"{rest}\n".encode(), f"{rest}\x00".encode())  # a line's or a file's ending
        held = f"{rest}\n" in cur.prefix or any(end in sent for end in ends)
        return rest if rest.strip() and held else ""

    table: dict[str, Policy] = {
        "model": model_policy,
        "copy": copy_policy,
        "copy-lines": copy_lines_policy,
        "lines": lines_policy,
        "either": either_policy,
        "served": served_policy,
        "request": request_policy,
        "copies": copies_policy,
        "ceiling": ceiling,
    }
    if args.fit:
        seed = int(args.seeds.split(",")[0])
        return fit(model_policy, writing_files(args.corpus), args.n, seed, args.min_request)
    chosen = {name: table[name] for name in args.policies.split(",") if name}
    paths = writing_files(args.corpus)
    print(f"{len(paths)} files, {sum(len(p.read_bytes()) for p in paths):,} bytes")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}

    def record(seed: int, name: str, part: str, tally: Tally) -> None:
        results.setdefault((name, part), []).append(tally.figures())
        figs = "  ".join(f"{k} {v:.3f}" for k, v in results[name, part][-1].items())
        print(f"seed {seed} {name:<8} {part:<9} n={tally.requests:<5} {figs}", flush=True)

    seeds = [int(s) for s in args.seeds.split(",")]
    if args.compare:
        import tempfile

        from benchmarks.ingest import WORK, checkout

        work = Path(tempfile.mkdtemp(prefix="tabloop-writing-"))
        with contextlib.ExitStack() as stack:
            full = None
            if args.mode == "full":
                from tabloop.testing.kafka import KafkaBroker
                from tabloop.testing.postgres import PostgresServer

                pg_dir = Path(tempfile.mkdtemp(prefix="tabloop-writing-pg-"))  # postgres reaches it
                pg = stack.enter_context(PostgresServer(pg_dir).start())
                broker = stack.enter_context(KafkaBroker(work / "kafka", durable=False).start())
                full = (pg, broker)
            trees = (checkout(args.compare, work), WORK)
            for i, seed in enumerate(seeds):  # interleaved, each tree first on every other seed
                for tree in trees if i % 2 == 0 else trees[::-1]:
                    tallies = over_http(tree, paths, args.n, [seed], work, full)[seed]
                    for part, tally in tallies.items():
                        record(seed, f"http:{tree.label}", part, tally)
    for seed in seeds if chosen else ():
        for (name, part), tally in run(chosen, paths, args.n, seed).items():
            record(seed, name, part, tally)
    print("\nmean (min-max) over seeds")
    for (name, part), runs in sorted(
        results.items(), key=lambda kv: (PARTS.index(kv[0][1]), kv[0][0])
    ):
        cells = []
        for k in runs[0]:
            vals = [r[k] for r in runs]
            cells.append(f"{k} {statistics.mean(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
        print(f"{name:<8} {part:<9} " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
