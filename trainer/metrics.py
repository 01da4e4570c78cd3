"""Prometheus metrics of the trainer (exposed by the API process under `tabloop up`, and on
TABLOOP_METRICS_PORT by `tabloop train`). Documented in docs/METRICS.md."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, disable_created_metrics

disable_created_metrics()  # as in service/metrics.py, for `tabloop train` on its own

REWARDS_FINALIZED = Counter(
    "tabloop_trainer_rewards_finalized_total",
    "Rewards finalized by the join, by outcome.",
    ["outcome"],
)
LATE_EVENTS = Counter(
    "tabloop_trainer_late_events_total",
    "Feedback that arrived after its rollout's reward was final (stored, counted, not applied).",
)
UPDATES = Counter("tabloop_trainer_updates_total", "Policy-gradient updates taken.")
GATE_RESULTS = Counter(
    "tabloop_trainer_gate_results_total", "Gate decisions on candidates.", ["result"]
)
CANARY_VERDICTS = Counter(
    "tabloop_trainer_canary_verdicts_total", "Canary decisions (promote, rollback).", ["verdict"]
)
BATCH_FILL = Gauge("tabloop_trainer_batch_fill", "Untrained rewards ready for the next batch.")
PENDING = Gauge(
    "tabloop_trainer_pending_rollouts", "Rollouts waiting for their reward to be final."
)
JOIN_LAG = Gauge("tabloop_trainer_join_lag_seconds", "Age of the oldest pending rollout.")
PURGED_ROLLOUTS = Counter(
    "tabloop_trainer_purged_rollouts_total",
    "Pending rollouts dropped without a reward because their user was purged.",
)
BAD_RECORDS = Counter(
    "tabloop_trainer_bad_records_total",
    "Topic records the join could not read (not JSON, not an object, missing fields): skipped.",
)

# Known label values start at 0, so a dashboard sees the series before the first event.
for _result in ("passed", "failed"):
    GATE_RESULTS.labels(result=_result)
for _verdict in ("promote", "rollback"):
    CANARY_VERDICTS.labels(verdict=_verdict)
