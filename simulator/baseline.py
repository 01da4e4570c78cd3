"""The honest baseline: the pretrained policy with its best fixed confidence threshold.

Offline, no service: the base checkpoint completes held-out cursors drawn exactly as the
simulation draws them (same reject-family share), at the serving temperature and nucleus. A
threshold t shows a completion when it is non-empty and the gate's p(show) >= t. Each shown
completion is judged by `persons` people drawn from the same population with the same
`decide` rule; its outcome is their average. The threshold is chosen on one half of the
cursors (best reward per request, the quantity the service optimises) and reported on the
other half, so the baseline is not scored on the cursors it was tuned on.

Not modelled: model switches and churn (they depend on a person's history), and partial
retention over time (the simulation reports one fraction at every check anyway).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.population import (
    CursorSource,
    PersonParams,
    PopulationConfig,
    decide,
    decision_reward,
    draw_person,
    in_reject_family,
    request_context,
)
from tabloop.core.corpus import Cursor

THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(20)) + (0.975, 0.99)


@dataclass(frozen=True)
class Scored:
    """One completion of the base policy and its expected outcome if shown."""

    p_show: float  # the gate's p(show)
    chars: int  # characters of the completion (0: never shown)
    family: bool
    accept: float  # expected accept probability over the people
    accepted_chars: float  # expected accepted characters
    retained_chars: float  # expected retained characters
    reward: float  # expected reward's decision part when shown


def score(
    text: str,
    truth: str,
    family: bool,
    p_show: float,
    people: Sequence[PersonParams],
    spec: Mapping[str, Any],
    rng: random.Random,
) -> Scored:
    """The expected outcome of showing `text`, averaged over `people` (an empty completion is
    never shown: chars 0, outcome zeros)."""
    if not text:
        return Scored(p_show, 0, family, 0.0, 0.0, 0.0, 0.0)
    acc = chars = kept = reward = 0.0
    for person in people:
        d = decide(person, text, truth, family, float(spec["decision_window_s"]), rng)
        reward += decision_reward(spec, len(text), d)
        if d.action == "accept":
            acc += 1
            chars += d.accepted_chars
            kept += d.accepted_chars * d.retained_fraction
    n = len(people)
    return Scored(p_show, len(text), family, acc / n, chars / n, kept / n, reward / n)


def complete_cursor(
    model: Any,
    tokenizer: Any,
    cursor: Cursor,
    generator: Any,
    max_new_tokens: int = 32,
    temperature: float | None = None,
    stop_logprob: float | None = None,
) -> tuple[Any, bool]:
    """Complete `cursor` as the service would for the simulator's request (serving temperature,
    nucleus and confidence stop: the defaults unless given; stop_logprob -inf turns the stop
    off): the Completion, and whether the cursor is in the reject family."""
    from tabloop.core.policy.sampling import (
        DEFAULT_STOP_LOGPROB,
        DEFAULT_TEMPERATURE,
        DEFAULT_TOP_P,
        complete,
    )

    prefix, suffix = request_context(cursor)
    c = complete(
        model,
        tokenizer,
        prefix,
        suffix,
        max_new_tokens,
        DEFAULT_TEMPERATURE if temperature is None else temperature,
        DEFAULT_TOP_P,
        generator,
        stop_logprob=DEFAULT_STOP_LOGPROB if stop_logprob is None else stop_logprob,
    )
    return c, in_reject_family(prefix)


def complete_and_score(
    model: Any,
    tokenizer: Any,
    cursor: Cursor,
    people: Sequence[PersonParams],
    spec: Mapping[str, Any],
    rng: random.Random,
    generator: Any,
    max_new_tokens: int = 32,
    temperature: float | None = None,
    stop_logprob: float | None = None,
) -> tuple[Any, Scored]:
    """complete_cursor, then the completion's expected outcome over `people` (score)."""
    c, family = complete_cursor(
        model, tokenizer, cursor, generator, max_new_tokens, temperature, stop_logprob
    )
    return c, score(c.text, cursor.rest_of_line, family, c.gate_prob_show, people, spec, rng)


def show_weight(s: Scored, threshold: float | None) -> float:
    """1/0 for a fixed threshold; p_show for the stochastic gate (threshold None)."""
    if s.chars == 0:
        return 0.0
    return s.p_show if threshold is None else float(s.p_show >= threshold)


def at_threshold(items: Sequence[Scored], threshold: float | None) -> dict[str, Any]:
    """Expected rates over `items` (one per request) when showing at `threshold`."""
    n = len(items)
    assert n, "no items"
    w = [show_weight(s, threshold) for s in items]
    shown = sum(w)
    accepted = sum(wi * s.accept for wi, s in zip(w, items, strict=True))
    family = [wi for wi, s in zip(w, items, strict=True) if s.family]

    def per_100(value: float) -> float:
        return 100 * value / n

    return {
        "threshold": threshold,
        "requests": n,
        "shown_per_request": shown / n,
        "accept_rate_of_shown": accepted / shown if shown else None,
        "accepted_chars_per_100": per_100(
            sum(wi * s.accepted_chars for wi, s in zip(w, items, strict=True))
        ),
        "retained_chars_per_100": per_100(
            sum(wi * s.retained_chars for wi, s in zip(w, items, strict=True))
        ),
        "reward_per_request": sum(wi * s.reward for wi, s in zip(w, items, strict=True)) / n,
        "family_shown_rate": sum(family) / len(family) if family else None,
    }


