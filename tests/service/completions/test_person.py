"""The person and the moment over HTTP: what a decision read of the person comes from the
service's own records (their earlier suggestions and feedback under the key), is logged with the
rollout, recomputes exactly (with the extend draws: how far to suggest), stays out of privacy
mode, and goes with the person."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import torch

from tabloop.core.db import make_engine
from tabloop.core.person import PERSON_INPUTS
from tabloop.core.policy.checkpoint import load_checkpoint, save_checkpoint
from tabloop.core.policy.scoring import score_actions
from tabloop.core.tables import rollouts

PREFIX = "import os\n\n\ndef read(path):\n    with open(path) as f:\n        return f.re"


@pytest.fixture
def served_overrides(tiny_checkpoint_factory: Any, tmp_path: Path) -> dict[str, Any]:
    """The tiny base showing about three in four (its gate a bias alone), with random weights on
    the heads' person inputs: every feature moves the decision."""
    model, tokenizer, _ = load_checkpoint(tiny_checkpoint_factory(0))
    with torch.no_grad():
        model.gate.features.weight.zero_()
        model.gate.features.bias.fill_(1.0)
        gen = torch.Generator().manual_seed(3)
        model.gate.person.copy_(torch.randn(model.gate.person.shape, generator=gen))
        model.gate.copy.person.copy_(torch.randn(model.gate.copy.person.shape, generator=gen))
        model.gate.extend.bias.fill_(0.0)
        model.gate.extend.person.copy_(torch.randn(model.gate.extend.person.shape, generator=gen))
    out = save_checkpoint(tmp_path / "person", model, tokenizer, version=0, parent=None)
    # a confidence stop the tiny model often reaches: the extend head draws there
    return {"base_checkpoint": out, "stop_logprob": -3.0}


@pytest.fixture
def api(served: Any, key_factory: Any) -> Any:
    token = key_factory("ingest", "admin")
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as c:
        yield c


def _complete(c: httpx.Client, user: str, **headers: str) -> dict[str, Any]:
    body = {"user_id": user, "language": "python", "prefix": PREFIX, "suffix": "\n"}
    r = c.post("/v1/complete", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _feedback(c: httpx.Client, user: str, sid: str, kind: str) -> None:
    event = {
        "event_id": str(uuid.uuid4()),
        "type": kind,
        "user_id": user,
        "suggestion_id": sid,
        "occurred_at": datetime.now(UTC).isoformat(),
    }
    r = c.post("/v1/events", json={"events": [event]})
    assert r.status_code == 202 and r.json()["accepted"] == 1, r.text


def _rows(served: Any) -> dict[str, Any]:
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        rows = {r.suggestion_id: r for r in conn.execute(sa.select(rollouts)).all()}
    engine.dispose()
    return rows


def test_the_decisions_read_the_persons_record_and_recompute_exactly(
    api: httpx.Client, served: Any
) -> None:
    shown: list[str] = []
    for _ in range(60):
        r = _complete(api, "u-1")
        if r["shown"]:
            shown.append(r["suggestion_id"])
        if len(shown) == 4:
            break
    assert len(shown) == 4, "the policy shows most suggestions"
    for sid, kind in zip(shown, ("accept", "reject", "accept", "accept"), strict=True):
        _feedback(api, "u-1", sid, kind)
    later = [_complete(api, "u-1")["suggestion_id"] for _ in range(6)]
    private = _complete(api, "u-1", **{"X-Tabloop-No-Train": "1"})["suggestion_id"]
    after_private = _complete(api, "u-1")["suggestion_id"]
    other = _complete(api, "u-2")["suggestion_id"]

    rows = _rows(served)
    first = rows[later[0]].person
    assert len(first["gate"]) == len(PERSON_INPUTS)
    # newest first: the four judged ones (the last accepted), the rest of the shown ones too old
    # to be pending or judged by now are not in it yet (the sim window is not over)
    outcomes = [tuple(o) for o in first["history"]["outcomes"]]
    taken = [t for _, t in outcomes]
    assert taken[:4] == [True, True, False, True], outcomes
    assert first["gate"][PERSON_INPUTS.index("prev_accepted")] == 1.0
    assert first["history"]["since_s"] is not None
    # privacy mode: nothing read, nothing kept, and never read afterwards
    assert rows[private].person is None
    assert rows[after_private].person["history"] == rows[later[-1]].person["history"] | {
        "since_s": rows[after_private].person["history"]["since_s"]
    }
    # another person starts with nothing known
    assert rows[other].person["history"] == {"outcomes": [], "since_s": None}

    # how far to suggest is drawn where the stop comes, and logged
    extends = [r.extend for r in rows.values() if r.extend is not None]
    assert extends and all(set(e) == {"at", "extended", "logprob"} for e in extends), extends
    model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    scored = [rows[s] for s in (*later, after_private, other)] + [
        r for r in rows.values() if r.extend is not None and r.no_train is not True
    ]
    with torch.no_grad():
        scores = score_actions(model, tokenizer, scored)
    torch.testing.assert_close(
        scores.decision, torch.tensor([r.decision_logprob for r in scored]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        scores.total, torch.tensor([r.logprob_total for r in scored]), atol=1e-4, rtol=0
    )


def test_a_purged_person_is_known_as_nothing(api: httpx.Client, served: Any) -> None:
    for _ in range(3):
        r = _complete(api, "u-gone")
        if r["shown"]:
            _feedback(api, "u-gone", r["suggestion_id"], "reject")
    known = _complete(api, "u-gone")["suggestion_id"]
    assert _rows(served)[known].person["history"]["since_s"] is not None
    r = api.delete("/admin/users/u-gone")
    assert r.status_code == 200, r.text
    fresh = _complete(api, "u-gone")["suggestion_id"]
    assert _rows(served)[fresh].person["history"] == {"outcomes": [], "since_s": None}


@pytest.mark.parametrize("served_overrides", [{"person_features": False}])
def test_with_person_features_off_nothing_is_read(api: httpx.Client, served: Any) -> None:
    _complete(api, "u-1")
    again = _complete(api, "u-1")["suggestion_id"]
    assert _rows(served)[again].person is None
