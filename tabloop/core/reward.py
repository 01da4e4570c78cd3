"""The reward of one rollout: a pure function of the rollout, its feedback and a reward spec.

DESIGN.md "Reward spec" and "Reward semantics" are the contract; docs/REWARD.md has the formulas,
the finalization rule and a worked example. The streaming join and the replay from the database
both call these functions, so a reward depends only on their arguments: never on the wall clock,
on the order events arrived in, or on state kept elsewhere.

All times are timezone-aware. A rollout's `created_at` is the server's clock, an event's
`occurred_at` the client's; `received_at` (used only by `is_late` and `settle`) is the server's
ingestion time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from tabloop.core.events import EVENT_TYPES
from tabloop.core.reward_spec import RewardSpec, is_number, size_scale

# Client clocks drift: an event stamped up to this long before its rollout was created still
# counts for it (a reject cannot precede its suggestion, but a slow clock can say it did).
CLOCK_SKEW_S = 5.0

# about one rollout (suggestion_id); a view counts only for a rollout that reports views
SUGGESTION_EVENTS = ("view", "accept", "reject", "typed_through", "code_retained")
USER_EVENTS = ("model_switch", "churn")  # about a user, spread over that user's rollouts
# About one rollout, but never read by the reward: it neither counts, nor is expected, nor late.
UNREWARDED_EVENTS = ("code_settled",)
# unviewed: shown to a client that reports views, never viewed, neither accepted nor rejected;
# nobody saw it, so it says nothing about the suggestion and is never trained on
UNVIEWED = "unviewed"
# typed_through: shown, neither accepted nor rejected, and the person typed it themselves; it
# was right, and it saved them nothing: no rejection, a smaller penalty (typed_through_penalty)
TYPED_THROUGH = "typed_through"
OUTCOMES = ("abstained", "accepted", "rejected", "ignored", UNVIEWED, TYPED_THROUGH)
COMPONENTS = ("decision", "size_scale", "share", "retention", "provisional", "switch", "churn")

_SKEW = timedelta(seconds=CLOCK_SKEW_S)


def _seconds(s: float) -> timedelta:
    return timedelta(seconds=s)


def _aware(value: datetime, name: str) -> None:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got {value!r}")


@dataclass(frozen=True)
class RolloutInfo:
    """What the reward needs to know about one rollout."""

    suggestion_id: str
    user_id: str
    created_at: datetime  # server time the suggestion was served (timezone-aware)
    shown: bool  # False: the policy abstained
    text_chars: int  # length in characters of the shown suggestion (0 when abstaining)
    # its client sends a `view` event when it displays a suggestion (the request said so)
    reports_views: bool = False
    language: str | None = None  # the request's (the measured retention is per language)

    def __post_init__(self) -> None:
        _aware(self.created_at, "RolloutInfo.created_at")
        if not isinstance(self.text_chars, int) or self.text_chars < 0:
            raise ValueError(f"RolloutInfo.text_chars must be an int >= 0, got {self.text_chars!r}")


@dataclass(frozen=True)
class Feedback:
    """One feedback event (DESIGN.md's event table), the fields the reward reads."""

    event_id: str
    type: str  # one of EVENT_TYPES
    user_id: str
    occurred_at: datetime  # client time (timezone-aware)
    suggestion_id: str | None = None  # view, accept, reject, code_retained, code_settled
    accepted_chars: int | None = None  # accept, optional (partial accept)
    after_seconds: float | None = None  # code_retained: seconds after the accept (and
    # code_settled: after the request, unread)
    retained_fraction: float | None = None  # code_retained: 0..1 of the accepted text still there

    def __post_init__(self) -> None:
        if self.type not in EVENT_TYPES:
            known = ", ".join(EVENT_TYPES)
            raise ValueError(f"Feedback.type must be one of {known}, got {self.type!r}")
        _aware(self.occurred_at, "Feedback.occurred_at")

    @classmethod
    def from_event(cls, d: Mapping[str, Any]) -> Feedback:
        """From the event JSON as published on the feedback topic. Keys the reward does not read
        (schema_version, from_model, to_model, reason, text) are ignored. ValueError when
        malformed."""
        if not isinstance(d, Mapping):
            raise ValueError(f"event must be a JSON object, got {type(d).__name__}")

        def text(key: str) -> str | None:
            value = d.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"event {key} must be a non-empty string, got {value!r}")
            return value

        def required(key: str) -> str:
            value = text(key)
            if value is None:
                raise ValueError(f"event {key} is missing")
            return value

        def number(key: str) -> float | None:
            value = d.get(key)
            if value is not None and not is_number(value):
                raise ValueError(f"event {key} must be a finite number, got {value!r}")
            return None if value is None else float(value)

        type_ = required("type")
        if type_ not in EVENT_TYPES:
            raise ValueError(f"event type must be one of {', '.join(EVENT_TYPES)}, got {type_!r}")
        occurred = d.get("occurred_at")
        if isinstance(occurred, str):
            try:
                occurred = datetime.fromisoformat(occurred.replace("z", "Z"))
            except ValueError:
                raise ValueError(f"event occurred_at must be RFC 3339, got {occurred!r}") from None
        if not isinstance(occurred, datetime) or occurred.utcoffset() is None:
            raise ValueError(f"event occurred_at must be RFC 3339 with a zone, got {occurred!r}")
        accepted_chars = d.get("accepted_chars")
        if accepted_chars is not None and (
            not isinstance(accepted_chars, int) or isinstance(accepted_chars, bool)
        ):
            raise ValueError(f"event accepted_chars must be an integer, got {accepted_chars!r}")
        feedback = cls(
            event_id=required("event_id"),
            type=type_,
            user_id=required("user_id"),
            occurred_at=occurred,
            suggestion_id=(
                required("suggestion_id")
                if type_ in SUGGESTION_EVENTS + UNREWARDED_EVENTS
                else None
            ),
            accepted_chars=accepted_chars,
            after_seconds=number("after_seconds"),
            retained_fraction=number("retained_fraction"),
        )
        if type_ == "code_retained" and (
            feedback.after_seconds is None or feedback.retained_fraction is None
        ):
            raise ValueError("event code_retained needs after_seconds and retained_fraction")
        return feedback