def best_threshold(items: Sequence[Scored], thresholds: Sequence[float] = THRESHOLDS) -> float:
    """The threshold with the highest reward per request (the lowest one on ties)."""
    assert items, "no items to choose a threshold on"
    return max(thresholds, key=lambda t: (at_threshold(items, t)["reward_per_request"], -t))


def run(
    checkpoint: Path,
    source: CursorSource,
    population: PopulationConfig,
    spec: Mapping[str, Any],
    n_cursors: int,
    seed: int,
    *,
    persons: int = 32,
    max_new_tokens: int = 32,
    progress: Any = None,
) -> dict[str, Any]:
    """Sample the base policy on n_cursors held-out cursors, choose the threshold on the first
    half, report every threshold and the chosen one on the second half."""
    import torch

    from tabloop.core.policy.checkpoint import load_checkpoint
    from tabloop.core.policy.sampling import (
        DEFAULT_STOP_LOGPROB,
        DEFAULT_TEMPERATURE,
        DEFAULT_TOP_P,
    )

    assert n_cursors >= 2, "need at least two cursors (one per half)"
    model, tokenizer, manifest = load_checkpoint(checkpoint)
    model.eval()
    rng = random.Random(f"baseline:{seed}")
    people = [draw_person(population, rng) for _ in range(persons)]
    generator = torch.Generator().manual_seed(seed)
    items: list[Scored] = []
    for i in range(n_cursors):
        cursor = source.draw(rng, population.reject_family_share)
        items.append(
            complete_and_score(
                model, tokenizer, cursor, people, spec, rng, generator, max_new_tokens
            )[1]
        )
        if progress is not None:
            progress(i + 1, n_cursors)
    half = n_cursors // 2
    select, evaluate = items[:half], items[half:]
    best = best_threshold(select)
    return {
        "checkpoint": str(checkpoint),
        "policy_version_in_manifest": manifest.version,
        "cursors": n_cursors,
        "selection_cursors": len(select),
        "evaluation_cursors": len(evaluate),
        "people": persons,
        "temperature": DEFAULT_TEMPERATURE,
        "top_p": DEFAULT_TOP_P,
        "stop_logprob": DEFAULT_STOP_LOGPROB,
        "chosen_threshold": best,
        "best": at_threshold(evaluate, best),
        "stochastic_gate": at_threshold(evaluate, None),
        "thresholds": [at_threshold(evaluate, t) for t in THRESHOLDS],
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m simulator.baseline`: the baseline alone, as JSON (for `tabloop simulate
    --baseline-json`, or `python -m simulator.plot --baseline`)."""
    import argparse
    import json
    import sys

    from tabloop.core.corpus import heldout_lines
    from tabloop.core.reward_spec import RewardSpec

    p = argparse.ArgumentParser(prog="python -m simulator.baseline", description=__doc__)
    p.add_argument("--cursors", type=int, default=2000, help="held-out cursors (half choose)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--population", type=Path, help="population JSON, as for tabloop simulate")
    p.add_argument("--reject-family-share", type=float)
    p.add_argument("--spec", type=Path, help="reward-spec JSON (default: the sim profile's)")
    p.add_argument("--checkpoint", type=Path, help="default: the shipped base policy")
    p.add_argument("--persons", type=int, default=32, help="people judging each completion")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    given = json.loads(args.population.read_text()) if args.population else {}
    if args.reject_family_share is not None:
        given = {**given, "reject_family_share": args.reject_family_share}
    population = PopulationConfig.from_dict(given)
    spec = (
        RewardSpec.from_dict(json.loads(args.spec.read_text())) if args.spec else RewardSpec.sim()
    ).to_dict()
    if args.checkpoint is None:
        import tabloop.core.policy

        args.checkpoint = Path(tabloop.core.policy.__file__).resolve().parent / "base"

    def progress(i: int, n: int) -> None:
        if i % 100 == 0 or i == n:
            print(f"{i}/{n} cursors", file=sys.stderr, flush=True)

    out = run(
        args.checkpoint,
        CursorSource(list(heldout_lines())),
        population,
        spec,
        args.cursors,
        args.seed,
        persons=args.persons,
        progress=progress,
    )
    out["population"] = population.to_dict()
    args.out.write_text(json.dumps(out, indent=1))
    best = out["best"]
    print(
        f"threshold {out['chosen_threshold']}: shown/request {best['shown_per_request']:.3f}, "
        f"accept rate of shown {best['accept_rate_of_shown']}, reward/request "
        f"{best['reward_per_request']:.4f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
