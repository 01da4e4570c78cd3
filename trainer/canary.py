"""The canary's verdict, pure: each arm's finalized rewards (capped per person and key like a
batch), then wait, promote or roll back (docs/TRAINER.md, Watching the canary)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from trainer.caps import cap_weights


@dataclass(frozen=True)
class ArmStats:
    """Finalized rewards of one policy version over the canary period. Under the per-person and
    per-key caps (`arm_stats`) the counts are effective sizes (Kish), not whole numbers."""

    n: float
    shown: float
    accepted: float
    mean_reward: float
    reward_var: float = 0.0  # variance of the per-rollout rewards
    rows: int | None = None  # finalized rollouts counted, when `n` is an effective size
    mean_kept: float = 0.0  # kept characters per request (accepted chars x retention)
    kept_var: float = 0.0  # their variance

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.shown if self.shown else 0.0


def _effective(weights: Sequence[float]) -> float:
    """Kish's effective sample size of weighted rows: (sum w)^2 / sum w^2."""
    sq = sum(w * w for w in weights)
    return sum(weights) ** 2 / sq if sq > 0 else 0.0


def arm_stats(
    values: Sequence[float],
    outcomes: Sequence[str],
    users: Sequence[str],
    keys: Sequence[str | None],
    max_share: float,
    kept: Sequence[float] | None = None,
) -> ArmStats:
    """One arm's rewards (and `kept` characters, per rollout) with no person or key above
    `max_share` of its weight (the batch caps, trainer/caps.py): the verdict cannot be carried
    by one person who accepts or rejects everything. Means and the accept rate are weighted;
    the counts are effective sizes, so a capped arm's standard errors are honest about resting
    on fewer people."""
    if not values:
        return ArmStats(0, 0, 0, 0.0)
    w = cap_weights(users, keys, max_share)
    total = sum(w)

    def moments(xs: Sequence[float]) -> tuple[float, float]:
        mean = sum(wi * x for wi, x in zip(w, xs, strict=True)) / total
        return mean, sum(wi * (x - mean) ** 2 for wi, x in zip(w, xs, strict=True)) / total

    mean, var = moments(values)
    kept_mean, kept_var = moments(kept) if kept is not None else (0.0, 0.0)
    shown_w = [wi for wi, o in zip(w, outcomes, strict=True) if o != "abstained"]
    accepted_w = sum(wi for wi, o in zip(w, outcomes, strict=True) if o == "accepted")
    shown = _effective(shown_w)
    rate = accepted_w / sum(shown_w) if shown_w else 0.0
    # an arm without capping gives back the plain counts exactly (no float drift)
    if all(abs(wi - 1.0) < 1e-9 for wi in w):
        return ArmStats(
            len(values), len(shown_w), int(round(accepted_w)), mean, var, None, kept_mean, kept_var
        )
    return ArmStats(_effective(w), shown, rate * shown, mean, var, len(values), kept_mean, kept_var)


@dataclass(frozen=True)
class CanaryConfig:
    min_rollouts: int  # finalized canary rollouts needed for a verdict
    timeout_s: float  # past this with too little data, the canary is withdrawn
    min_shown: int = 10  # ... of which shown: abstentions finalize at once and say little
    reward_tolerance: float = 0.02  # the canary's mean reward may trail live by this much
    accept_tolerance: float = 0.05  # and its accept rate (of shown) by this much
    kept_tolerance: float = 0.0  # and its kept characters per request by this many
    # ... and past the tolerance it is rolled back only when the drop is this many standard
    # errors (one-sided; 1.64: an equally good canary is rolled back 5% of the time). 0: on any
    # observed drop, however few suggestions it rests on.
    z: float = 1.64


def significantly_below(diff: float, se: float, z: float) -> bool:
    """A drop (diff < 0) of more than z standard errors; with z 0, any drop."""
    return diff < 0 and diff < -z * se


def canary_verdict(
    canary: ArmStats, live: ArmStats, age_s: float, cfg: CanaryConfig
) -> tuple[Literal["wait", "promote", "rollback"], str]:
    """Wait for enough data, then roll back on collapse or on a significant drop in mean reward,
    kept characters per request or accept rate (Welch's, and Agresti-Caffo's two-proportion z;
    one-sided); otherwise promote. A canary that wins reward by showing less, and so gives people
    less code, is rolled back.

    The candidate already passed the off-policy gate; the canary guards against what that
    estimate cannot see. A canary of a few dozen shown suggestions cannot show a small gain:
    demanding one (or rolling back on any drop) throws away good candidates half the time.
    """
    if canary.n < cfg.min_rollouts or canary.shown < cfg.min_shown:
        if age_s < cfg.timeout_s:
            return "wait", (
                f"{canary.n:.0f}/{cfg.min_rollouts} canary rollouts finalized, "
                f"{canary.shown:.0f}/{cfg.min_shown} shown"
            )
        return "rollback", (
            f"only {canary.n:.0f} canary rollouts ({canary.shown:.0f} shown"
            + ("" if canary.rows is None else f"; effective, of {canary.rows} under the caps")
            + f") in {cfg.timeout_s:.0f}s"
        )
    if canary.shown == 0:
        return "rollback", "the canary showed nothing (collapse)"
    # per-rollout means, Welch: (what, canary's mean and variance, live's, tolerance, digits)
    for what, (m_c, v_c), (m_l, v_l), tolerance, digits in (
        (
            "mean reward",
            (canary.mean_reward, canary.reward_var),
            (live.mean_reward, live.reward_var),
            cfg.reward_tolerance,
            3,
        ),
        (
            "kept chars/request",
            (canary.mean_kept, canary.kept_var),
            (live.mean_kept, live.kept_var),
            cfg.kept_tolerance,
            2,
        ),
    ):
        se = math.sqrt(v_c / canary.n + v_l / max(live.n, 1))
        if significantly_below(m_c - m_l + tolerance, se, cfg.z):
            return (
                "rollback",
                f"{what} {m_c:.{digits}f} < live {m_l:.{digits}f} (s.e. {se:.{digits}f})",
            )
    if live.shown:
        # two proportions, Agresti-Caffo: each arm's rate and its variance with one accept and
        # one not added. The plain (Wald) variance p(1 - p) / n is 0 at a rate of 0 or 1, which
        # a few dozen shown suggestions at the telemetry people's few percent often give: 0 of
        # 25 against live's 3 of 25 was then a "significant" drop
        p_c, p_l = ((arm.accepted + 1) / (arm.shown + 2) for arm in (canary, live))
        d_accept = p_c - p_l + cfg.accept_tolerance
        se_accept = math.sqrt(
            p_c * (1 - p_c) / (canary.shown + 2) + p_l * (1 - p_l) / (live.shown + 2)
        )
        if significantly_below(d_accept, se_accept, cfg.z):
            return "rollback", (
                f"accept rate {canary.accept_rate:.2f} < live {live.accept_rate:.2f} "
                f"(s.e. {se_accept:.2f})"
            )
    return "promote", (
        f"mean reward {canary.mean_reward:.3f} vs live {live.mean_reward:.3f}, "
        f"kept chars/request {canary.mean_kept:.2f} vs {live.mean_kept:.2f}, "
        f"accept rate {canary.accept_rate:.2f} vs {live.accept_rate:.2f}"
    )
