"""The workspace memory over HTTP: shared by a workspace's keys and API processes, rebuilt after a
restart, never read across workspaces, bounded per person, emptied by a purge, and never fed in
privacy mode."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import torch

from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.scoring import score_actions
from tabloop.core.recall import RECALL_INPUTS
from tabloop.core.tables import rollouts, workspace_code

SECRET = "'hunter2-ab41f0-do-not-share')"
FILE_A = (
    "import settings\n\n\ndef configure(client):\n"
    f"    client.connect(api_secret={SECRET}\n"
    "    return client\n"
)
ASK = "def reconnect(client):\n    client.connect(api_secret="  # a teammate's cursor
FROM_MEMORY = RECALL_INPUTS.index("from_memory")

FAST = pytest.mark.parametrize("served_overrides", [{"memory_refresh_s": 0.1}])


def make_key(admin: httpx.Client, name: str, workspace: str, **extra: Any) -> httpx.Client:
    r = admin.post(
        "/admin/keys", json={"name": name, "scopes": ["ingest"], "workspace": workspace, **extra}
    )
    assert r.status_code == 201, r.text
    assert r.json()["workspace"] == workspace
    return httpx.Client(
        base_url=str(admin.base_url),
        headers={"Authorization": f"Bearer {r.json()['token']}"},
        timeout=30,
    )


@pytest.fixture
def admin(served: Any, key_factory: Any) -> Any:
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {key_factory('admin')}"}
    ) as c:
        yield c


def ask(c: httpx.Client, user: str, prefix: str, **extra: Any) -> str:
    body = {"user_id": user, "prefix": prefix, "max_new_tokens": 8, **extra}
    r = c.post("/v1/complete", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["suggestion_id"])


def recall_of(settings: Any, suggestion_id: str) -> dict[str, Any] | None:
    engine = make_engine(settings)
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(rollouts.c.recall).where(rollouts.c.suggestion_id == suggestion_id)
        ).one()
    engine.dispose()
    return row.recall  # type: ignore[no-any-return]


def proposal_from_memory(c: httpx.Client, settings: Any, user: str, **extra: Any) -> Any:
    """Ask at the teammate's cursor until the memory proposes (it is built in the background);
    the last recall record when it never does within 10 s."""
    deadline = time.monotonic() + 10
    while True:
        recall = recall_of(settings, ask(c, user, ASK, **extra))
        if (recall and recall["inputs"][FROM_MEMORY]) or time.monotonic() > deadline:
            return recall
        time.sleep(0.1)


@FAST
def test_a_workspace_shares_its_memory_and_no_other_workspace_reads_it(
    served: Any, admin: httpx.Client, service_factory: Any
) -> None:
    alice = make_key(admin, "alice-editor", "team-a")
    bob = make_key(admin, "bob-editor", "team-a")
    mallory = make_key(admin, "mallory-editor", "team-b")
    for _ in range(3):  # alice writes the file, hundreds of secret lines in it, and settles
        ask(alice, "alice", FILE_A * 100, file_path="cfg.py", workspace_id="repo-a")

    recall = proposal_from_memory(bob, served.settings, "bob")
    assert recall is not None and recall["inputs"][FROM_MEMORY] == 1.0
    assert recall["text"] == SECRET  # a teammate gets what alice wrote there
    # the rollouts that used the memory: their log-probabilities recomputed exactly
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(rollouts).where(rollouts.c.recall.is_not(None))).all()
    engine.dispose()
    model, tokenizer, _ = load_checkpoint(served.settings.base_checkpoint)
    with torch.no_grad():
        totals = score_actions(model, tokenizer, rows).total.tolist()
    for row, total in zip(rows, totals, strict=True):
        assert abs(total - row.logprob_total) <= 1e-4 * max(1.0, abs(row.logprob_total))

    # another workspace's key, even naming alice's repository, never gets it
    for workspace_id in ("repo-a", None):
        extra = {"workspace_id": workspace_id} if workspace_id else {}
        for _ in range(5):
            recall = recall_of(served.settings, ask(mallory, "mallory", ASK, **extra))
            assert recall is None or "hunter2" not in recall["text"], recall
            time.sleep(0.1)
    # naming another repository narrows alice's team's memory to nothing
    recall = recall_of(served.settings, ask(bob, "bob", ASK, workspace_id="repo-z"))
    assert recall is None or not recall["inputs"][FROM_MEMORY]

    # a second API process on the same database sees the same memory
    second = service_factory(served.settings)
    with httpx.Client(base_url=second.url, headers=bob.headers, timeout=30) as bob2:
        recall = proposal_from_memory(bob2, served.settings, "bob")
    assert recall is not None and recall["text"] == SECRET

    # and after a restart it is rebuilt from what is stored
    served.stop()
    second.stop()
    again = service_factory(served.settings)
    with httpx.Client(base_url=again.url, headers=bob.headers, timeout=30) as bob3:
        recall = proposal_from_memory(bob3, served.settings, "bob")
    assert recall is not None and recall["text"] == SECRET


def report(c: httpx.Client, user: str, suggestion_id: str, type_: str, **fields: Any) -> None:
    event = {
        "event_id": str(uuid.uuid4()),
        "type": type_,
        "user_id": user,
        "suggestion_id": suggestion_id,
        "occurred_at": datetime.now(UTC).isoformat(),
        **fields,
    }
    r = c.post("/v1/events", json={"events": [event]})
    assert r.status_code == 202 and r.json()["accepted"] == 1, r.text


def document_text(settings: Any, user: str, document: str = "cfg.py") -> str:
    engine = make_engine(settings)
    with engine.connect() as conn:
        text = conn.execute(
            sa.select(workspace_code.c.text).where(
                workspace_code.c.user_id == user, workspace_code.c.document == document
            )
        ).scalar_one()
    engine.dispose()
    return str(text)


@FAST
def test_settled_text_joins_the_memory_where_its_cursor_was(
    served: Any, admin: httpx.Client
) -> None:
    alice = make_key(admin, "alice-editor", "team-a")
    bob = make_key(admin, "bob-editor", "team-a")
    prefix = FILE_A.split(SECRET)[0] * 50  # the secret line, typed up to its value, many times
    suffix = "\n    return client\n"
    sid = ask(alice, "alice", prefix, suffix=suffix, file_path="cfg.py")
    recall = recall_of(served.settings, ask(bob, "bob", ASK))
    assert recall is None or "hunter2" not in recall["text"]  # nobody sent it yet
    report(alice, "alice", sid, "code_settled", after_seconds=30, text=SECRET)
    assert document_text(served.settings, "alice") == prefix + SECRET + suffix
    recall = proposal_from_memory(bob, served.settings, "bob")
    assert recall is not None and recall["text"] == SECRET
    # a report about an older request leaves the newer document alone
    newer = "import os\n" * 3
    ask(alice, "alice", newer, file_path="cfg.py")
    report(alice, "alice", sid, "code_settled", after_seconds=60, text="other()")
    assert document_text(served.settings, "alice") == newer

    # an accepted suggestion's accepted characters go in at the cursor, before any settled text
    sid = ask(alice, "alice", "x = os.", suffix="\nprint(x)\n", file_path="b.py")
    engine = make_engine(served.settings)
    with engine.begin() as conn:  # as if the policy had shown this
        conn.execute(
            rollouts.update()
            .where(rollouts.c.suggestion_id == sid)
            .values(shown=True, text="getcwd()  # here")
        )
    engine.dispose()
    report(alice, "alice", sid, "accept", accepted_chars=8)
    assert document_text(served.settings, "alice", "b.py") == "x = os.getcwd()\nprint(x)\n"
    report(alice, "alice", sid, "code_settled", after_seconds=30, text="path.sep")
    assert document_text(served.settings, "alice", "b.py") == "x = os.path.sep\nprint(x)\n"


@FAST
def test_an_editors_snippets_join_the_memory(served: Any, admin: httpx.Client) -> None:
    alice = make_key(admin, "alice-editor", "team-a")
    bob = make_key(admin, "bob-editor", "team-a")
    snippet = {"filepath": "cfg.py", "body": FILE_A}
    ask(alice, "alice", "import os\n", file_path="main.py", snippets=[snippet])
    recall = proposal_from_memory(bob, served.settings, "bob")
    assert recall is not None and recall["text"] == SECRET


@FAST
def test_one_person_flooding_a_line_counts_once_and_only_where_the_text_matches(
    served: Any, admin: httpx.Client
) -> None:
    eve = make_key(admin, "eve-editor", "team-a")
    bob = make_key(admin, "bob-editor", "team-a")
    flood = "def configure(client):\n    client.connect(api_secret='evil-marker-991')\n" * 3000
    ask(eve, "eve", flood + "\n", file_path="flood.py")
    recall = proposal_from_memory(bob, served.settings, "bob")
    assert recall is not None and recall["text"] == "'evil-marker-991')"
    # 3,000 copies from one person are one occurrence (log 1 = 0), one person's word
    assert recall["inputs"][RECALL_INPUTS.index("log_occurrences")] == 0.0
    for unrelated in ("def area(w, h):\n    return w * ", "import os\nprint(os.getcwd(", "x = "):
        recall = recall_of(served.settings, ask(bob, "bob", unrelated))
        assert recall is None or "evil-marker" not in recall["text"], recall


@pytest.mark.parametrize(
    "served_overrides", [{"memory_refresh_s": 0.1, "memory_person_bytes": 20_000}]
)
def test_a_person_fills_the_memory_only_up_to_the_cap(served: Any, admin: httpx.Client) -> None:
    eve = make_key(admin, "eve-editor", "team-a")
    bob = make_key(admin, "bob-editor", "team-a")
    line = "    client.connect(api_secret='evil-marker-992')\n"
    ask(eve, "eve", "def configure(client):\n" + line * 1000, file_path="big.py")  # 50 KB
    recall = proposal_from_memory(bob, served.settings, "bob")
    assert recall is None or "evil-marker" not in recall["text"]  # over the cap: not read


@FAST
def test_privacy_mode_feeds_nothing_and_a_purge_empties_it(
    served: Any, admin: httpx.Client
) -> None:
    private = make_key(admin, "private-editor", "team-a", no_train=True)
    alice = make_key(admin, "alice-editor", "team-a")
    bob = make_key(admin, "bob-editor", "team-a")
    ask(private, "carol", FILE_A)
    ask(alice, "dave", FILE_A, no_train=True)
    engine = make_engine(served.settings)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(workspace_code)).scalar() == 0
    ask(alice, "alice", FILE_A)
    recall = proposal_from_memory(bob, served.settings, "bob")
    assert recall is not None and recall["text"] == SECRET

    r = admin.delete("/admin/users/alice")
    assert r.status_code == 200 and r.json()["removed"]["workspace_code"] == 1, r.text
    with engine.connect() as conn:
        left = sa.select(workspace_code.c.user_id).where(workspace_code.c.user_id == "alice")
        assert conn.execute(left).all() == []
    engine.dispose()
    time.sleep(0.5)  # a few refreshes
    recall = recall_of(served.settings, ask(bob, "bob", ASK))
    assert recall is None or "hunter2" not in recall["text"]
