"""How good and how fast is a policy checkpoint? Prints the figures quoted in docs/MODEL.md.

    python benchmarks/model_quality.py --checkpoint checkpoints/base [--n 1000] [--seed 0]
        [--no-suffix] [--corpus DIR]

- params, weights size, held-out bits/byte (every held-out file, float32);
- exact rest-of-line match and prefix match (completion non-empty and a prefix of the truth) on
  n held-out cursors (a random column inside a random non-blank line, seeded), by true
  rest-of-line length (1-3, 4-10, 11+ chars): whole lines (the confidence stop off) greedy,
  greedy without token healing, and sampled at the serving temperature/top-p; then sampled as
  served (with the confidence stop, DEFAULT_STOP_LOGPROB);
- on the completions as served: AUROC of the completion's log-prob (sum and mean) and of the
  gate's p(show) for separating right (prefix match) from wrong; what the gate shows and the
  reward it would earn under the default spec if a user accepted exactly the prefix-right
  suggestions;
- for a checkpoint trained for fill-in-the-middle, exact and prefix match with and without the
  suffix (the text after the cursor; the model reads the lines after the cursor's line), greedy
  on whole lines and as served. `--no-suffix` sends no suffix in all the figures above (a
  left-to-right checkpoint never reads it);
- latency of `complete` at max_new_tokens=32 (p50/p99 over held-out cursors, 1 thread), the
  forced worst case (a full serving context, 32 decoded tokens), and the parts (prefill, one
  decode step) as min and median: on a shared machine the min is closest to uncontended.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from tabloop.core.corpus import (
    Cursor,
    corpus_files,
    cursors_from,
    directory_files,
    exact_match,
    prefix_match,
)
from tabloop.core.policy.actions import Completion
from tabloop.core.policy.checkpoint import WEIGHTS_FILE, load_checkpoint
from tabloop.core.policy.model import GPT, KVCache
from tabloop.core.policy.sampling import (
    DEFAULT_MAX_CONTEXT_TOKENS,
    DEFAULT_STOP_LOGPROB,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    complete,
)
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.reward_spec import RewardSpec, size_scale
from trainer.pretrain.config import bits_per_byte
from trainer.pretrain.data import tokenize_files
from trainer.pretrain.run import stream_loss

BUCKETS = (("1-3", 1, 3), ("4-10", 4, 10), ("11+", 11, 10**9))
SPEC = RewardSpec()  # the default reward spec, as the accept reward and reject penalty


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Probability a random positive scores above a random negative (ties count half)."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = s.argsort(kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def accept_reward(chars: int) -> float:
    return SPEC.accept_reward * size_scale(chars, SPEC)


def is_prefix_right(c: Completion, cur: Cursor) -> bool:
    return prefix_match(c.text, cur.rest_of_line)


def is_exact(c: Completion, cur: Cursor) -> bool:
    return exact_match(c.text, cur.rest_of_line)


def match_table(name: str, comps: Sequence[Completion], cursors: Sequence[Cursor]) -> None:
    print(f"\n{name}")
    print(f"  {'rest length':<12}{'n':>6}{'exact':>9}{'prefix':>9}{'mean chars':>12}")
    rows = [("all", 1, 10**9), *BUCKETS]
    for label, lo, hi in rows:
        idx = [i for i, cur in enumerate(cursors) if lo <= len(cur.rest_of_line.rstrip()) <= hi]
        if not idx:
            continue
        exact = statistics.mean(is_exact(comps[i], cursors[i]) for i in idx)
        prefix = statistics.mean(is_prefix_right(comps[i], cursors[i]) for i in idx)
        chars = statistics.mean(len(comps[i].text) for i in idx)
        print(f"  {label:<12}{len(idx):>6}{exact:>9.1%}{prefix:>9.1%}{chars:>12.1f}")


def gate_report(comps: Sequence[Completion], cursors: Sequence[Cursor]) -> None:
    right = [is_prefix_right(c, cur) for c, cur in zip(comps, cursors, strict=True)]
    nonempty = [i for i, c in enumerate(comps) if c.text]
    y = [right[i] for i in nonempty]
    sum_lp = [sum(comps[i].model_logprobs) for i in nonempty]
    mean_lp = [s / len(comps[i].model_logprobs) for s, i in zip(sum_lp, nonempty, strict=True)]
    gate = [comps[i].gate_prob_show for i in nonempty]
    print("\nseparating right (prefix match) from wrong, non-empty sampled completions")
    print(f"  n={len(y)}  right={statistics.mean(y):.1%}")
    print(
        f"  AUROC sum log-prob {auroc(sum_lp, y):.3f}   mean log-prob {auroc(mean_lp, y):.3f}"
        f"   gate p(show) {auroc(gate, y):.3f}"
    )
    exact_y = [is_exact(comps[i], cursors[i]) for i in nonempty]
    print(f"  (exact-match label: AUROC sum log-prob {auroc(sum_lp, exact_y):.3f})")

    def reward(show: Sequence[bool]) -> float:
        total = 0.0
        for c, r, s in zip(comps, right, show, strict=True):
            if s and c.text:
                total += accept_reward(len(c.text)) if r else -SPEC.reject_penalty
        return total / len(comps)

    shown = [c.shown for c in comps]
    n_shown = sum(shown)
    acc = statistics.mean(r for r, s in zip(right, shown, strict=True) if s) if n_shown else 0.0
    print(f"  gate decisions: shown {n_shown / len(comps):.1%}, right when shown {acc:.1%}")
    print(
        f"  reward/request (accept = prefix-right): gate {reward(shown):+.4f}, "
        f"show all {reward([True] * len(comps)):+.4f}, oracle {reward(right):+.4f}, never 0"
    )


def latency(model: GPT, tok: CodeTokenizer, cursors: Sequence[Cursor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for cur in cursors[:10]:  # warm-up
        complete(model, tok, cur.prefix, "", 32, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, gen)
    times, ntok = [], []
    for cur in cursors:
        t0 = time.perf_counter()
        c = complete(
            model, tok, cur.prefix, cur.suffix, 32, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, gen
        )
        times.append((time.perf_counter() - t0) * 1e3)
        ntok.append(len(c.token_ids))
    q = np.percentile(times, [50, 90, 99])
    print(
        f"\nlatency of complete(max_new_tokens=32), {len(times)} held-out cursors, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(
        f"  p50 {q[0]:.1f} ms   p90 {q[1]:.1f} ms   p99 {q[2]:.1f} ms   "
        f"mean tokens {statistics.mean(ntok):.1f}"
    )
    cfg = model.config
    n_ctx = min(cfg.block_size - 32, DEFAULT_MAX_CONTEXT_TOKENS or cfg.block_size)
    ctx = torch.randint(0, cfg.vocab_size, (1, n_ctx))
    last = torch.tensor([n_ctx - 1])
    worst, pre, step = [], [], []
    with torch.inference_mode():
        for _ in range(20):
            t0 = time.perf_counter()
            cache = KVCache(cfg, 1)
            h = model.hidden(ctx, cache, last=last)[:, -1]  # the prompt's pass, as sampling's
            for _ in range(32):
                tok_id = int(model.logits(h).argmax(-1))
                h = model.hidden(torch.tensor([[tok_id]]), cache)[:, -1]
            worst.append((time.perf_counter() - t0) * 1e3)
        for _ in range(30):
            t0 = time.perf_counter()
            cache = KVCache(cfg, 1)
            model.logits(model.hidden(ctx, cache, last=last)[:, -1])
            pre.append((time.perf_counter() - t0) * 1e3)
        one = torch.tensor([[0]])
        for _ in range(200):
            t0 = time.perf_counter()
            model.logits(model.hidden(one, cache)[:, -1])
            cache.pos -= 1  # decode the same position again
            step.append((time.perf_counter() - t0) * 1e3)
    print(
        f"  forced worst case ({n_ctx}-token context + 32 decoded tokens): "
        f"p50 {statistics.median(worst):.1f} ms, min {min(worst):.1f} ms"
    )
    print(
        f"  prefill of {n_ctx} tokens: min {min(pre):.2f} / median {statistics.median(pre):.2f} ms;"
        f" one decode step: min {min(step):.2f} / median {statistics.median(step):.2f} ms"
    )


def suffix_report(
    model: GPT,
    tok: CodeTokenizer,
    cursors: Sequence[Cursor],
    seed: int,
    suffix: bool,
    greedy: Sequence[Completion],
    served: Sequence[Completion],
) -> None:
    """Exact and prefix match with and without the suffix; `greedy`/`served` are the main run's
    (with the suffix iff `suffix`), the other side is computed here."""
    gen = torch.Generator().manual_seed(seed + 2)
    other = [(c.prefix, "" if suffix else c.suffix) for c in cursors]
    other_greedy = [
        complete(model, tok, p, s, 32, 0.0, None, None, stop_logprob=None) for p, s in other
    ]
    other_served = [
        complete(model, tok, p, s, 32, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, gen) for p, s in other
    ]
    sides = {"with": (greedy, served), "without": (other_greedy, other_served)}
    if not suffix:
        sides = {"with": sides["without"], "without": sides["with"]}
    print(f"\nthe suffix's worth, {len(cursors)} held-out cursors (exact / prefix match)")
    print(f"  {'':<34}{'with suffix':>16}{'without':>16}")
    for name, i in (("greedy, whole lines", 0), ("as served", 1)):
        cells = []
        for side in ("with", "without"):
            comps = sides[side][i]
            exact = statistics.mean(is_exact(c, cur) for c, cur in zip(comps, cursors, strict=True))
            prefix = statistics.mean(
                is_prefix_right(c, cur) for c, cur in zip(comps, cursors, strict=True)
            )
            cells.append(f"{exact:.1%} / {prefix:.1%}")
        print(f"  {name:<34}{cells[0]:>16}{cells[1]:>16}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/base"))
    p.add_argument("--n", type=int, default=1000, help="held-out cursors for match figures")
    p.add_argument("--latency-n", type=int, default=300, help="cursors for latency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--latency-only", action="store_true", help="skip the quality figures")
    p.add_argument(
        "--suffix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the text after the cursor (read by FIM checkpoints only)",
    )
    p.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="held-out files of this directory corpus (default: the standard library)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    heldout = (
        corpus_files("heldout") if args.corpus is None else directory_files("heldout", args.corpus)
    )

    def cursor_sample(n: int, seed: int) -> list[Cursor]:
        picked = cursors_from(heldout, n, seed)
        if args.suffix:
            return picked
        return [replace(c, suffix="") for c in picked]

    model, tok, manifest = load_checkpoint(args.checkpoint)
    print(
        f"checkpoint {args.checkpoint}  version {manifest.version}  "
        f"sha256 {manifest.weights_sha256[:16]}..."
    )
    print(
        f"params {model.num_params():,}  weights file "
        f"{(args.checkpoint / WEIGHTS_FILE).stat().st_size / 1e6:.2f} MB ({manifest.weights_dtype})"
        f"  config {manifest.config}"
    )
    print(
        f"languages {', '.join(manifest.languages) or '-'}  fill-in-the-middle {manifest.fim}"
        f"  suffix {'sent' if args.suffix else 'not sent'}"
    )
    if args.latency_only:
        latency(model, tok, cursor_sample(args.latency_n, args.seed + 1), args.seed)
        return 0
    held = tokenize_files(tok, heldout)
    with torch.inference_mode():
        loss = stream_loss(model, held.tokens, model.config.block_size)
    print(
        f"held-out: {held.files} files, {len(held.tokens):,} tokens, {held.n_bytes:,} bytes: "
        f"{loss:.4f} nats/token, {bits_per_byte(loss, len(held.tokens), held.n_bytes):.4f} "
        "bits/byte"
    )

    cursors = cursor_sample(args.n, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    whole = None  # stop_logprob: the language model's own quality, on whole lines
    greedy = [
        complete(model, tok, c.prefix, c.suffix, 32, 0.0, None, None, stop_logprob=whole)
        for c in cursors
    ]
    no_heal = [
        complete(
            model, tok, c.prefix, c.suffix, 32, 0.0, None, None, heal=False, stop_logprob=whole
        )
        for c in cursors
    ]
    sampled = [
        complete(
            model,
            tok,
            c.prefix,
            c.suffix,
            32,
            DEFAULT_TEMPERATURE,
            DEFAULT_TOP_P,
            gen,
            stop_logprob=whole,
        )
        for c in cursors
    ]
    served = [
        complete(model, tok, c.prefix, c.suffix, 32, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, gen)
        for c in cursors
    ]
    match_table(f"greedy (temperature 0), {len(cursors)} held-out cursors", greedy, cursors)
    match_table("greedy without token healing", no_heal, cursors)
    match_table(
        f"sampled (temperature {DEFAULT_TEMPERATURE}, top-p {DEFAULT_TOP_P})", sampled, cursors
    )
    match_table(f"as served: sampled, confidence stop {DEFAULT_STOP_LOGPROB}", served, cursors)
    gate_report(served, cursors)
    if manifest.fim:
        truth = cursors_from(heldout, args.n, args.seed)  # with their suffixes, whatever was sent
        suffix_report(model, tok, truth, args.seed, args.suffix, greedy, served)
    latency(model, tok, cursor_sample(args.latency_n, args.seed + 1), args.seed)
    if math.isnan(loss):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
