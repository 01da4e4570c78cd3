"""Live-traffic metrics per policy version and time bucket, from the rollouts and rewards tables.

Two grouped queries over the window, whatever its size, so the work stays in the database: one
sums counts, characters and rewards per (bucket, version); one ranks latencies with window
functions (SQLite has no percentile aggregate) and returns only the few ranked rows that the
p50 and p99 of each bucket and version interpolate between. Buckets are aligned to multiples of
bucket_s since the epoch, so a refreshing chart keeps its points in place; the first and last
bucket may be partial. The `feedback` section (whose feedback was refused or capped) comes from
service/admin/metrics/trust.py. `recent_versions` is the same sums per version alone, for
GET /admin/training.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from service.admin.metrics.schemas import BucketRow, MetricsOut, Row
from service.admin.metrics.trust import feedback_trust
from service.errors import Unprocessable
from tabloop.core.reward import UNVIEWED
from tabloop.core.reward_store import accepted_chars, kept_chars
from tabloop.core.tables import rewards, rollouts, utcnow

DEFAULT_WINDOW_S = 3600
MAX_WINDOW_S = 30 * 86400
MIN_DEFAULT_BUCKET_S = 10
DEFAULT_BUCKETS = 30  # the default bucket is window / this (but at least MIN_DEFAULT_BUCKET_S)
MAX_BUCKETS = 500
RECENT_VERSIONS = 10  # GET /admin/training: the newest versions that served in its window

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_HINT = "seconds or a duration like 90s, 15m, 1h, 24h, 7d"


def parse_duration(text: str, *, name: str, most: int) -> int:
    """'3600', '90s', '15m', '1h', '1.5h', '7d' -> whole seconds, 1..most. Unprocessable if not."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise Unprocessable(f"{name} must be {_HINT}; got {text!r}")
    seconds = float(match[1]) * _UNITS[match[2]]
    if seconds > most:
        raise Unprocessable(f"{name} must be at most {most} s; got {text!r}")
    if round(seconds) < 1:
        raise Unprocessable(f"{name} must be at least 1 s; got {text!r}")
    return round(seconds)


def resolve_window(*, window: str | None, bucket: str | None) -> tuple[int, int]:
    """(window_s, bucket_s) from the query parameters, with the defaults and limits applied."""
    window_s = (
        DEFAULT_WINDOW_S
        if window is None
        else parse_duration(window, name="window", most=MAX_WINDOW_S)
    )
    if bucket is None:
        bucket_s = max(MIN_DEFAULT_BUCKET_S, math.ceil(window_s / DEFAULT_BUCKETS))
        return window_s, min(bucket_s, window_s)
    bucket_s = parse_duration(bucket, name="bucket", most=window_s)
    if math.ceil(window_s / bucket_s) > MAX_BUCKETS:
        raise Unprocessable(
            f"window {window_s} s in buckets of {bucket_s} s makes "
            f"{math.ceil(window_s / bucket_s)} buckets; at most {MAX_BUCKETS} (use a larger bucket)"
        )
    return window_s, bucket_s


def resolve_end(to: datetime | None) -> datetime:
    """The window's end: `to` (a time without a zone is UTC) or now."""
    if to is None:
        return utcnow()
    return to.replace(tzinfo=UTC) if to.tzinfo is None else to.astimezone(UTC)


def loop_rates(
    *, finalized: int, shown_finalized: int, accepted: int, kept_chars: float
) -> dict[str, float | None]:
    """The loop's measure, then how it was reached, over the rollouts with a finalized reward
    (as every rate of a Row): kept characters per 100 requests, the accept rate of shown, and
    shown-but-not-taken per request. None where the denominator is 0."""
    return {
        "kept_chars_per_100": 100 * kept_chars / finalized if finalized else None,
        "accept_rate_of_shown": accepted / shown_finalized if shown_finalized else None,
        "not_taken_per_request": (shown_finalized - accepted) / finalized if finalized else None,
    }


