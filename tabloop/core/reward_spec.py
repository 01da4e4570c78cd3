"""The reward spec (DESIGN.md "Reward spec"): its fields and defaults, one numbered version of
which every reward is computed under, and what it implies: the size scale of an accept and the
accept rate above which showing a suggestion pays (docs/REWARD.md, Break-even accept rates)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class RewardSpec:
    """DESIGN.md's reward spec JSON, field for field. Construction validates (ValueError)."""

    accept_reward: float = 0.75  # reward of a whole, fully retained accept of chars_norm chars
    reject_penalty: float = 0.1  # subtracted when a shown suggestion is rejected or ignored
    # subtracted when a shown suggestion was right but typed through, not taken: it cost a read
    # and saved nothing (a fragment too short to be worth a Tab)
    typed_through_penalty: float = 0.05
    abstain_reward: float = 0.0  # reward of showing nothing
    chars_norm: float = 20  # accepted size (characters) at which size_scale is 1
    chars_exponent: float = 1.0  # size_scale = (min(chars, 3 * chars_norm) / chars_norm) ** this
    decision_window_s: float = 30  # an accept or reject counts only this long after the rollout
    retention_checks_s: tuple[float, ...] = (30, 120, 300, 600)  # expected code_retained cadence,
    # seconds after the accept; finalization waits for the last one that fits in the horizon
    horizon_s: float = 600  # a reward is final by created_at + horizon_s at the latest
    # retention of an accept with no retention report, until enough reports are measured
    provisional_accept_weight: float = 1.0
    switch_penalty: float = 0.5  # per model_switch, spread over the user's shown rollouts before it
    switch_window_s: float = 300  # a model_switch reaches rollouts created this long before it
    churn_penalty: float = 1.0  # per churn, spread over all the user's rollouts inside the horizon

    def __post_init__(self) -> None:
        checks = self.retention_checks_s
        if isinstance(checks, list):  # JSON arrays arrive as lists; keep the spec hashable
            object.__setattr__(self, "retention_checks_s", tuple(checks))
        problems = self._problems()
        if problems:
            raise ValueError("invalid reward spec: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        problems: list[str] = []
        # field: (lowest allowed, whether the lowest itself is allowed); None: any number
        bounds: dict[str, tuple[float, bool] | None] = {
            "accept_reward": (0, True),
            "reject_penalty": (0, True),
            "typed_through_penalty": (0, True),
            "abstain_reward": None,
            "chars_norm": (0, False),
            "chars_exponent": (0, True),
            "decision_window_s": (0, False),
            "horizon_s": (0, False),
            "provisional_accept_weight": (0, True),
            "switch_penalty": (0, True),
            "switch_window_s": (0, False),
            "churn_penalty": (0, True),
        }
        for name, bound in bounds.items():
            value = getattr(self, name)
            if not is_number(value):
                problems.append(f"{name} must be a finite number, got {value!r}")
            elif bound is not None and (value < bound[0] or (value == bound[0] and not bound[1])):
                op = ">=" if bound[1] else ">"
                problems.append(f"{name} must be {op} {bound[0]:g}, got {value}")
        if is_number(self.provisional_accept_weight) and self.provisional_accept_weight > 1:
            problems.append(
                f"provisional_accept_weight must be <= 1, got {self.provisional_accept_weight}"
            )
        checks = self.retention_checks_s
        if not isinstance(checks, tuple) or not all(is_number(c) for c in checks):
            problems.append(f"retention_checks_s must be a list of numbers, got {checks!r}")
            checks = ()
        elif any(c <= 0 for c in checks):
            problems.append(f"retention_checks_s must all be > 0, got {list(checks)}")
        elif any(b <= a for a, b in zip(checks, checks[1:], strict=False)):
            problems.append(f"retention_checks_s must be strictly increasing, got {list(checks)}")
        if not problems:  # relations between windows, once each one is a valid number
            for name in ("decision_window_s", "switch_window_s"):
                if getattr(self, name) > self.horizon_s:
                    problems.append(
                        f"{name} ({getattr(self, name)}) must be <= horizon_s ({self.horizon_s})"
                    )
            if checks and checks[-1] > self.horizon_s:
                problems.append(
                    f"retention_checks_s ({list(checks)}) must all be <= horizon_s "
                    f"({self.horizon_s}): a later check could never count"
                )
        return problems

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RewardSpec:
        """A spec from its JSON object; missing keys take the defaults. ValueError when invalid."""
        if not isinstance(d, Mapping):
            raise ValueError(f"invalid reward spec: must be a JSON object, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(
                f"invalid reward spec: unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(known)})"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, every key present (a stored spec version never depends on defaults)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["retention_checks_s"] = list(self.retention_checks_s)
        return out

    @classmethod
    def sim(cls) -> RewardSpec:
        """TABLOOP_PROFILE=sim: the same rewards, every window in seconds.

        A rejected rollout is final after 8 s and an accepted one after at most 16 s, so
        feedback, batch, update and redeploy fit in a minute. horizon_s = decision window + the
        last check, so every check fits even for an accept at the end of the decision window.
        """
        return cls(
            decision_window_s=4, retention_checks_s=(4, 8, 12), horizon_s=16, switch_window_s=8
        )


# the profiles' reward windows (TABLOOP_PROFILE; the trainer's side: trainer/config.PROFILES)
REWARD_SPECS: dict[str, RewardSpec] = {"prod": RewardSpec(), "sim": RewardSpec.sim()}


def size_scale(chars: int, spec: RewardSpec) -> float:
    """(min(chars, 3 * chars_norm) / chars_norm) ** chars_exponent; 0 for nothing accepted."""
    if chars <= 0:
        return 0.0
    return float((min(chars, 3 * spec.chars_norm) / spec.chars_norm) ** spec.chars_exponent)


def show_threshold(spec: RewardSpec, chars: int, retention: float | None = None) -> float | None:
    """The accept probability above which showing a `chars`-character suggestion earns more, in
    expectation, than abstaining: p * A - (1 - p) * reject_penalty > abstain_reward, where A is
    the reward of its whole accept, `retention` kept (None: no retention report, so
    provisional_accept_weight). None when showing never pays (not even at p = 1); 0 when it
    always does (docs/REWARD.md, Break-even accept rates)."""
    kept = spec.provisional_accept_weight if retention is None else retention
    gain = spec.accept_reward * size_scale(chars, spec) * kept
    cost = spec.reject_penalty + spec.abstain_reward  # a wrong one's loss against silence
    if cost <= 0:
        return 0.0
    if cost >= gain + spec.reject_penalty:  # it would have to be accepted more than always
        return None
    return cost / (gain + spec.reject_penalty)


THRESHOLD_CHARS = (3, 10, 20, 60)  # the sizes docs/REWARD.md, the API and the dashboard tabulate


def show_thresholds(spec: RewardSpec, provisional: float | None = None) -> list[dict[str, Any]]:
    """`show_threshold` for THRESHOLD_CHARS: with a retention report of 1 (all of it kept) and
    without one (at the `provisional` retention measured on clients that report it; None: the
    spec's provisional_accept_weight)."""
    return [
        {
            "chars": n,
            "kept": show_threshold(spec, n, 1.0),
            "no_report": show_threshold(spec, n, provisional),
        }
        for n in THRESHOLD_CHARS
    ]