@dataclass(frozen=True)
class Reward:
    value: float  # decision + switch + churn
    components: dict[str, float]  # every key of COMPONENTS; see docs/REWARD.md
    outcome: str  # one of OUTCOMES


# --- which events count for a rollout ------------------------------------------------------


def _about(event: Feedback, rollout: RolloutInfo) -> bool:
    """The event concerns this rollout's reward: its suggestion (and user), or its user.
    A code_settled never does, so it is neither counted nor ever late."""
    if event.user_id != rollout.user_id or event.type in UNREWARDED_EVENTS:
        return False
    return event.type in USER_EVENTS or event.suggestion_id == rollout.suggestion_id


def _window_end(event: Feedback, rollout: RolloutInfo, spec: RewardSpec) -> datetime | None:
    """The latest occurred_at at which such an event counts for the rollout; None: never counts.

    Every window starts at created_at - CLOCK_SKEW_S. A model_switch at t reaches rollouts created
    in [t - switch_window_s, t], a churn those in [t - horizon_s, t]: seen from the rollout, that
    is t <= created_at + window.
    """
    if event.type == "churn":
        return rollout.created_at + _seconds(spec.horizon_s)
    if not rollout.shown:  # nothing shown: no decision, no retention, no switch share
        return None
    if event.type == "view" and not rollout.reports_views:  # its client's views mean nothing
        return None
    window = {
        "view": spec.decision_window_s,
        "accept": spec.decision_window_s,
        "reject": spec.decision_window_s,
        "typed_through": spec.decision_window_s,
        "code_retained": spec.horizon_s,
        "model_switch": spec.switch_window_s,
    }[event.type]
    return rollout.created_at + _seconds(window)


def _counts(event: Feedback, rollout: RolloutInfo, spec: RewardSpec) -> bool:
    if not _about(event, rollout):
        return False
    end = _window_end(event, rollout, spec)
    if end is None or not rollout.created_at - _SKEW <= event.occurred_at <= end:
        return False
    if event.type == "code_retained":
        return (
            event.after_seconds is not None
            and event.retained_fraction is not None
            and event.after_seconds <= spec.horizon_s
        )
    return True


def _dedup(events: Iterable[Feedback]) -> list[Feedback]:
    """One event per event_id (the first seen), in (occurred_at, event_id) order."""
    by_id: dict[str, Feedback] = {}
    for e in events:
        by_id.setdefault(e.event_id, e)
    return sorted(by_id.values(), key=lambda e: (e.occurred_at, e.event_id))


