"""Prometheus metrics of the API and relay processes, namespaced `tabloop_<area>_...`.

Documented in docs/METRICS.md. Under `tabloop serve --workers N` the workers share them through
prometheus_client's multiprocess mode (tabloop/cli.py): counters and histograms are summed over
the workers, and each gauge says how its workers' values combine.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # the *_created series double the output and nobody graphs them

INGEST_EVENTS = Counter(
    "tabloop_ingest_events_total",
    "Feedback events received, by event type and outcome (accepted, duplicate, rejected).",
    ["type", "outcome"],
)
HTTP_REQUEST_SECONDS = Histogram(
    "tabloop_http_request_duration_seconds",
    "HTTP request latency by route template, method and status code.",
    ["route", "method", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
# every worker's monitor reads the same table: the latest reading is the value
OUTBOX_BACKLOG = Gauge(
    "tabloop_outbox_backlog_rows",
    "Outbox rows committed but not yet published to the broker.",
    multiprocess_mode="mostrecent",
)
OUTBOX_LAG = Gauge(
    "tabloop_outbox_publish_lag_seconds",
    "Age of the oldest unpublished outbox row.",
    multiprocess_mode="mostrecent",
)
RELAY_PUBLISHED = Counter(
    "tabloop_relay_published_total", "Outbox rows the relay published, by topic.", ["topic"]
)
RELAY_ERRORS = Counter(
    "tabloop_relay_errors_total", "Relay rounds that failed to publish (broker or database)."
)
RELAY_RECONCILED = Counter(
    "tabloop_relay_reconciled_total",
    "Rows found already in the topic after a relay restart and marked published, not resent.",
)
COMPLETIONS = Counter(
    "tabloop_complete_suggestions_total",
    "Completions served (rollouts), by policy version and whether they were shown.",
    ["version", "shown"],
)
COMPLETE_SECONDS = Histogram(
    "tabloop_complete_inference_seconds",
    "Time spent sampling a completion (model only).",
    buckets=(0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0),
)
COMPLETE_BATCH_SIZE = Histogram(
    "tabloop_complete_batch_size",
    "Completions sampled together in one batch (service/completions/batching.py).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
COMPLETE_QUEUE_SECONDS = Histogram(
    "tabloop_complete_queue_seconds",
    "Time a completion waited for an inference thread before its batch started.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
)
UNSUPPORTED_LANGUAGE = Counter(
    "tabloop_complete_unsupported_language_total",
    "Requests in a language the routed policy was not trained on: abstained without a model "
    "call, by language id (other: an id outside the known list).",
    ["language"],
)
FEEDBACK_REFUSED = Counter(
    "tabloop_feedback_refused_total",
    "Feedback events refused by reason (wrong_key, wrong_user, not_shown, before_served, late): "
    "kept as dead letters, never joined into a reward.",
    ["reason"],
)