@dataclass
class _Acc:
    """Sums for one (bucket, version) or one version; `row()` turns them into rates."""

    suggestions: int = 0
    shown: int = 0
    shown_finalized: int = 0
    accepted: int = 0
    accepted_chars: float = 0.0
    retained_chars: float = 0.0
    retention_sum: float = 0.0
    reward_sum: float = 0.0
    rewards_finalized: int = 0

    def add(self, other: _Acc) -> None:
        self.suggestions += other.suggestions
        self.shown += other.shown
        self.shown_finalized += other.shown_finalized
        self.accepted += other.accepted
        self.accepted_chars += other.accepted_chars
        self.retained_chars += other.retained_chars
        self.retention_sum += other.retention_sum
        self.reward_sum += other.reward_sum
        self.rewards_finalized += other.rewards_finalized

    def loop(self) -> dict[str, float | None]:
        """`loop_rates` of these sums."""
        return loop_rates(
            finalized=self.rewards_finalized,
            shown_finalized=self.shown_finalized,
            accepted=self.accepted,
            kept_chars=self.retained_chars,
        )

    def row(self, version: int, latency: dict[int, float]) -> dict[str, Any]:
        n, done = self.suggestions, self.rewards_finalized
        loop = self.loop()
        return {
            "policy_version": version,
            "suggestions": n,
            "shown": self.shown,
            "shown_rate": self.shown / n if n else 0.0,
            "accepted": self.accepted,
            "shown_finalized": self.shown_finalized,
            "accept_rate": self.accepted / self.shown_finalized if self.shown_finalized else None,
            "retained_fraction": self.retention_sum / self.accepted if self.accepted else None,
            "accepted_chars_per_request": self.accepted_chars / done if done else None,
            "retained_chars_per_request": self.retained_chars / done if done else None,
            "kept_chars_per_100": loop["kept_chars_per_100"],
            "not_taken_per_request": loop["not_taken_per_request"],
            "mean_reward": self.reward_sum / done if done else None,
            "rewards_finalized": self.rewards_finalized,
            "latency_ms_p50": latency.get(50),
            "latency_ms_p99": latency.get(99),
        }


PERCENTILES = (50, 99)