def _counting(events: Iterable[Feedback], rollout: RolloutInfo, spec: RewardSpec) -> list[Feedback]:
    return [e for e in _dedup(events) if _counts(e, rollout, spec)]


def _decision(counted: Sequence[Feedback]) -> Feedback | None:
    """The first accept or reject; at the same instant a reject wins (do not reinforce an
    ambiguous suggestion), then the smaller event_id, so arrival order never matters."""
    decisions = [e for e in counted if e.type in ("accept", "reject")]
    if not decisions:
        return None
    return min(decisions, key=lambda e: (e.occurred_at, e.type != "reject", e.event_id))


def _last_retention(counted: Sequence[Feedback]) -> Feedback | None:
    """The latest check (by after_seconds, then occurred_at, then event_id)."""
    reports = [e for e in counted if e.type == "code_retained"]
    if not reports:
        return None
    return max(reports, key=lambda e: (e.after_seconds, e.occurred_at, e.event_id))


def _unviewed(rollout: RolloutInfo, counted: Sequence[Feedback]) -> bool:
    """A client that reports views never reported one inside the decision window."""
    return rollout.reports_views and not any(e.type == "view" for e in counted)


def _share_of(
    t: datetime,
    rollout: RolloutInfo,
    user_rollouts: Sequence[RolloutInfo],
    window_s: float,
    shown_only: bool,
) -> int:
    """How many of the user's rollouts (this one included) were created in [t - window, t]
    (upper end widened by the clock skew, as for every event), counting shown ones only if asked."""
    peers = {r.suggestion_id: r for r in user_rollouts if r.user_id == rollout.user_id}
    peers[rollout.suggestion_id] = rollout
    low, high = t - _seconds(window_s), t + _SKEW
    return sum(
        1 for r in peers.values() if low <= r.created_at <= high and (r.shown or not shown_only)
    )


# --- the reward ----------------------------------------------------------------------------


def compute_reward(
    rollout: RolloutInfo,
    events: Sequence[Feedback],
    user_rollouts: Sequence[RolloutInfo],
    spec: RewardSpec,
    provisional: float | None = None,
) -> Reward:
    """The rollout's reward from the events given (the caller leaves out late ones: `is_late`).

    `events` may hold anything about the user; only what counts for this rollout is read.
    `user_rollouts` are the user's rollouts known to the caller, used only to spread the
    model_switch and churn penalties; this rollout is counted among them even if missing.
    `provisional`: the retention an accept without a retention report counts at, the one
    measured on the clients that do report it (tabloop/core/reward_store.MeasuredRetention); None:
    the spec's provisional_accept_weight.
    """
    counted = _counting(events, rollout, spec)
    parts = dict.fromkeys(COMPONENTS, 0.0)

    if not rollout.shown:
        outcome = "abstained"
        parts["decision"] = float(spec.abstain_reward)
    else:
        decision = _decision(counted)
        if decision is None and any(e.type == TYPED_THROUGH for e in counted):
            outcome = TYPED_THROUGH  # right, but not taken: it cost a read and saved nothing
            parts["decision"] = -float(spec.typed_through_penalty)
        elif decision is None and _unviewed(rollout, counted):
            outcome = UNVIEWED  # decision 0: nobody saw it (the trainer skips it)
        elif decision is None or decision.type == "reject":
            outcome = "ignored" if decision is None else "rejected"
            parts["decision"] = -float(spec.reject_penalty)
        else:
            outcome = "accepted"
            n = rollout.text_chars
            chars = decision.accepted_chars if decision.accepted_chars is not None else n
            chars = max(0, min(chars, n))
            report = _last_retention(counted)
            if report is None:
                estimate = spec.provisional_accept_weight if provisional is None else provisional
                retention, is_provisional = min(1.0, max(0.0, float(estimate))), 1.0
            else:
                retention = min(1.0, max(0.0, report.retained_fraction or 0.0))
                is_provisional = 0.0
            parts["size_scale"] = size_scale(chars, spec)
            parts["share"] = chars / n if n > 0 else 0.0
            parts["retention"] = retention
            parts["provisional"] = is_provisional
            parts["decision"] = (
                spec.accept_reward * parts["size_scale"] * parts["share"] * retention
            )

    for e in counted:
        if e.type == "model_switch":
            n_shown = _share_of(e.occurred_at, rollout, user_rollouts, spec.switch_window_s, True)
            parts["switch"] -= spec.switch_penalty / n_shown
        elif e.type == "churn":
            n_all = _share_of(e.occurred_at, rollout, user_rollouts, spec.horizon_s, False)
            parts["churn"] -= spec.churn_penalty / n_all

    value = parts["decision"] + parts["switch"] + parts["churn"]
    return Reward(value=value, components=parts, outcome=outcome)


