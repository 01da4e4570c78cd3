"""Each person's and each key's share of a batch's weight is capped (trainer/caps.py)."""

from __future__ import annotations

import pytest

from trainer.caps import cap_one, cap_weights, capped, effective_cap, max_share

A, B = "key-a", "key-b"


def shares(weights: list[float], groups: list[str | None]) -> dict[str, float]:
    total = sum(weights)
    out: dict[str, float] = {}
    for w, g in zip(weights, groups, strict=True):
        if g is not None:
            out[g] = out.get(g, 0.0) + w / total
    return out


def test_a_user_with_90_percent_of_the_feedback_gets_the_caps_share() -> None:
    users = ["loud"] * 90 + [f"u{i}" for i in range(10)]
    w = cap_weights(users, [A] * 45 + [B] * 55, 0.25)
    s = shares(w, users)
    assert s["loud"] == pytest.approx(0.25)
    assert all(s[f"u{i}"] == pytest.approx(0.75 / 10) for i in range(10))  # the rest share alike
    assert sum(w) / len(w) == pytest.approx(1.0)  # mean 1: the loss keeps its scale
    [c] = capped(users, w)
    assert (c.id, c.rows, c.share) == ("loud", 90, 0.9)
    assert c.weight_share == pytest.approx(0.25) and c.weight_removed == pytest.approx(90 - 25)


@pytest.mark.parametrize(
    ("case", "users", "cap", "expected"),
    [
        ("empty batch", [], 0.25, {}),
        ("one sample", ["u"], 0.25, {"u": 1.0}),
        ("one person: never capped", ["u"] * 5, 0.25, {"u": 1.0}),
        ("two people: at most even", ["u"] * 9 + ["v"], 0.25, {"u": 0.5, "v": 0.5}),
        (
            "four people: exactly a quarter each",
            ["u"] * 7 + ["v", "w", "x"],
            0.25,
            {"u": 0.25, "v": 0.25, "w": 0.25, "x": 0.25},
        ),
        (
            "nobody over the cap: unchanged",
            ["u", "v", "w", "x", "y"] * 2,
            0.25,
            {g: 0.2 for g in "uvwxy"},
        ),
        (
            "two over the cap",
            ["u"] * 40 + ["v"] * 40 + [f"s{i}" for i in range(20)],
            0.25,
            {"u": 0.25, "v": 0.25, **{f"s{i}": 0.025 for i in range(20)}},
        ),
        ("cap 1: off", ["u"] * 9 + ["v"], 1.0, {"u": 0.9, "v": 0.1}),
    ],
)
def test_user_shares(case: str, users: list[str], cap: float, expected: dict[str, float]) -> None:
    w = cap_weights(users, [None] * len(users), cap)
    assert shares(w, list(users)) == pytest.approx(expected), case
    if users:
        assert sum(w) / len(w) == pytest.approx(1.0), case


def test_a_key_is_capped_like_a_person() -> None:
    """Ten people behind one key sending 90% of the rows, one person each behind nine keys."""
    users = [f"k{i % 10}" for i in range(90)] + [f"p{i}" for i in range(9)]
    keys = [A] * 90 + [f"key-{i}" for i in range(9)]
    w = cap_weights(users, keys, 0.25)
    assert shares(w, keys)[A] == pytest.approx(0.25)
    assert max_share(w, users) <= 0.25 + 1e-9


def test_rows_without_a_key_count_in_the_total_only() -> None:
    keys: list[str | None] = [A] * 60 + [B] * 20 + [None] * 20
    w = cap_weights([f"u{i}" for i in range(100)], keys, 0.25)
    s = shares(w, keys)
    assert s[A] == pytest.approx(0.5)  # two keys: the most they can be held to is half each
    assert s[B] == pytest.approx(0.25)  # the other half: key B and the rows without one
    assert sum(w[80:]) / sum(w) == pytest.approx(0.25)


def test_when_both_caps_cannot_hold_the_persons_cap_does() -> None:
    """Four people, three behind one key: each person at a quarter makes that key 3/4, over the
    two keys' effective cap of 1/2; holding the key to 1/2 would push the fourth person to 1/2."""
    users = ["a"] * 10 + ["b"] * 10 + ["c"] * 10 + ["d"] * 2
    keys = [A] * 30 + [B] * 2
    w = cap_weights(users, keys, 0.25)
    assert max_share(w, users) <= 0.25 + 1e-9


@pytest.mark.parametrize(
    ("cap", "groups", "expected"),
    [(0.25, 0, 1.0), (0.25, 1, 1.0), (0.25, 3, 1 / 3), (0.25, 10, 0.25)],
)
def test_effective_cap(cap: float, groups: int, expected: float) -> None:
    assert effective_cap(cap, groups) == pytest.approx(expected)


def test_cap_one_leaves_rows_in_no_group_and_uncapped_groups_alone() -> None:
    w = cap_one([1.0] * 6, ["u", "u", "u", "u", "v", None], 0.5)
    assert w[4:] == [1.0, 1.0]
    assert sum(w[:4]) == pytest.approx(0.5 * sum(w))
