"""What a simulation run measured: per-request records, time buckets, first vs last fifth, the
learning targets, and the plot. Pure functions of the records (the plot aside).

report.json (written by `tabloop simulate`; keys are stable, new ones are only added):

- `config`: the run's settings (api, users, minutes, baseline_minutes, duration_s = the whole run
  in seconds, baseline and learning phases together, settled_share, corpus (null: the stdlib's
  held-out split), seed, bucket_s, population, reward_spec and where it came from, machine).
- `metrics` (of any set of requests) leads with `kept_chars_per_100`: characters accepted times
  the fraction still there at the last retention check, per 100 requests (the loop's measure;
  `retained_chars_per_100` is the same figure under its older name), then
  `accept_rate_of_shown` and `not_taken_per_request` (shown but not accepted, per request).
  `expected_kept_per_100` is kept_chars_per_100 in expectation over each person's own draws
  (whether they accept, how much they take, later edits) given what was shown where: the same
  measure without the noise of those coin flips.
- `totals`: `metrics` of every request, the simulator's counters (people, switches, churns,
  errors = completion requests with no answer, settled = code_settled events sent,
  settled_people = people who opted in), `events` (the sender's queued, sent, accepted,
  duplicates, rejected = refused one by one in a 202, rejected_by_type, dropped = in batches
  refused whole, pending = never delivered) and `http` (retries, 429s, 503s).
- `phases`: `baseline_s`, `learning_s` and `trainer` (paused_before, paused_by_simulator,
  paused_at_s, resumed_at_s, note).
- `buckets`: `metrics` per `bucket_s` window of the whole run, plus `fresh_*` rates of the
  requests on fresh lines.
- `fifths`: the learning phase's fifths (the whole run's when there is no baseline phase):
  `parts`, `first`, `last`, `change` (relative, last vs first) and `interval` (95% bootstrap).
- `phase_comparison` (simulator.phases): `reference` ("baseline_phase" or "first_fifth"),
  `note`, `reference_window_s`, `last_window_s`, then `all` and `fresh` (requests on lines
  whose text was never sent before in any form: simulator.population.SentLines), each with
  `reference` and `last_fifth` (requests, shown, accepted, shown_per_request,
  accept_rate_of_shown, retained_chars_per_100, reward_per_request), `change` (relative),
  `difference` and `interval`; and `gated_deploys`,
  `gated_deploys_in_baseline_phase`, `deploy_counts`, `errors`, `events_refused`,
  `events_lost` (dropped + never delivered).
- `by_length` (by_length): per policy version (`versions`, by version number) and over all of
  them (`all_versions`), per length of the shown suggestion (`buckets`: "<=5", "6-20", "21-60",
  ">60" characters) and over all lengths ("all"): requests (all the version's requests: the
  per-request rates' denominator, so a version's buckets add up to its "all"), shown,
  accepted, accept_rate_of_shown, not_taken_per_request and kept_chars_per_100.
- `by_version`, `deployments` (the timeline, `t` seconds into the run), `deploy_counts`,
  `gated_deploys`, `training` (GET /admin/training after the run), `baseline` (the offline
  base-policy baseline), `comparison` (the last fifth against it), `targets` (against the
  baseline phase when there is one, else the first fifth), `settled` (share, people, opted_in,
  events, lines: distinct source lines reported).
- `honest`: the honest people's own figures (without the adversaries' requests; the same as the
  whole run's when there are none), so that runs with and without adversaries compare:
  `people`, `totals` (`metrics` of their requests), `comparison` (as `phase_comparison`'s
  `all`: reference against the last fifth, with intervals) and `targets`.
- `adversaries`: `count`, `kinds` (per adversary), `by_kind` (requests, shown, accepted and
  rejected as they said, shown_per_request) and `events` (their sender's figures: sent,
  accepted, rejected = refused by the service, rejected_by_type).
- `offline_exact_rest_of_line`: added by benchmarks/simulation.py (see simulator.exact).

records.jsonl holds one RequestRecord per request; settled_lines.json the [path, line] of every
line a code_settled was sent for.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# The learning targets: the reference (baseline phase or first fifth) against the last fifth.
ACCEPT_RATE_GAIN = 0.30  # accept rate of shown up by at least 30% (relative)
SHOWN_DROP = 0.20  # shown suggestions per request down by at least 20% (relative)
MIN_GATED_DEPLOYS = 5
# Collapse: the policy (nearly) stopped showing, or its retained characters fell by half.
COLLAPSE_SHOWN_SHARE = 0.25
COLLAPSE_RETAINED_SHARE = 0.5
# The rates the targets compare, whose first-to-last changes get a bootstrap interval.
INTERVAL_KEYS = ("accept_rate_of_shown", "shown_per_request", "retained_chars_per_100")


@dataclass(frozen=True)
class RequestRecord:
    """One completion request and what the simulated person did with it."""

    t: float  # seconds since the run started, when the request was sent
    user_id: str
    version: int  # policy version that answered
    shown: bool
    family: bool  # a reject-family context (simulator.population.in_reject_family)
    shown_chars: int  # characters shown (0 when abstained)
    verdict: str | None  # correct | close | wrong; None when nothing was shown
    action: str  # abstained | accept | reject | ignore
    accepted_chars: int
    retained_chars: float  # accepted_chars * retained fraction
    reward: float  # the reward's decision part, as the service computes it (no switch/churn)
    latency_ms: float
    phase: str = "learning"  # baseline (trainer paused) | learning (simulator.phases)
    fresh: bool = True  # the line's text was never sent before, in any form (SentLines)
    # characters of the shown suggestion that are a prefix of the true rest of the line (all of
    # it when exact), and whether it was exactly the rest of the line
    useful_chars: int = 0
    whole_line: bool = False
    path: str = ""  # the source file of the cursor's line
    line_no: int = -1  # the cursor's line in it, 0-based
    adversary: str | None = None  # the adversary's kind (simulator.population); None: honest
    shown_lines: int = 0  # lines of the shown suggestion (0 when abstained)
    # retained_chars in expectation over the person's own draws (Decision.expected_kept)
    expected_kept: float = 0.0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Rates over a set of requests; a rate with an empty denominator is None."""
    n = len(records)
    shown = [r for r in records if r.shown]
    accepted = [r for r in shown if r.action == "accept"]
    family = [r for r in records if r.family]
    other = [r for r in records if not r.family]
    other_shown = [r for r in other if r.shown]
    return {
        "requests": n,
        "shown": len(shown),
        "accepted": len(accepted),
        "rejected": sum(r.action == "reject" for r in shown),
        "ignored": sum(r.action == "ignore" for r in shown),
        **loop_rates(n, len(shown), len(accepted), kept_chars(accepted)),
        "shown_per_request": _ratio(len(shown), n),
        "retained_chars_per_100": _ratio(100 * kept_chars(accepted), n),  # kept_chars_per_100
        "expected_kept_per_100": _ratio(100 * sum(r.expected_kept for r in shown), n),
        "useful_chars_per_100": _ratio(100 * sum(r.useful_chars for r in records), n),
        "whole_line_rate": _ratio(sum(r.whole_line for r in records), n),
        "exact_of_shown": _ratio(sum(r.whole_line for r in shown), len(shown)),
        "wrong_shown_per_request": _ratio(sum(r.useful_chars == 0 for r in shown), n),
        "correct_of_shown": _ratio(sum(r.verdict == "correct" for r in shown), len(shown)),
        "accepted_chars_per_100": _ratio(100 * sum(r.accepted_chars for r in accepted), n),
        "reward_per_request": _ratio(sum(r.reward for r in records), n),
        "mean_shown_chars": _ratio(sum(r.shown_chars for r in shown), len(shown)),
        "multi_line_of_shown": _ratio(sum(r.shown_lines > 1 for r in shown), len(shown)),
        "multi_line_of_kept": _ratio(
            kept_chars([r for r in accepted if r.shown_lines > 1]), kept_chars(accepted)
        ),
        "family_requests": len(family),
        "family_shown": sum(r.shown for r in family),
        "family_shown_rate": _ratio(sum(r.shown for r in family), len(family)),
        "other_shown_per_request": _ratio(len(other_shown), len(other)),
        "other_accept_rate_of_shown": _ratio(
            sum(r.action == "accept" for r in other_shown), len(other_shown)
        ),
        "versions": {str(v): c for v, c in sorted(Counter(r.version for r in records).items())},
        "latency_ms_p50": _percentile([r.latency_ms for r in records], 0.5),
    }