# --- when a reward is final ----------------------------------------------------------------


def finalize_at(rollout: RolloutInfo, events: Sequence[Feedback], spec: RewardSpec) -> datetime:
    """When the reward becomes final, given the events that have arrived (nothing more coming).

    - abstained: created_at (nothing to wait for).
    - shown, rejected or not yet decided (viewed or not): created_at + max(decision_window_s,
      switch_window_s): the decision window must close, and a model_switch can charge it until
      then.
    - accepted: when the last expected retention check has been reported (the last of
      retention_checks_s that, counted from the accept, lands inside the horizon), but not
      before the switch window closes; created_at + horizon_s while that report is missing.

    churn is never expected, so a churn after this instant is late (docs/REWARD.md says why);
    code_settled is not read at all, so it never holds a reward back.
    Never later than created_at + horizon_s.
    """
    start = rollout.created_at
    if not rollout.shown:
        return start
    counted = _counting(events, rollout, spec)
    closed = start + _seconds(max(spec.decision_window_s, spec.switch_window_s))
    decision = _decision(counted)
    if decision is None or decision.type == "reject":
        return closed
    horizon = start + _seconds(spec.horizon_s)
    expected = [c for c in spec.retention_checks_s if decision.occurred_at + _seconds(c) <= horizon]
    if not expected:  # accepted too late for any check to fit: it stays provisional
        return closed
    done = [
        e.occurred_at
        for e in counted
        if e.type == "code_retained" and (e.after_seconds or 0.0) >= expected[-1]
    ]
    if not done:
        return horizon
    return min(horizon, max(closed, min(done)))


def is_late(
    event: Feedback,
    rollout: RolloutInfo,
    spec: RewardSpec,
    *,
    received_at: datetime | None = None,
    arrived: Sequence[Feedback] = (),
) -> bool:
    """True when the event is about this rollout but can no longer change its reward.

    Late by its own time: it occurred after its window closed (a view, accept or reject after the
    decision window, a code_retained past the horizon or with after_seconds > horizon_s, a
    model_switch past the switch window, a churn past the horizon) or after the reward became
    final (`finalize_at` of the `arrived` events, this one left out).
    Late by arrival: given `received_at` (server ingestion time), when it was received after that
    finalization; then received_at, not occurred_at, is compared with it.

    False for events not about this rollout, events from before it (beyond the clock skew), and
    events that never count for it (a decision on an abstained rollout, a view of a rollout whose
    client does not report views, any code_settled): those are not late, just unrelated. A late
    event is still stored and counted as late, never applied.
    """
    if not _about(event, rollout):
        return False
    end = _window_end(event, rollout, spec)
    if end is None or event.occurred_at < rollout.created_at - _SKEW:
        return False
    if event.occurred_at > end:
        return True
    if event.type == "code_retained" and (event.after_seconds or 0.0) > spec.horizon_s:
        return True
    known_at = received_at if received_at is not None else event.occurred_at
    others = [e for e in arrived if e.event_id != event.event_id]
    return known_at > finalize_at(rollout, others, spec)


def settle(
    rollout: RolloutInfo,
    arrivals: Iterable[tuple[datetime, Feedback]],
    spec: RewardSpec,
) -> tuple[datetime, list[Feedback]]:
    """Replay of the streaming join for one rollout: (final instant, the events that count).

    `arrivals` are (received_at, event) pairs, in any order; they are taken in received order
    (then event_id) and each one that is about the rollout is kept unless `is_late` given those
    before it. Passing the kept events to `compute_reward` gives the reward the join produced.
    """
    kept: list[Feedback] = []
    seen: set[str] = set()
    for received_at, event in sorted(arrivals, key=lambda a: (a[0], a[1].event_id)):
        if event.event_id in seen or not _counts(event, rollout, spec):
            continue
        seen.add(event.event_id)
        if is_late(event, rollout, spec, received_at=received_at, arrived=kept):
            continue
        kept.append(event)
    return finalize_at(rollout, kept, spec), kept
