"""The update rule against the simulated people, offline: how far K updates move the policy.

    python benchmarks/learning.py [--rounds 10] [--rollouts 640] [--eval 600] [--seed 0]
        [--set gate_hidden_lr_mult=30 --set epochs=2 ...] [--reward chars_exponent=1.0 ...]
        [--temperature 0.3] [--stop-logprob=-inf] [--checkpoint DIR] [--out FILE]
        [--items FILE] [--settled SHARE] [--corpus DIR]

No service, no clock: each round samples `--rollouts` completions from the current policy on
held-out cursors drawn as `tabloop simulate` draws them (serving temperature and nucleus,
stochastic gate), lets a person from the simulated population decide on every shown one,
computes the reward's decision part as the service does, and takes one trainer update
(`trainer.candidate.train_candidate`, as the trainer calls it: the sim profile's UpdateConfig
with `--set` overrides, Adam's moments carried, on the rollouts the live trainer trains on, all
but the fifth it holds back for its deploy check; with `gate_fit`, the shown ones of earlier
rounds replayed to the gate's fit, newest first, as the trainer reads them back) — the
live loop's round without the canary. After every round the policy is scored on a fixed
evaluation set: one sampled completion per cursor, each judged by a panel of 16 people, weighted
by the gate's p(show) (simulator.baseline.at_threshold with the stochastic gate), so the figures
are expectations, not one noisy draw. A 15-minute simulation makes about 10 such updates. Each
round's line also gives the mean length of all completions (shown or not: the language model's
part), and a second line the same gate made greedy (shown iff p(show) >= 1/2).

With `--settled SHARE` that share of the rollouts comes with the text the person settled on
(the line's real rest after the cursor, as an opted-in editor's `code_settled` reports it), for
the update's supervised term (`settled_epochs`; earlier rounds' settled rollouts are replayed to
it up to `settled_replay`, as the trainer reads them back). The people edit four fifths of the
lines (by a hash of file and line number); the evaluation cursors lie on the other fifth, so
every figure is on *fresh lines*, whose settled text no update ever saw: learning must
generalize, not memorize. Each round also reports the exact rest-of-line rate of the sampled
completions (the completion is the whole rest of the line), shown or not: the language model's
part. `--corpus DIR` takes the people's code from the `*.py` files under DIR instead of the
standard library's held-out files (a corpus the base policy never trained on).

What it leaves out: the canary (every candidate is kept), rollouts from older versions
(staleness), model switches and churn. Use it to compare update rules in minutes, with the
same seed; the simulation (benchmarks/simulation.py) stays the measure of the whole loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.ingest import parse_pairs, sim_reward_spec
from simulator.baseline import at_threshold, complete_and_score, complete_cursor
from simulator.population import (
    CursorSource,
    PopulationConfig,
    decide,
    decision_reward,
    draw_person,
)
from tabloop.core.corpus import exact_match, heldout_lines, lines_of
from tabloop.core.policy.checkpoint import load_checkpoint
from trainer.candidate import split_for_check, train_candidate
from trainer.loop import TrainerConfig
from trainer.update import Batch

BASE = Path(__file__).resolve().parent.parent / "tabloop" / "core" / "policy" / "base"


def parse_set(items: list[str]) -> dict[str, Any]:
    """`name=value` pairs for UpdateConfig, values parsed as JSON where they parse."""
    names = {f.name for f in fields(TrainerConfig.for_profile("sim").update)}
    for item in items:
        if item.partition("=")[0] not in names:
            raise SystemExit(f"--set {item}: UpdateConfig has no field {item.partition('=')[0]!r}")
    return parse_pairs(items)


def is_eval_line(path: Path, line_no: int) -> bool:
    """One line in five, by a hash of its file and number: the evaluation's fresh lines."""
    digest = hashlib.sha256(f"{path}:{line_no}".encode()).digest()
    return digest[0] % 5 == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--checkpoint", type=Path, default=BASE, help="the base policy")
    p.add_argument("--rollouts", type=int, default=640, help="rollouts sampled per round")
    p.add_argument("--eval", type=int, default=600, help="evaluation cursors")
    p.add_argument("--panel", type=int, default=16, help="people judging each evaluation item")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a field of the sim reward spec (training and scoring)",
    )
    p.add_argument(
        "--temperature", type=float, help="serving temperature (default: the service's, 0.7)"
    )
    p.add_argument(
        "--stop-logprob",
        type=float,
        help="the confidence stop (default: the service's, -1.0; -inf: whole lines)",
    )
    p.add_argument("--out", type=Path, help="write the per-round figures as JSON")
    p.add_argument(
        "--items",
        type=Path,
        help="write every round's scored evaluation items as JSON (one list per "
        "round of [p_show, chars, def/class, accept, accepted_chars, "
        "retained_chars, reward]; with the language model frozen the "
        "completions are the same each round, so decisions can be followed)",
    )
    p.add_argument(
        "--settled",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of rollouts with a settled text (code_settled), default 0",
    )
    p.add_argument(
        "--corpus",
        type=Path,
        help="the people's code: *.py under DIR (default: the standard library's held-out files)",
    )
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    cfg = replace(TrainerConfig.for_profile("sim").update, **parse_set(args.set))
    check_fraction = TrainerConfig.for_profile("sim").gate_fraction
    spec = sim_reward_spec(args.reward)
    population = PopulationConfig()
    if args.corpus:
        lines = list(lines_of(sorted(p for p in args.corpus.rglob("*.py") if p.is_file())))
    else:
        lines = list(heldout_lines())
    # fresh lines: the evaluation's fifth of the lines is never edited by the people
    fresh = [is_eval_line(cl.path, cl.line_no) for cl in lines]
    source = CursorSource([cl for cl, f in zip(lines, fresh, strict=True) if not f])
    eval_source = CursorSource([cl for cl, f in zip(lines, fresh, strict=True) if f])
    model, tokenizer, _ = load_checkpoint(args.checkpoint)
    ref, _, _ = load_checkpoint(args.checkpoint)
    model.eval()
    ref.eval()

    rng = random.Random(f"learning:{args.seed}")
    people = [draw_person(population, rng) for _ in range(16)]
    panel = [draw_person(population, rng) for _ in range(args.panel)]
    eval_cursors = [eval_source.draw(rng, population.reject_family_share) for _ in range(args.eval)]
    sample_gen = torch.Generator().manual_seed(args.seed)

    def evaluate() -> dict[str, Any]:
        g = torch.Generator().manual_seed(10_000 + args.seed)  # the same draws every round
        judge_rng = random.Random(f"judge:{args.seed}")
        items, exact = [], 0
        with torch.no_grad():
            for c in eval_cursors:
                comp, item = complete_and_score(
                    model,
                    tokenizer,
                    c,
                    panel,
                    spec,
                    judge_rng,
                    g,
                    temperature=args.temperature,
                    stop_logprob=args.stop_logprob,
                )
                items.append(item)
                exact += bool(comp.text.strip()) and exact_match(comp.text, c.rest_of_line)
        scored.append([dataclasses.astuple(s) for s in items])
        m = at_threshold(items, None)
        m["greedy"] = at_threshold(items, 0.5)  # the same gate, shown iff p(show) >= 1/2
        # the language model alone: what showing every completion would keep
        m["retained_all_per_100"] = at_threshold(items, 0.0)["retained_chars_per_100"]
        weight = sum(s.p_show for s in items if s.chars)
        m["mean_shown_chars"] = sum(s.p_show * s.chars for s in items) / weight if weight else 0.0
        # the language model alone: how long its completions are, shown or not
        m["mean_chars"] = sum(s.chars for s in items) / len(items) if items else 0.0
        m["exact_rate"] = exact / len(items) if items else 0.0
        return m

    print(f"update config: {cfg}", flush=True)
    print(f"reward spec: {spec}", flush=True)
    state = None
    replay: list[tuple[Any, float]] = []  # earlier rounds' shown rollouts, newest first (gate_fit)
    settled_replay: list[tuple[Any, float, str]] = []  # earlier settled rollouts, newest first
    history: list[dict[str, Any]] = []
    scored: list[list[tuple[Any, ...]]] = []
    first = evaluate()
    history.append({"round": 0, **first})
    print(_line(0, first, first, {}), flush=True)
    for r in range(1, args.rounds + 1):
        t0 = time.perf_counter()
        actions, rewards, settled = [], [], []
        with torch.no_grad():
            for _ in range(args.rollouts):
                c = source.draw(rng, population.reject_family_share)
                opted_in = args.settled and rng.random() < args.settled
                settled.append(c.rest_of_line if opted_in else None)
                comp, family = complete_cursor(
                    model,
                    tokenizer,
                    c,
                    sample_gen,
                    temperature=args.temperature,
                    stop_logprob=args.stop_logprob,
                )
                d = None
                if comp.shown and comp.text:
                    d = decide(
                        rng.choice(people),
                        comp.text,
                        c.rest_of_line,
                        family,
                        float(spec["decision_window_s"]),
                        rng,
                    )
                actions.append(comp)
                rewards.append(decision_reward(spec, len(comp.text), d))
        # the trainer's split: the last fifth is held back for its deploy check
        actions, _ = split_for_check(actions, check_fraction)
        n_train = len(actions)
        earlier = Batch.of(*zip(*replay, strict=True)) if replay else None
        earlier_settled = Batch.of(*zip(*settled_replay, strict=True)) if settled_replay else None
        candidate = train_candidate(
            model,
            ref,
            tokenizer,
            Batch.of(actions, rewards[:n_train], settled[:n_train]),
            cfg,
            state,
            replay=earlier,
            settled_replay=earlier_settled,
        )
        metrics = candidate.metrics
        settled_replay = [
            (a, rw, t)
            for a, rw, t in zip(
                actions[:n_train], rewards[:n_train], settled[:n_train], strict=True
            )
            if t is not None
        ][::-1] + settled_replay
        settled_replay = settled_replay[: cfg.settled_replay]
        replay = [
            (a, rw) for a, rw in zip(actions[:n_train], rewards[:n_train], strict=True) if a.shown
        ][::-1] + replay
        replay = replay[: cfg.gate_fit_replay]
        state = candidate.optimizer_state
        model = candidate.model
        m = evaluate()
        history.append({"round": r, "update": metrics, "seconds": time.perf_counter() - t0, **m})
        print(_line(r, m, first, metrics), flush=True)
    if args.items:
        args.items.write_text(json.dumps(scored))
    if args.out:
        args.out.write_text(
            json.dumps(
                {"config": vars(args), "update": str(cfg), "history": history},
                indent=1,
                default=str,
            )
        )
    return 0