def kept_chars(accepted: Sequence[RequestRecord]) -> float:
    """Characters people kept of these accepted requests: accepted x the retained fraction."""
    return sum(r.retained_chars for r in accepted)


def loop_rates(requests: int, shown: int, accepted: int, kept: float) -> dict[str, float | None]:
    """The loop's measure first, then how it was reached: kept characters per 100 requests, the
    accept rate of shown, and shown-but-not-taken (shown, not accepted) per request."""
    return {
        "kept_chars_per_100": _ratio(100 * kept, requests),
        "accept_rate_of_shown": _ratio(accepted, shown),
        "not_taken_per_request": _ratio(shown - accepted, requests),
    }


# Lengths of the shown suggestion (characters): (label, longest in the bucket; None: no limit).
LENGTH_BUCKETS: tuple[tuple[str, int | None], ...] = (
    ("<=5", 5),
    ("6-20", 20),
    ("21-60", 60),
    (">60", None),
)
ALL_LENGTHS = "all"


def length_bucket(chars: int) -> str:
    """The LENGTH_BUCKETS label of a suggestion of `chars` characters."""
    for label, most in LENGTH_BUCKETS:
        if most is None or chars <= most:
            return label
    raise AssertionError("the last length bucket has no limit")


def length_rows(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Per length bucket of the shown suggestion, and over all lengths: requests (all of them,
    the per-request rates' denominator, so the buckets add up to "all"), shown, accepted and
    `loop_rates`."""
    n = len(records)
    parts: dict[str, list[RequestRecord]] = {label: [] for label, _ in LENGTH_BUCKETS}
    for r in records:
        if r.shown:
            parts[length_bucket(r.shown_chars)].append(r)
    parts[ALL_LENGTHS] = [r for r in records if r.shown]
    out = {}
    for label, part in parts.items():
        accepted = [r for r in part if r.action == "accept"]
        out[label] = {
            "requests": n,
            "shown": len(part),
            "accepted": len(accepted),
            **loop_rates(n, len(part), len(accepted), kept_chars(accepted)),
        }
    return out


def by_length(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """`length_rows` per policy version that answered, and over all versions."""
    per_version: dict[int, list[RequestRecord]] = {}
    for r in records:
        per_version.setdefault(r.version, []).append(r)
    return {
        "buckets": [label for label, _ in LENGTH_BUCKETS],
        "versions": {str(v): length_rows(per_version[v]) for v in sorted(per_version)},
        "all_versions": length_rows(records),
    }


def split_people(
    records: Sequence[RequestRecord],
) -> tuple[list[RequestRecord], dict[str, list[RequestRecord]]]:
    """(the honest people's requests, the adversaries' by kind)."""
    honest = [r for r in records if r.adversary is None]
    by_kind: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.adversary is not None:
            by_kind.setdefault(r.adversary, []).append(r)
    return honest, by_kind


def adversary_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """What an adversary kind asked for and what it said of what it was shown."""
    shown = [r for r in records if r.shown]
    return {
        "people": len({r.user_id for r in records}),
        "requests": len(records),
        "shown": len(shown),
        "accepted": sum(r.action == "accept" for r in shown),
        "rejected": sum(r.action == "reject" for r in shown),
        "shown_per_request": _ratio(len(shown), len(records)),
    }


def _percentile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def split_by_time(
    records: Sequence[RequestRecord], width_s: float, duration_s: float
) -> list[tuple[float, float, list[RequestRecord]]]:
    """(start, end, records) for consecutive windows of width_s covering [0, duration_s)."""
    assert width_s > 0, "width_s must be > 0"
    n = max(1, math.ceil(duration_s / width_s - 1e-9))
    parts: list[list[RequestRecord]] = [[] for _ in range(n)]
    for r in records:
        parts[min(n - 1, max(0, int(r.t // width_s)))].append(r)
    return [(k * width_s, min(duration_s, (k + 1) * width_s), p) for k, p in enumerate(parts)]


FRESH_KEYS = ("shown_per_request", "accept_rate_of_shown", "retained_chars_per_100")


def bucketize(
    records: Sequence[RequestRecord], bucket_s: float, duration_s: float
) -> list[dict[str, Any]]:
    """`metrics` per window, plus `fresh_<rate>` of FRESH_KEYS over its fresh-line requests."""
    out = []
    for t0, t1, part in split_by_time(records, bucket_s, duration_s):
        fresh = metrics([r for r in part if r.fresh])
        out.append(
            {"t0": t0, "t1": t1, **metrics(part), **{f"fresh_{k}": fresh[k] for k in FRESH_KEYS}}
        )
    return out


def by_version(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Metrics of the requests each policy version answered."""
    versions = sorted({r.version for r in records})
    out = {}
    for v in versions:
        m = metrics([r for r in records if r.version == v])
        del m["versions"]
        out[str(v)] = m
    return out


def relative_change(first: float | None, last: float | None) -> float | None:
    """(last - first) / first; None unless first > 0 (a reward can start at or below zero,
    where a ratio says nothing: -0.0007 -> 0.0091 is not "-1453%")."""
    if first is None or last is None or first <= 0:
        return None
    return (last - first) / first


def fifths(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Metrics of each fifth of the run, the first-to-last relative changes, and 95% bootstrap
    intervals of the changes the targets read (change_intervals)."""
    windows = [p for _, _, p in split_by_time(records, duration_s / 5, duration_s)]
    parts = [metrics(p) for p in windows]
    first, last = parts[0], parts[-1]
    keys = (
        "shown_per_request",
        "accept_rate_of_shown",
        "retained_chars_per_100",
        "accepted_chars_per_100",
        "reward_per_request",
        "family_shown_rate",
        "other_shown_per_request",
        "other_accept_rate_of_shown",
        "mean_shown_chars",
    )
    return {
        "parts": parts,
        "first": first,
        "last": last,
        "change": {k: relative_change(first[k], last[k]) for k in keys},
        "interval": change_intervals(windows[0], windows[-1]),
    }


def thirds(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """`metrics` of the run's first and last third (writing mode's comparison)."""
    windows = third_windows(records, duration_s)
    return {"first": metrics(windows[0]), "last": metrics(windows[-1])}


def third_windows(records: Sequence[RequestRecord], duration_s: float) -> list[list[RequestRecord]]:
    """The run's requests in three windows of equal time."""
    return [p for _, _, p in split_by_time(records, duration_s / 3, duration_s)]


def same_cursors(
    a: Sequence[RequestRecord], b: Sequence[RequestRecord]
) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """The requests of `a` and of `b` at the cursors (file and line) both asked at: two runs of
    one seed compared on the same cursors, whatever else either reached in its time."""
    both = {_cursor(r) for r in a} & {_cursor(r) for r in b}
    return [r for r in a if _cursor(r) in both], [r for r in b if _cursor(r) in both]


def _cursor(r: RequestRecord) -> tuple[str, int]:
    return r.path, r.line_no


def _rates(n: float, shown: float, accepted: float, retained: float) -> dict[str, float | None]:
    """The three rates the targets read, from counts of requests, shown, accepted and the
    retained characters of the accepted ones (metrics and change_intervals)."""
    return {
        "accept_rate_of_shown": _ratio(accepted, shown),
        "shown_per_request": _ratio(shown, n),
        "retained_chars_per_100": _ratio(100 * retained, n),
    }


def change_intervals(
    first: Sequence[RequestRecord],
    last: Sequence[RequestRecord],
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, list[float] | None]:
    """Percentile-bootstrap intervals of the first-to-last relative change of INTERVAL_KEYS.

    One run's fifths hold ~1,500 requests and ~100 accepts each, so a change of a few tens of
    percent can be noise. The resampling unit is the simulated person (user id), with their
    requests of both fifths together: people differ (their own accept and reject habits) and
    the same people are in both fifths, so resampling requests alone would understate the
    spread. Seeded, so a report is reproducible. None where a resample leaves no ratio.
    """
    assert 0 < level < 1 and resamples > 0, "level in (0, 1), resamples > 0"
    sums: dict[str, list[float]] = {}  # user -> (n, shown, accepted, retained) first, then last
    for offset, part in ((0, first), (4, last)):
        for r in part:
            s = sums.setdefault(r.user_id, [0.0] * 8)
            accepted = r.shown and r.action == "accept"
            s[offset] += 1
            s[offset + 1] += r.shown
            s[offset + 2] += accepted
            s[offset + 3] += r.retained_chars if accepted else 0.0
    people = list(sums.values())
    draws: dict[str, list[float]] = {k: [] for k in INTERVAL_KEYS}
    rng = random.Random(seed)
    for _ in range(resamples if people else 0):
        pick = rng.choices(people, k=len(people))
        total = [sum(s[i] for s in pick) for i in range(8)]
        a, b = _rates(*total[:4]), _rates(*total[4:])
        for k in INTERVAL_KEYS:
            c = relative_change(a[k], b[k])
            if c is not None:
                draws[k].append(c)
    out: dict[str, list[float] | None] = {}
    for k, xs in draws.items():
        if len(xs) < resamples:  # some resample had no ratio: no honest interval
            out[k] = None
            continue
        xs.sort()
        tail = (1 - level) / 2
        out[k] = [xs[int(tail * (len(xs) - 1))], xs[int(round((1 - tail) * (len(xs) - 1)))]]
    return out


def gated_deploys(deployments: Sequence[dict[str, Any]]) -> int:
    """Canary deploys (the trainer deploys only what passed its gate)."""
    return sum(d["action"] == "deploy" and d.get("canary_version") is not None for d in deployments)


def targets(
    summary: dict[str, Any], deployments: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The learning targets, each with its value and whether it was met (None: not measurable).
    The three that compare fifths also carry the change's 95% interval (None where unknown):
    "met" reads the point estimate, as the targets are stated; the interval says how
    sure one run can be of it."""
    first, last, change = summary["first"], summary["last"], summary["change"]
    interval = summary.get("interval") or {}

    acc, shown = change["accept_rate_of_shown"], change["shown_per_request"]
    ret_first, ret_last = first["retained_chars_per_100"], last["retained_chars_per_100"]
    deploys = None if deployments is None else gated_deploys(deployments)
    collapse = None
    shown_first, shown_last = first["shown_per_request"], last["shown_per_request"]
    if shown_first and ret_first is not None and shown_last is not None:
        collapse = (
            last["shown_per_request"] < COLLAPSE_SHOWN_SHARE * first["shown_per_request"]
            or (ret_last or 0.0) < COLLAPSE_RETAINED_SHARE * ret_first
        )
    return [
        {
            "name": "accept rate of shown, relative change",
            "target": f">= +{ACCEPT_RATE_GAIN:.0%}",
            "value": acc,
            "met": (None if acc is None else acc >= ACCEPT_RATE_GAIN),
            "interval": interval.get("accept_rate_of_shown"),
        },
        {
            "name": "shown per request, relative change",
            "target": f"<= -{SHOWN_DROP:.0%}",
            "value": shown,
            "met": (None if shown is None else shown <= -SHOWN_DROP),
            "interval": interval.get("shown_per_request"),
        },
        {
            "name": "kept chars per 100 requests, last vs first",
            "target": "not lower",
            "value": [ret_first, ret_last],
            "met": (None if ret_first is None or ret_last is None else ret_last >= ret_first),
            "interval": interval.get("retained_chars_per_100"),
        },
        {
            "name": "gated deploys",
            "target": f">= {MIN_GATED_DEPLOYS}",
            "value": deploys,
            "met": (None if deploys is None else deploys >= MIN_GATED_DEPLOYS),
        },
        {
            "name": "no collapse",
            "target": (
                f"last fifth shows >= {COLLAPSE_SHOWN_SHARE:.0%} of the first's rate and "
                f"keeps >= {COLLAPSE_RETAINED_SHARE:.0%} of its kept chars"
            ),
            "value": None if collapse is None else not collapse,
            "met": (None if collapse is None else not collapse),
        },
    ]


def compare(summary: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any] | None:
    """The learned policy's last fifth against the baseline's chosen threshold."""
    if not baseline:
        return None
    first, last = summary["first"], summary["last"]
    best, served = baseline["best"], baseline.get("stochastic_gate") or {}
    keys = (
        "accept_rate_of_shown",
        "shown_per_request",
        "retained_chars_per_100",
        "reward_per_request",
        "family_shown_rate",
    )
    return {
        k: {
            "learned_last_fifth": last.get(k),
            "baseline": best.get(k),
            "difference": None if last.get(k) is None or best.get(k) is None else last[k] - best[k],
            "live_first_fifth": first.get(k),
            "base_as_served_offline": served.get(k),
        }
        for k in keys
    }


def timeline(
    deployments: Sequence[dict[str, Any]], started_at: datetime, until_s: float
) -> list[dict[str, Any]]:
    """Deployments made during the run (oldest first), each with `t` seconds since its start."""
    out = []
    for d in deployments:
        at = datetime.fromisoformat(str(d["created_at"]).replace("Z", "+00:00"))
        t = (at - started_at).total_seconds()
        if 0 <= t <= until_s:
            out.append(
                {
                    "t": round(t, 2),
                    **{
                        k: d.get(k)
                        for k in (
                            "id",
                            "action",
                            "live_version",
                            "canary_version",
                            "canary_fraction",
                            "reason",
                        )
                    },
                }
            )
    return sorted(out, key=lambda d: (d["t"], d["id"] or 0))