def _ranks(n: int, p: int) -> tuple[int, int, float]:
    """The 0-based ranks the p-th percentile of n sorted values interpolates between, and the
    weight of the upper one: numpy's default ("linear") definition."""
    position = (n - 1) * p / 100
    low = (n - 1) * p // 100
    return low, -(-(n - 1) * p // 100), position - low


def _percentile_rows(rank: Any, count: Any) -> Any:
    """SQL: this row holds one of the ranks `_ranks` needs (integer arithmetic: SQLite has no
    floor() or ceil() unless built with its math functions)."""
    wanted = []
    for p in PERCENTILES:
        wanted += [rank == ((count - 1) * p) // 100, rank == ((count - 1) * p + 99) // 100]
    return sa.or_(*wanted)


def _interpolate(n: int, values: dict[int, float]) -> dict[int, float]:
    out = {}
    for p in PERCENTILES:
        low, high, weight = _ranks(n, p)
        out[p] = values[low] + (values[high] - values[low]) * weight
    return out


def _epoch_s(column: Any, dialect: str) -> Any:
    """Whole seconds since the epoch of a UTCDateTime column, in SQL."""
    if dialect == "sqlite":  # stored as naive UTC text
        return sa.cast(sa.func.strftime("%s", column), sa.Integer)
    return sa.cast(sa.func.floor(sa.extract("epoch", column)), sa.BigInteger)


def _sum_columns() -> list[Any]:
    """SQL over rollouts left-joined with rewards: the sums an _Acc holds, labelled as its
    fields (kept characters: tabloop.core.reward_store.kept_chars)."""
    r, w = rollouts, rewards
    final = w.c.suggestion_id.is_not(None)
    # an unviewed suggestion was neither accepted nor rejected by anyone: not in the accept rate
    judged = sa.and_(r.c.shown, final, w.c.outcome != UNVIEWED)
    accepted = w.c.outcome == "accepted"
    retention = w.c.components["retention"].as_float()
    return [
        sa.func.count().label("suggestions"),
        sa.func.sum(sa.case((r.c.shown, 1), else_=0)).label("shown"),
        sa.func.sum(sa.case((judged, 1), else_=0)).label("shown_finalized"),
        sa.func.sum(sa.case((accepted, 1), else_=0)).label("accepted"),
        sa.func.sum(accepted_chars()).label("accepted_chars"),
        sa.func.sum(kept_chars()).label("retained_chars"),
        sa.func.sum(sa.case((accepted, retention), else_=0)).label("retention_sum"),
        sa.func.coalesce(sa.func.sum(w.c.value), 0).label("reward_sum"),
        sa.func.count(w.c.value).label("rewards_finalized"),
    ]


def _acc(row: Any) -> _Acc:
    """An _Acc from a row of `_sum_columns`."""
    return _Acc(
        suggestions=int(row.suggestions),
        shown=int(row.shown),
        shown_finalized=int(row.shown_finalized),
        accepted=int(row.accepted),
        accepted_chars=float(row.accepted_chars),
        retained_chars=float(row.retained_chars),
        retention_sum=float(row.retention_sum),
        reward_sum=float(row.reward_sum),
        rewards_finalized=int(row.rewards_finalized),
    )


def recent_versions(
    conn: sa.Connection, *, end: datetime, window_s: int = DEFAULT_WINDOW_S
) -> list[dict[str, Any]]:
    """The RECENT_VERSIONS newest policy versions that served rollouts in [end - window_s,
    end), newest first: their counts and `_Acc.loop` figures over that window."""
    r, w = rollouts, rewards
    start = end - timedelta(seconds=window_s)
    sums = (
        sa.select(r.c.policy_version, *_sum_columns())
        .select_from(r.outerjoin(w, w.c.suggestion_id == r.c.suggestion_id))
        .where(r.c.created_at >= start, r.c.created_at < end)
        .group_by(r.c.policy_version)
        .order_by(r.c.policy_version.desc())
        .limit(RECENT_VERSIONS)
    )
    out = []
    for row in conn.execute(sums):
        acc = _acc(row)
        out.append(
            {
                "policy_version": int(row.policy_version),
                "requests": acc.suggestions,
                "shown": acc.shown,
                "shown_finalized": acc.shown_finalized,
                "accepted": acc.accepted,
                "rewards_finalized": acc.rewards_finalized,
                **acc.loop(),
            }
        )
    return out


def metrics(conn: sa.Connection, *, window_s: int, bucket_s: int, end: datetime) -> MetricsOut:
    """The metrics of rollouts created in [end - window_s, end), per version and per bucket."""
    try:
        start = end - timedelta(seconds=window_s)
    except OverflowError:
        raise Unprocessable(f"'to' ({end.isoformat()}) is too early for the window") from None
    first = math.floor(start.timestamp() / bucket_s) * bucket_s  # epoch s of the first bucket
    r, w = rollouts, rewards
    bucket = ((_epoch_s(r.c.created_at, conn.dialect.name) - first) // bucket_s).label("bucket")
    in_window = sa.and_(r.c.created_at >= start, r.c.created_at < end)

    sums = (
        sa.select(bucket, r.c.policy_version, *_sum_columns())
        .select_from(r.outerjoin(w, w.c.suggestion_id == r.c.suggestion_id))
        .where(in_window)
        .group_by(bucket, r.c.policy_version)
    )
    accs = {(int(row.bucket), int(row.policy_version)): _acc(row) for row in conn.execute(sums)}
    # Latency percentiles: each rollout's rank within its (bucket, version) and its version.
    ms = r.c.latency_ms
    by_bucket, by_version = [bucket, r.c.policy_version], [r.c.policy_version]
    ranked = (
        sa.select(
            bucket,
            r.c.policy_version,
            ms.label("ms"),
            (sa.func.row_number().over(partition_by=by_bucket, order_by=ms) - 1).label("b_rank"),
            sa.func.count().over(partition_by=by_bucket).label("b_n"),
            (sa.func.row_number().over(partition_by=by_version, order_by=ms) - 1).label("v_rank"),
            sa.func.count().over(partition_by=by_version).label("v_n"),
        )
        .where(in_window)
        .subquery()
    )
    q = ranked.c
    picked = sa.select(ranked).where(
        sa.or_(_percentile_rows(q.b_rank, q.b_n), _percentile_rows(q.v_rank, q.v_n))
    )
    bucket_ms: dict[tuple[int, int], tuple[int, dict[int, float]]] = {}
    version_ms: dict[int, tuple[int, dict[int, float]]] = {}
    for row in conn.execute(picked):
        key = (int(row.bucket), int(row.policy_version))
        bucket_ms.setdefault(key, (int(row.b_n), {}))[1][int(row.b_rank)] = float(row.ms)
        version_ms.setdefault(key[1], (int(row.v_n), {}))[1][int(row.v_rank)] = float(row.ms)

    def latency(ranked_ms: tuple[int, dict[int, float]] | None) -> dict[int, float]:
        # None: a rollout inserted between the two queries made a new group; no figure for it
        return {} if ranked_ms is None else _interpolate(*ranked_ms)

    per_version: dict[int, _Acc] = defaultdict(_Acc)
    buckets = []
    for (b, version), acc in sorted(accs.items()):
        per_version[version].add(acc)
        bucket_start = datetime.fromtimestamp(first + b * bucket_s, UTC)
        row_ = acc.row(version, latency(bucket_ms.get((b, version))))
        buckets.append(BucketRow(start=bucket_start, **row_))
    return MetricsOut.model_validate(
        {
            "window_s": window_s,
            "bucket_s": bucket_s,
            "from": start,
            "to": end,
            "versions": [
                Row(**per_version[v].row(v, latency(version_ms.get(v))))
                for v in sorted(per_version)
            ],
            "buckets": buckets,
            "feedback": feedback_trust(conn, start=start, end=end),
        }
    )
