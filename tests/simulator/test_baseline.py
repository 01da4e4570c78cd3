"""The offline baseline: expected outcomes per threshold, the choice, and a run on the real base
checkpoint."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from simulator.baseline import THRESHOLDS, Scored, at_threshold, best_threshold, run, score
from simulator.config import default_checkpoint
from simulator.population import CursorSource, PopulationConfig
from tests.simulator.test_population import NOBODY, SIM_SPEC, corpus_line


def item(
    p: float,
    reward: float,
    accept: float = 0.0,
    chars: int = 10,
    family: bool = False,
    kept: float = 0.0,
) -> Scored:
    return Scored(
        p_show=p,
        chars=chars,
        family=family,
        accept=accept,
        accepted_chars=kept,
        retained_chars=kept,
        reward=reward,
    )


ITEMS = [
    item(0.9, 0.5, accept=1.0, kept=10),
    item(0.6, -0.25, family=True),
    item(0.3, 0.2, accept=0.8, kept=6),
    item(0.95, 0.0, chars=0),
]


@pytest.mark.parametrize(
    ("threshold", "shown", "accept", "reward", "family"),
    [
        pytest.param(0.0, 3 / 4, 1.8 / 3, 0.45 / 4, 1.0, id="show-everything-non-empty"),
        pytest.param(0.5, 2 / 4, 1.0 / 2, 0.25 / 4, 1.0, id="mid"),
        pytest.param(0.7, 1 / 4, 1.0, 0.5 / 4, 0.0, id="confident-only"),
        pytest.param(0.99, 0.0, None, 0.0, 0.0, id="nothing"),
        pytest.param(
            None, 1.8 / 4, (0.9 + 0.24) / 1.8, (0.45 - 0.15 + 0.06) / 4, 0.6, id="stochastic-gate"
        ),
    ],
)
def test_at_threshold(
    threshold: float | None, shown: float, accept: float | None, reward: float, family: float
) -> None:
    m = at_threshold(ITEMS, threshold)
    assert m["shown_per_request"] == pytest.approx(shown)
    assert m["accept_rate_of_shown"] == (None if accept is None else pytest.approx(accept))
    assert m["reward_per_request"] == pytest.approx(reward)
    assert m["family_shown_rate"] == pytest.approx(family)


def test_best_threshold_maximises_reward_per_request() -> None:
    # showing the 0.6 item costs 0.25, the 0.3 one earns 0.2: best is to show p >= 0.7 only
    assert best_threshold(ITEMS, (0.0, 0.5, 0.7, 0.99)) == 0.7


def test_best_threshold_ties_go_to_the_lowest() -> None:
    assert best_threshold([item(0.5, 0.0)], (0.2, 0.4, 0.9)) == 0.2


@pytest.mark.parametrize(
    ("person", "text", "family", "accept", "reward"),
    [
        pytest.param(replace(NOBODY, accept_correct=1.0), "x" * 20, False, 1.0, 0.75, id="kept"),
        pytest.param(replace(NOBODY, accept_correct=1.0), "x" * 20, True, 0.0, -0.25, id="family"),
        pytest.param(NOBODY, "x" * 20, False, 0.0, -0.25, id="ignored"),
    ],
)
def test_score(person: object, text: str, family: bool, accept: float, reward: float) -> None:
    s = score(text, "x" * 20, family, 0.4, [person] * 3, SIM_SPEC, random.Random(0))  # type: ignore[list-item]
    assert (s.p_show, s.chars, s.family) == (0.4, 20, family)
    assert (s.accept, s.reward) == (pytest.approx(accept), pytest.approx(reward))


def test_score_of_an_empty_completion_never_shows() -> None:
    s = score("", "foo", False, 0.99, [NOBODY], SIM_SPEC, random.Random(0))
    assert at_threshold([s], 0.0)["shown_per_request"] == 0.0


def test_run_on_the_base_checkpoint() -> None:
    source = CursorSource([corpus_line(0), corpus_line(2), corpus_line(3)])
    out = run(
        default_checkpoint(),
        source,
        PopulationConfig(reject_family_share=0.5),
        SIM_SPEC,
        6,
        seed=0,
        persons=4,
        max_new_tokens=8,
    )
    assert (out["selection_cursors"], out["evaluation_cursors"]) == (3, 3)
    assert out["chosen_threshold"] in THRESHOLDS
    assert out["best"]["threshold"] == out["chosen_threshold"]
    assert len(out["thresholds"]) == len(THRESHOLDS)
    assert 0.0 <= out["stochastic_gate"]["shown_per_request"] <= 1.0
    assert Path(out["checkpoint"]).is_dir()


def test_baseline_command_writes_json(tmp_path: Path) -> None:
    import json

    from simulator.baseline import main

    assert (
        main(
            [
                "--cursors",
                "4",
                "--persons",
                "2",
                "--reject-family-share",
                "0.5",
                "--out",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["cursors"] == 4 and out["population"]["reject_family_share"] == 0.5
    assert out["chosen_threshold"] in THRESHOLDS