def _line(r: int, m: dict[str, Any], first: dict[str, Any], metrics: dict[str, float]) -> str:
    def rel(k: str, sub: str | None = None) -> str:
        """m[k] (or m[k][sub]) against the base policy's m[k] (or m[sub])."""
        now, was = (m[k], first[k]) if sub is None else (m[k][sub], first[sub])
        return f"{100 * (now / was - 1):+.0f}%" if was and now is not None else "n/a"

    extra = (
        f"  clipfrac {metrics['charts/clipfrac']:.2f} p_show {metrics['charts/p_show']:.2f}"
        if metrics
        else ""
    )
    return (
        f"round {r:2d}: shown {m['shown_per_request']:.3f} ({rel('shown_per_request')}) "
        f"accept {m['accept_rate_of_shown']:.3f} ({rel('accept_rate_of_shown')}) "
        f"retained {m['retained_chars_per_100']:.1f} ({rel('retained_chars_per_100')}) "
        f"reward {m['reward_per_request']:.4f} family {m['family_shown_rate']:.3f} "
        f"chars {m['mean_shown_chars']:.2f} (all {m['mean_chars']:.2f}) "
        f"all-shown retained {m['retained_all_per_100']:.1f} "
        f"exact {m['exact_rate']:.3f} ({rel('exact_rate')}){extra}"
        f"\n    greedy (shown iff p(show) >= 1/2): shown {rel('greedy', 'shown_per_request')} "
        f"accept {rel('greedy', 'accept_rate_of_shown')} "
        f"retained {rel('greedy', 'retained_chars_per_100')} "
        f"reward {m['greedy']['reward_per_request']:.4f}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
