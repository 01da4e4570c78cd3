"""What a show/abstain gate could reach on the base policy's completions, at best.

    python benchmarks/gate_frontier.py [--cursors 3000] [--seed 0] [--out FILE.json]
        [--reward chars_norm=8 --reward chars_exponent=1.0 ...]
        [--stop-logprob=-inf] [--checkpoint DIR] [--more-inputs K]

Samples the shipped base policy (or `--checkpoint`) on held-out cursors drawn as `tabloop
simulate` draws them (serving temperature, nucleus and confidence stop; `--stop-logprob=-inf`
samples whole lines), and scores each completion with a panel of 32 simulated
people (simulator.baseline.score: expected accept rate, retained characters, reward). Then, on
the second half of the cursors, it reports the shown rate, accept rate of shown, retained
characters per 100 requests and reward per request of

- the base policy's own stochastic gate (what it serves before any learning);
- the best *logistic* gate on the gate's confidence inputs (mean and summed token log-prob,
  tokens, bytes), fit on the first half to predict acceptance, at several thresholds;
- the same with a def/class-line flag added (what the hidden-state half of the gate can learn
  from the prefix: the simulated people reject every suggestion there);
- that gate where the reward spec expects a gain from showing, p * accept_reward *
  size_scale(chars) > (1 - p) * reject_penalty with p its predicted accept rate: about where a
  policy that maximizes this reward ends up, if it ranked as well as the fitted gate.
  `--reward NAME=VALUE` changes the spec (scoring and this rule) to see where another one puts
  that point;
- the expected-gain rule again, with p(accept) fit the way a live loop could fit it: on
  LIVE_LABELS suggestions the base gate showed, one person's verdict each; on the confidence
  inputs alone, with the def/class flag, or with the gate's hidden-state input (L2 HIDDEN_L2 on
  its weights); three draws each;
- an oracle that knows each completion's expected reward and hides the ones below a bar, and
  one that shows exactly those with a positive expected reward (the reward's own optimum).

With `--more-inputs K` (K >= 1) it also asks whether the gate would rank better with inputs it
does not have: each fit on every verdict of the first half (soft labels), on the gate's inputs
(confidence and hidden state), then those plus token-level confidence (the lowest, first and
last token log-probs, and why sampling stopped), then those plus self-consistency (how many of K
more samples at the same cursor, from a separate generator, repeat the completion, start with it,
or match it by difflib's measure). About (K + 1) times the sampling time.

The learned gate is a logistic head of the same confidence inputs plus a projection of the
last hidden state, so the second line is about what it can learn without better completions.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.ingest import sim_reward_spec
from simulator.baseline import complete_and_score, complete_cursor
from simulator.population import (
    CursorSource,
    PopulationConfig,
    draw_person,
    matched_fraction,
    size_scale,
)
from tabloop.core.corpus import heldout_lines
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.scoring import score_actions

BASE = Path(__file__).resolve().parent.parent / "tabloop" / "core" / "policy" / "base"
LIVE_LABELS = 300  # judged suggestions: about what three or four live batches hold
HIDDEN_L2 = 100.0  # L2 on the hidden-state weights of a fit on LIVE_LABELS (standardised inputs)
STOPS = ("newline", "confidence", "length", "eof")
TOKEN_LEVEL = 3 + len(STOPS)  # more_inputs: the lowest, first and last log-prob, the stop
AGREEMENT = 3  # more_inputs after those: repeated, continued, matched


def sample(
    n: int,
    seed: int,
    spec: dict[str, Any],
    checkpoint: Path = BASE,
    stop_logprob: float | None = None,
    more: int = 0,
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """The completions with their scores, and the gate's hidden-state input for each (n, C);
    `more` > 0: with the token-level and self-consistency inputs (module docstring)."""
    model, tokenizer, _ = load_checkpoint(checkpoint)
    model.eval()
    population = PopulationConfig()
    source = CursorSource(list(heldout_lines()))
    rng = random.Random(f"frontier:{seed}")
    g = torch.Generator().manual_seed(seed)
    g_more = torch.Generator().manual_seed(seed + 1)  # the other rows' samples stay the same
    people = [draw_person(population, rng) for _ in range(32)]
    items, hidden = [], []
    with torch.no_grad():
        for i in range(n):
            cursor = source.draw(rng, population.reject_family_share)
            c, s = complete_and_score(
                model, tokenizer, cursor, people, spec, rng, g, stop_logprob=stop_logprob
            )
            lps = c.model_logprobs
            items.append(
                {
                    "p_show": c.gate_prob_show,
                    "chars": s.chars,
                    "family": s.family,
                    "accept": s.accept,
                    "retained": s.retained_chars,
                    "reward": s.reward,
                    "tokens": len(lps),
                    "sum_logprob": sum(lps),
                }
            )
            if more:
                items[-1]["more"] = more_inputs(
                    c,
                    [
                        complete_cursor(
                            model, tokenizer, cursor, g_more, stop_logprob=stop_logprob
                        )[0].text
                        for _ in range(more)
                    ],
                )
            hidden.append(score_actions(model, tokenizer, [c]).gate_hidden[0])
            if (i + 1) % 500 == 0:
                print(f"{i + 1}/{n} completions scored", file=sys.stderr, flush=True)
    return items, torch.stack(hidden)


def more_inputs(c: Any, others: list[str]) -> list[float]:
    """Token-level confidence and agreement with `others` (module docstring)."""
    lps = c.model_logprobs or [0.0]
    text = c.text.rstrip()
    k = len(others)
    agree = [
        sum(o.rstrip() == text for o in others) / k,
        sum(o.startswith(text) for o in others) / k if text else 0.0,
        sum(matched_fraction(text, o) for o in others) / k,
    ]
    return [min(lps), lps[0], lps[-1]] + [float(c.stop_reason == s) for s in STOPS] + agree


def features(it: dict[str, Any], family: bool) -> list[float]:
    row = [
        it["sum_logprob"] / max(it["tokens"], 1),
        it["sum_logprob"],
        math.log1p(it["tokens"]),
        math.log1p(it["chars"]),
    ]
    return row + [float(it["family"])] if family else row


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: torch.Tensor | None = None) -> torch.Tensor:
    """Weights (with a bias last) of a logistic regression of y (soft labels) on x; `l2`: an L2
    weight per column (summed-loss scale), none by default."""
    x1 = torch.cat([x, torch.ones(len(x), 1)], 1)
    w = torch.zeros(x1.shape[1], requires_grad=True)
    ridge = torch.zeros(x1.shape[1]) if l2 is None else torch.cat([l2, torch.zeros(1)])
    opt = torch.optim.LBFGS([w], max_iter=200)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x1 @ w, y)
        loss = loss + 0.5 * (ridge * w * w).sum() / len(x)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def rates(items: list[dict[str, Any]], show: list[float]) -> dict[str, float]:
    n = len(items)
    shown = sum(show)
    accepted = sum(s * it["accept"] for s, it in zip(show, items, strict=True))
    return {
        "shown_per_request": shown / n,
        "accept_rate_of_shown": accepted / shown if shown else float("nan"),
        "retained_chars_per_100": 100
        * sum(s * it["retained"] for s, it in zip(show, items, strict=True))
        / n,
        "reward_per_request": sum(s * it["reward"] for s, it in zip(show, items, strict=True)) / n,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cursors", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a field of the sim reward spec",
    )
    p.add_argument(
        "--stop-logprob",
        type=float,
        help="the confidence stop (default: the service's; -inf: whole lines)",
    )
    p.add_argument("--checkpoint", type=Path, default=BASE, help="the policy to sample")
    p.add_argument(
        "--more-inputs",
        type=int,
        default=0,
        metavar="K",
        help="also fit with inputs the gate lacks; K more samples per cursor",
    )
    args = p.parse_args()
    spec = sim_reward_spec(args.reward)
    print(f"reward spec: {spec}", flush=True)
    torch.set_num_threads(1)
    items, hidden = sample(
        args.cursors, args.seed, spec, args.checkpoint, args.stop_logprob, args.more_inputs
    )
    half = len(items) // 2
    fit_on = [i for i in range(half) if items[i]["chars"]]
    test = items[half:]
    rows: list[tuple[str, dict[str, float]]] = []
    base = rates(test, [it["p_show"] if it["chars"] else 0.0 for it in test])
    rows.append(("base policy, its stochastic gate", base))
    worth = [
        spec["accept_reward"] * size_scale(it["chars"], spec["chars_norm"], spec["chars_exponent"])
        for it in test
    ]

    def gain(p_accept: list[float]) -> list[float]:
        """Shown where the reward expects a gain from showing, by the fitted p(accept)."""
        return [
            float(bool(it["chars"]) and pa * w > (1 - pa) * spec["reject_penalty"])
            for it, pa, w in zip(test, p_accept, worth, strict=True)
        ]

    def inputs(idx: list[int], family: bool, with_hidden: bool, more: int = 0) -> torch.Tensor:
        """`more`: the first `more` of more_inputs (TOKEN_LEVEL, or + AGREEMENT) too."""
        x = torch.tensor(
            [features(items[i], family) + items[i].get("more", [])[:more] for i in idx]
        )
        return torch.cat([hidden[idx], x], 1) if with_hidden else x

    def fitted(
        on: list[int], labels: list[float], family: bool, with_hidden: bool = False, more: int = 0
    ) -> list[float]:
        """p(accept) on the test half from a logistic fit of `labels` on the items `on` (with
        the hidden state: L2 HIDDEN_L2 on its weights, none on the confidence features)."""
        x = inputs(on, family, with_hidden, more)
        mu, sd = x.mean(0), x.std(0) + 1e-6
        l2 = torch.zeros(x.shape[1])
        l2[: hidden.shape[1] if with_hidden else 0] = HIDDEN_L2
        w = fit_logistic((x - mu) / sd, torch.tensor(labels), l2)
        xt = (inputs(list(range(half, len(items))), family, with_hidden, more) - mu) / sd
        return torch.sigmoid(torch.cat([xt, torch.ones(len(xt), 1)], 1) @ w).tolist()

    for family in (False, True):
        p_accept = fitted(fit_on, [items[i]["accept"] for i in fit_on], family)
        name = "logistic gate, confidence" + (" + def/class flag" if family else "")
        for t in (0.3, 0.4, 0.5, 0.6):
            show = [
                float(bool(it["chars"]) and pa >= t) for it, pa in zip(test, p_accept, strict=True)
            ]
            rows.append((f"{name}, p(accept) >= {t}", rates(test, show)))
        if family:
            rows.append((f"{name}, where the reward expects a gain", rates(test, gain(p_accept))))
    # What a live loop has to learn from: only what the base gate showed (drawn with its
    # p(show)), one person's verdict each, a few hundred of them. Knowing nothing of the
    # context, knowing the def/class lines (the simulator's rule), or reading the gate's own
    # hidden-state input; three draws each.
    for name, family, with_hidden in (
        ("confidence", False, False),
        ("confidence + def/class flag", True, False),
        ("confidence + the gate's hidden state", False, True),
    ):
        for draw in range(3):
            rng = random.Random(f"live-labels:{args.seed}:{draw}")
            seen = [i for i in fit_on if rng.random() < items[i]["p_show"]][:LIVE_LABELS]
            verdicts = [float(rng.random() < items[i]["accept"]) for i in seen]
            p_accept = fitted(seen, verdicts, family, with_hidden)
            rows.append(
                (
                    f"{name}, fit on {len(seen)} shown verdicts (draw {draw}), expected gain",
                    rates(test, gain(p_accept)),
                )
            )
    if args.more_inputs:
        soft = [items[i]["accept"] for i in fit_on]
        for name, more in (
            ("the gate's inputs", 0),
            ("+ token-level confidence", TOKEN_LEVEL),
            (f"+ agreement of {args.more_inputs} more samples", TOKEN_LEVEL + AGREEMENT),
        ):
            rows.append(
                (
                    f"{name}, fit on every verdict, expected gain",
                    rates(test, gain(fitted(fit_on, soft, False, True, more))),
                )
            )
    for bar in (-0.2, -0.1, 0.0):
        show = [
            0.0 if (not it["chars"] or it["family"] or it["reward"] < bar) else it["p_show"]
            for it in test
        ]
        rows.append(
            (f"oracle: base gate, hide def/class and expected reward < {bar}", rates(test, show))
        )
    # the reward's own optimum, suggestion by suggestion: what a perfect gate converges to
    rows.append(
        (
            "oracle: show exactly the completions with expected reward > 0",
            rates(test, [float(bool(it["chars"]) and it["reward"] > 0) for it in test]),
        )
    )

    def rel(r: dict[str, float], k: str) -> str:
        return f"{100 * (r[k] / base[k] - 1):+.0f}%"

    print(f"{len(test)} evaluation cursors (a gate fit on the other {half})")
    width = max(len(name) for name, _ in rows)
    for name, r in rows:
        print(
            f"{name:{width}s} "
            f"shown {r['shown_per_request']:.3f} ({rel(r, 'shown_per_request')})  "
            f"accept {r['accept_rate_of_shown']:.3f} ({rel(r, 'accept_rate_of_shown')})  "
            f"retained {r['retained_chars_per_100']:.1f} ({rel(r, 'retained_chars_per_100')})  "
            f"reward {r['reward_per_request']:.4f}"
        )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "items": items}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
