"""The offline exact rest-of-line check of a run (benchmarks/simulation.py): does the last live
policy complete the people's code exactly more often than the base policy, on lines nobody
reported?

- Cursors: lines of the run's corpus for which no code_settled was sent during the run (fresh
  lines), drawn the way the people draw them (`CursorSource.draw`, seeded with `exact:<seed>`),
  reject-family cursors (def/class past the keyword) left out. Both policies get the same ones.
- Completions: sampled as served (`simulator.baseline.complete_cursor`: the serving temperature,
  top-p and confidence stop), each policy with a torch generator seeded with the same seed.
- Exact: `tabloop.core.corpus.exact_match`, the completion equals the rest of the line after
  rstrip. `exact_rate` is over every cursor (an empty completion is a miss),
  `exact_rate_non_empty` over the cursors with a non-empty completion. The policy's show/abstain
  decision is not applied: this measures the language model, not the gate.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from simulator.population import CursorSource, in_reject_family
from tabloop.core.corpus import CorpusLine, Cursor, exact_match


def fresh_lines(
    lines: Sequence[CorpusLine], settled: Collection[tuple[str, int]]
) -> list[CorpusLine]:
    """The lines with no code_settled sent for them (keys as simulator.population.line_key)."""
    return [cl for cl in lines if (str(cl.path), cl.line_no) not in settled]


def fresh_cursors(
    lines: Sequence[CorpusLine], settled: Collection[tuple[str, int]], n: int, seed: int
) -> list[Cursor]:
    """n cursors on fresh lines, drawn as the people draw them, none in the reject family."""
    source = CursorSource(fresh_lines(lines, settled))
    rng = random.Random(f"exact:{seed}")
    out: list[Cursor] = []
    for _ in range(100 * n):
        if len(out) == n:
            break
        cursor = source.draw(rng, 0.0)
        if not in_reject_family(cursor.prefix):
            out.append(cursor)
    assert len(out) == n, f"only {len(out)} of {n} cursors outside the reject family"
    return out


def exact_rates(texts: Sequence[str], truths: Sequence[str]) -> dict[str, Any]:
    """Exact rest-of-line matches of completions `texts` against the lines' true rests."""
    assert len(texts) == len(truths), "one completion per cursor"
    non_empty = [i for i, t in enumerate(texts) if t]
    exact = sum(exact_match(texts[i], truths[i]) for i in non_empty)
    return {
        "cursors": len(texts),
        "non_empty": len(non_empty),
        "exact": exact,
        "exact_rate": exact / len(texts) if texts else None,
        "exact_rate_non_empty": exact / len(non_empty) if non_empty else None,
    }


def complete_all(
    checkpoint: Path,
    cursors: Sequence[Cursor],
    seed: int,
    max_new_tokens: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """One policy's exact_rates on `cursors`, sampled as served with a generator seeded `seed`."""
    import torch

    from simulator.baseline import complete_cursor
    from tabloop.core.policy.checkpoint import load_checkpoint

    model, tokenizer, manifest = load_checkpoint(checkpoint)
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for i, cursor in enumerate(cursors):
        completion, _ = complete_cursor(model, tokenizer, cursor, generator, max_new_tokens)
        texts.append(completion.text)
        if progress is not None:
            progress(i + 1, len(cursors))
    return {
        "checkpoint": str(checkpoint),
        "policy_version_in_manifest": manifest.version,
        **exact_rates(texts, [c.rest_of_line for c in cursors]),
    }


def check(
    base: Path,
    last: Path,
    lines: Sequence[CorpusLine],
    settled: Collection[tuple[str, int]],
    n: int,
    seed: int,
    *,
    max_new_tokens: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The base and the last live policy on the same n fresh-line cursors (see the module)."""
    from tabloop.core.policy.sampling import (
        DEFAULT_STOP_LOGPROB,
        DEFAULT_TEMPERATURE,
        DEFAULT_TOP_P,
    )

    cursors = fresh_cursors(lines, settled, n, seed)
    out: dict[str, Any] = {
        "sampling": (
            f"as served: temperature {DEFAULT_TEMPERATURE}, top-p {DEFAULT_TOP_P}, "
            f"confidence stop {DEFAULT_STOP_LOGPROB}; torch generator seeded {seed} for "
            "each policy"
        ),
        "cursors": n,
        "seed": seed,
        "lines": len(lines),
        "settled_lines": len(settled),
        "fresh_lines": len(fresh_lines(lines, settled)),
        "base": complete_all(base, cursors, seed, max_new_tokens, progress),
    }
    # the same checkpoint with the same generator seed gives the same completions
    out["last"] = (
        out["base"]
        if base.resolve() == last.resolve()
        else complete_all(last, cursors, seed, max_new_tokens, progress)
    )
    out["difference"] = {
        k: out["last"][k] - out["base"][k]
        for k in ("exact_rate", "exact_rate_non_empty")
        if out["last"][k] is not None and out["base"][k] is not None
    }
    return out
