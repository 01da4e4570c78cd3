"""No one person or key steers the policy: each one's share of a batch's weight is capped.

Every rollout of a batch starts with weight 1. A person (user_id) or an API key holding more
than `cap` of the batch's total weight has all of its rows scaled down by one factor, so that it
holds exactly `cap` of the new total; the others keep their weights. The weights then scale each
row's advantage in the policy-gradient loss (and its place in the gate's fit, the settled-text
term and the deploy check's estimate: trainer/update/, trainer/deploy_check.py), so a person
who sends 90% of a batch's feedback moves the policy as much as one who sends a quarter of it.

- Few groups: with n people in a batch, nobody can hold less than 1/n, so the cap is
  max(cap, 1/n) (two people split a batch evenly at most; one person is never capped).
- Both at once: keys first, then people; repeated until both hold (a few rounds at most). When
  they cannot both hold (one key's few people must each stay under the cap and the key under
  it too), the people's cap wins: it is applied last.
- Rows without a key (rollouts recorded before keys were) count in the total but in no key.
- The weights are returned scaled to a mean of 1, so a batch without capping is unchanged.

Pure functions, tested with tables (tests/trainer/test_caps.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ROUNDS = 20  # alternations of the key and person caps; they settle in 2-3 when both can hold
_EPS = 1e-9


def effective_cap(cap: float, groups: int) -> float:
    """The cap a batch with `groups` distinct people (or keys) can meet: never below 1/groups."""
    assert 0 < cap <= 1, f"cap must be in (0, 1], got {cap}"
    return max(cap, 1.0 / groups) if groups else 1.0


def _totals(weights: Sequence[float], groups: Sequence[str | None]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for w, g in zip(weights, groups, strict=True):
        if g is not None:
            totals[g] += w
    return {g: t for g, t in totals.items() if t > 0}


def cap_one(weights: Sequence[float], groups: Sequence[str | None], cap: float) -> list[float]:
    """Scale down the groups holding more than the (effective) cap of the total weight so that
    each holds exactly that share of the new total; other rows are unchanged. Water-filling: the
    largest m groups are capped for the smallest m after which the next one fits."""
    totals = _totals(weights, groups)
    total = float(sum(weights))
    if total <= 0 or not totals:
        return list(weights)
    c = effective_cap(cap, len(totals))
    order = sorted(totals, key=lambda g: -totals[g])
    rest = total  # weight outside the capped groups
    factors: dict[str, float] = {}
    for m, group in enumerate(order):
        if 1 - m * c <= _EPS:  # the capped groups would hold everything: make them equal
            floor = min(totals[g] for g in order[:m])
            factors = {g: floor / totals[g] for g in order[:m]}
            break
        new_total = rest / (1 - m * c)
        if totals[group] <= c * new_total * (1 + _EPS):
            factors = {g: c * new_total / totals[g] for g in order[:m]}
            break
        rest -= totals[group]
    else:  # every group capped with weight left outside them: c * n < 1 cannot happen
        raise AssertionError("effective cap below 1/groups")
    return [
        w * factors.get(g, 1.0) if g is not None else w
        for w, g in zip(weights, groups, strict=True)
    ]


def max_share(weights: Sequence[float], groups: Sequence[str | None]) -> float:
    """The largest share of the total weight any one group holds (0.0 for none)."""
    totals = _totals(weights, groups)
    total = float(sum(weights))
    return max(totals.values()) / total if totals and total > 0 else 0.0


def cap_weights(users: Sequence[str], keys: Sequence[str | None], cap: float) -> list[float]:
    """Row weights (mean 1) under which no user and no key holds more than the effective cap of
    the total; 1.0 everywhere when nobody exceeds it."""
    assert len(users) == len(keys), "one user and one key (or None) per row"
    if not users:
        return []
    w = [1.0] * len(users)
    key_cap = effective_cap(cap, len(_totals(w, keys)))
    for _ in range(ROUNDS):
        w = cap_one(w, keys, cap)
        w = cap_one(w, list(users), cap)
        if max_share(w, keys) <= key_cap + 1e-6:
            break
    mean = sum(w) / len(w)
    return [x / mean for x in w]


@dataclass(frozen=True)
class Capped:
    """A person or key whose rows were scaled down in a batch."""

    id: str
    rows: int
    share: float  # of the batch's rows
    weight_share: float  # of its weight, after the caps
    weight_removed: float  # rows - weight (the weights have mean 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "rows": self.rows,
            "share": round(self.share, 4),
            "weight_share": round(self.weight_share, 4),
            "weight_removed": round(self.weight_removed, 3),
        }


def capped(groups: Sequence[str | None], weights: Sequence[float]) -> list[Capped]:
    """The groups whose weight is below their row count (weights of mean 1), most removed first."""
    n, total = len(weights), float(sum(weights))
    rows: dict[str, int] = defaultdict(int)
    held: dict[str, float] = defaultdict(float)
    for g, w in zip(groups, weights, strict=True):
        if g is not None:
            rows[g] += 1
            held[g] += w
    out = [
        Capped(g, rows[g], rows[g] / n, held[g] / total, rows[g] - held[g])
        for g in rows
        if rows[g] - held[g] > 1e-6
    ]
    return sorted(out, key=lambda c: (-c.weight_removed, c.id))
