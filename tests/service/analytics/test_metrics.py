"""GET /admin/metrics: the window and bucket parameters, and exact figures on a hand-made dataset
(rollouts and rewards written straight to the database), in both modes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from service.admin.metrics.queries import loop_rates, resolve_window
from service.errors import Unprocessable
from tabloop.core.reward import COMPONENTS
from tabloop.core.tables import rewards, rollouts

END = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(minute: int, second: float = 0) -> datetime:
    """A time on 2026-01-01 at 11:mm:ss (the window below ends at 12:00)."""
    return END.replace(hour=11, minute=minute) + timedelta(seconds=second)


def rollout(
    sid: str, version: int, created: datetime, *, shown: bool, text: str, latency: float
) -> dict[str, Any]:
    return {
        "suggestion_id": sid,
        "user_id": "u-" + sid,
        "policy_version": version,
        "created_at": created,
        "context_token_ids": [],
        "heal_text": "",
        "token_ids": [],
        "token_logprobs": [],
        "text": text,
        "shown": shown,
        "gate_prob_show": 0.5,
        "decision_logprob": -0.7,
        "logprob_total": -1.0,
        "temperature": 1.0,
        "stop_reason": "eos",
        "latency_ms": latency,
    }


def reward(
    row: dict[str, Any], value: float, outcome: str, share: float = 0.0, retention: float = 0.0
) -> dict[str, Any]:
    components = {**dict.fromkeys(COMPONENTS, 0.0), "share": share, "retention": retention}
    return {
        "suggestion_id": row["suggestion_id"],
        "user_id": row["user_id"],
        "policy_version": row["policy_version"],
        "rollout_created_at": row["created_at"],
        "value": value,
        "outcome": outcome,
        "components": components,
        "spec_version": 1,
        "finalized_at": row["created_at"] + timedelta(seconds=30),
    }


def seed(engine: sa.Engine) -> None:
    r = {
        # v1, bucket 11:50-11:55
        "a": rollout("a", 1, at(51), shown=True, text="abcdefghij", latency=10),
        "b": rollout("b", 1, at(52), shown=True, text="xyz12", latency=20),
        "c": rollout("c", 1, at(53), shown=False, text="", latency=30),
        # v3 shows nothing: its rates of shown are null, not 0
        "v3": rollout("v3", 3, at(54), shown=False, text="", latency=7),
        # v1, bucket 11:55-12:00; e has no final reward yet
        "d": rollout("d", 1, at(56), shown=True, text="a" * 20, latency=40),
        "e": rollout("e", 1, at(57), shown=True, text="hello", latency=50),
        # v2, bucket 11:55-12:00; g half a second before the end of the window
        "f": rollout("f", 2, at(58), shown=True, text="12345678", latency=5),
        "g": rollout("g", 2, at(59, 59.5), shown=False, text="", latency=15),
        # outside [11:50, 12:00): the end is exclusive
        "before": rollout("before", 1, at(49, 59), shown=True, text="zz", latency=999),
        "end": rollout("end", 1, END, shown=True, text="zz", latency=999),
    }
    with engine.begin() as conn:
        conn.execute(rollouts.insert(), list(r.values()))
        conn.execute(
            rewards.insert(),
            [
                reward(r["a"], 0.4, "accepted", share=1.0, retention=0.5),  # 10 chars, 5 kept
                reward(r["b"], -0.25, "rejected"),
                reward(r["c"], 0.0, "abstained"),
                reward(
                    r["d"], 0.6, "accepted", share=0.5, retention=1.0
                ),  # 10 of 20 chars, all kept
                reward(
                    r["f"], 0.1, "accepted", share=0.25, retention=0.0
                ),  # 2 of 8 chars, none kept
                reward(r["before"], 1.0, "accepted", share=1.0, retention=1.0),
                reward(r["end"], 1.0, "accepted", share=1.0, retention=1.0),
            ],
        )


def row(
    version: int,
    suggestions: int,
    shown: int,
    shown_final: int,
    accepted: int,
    retained_fraction: Any,
    accepted_chars: float,
    retained_chars: float,
    reward_sum: float,
    finalized: int,
    p50: float,
    p99: float,
) -> dict[str, Any]:
    """The expected Row: rates of acceptance, characters and reward are over finalized rewards."""

    def per_final(x: float) -> Any:
        return pytest.approx(x / finalized) if finalized else None

    return {
        "policy_version": version,
        "suggestions": suggestions,
        "shown": shown,
        "shown_rate": pytest.approx(shown / suggestions),
        "shown_finalized": shown_final,
        "accepted": accepted,
        "accept_rate": pytest.approx(accepted / shown_final) if shown_final else None,
        "retained_fraction": retained_fraction,
        "accepted_chars_per_request": per_final(accepted_chars),
        "retained_chars_per_request": per_final(retained_chars),
        "kept_chars_per_100": per_final(100 * retained_chars),
        "not_taken_per_request": per_final(shown_final - accepted),
        "mean_reward": per_final(reward_sum),
        "rewards_finalized": finalized,
        "latency_ms_p50": pytest.approx(p50),
        "latency_ms_p99": pytest.approx(p99),
    }


def test_figures_on_a_small_dataset(client: httpx.Client, engine: sa.Engine) -> None:
    seed(engine)
    r = client.get(
        "/admin/metrics", params={"window": "10m", "bucket": "5m", "to": "2026-01-01T12:00:00Z"}
    )
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["window_s"] == 600 and m["bucket_s"] == 300
    assert datetime.fromisoformat(m["from"]) == at(50)
    assert datetime.fromisoformat(m["to"]) == END
    # latencies: v1 [10, 20, 30, 40, 50] -> p50 30, p99 40 + 0.96 * 10 (linear interpolation)
    # e is shown but not final: it counts in shown_rate, not in the rates of finalized rewards
    assert m["versions"] == [
        row(1, 5, 4, 3, 2, pytest.approx(0.75), 20, 15, 0.75, 4, 30, 49.6),
        row(2, 2, 1, 1, 1, pytest.approx(0.0), 2, 0, 0.1, 1, 10, 14.9),
        row(3, 1, 0, 0, 0, None, 0, 0, 0, 0, 7, 7),
    ]
    starts = [(datetime.fromisoformat(b.pop("start")), b["policy_version"]) for b in m["buckets"]]
    assert starts == [(at(50), 1), (at(50), 3), (at(55), 1), (at(55), 2)]
    assert m["buckets"] == [
        row(1, 3, 2, 2, 1, pytest.approx(0.5), 10, 5, 0.15, 3, 20, 29.8),
        row(3, 1, 0, 0, 0, None, 0, 0, 0, 0, 7, 7),
        row(1, 2, 2, 1, 1, pytest.approx(1.0), 10, 10, 0.6, 1, 45, 49.9),
        row(2, 2, 1, 1, 1, pytest.approx(0.0), 2, 0, 0.1, 1, 10, 14.9),
    ]


def test_buckets_align_to_the_epoch(client: httpx.Client, engine: sa.Engine) -> None:
    seed(engine)
    # the window starts at 11:52:30: its first bucket starts at 11:50 but holds only c and v3
    m = client.get(
        "/admin/metrics",
        params={"window": "450", "bucket": "300", "to": "2026-01-01T12:00:00+00:00"},
    ).json()
    assert datetime.fromisoformat(m["from"]) == at(52, 30)
    first = [b for b in m["buckets"] if datetime.fromisoformat(b["start"]) == at(50)]
    assert [(b["policy_version"], b["suggestions"]) for b in first] == [(1, 1), (3, 1)]


def test_defaults_and_an_empty_window(client: httpx.Client) -> None:
    r = client.get("/admin/metrics")
    assert r.status_code == 200, r.text
    m = r.json()
    assert (m["window_s"], m["bucket_s"], m["versions"], m["buckets"]) == (3600, 120, [], [])
    span = datetime.fromisoformat(m["to"]) - datetime.fromisoformat(m["from"])
    assert span == timedelta(hours=1)


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"window": "abc"}, "window must be seconds or a duration"),
        ({"window": "0"}, "at least 1 s"),
        ({"window": "-5m"}, "window must be seconds or a duration"),
        ({"window": "31d"}, "at most 2592000 s"),
        ({"window": "9" * 400 + "d"}, "at most 2592000 s"),
        ({"window": "1h", "bucket": "1s"}, "3600 buckets; at most 500"),
        ({"window": "1h", "bucket": "2h"}, "bucket must be at most 3600 s"),
        ({"to": "0.0"}, "to must be an RFC 3339 date-time"),  # not a Unix time
        ({"to": "2026-11-29"}, "to must be an RFC 3339 date-time"),
        ({"to": "yesterday"}, "to"),
    ],
)
def test_bad_parameters_are_422(client: httpx.Client, params: dict[str, str], needle: str) -> None:
    r = client.get("/admin/metrics", params=params)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]


def test_needs_an_admin_key(service: Any, key_factory: Any) -> None:
    assert httpx.get(service.url + "/admin/metrics").status_code == 401
    ingest = {"Authorization": f"Bearer {key_factory('ingest')}"}
    assert httpx.get(service.url + "/admin/metrics", headers=ingest).status_code == 403


@pytest.mark.parametrize(
    ("window", "bucket", "expected"),
    [
        (None, None, (3600, 120)),  # the defaults: 1 h in 30 buckets
        ("15m", None, (900, 30)),
        ("5m", None, (300, 10)),  # window / 30 is below the 10 s floor
        ("5", None, (5, 5)),  # ... but a bucket never outgrows its window
        ("24h", "1h", (86400, 3600)),
        ("1.5h", "90s", (5400, 90)),
        (" 2D ", None, (172800, 5760)),
        ("30d", "2h", (2592000, 7200)),  # 360 buckets
        ("500", "1", (500, 1)),  # exactly MAX_BUCKETS
    ],
)
def test_resolve_window(window: str | None, bucket: str | None, expected: tuple[int, int]) -> None:
    assert resolve_window(window=window, bucket=bucket) == expected


def test_resolve_window_bucket_count_limit() -> None:
    with pytest.raises(Unprocessable, match="501 buckets"):
        resolve_window(window="501", bucket="1")


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        pytest.param((0, 0, 0, 0.0), (None, None, None), id="empty"),
        pytest.param((1, 1, 1, 7.5), (750.0, 1.0, 0.0), id="one request, accepted"),
        pytest.param((4, 0, 0, 0.0), (0.0, None, 0.0), id="all unviewed or abstained"),
        pytest.param((10, 5, 2, 15.0), (150.0, 0.4, 0.3), id="some shown, some taken"),
    ],
)
def test_loop_rates(counts: tuple[int, int, int, float], expected: tuple[Any, ...]) -> None:
    """Kept characters per 100 requests, the accept rate of shown and shown-but-not-taken per
    request, over the rollouts with a finalized reward."""
    finalized, shown_finalized, accepted, kept = counts
    rates = loop_rates(
        finalized=finalized, shown_finalized=shown_finalized, accepted=accepted, kept_chars=kept
    )
    assert list(rates) == ["kept_chars_per_100", "accept_rate_of_shown", "not_taken_per_request"]
    assert tuple(rates.values()) == tuple(None if e is None else pytest.approx(e) for e in expected)
