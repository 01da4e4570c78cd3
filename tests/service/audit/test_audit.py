"""The audit log through the real HTTP API: every admin and deploy action leaves exactly one row
(who, what, target, request id, outcome), refusals by an authenticated key are recorded with
their status, unauthenticated requests are not, no row holds a secret, and GET /admin/audit
pages through it newest first."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.policy.checkpoint import MANIFEST_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from tabloop.core.tables import audit_log, deployments, utcnow
from tests.service.auth.test_route_matrix import endpoints
from tests.service.policies.test_registry import upload
from trainer.client import ServiceClient


@dataclass
class Admin:
    """An operator's key (admin and deploy scopes) on the running service."""

    http: httpx.Client
    token: str
    key_id: str
    name: str


@pytest.fixture
def admin(served: Any, key_factory: Any) -> Iterator[Admin]:
    token = key_factory("admin", "deploy", name="ops")
    with httpx.Client(
        base_url=served.url, timeout=30, headers={"Authorization": f"Bearer {token}"}
    ) as http:
        yield Admin(http, token, token.split("_")[1], "ops")


def rows(served: Any, after: int = 0) -> list[dict[str, Any]]:
    """Audit rows with an id above `after`, oldest first, straight from the database."""
    with served.app.state.ctx.engine.connect() as conn:
        found = conn.execute(
            sa.select(audit_log).where(audit_log.c.id > after).order_by(audit_log.c.id)
        ).all()
    return [dict(r._mapping) for r in found]


def last_id(served: Any) -> int:
    with served.app.state.ctx.engine.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.coalesce(sa.func.max(audit_log.c.id), 0))).scalar_one()
        )


def timeline_length(served: Any) -> int:
    with served.app.state.ctx.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(deployments)).scalar_one())


# --- every action, once ------------------------------------------------------------------------

RID = {"X-Request-ID": "audit-test-1"}
Act = Callable[[], tuple[httpx.Response, str | None]]  # -> the answer, the expected target


def _files(ckpt: Path) -> dict[str, tuple[str, bytes]]:
    return {
        field: (name, (ckpt / name).read_bytes())
        for field, name in (
            ("manifest", MANIFEST_FILE),
            ("weights", WEIGHTS_FILE),
            ("tokenizer", TOKENIZER_FILE),
        )
    }


def _register(a: Admin, ckpt: Any) -> None:
    assert upload(a.http, ckpt(1)).status_code == 201


def _canary(a: Admin, ckpt: Any) -> None:
    _register(a, ckpt)
    assert a.http.post("/admin/policies/2/deploy", json={"canary_fraction": 0.5}).status_code == 200


def key_create(a: Admin, ckpt: Any) -> Act:
    def act() -> tuple[httpx.Response, str | None]:
        r = a.http.post("/admin/keys", json={"name": "vscode", "scopes": ["ingest"]}, headers=RID)
        return r, r.json()["id"]

    return act


def key_revoke(a: Admin, ckpt: Any) -> Act:
    key_id = a.http.post("/admin/keys", json={"name": "old", "scopes": ["ingest"]}).json()["id"]
    return lambda: (a.http.delete(f"/admin/keys/{key_id}", headers=RID), key_id)


def policy_register(a: Admin, ckpt: Any) -> Act:
    return lambda: (
        a.http.post("/admin/policies", files=_files(ckpt(1)), data={"parent": "1"}, headers=RID),
        "2",
    )


def deploy(a: Admin, ckpt: Any) -> Act:
    _register(a, ckpt)
    return lambda: (
        a.http.post(
            "/admin/policies/2/deploy",
            headers=RID,
            json={"canary_fraction": 0.5, "reason": "hand canary"},
        ),
        "2",
    )


def promote(a: Admin, ckpt: Any) -> Act:
    _canary(a, ckpt)
    return lambda: (a.http.post("/admin/policies/2/promote", headers=RID), "2")


def rollback(a: Admin, ckpt: Any) -> Act:
    _canary(a, ckpt)  # the rollback withdraws the canary, v2: its target
    return lambda: (
        a.http.post("/admin/rollback", json={"reason": "accept rate fell"}, headers=RID),
        "2",
    )


def training_pause(a: Admin, ckpt: Any) -> Act:
    return lambda: (a.http.post("/admin/training/pause", headers=RID), None)


def training_resume(a: Admin, ckpt: Any) -> Act:
    assert a.http.post("/admin/training/pause").status_code == 200
    return lambda: (a.http.post("/admin/training/resume", headers=RID), None)


def reward_spec_update(a: Admin, ckpt: Any) -> Act:
    return lambda: (
        a.http.put("/admin/reward-spec", json={"reject_penalty": 0.3}, headers=RID),
        "2",
    )  # version 1 is the profile's default


def replay(a: Admin, ckpt: Any) -> Act:
    window = {"from": "2026-01-01T00:00:00Z", "to": "2027-01-01T00:00:00Z"}
    return lambda: (a.http.post("/admin/replay", json=window, headers=RID), "1")


def purge(a: Admin, ckpt: Any) -> Act:
    return lambda: (a.http.delete("/admin/users/u-42", headers=RID), "u-42")


ACTIONS = {
    "key.create": key_create,
    "key.revoke": key_revoke,
    "policy.register": policy_register,
    "deploy": deploy,
    "promote": promote,
    "rollback": rollback,
    "training.pause": training_pause,
    "training.resume": training_resume,
    "reward_spec.update": reward_spec_update,
    "replay": replay,
    "purge": purge,
}


@pytest.mark.parametrize("action", sorted(ACTIONS))
def test_every_action_leaves_exactly_one_row(
    served: Any, admin: Admin, tiny_checkpoint_factory: Any, action: str
) -> None:
    act = ACTIONS[action](admin, tiny_checkpoint_factory)
    mark = last_id(served)
    r, target = act()
    assert r.status_code < 300, r.text
    assert r.headers["x-request-id"] == "audit-test-1"
    (row,) = rows(served, mark)
    assert (row["action"], row["target"], row["outcome"]) == (action, target, "ok")
    assert (row["key_id"], row["key_name"]) == (admin.key_id, "ops")
    assert row["request_id"] == "audit-test-1"  # the access log's id for the request
    assert utcnow() - row["at"] < timedelta(minutes=1)
    if action == "key.create":
        assert row["detail"] == {
            "name": "vscode",
            "scopes": ["ingest"],
            "no_train": False,
            "workspace": target,  # its own
        }
    if action == "deploy":
        assert row["detail"]["canary_fraction"] == 0.5 and row["detail"]["canary_version"] == 2
        assert row["detail"]["reason"] == "hand canary"
    if action == "reward_spec.update":
        assert row["detail"] == {"changed": {"reject_penalty": 0.3}}
    if action == "purge":
        assert set(row["detail"]["removed"]) >= {"rollouts", "events", "rewards"}


def test_every_mutating_admin_route_is_audited(served: Any) -> None:
    """A new admin route that changes something cannot skip the audit log: every non-GET route
    that needs a key, bar the completions and events APIs, opens an audit entry."""
    audited = set()
    for route in endpoints(served.app):
        methods = set(getattr(route, "methods", None) or ()) - {"GET", "HEAD"}
        dependant = getattr(route, "dependant", None)
        if not methods or dependant is None or not route.path.startswith("/admin"):
            continue
        calls = [d.call for d in dependant.dependencies]
        assert any(
            getattr(c, "__name__", "") == "dependency" and "audited" in c.__qualname__
            for c in calls
        ), f"{sorted(methods)} {route.path} is not audited"
        audited.add(route.path)
    assert len(audited) >= 11, sorted(audited)


def test_the_bootstrap_is_recorded_as_done_by_the_service(served: Any) -> None:
    (row,) = [r for r in rows(served) if r["action"] == "bootstrap"]
    assert (row["key_id"], row["key_name"], row["target"], row["outcome"]) == (
        None,
        "service",
        "1",
        "ok",
    )
    assert len(row["detail"]["sha256"]) == 64 and row["request_id"] is None


def test_the_trainers_deploys_are_recorded_with_its_key(
    served: Any, key_factory: Any, tiny_checkpoint_factory: Any
) -> None:
    """The trainer acts over HTTP with its deploy-scoped key (trainer/client.py)."""
    token = key_factory("deploy", name="trainer")
    client = ServiceClient(served.url, token)
    mark = last_id(served)
    try:
        version = client.register(tiny_checkpoint_factory(1), parent=1, summary={"steps": 1})
        client.deploy(version, 0.2, reason="trainer: gate passed; canary")
        client.promote(version, reason="trainer: canary held")
        client.rollback(reason="trainer: accept rate fell")
    finally:
        client.close()
    written = rows(served, mark)
    assert [r["action"] for r in written] == ["policy.register", "deploy", "promote", "rollback"]
    assert {(r["key_id"], r["key_name"], r["outcome"]) for r in written} == {
        (token.split("_")[1], "trainer", "ok")
    }
    assert [r["target"] for r in written] == ["2", "2", "2", "2"]
    assert written[-1]["detail"]["reason"] == "trainer: accept rate fell"


# --- refusals ----------------------------------------------------------------------------------

REFUSALS: dict[str, tuple[Callable[[httpx.Client, Any], httpx.Response], str, int, str | None]] = {
    # case: (request, action, status, target)
    "deploy an unknown version": (
        lambda c, ck: c.post("/admin/policies/99/deploy", json={"canary_fraction": 0.1}),
        "deploy",
        404,
        "99",
    ),
    "deploy the live version": (
        lambda c, ck: c.post("/admin/policies/1/deploy", json={"canary_fraction": 1}),
        "deploy",
        409,
        "1",
    ),
    "deploy to too many users": (
        lambda c, ck: c.post("/admin/policies/1/deploy", json={"canary_fraction": 5}),
        "deploy",
        422,
        "1",
    ),
    "promote what is no canary": (
        lambda c, ck: c.post("/admin/policies/1/promote"),
        "promote",
        409,
        "1",
    ),
    "roll back with no previous version": (
        lambda c, ck: c.post("/admin/rollback"),
        "rollback",
        409,
        None,
    ),
    "register a tampered checkpoint": (
        lambda c, ck: upload(c, ck(1), weights=b"not the weights"),
        "policy.register",
        422,
        None,
    ),
    "revoke an unknown key": (
        lambda c, ck: c.delete("/admin/keys/nosuchkey"),
        "key.revoke",
        404,
        "nosuchkey",
    ),
    "make a key with no scope": (
        lambda c, ck: c.post("/admin/keys", json={"name": "x", "scopes": []}),
        "key.create",
        422,
        None,
    ),
    "store a spec whose windows do not fit": (
        lambda c, ck: c.put("/admin/reward-spec", json={"horizon_s": 1}),
        "reward_spec.update",
        422,
        None,
    ),
    "replay a spec that does not exist": (
        lambda c, ck: c.post(
            "/admin/replay",
            json={
                "from": "2026-01-01T00:00:00Z",
                "to": "2026-01-02T00:00:00Z",
                "reward_spec_version": 9,
            },
        ),
        "replay",
        404,
        "9",
    ),
    "replay backwards": (
        lambda c, ck: c.post(
            "/admin/replay", json={"from": "2026-01-02T00:00:00Z", "to": "2026-01-01T00:00:00Z"}
        ),
        "replay",
        422,
        None,
    ),
    "purge a user id too long": (
        lambda c, ck: c.delete("/admin/users/" + "u" * 257),
        "purge",
        422,
        "u" * 257,
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_action_leaves_one_row_with_its_status(
    served: Any, admin: Admin, tiny_checkpoint_factory: Any, case: str
) -> None:
    request, action, status, target = REFUSALS[case]
    mark, deployed = last_id(served), timeline_length(served)
    r = request(admin.http, tiny_checkpoint_factory)
    assert r.status_code == status, r.text
    (row,) = rows(served, mark)
    assert (row["action"], row["outcome"], row["target"]) == (action, str(status), target)
    assert (row["key_id"], row["key_name"]) == (admin.key_id, "ops")
    assert row["request_id"] == r.headers["x-request-id"]
    assert row["detail"]["error"]["code"] == r.json()["error"]["code"]
    assert timeline_length(served) == deployed  # and nothing was deployed


def test_a_key_without_the_scope_is_recorded_and_nothing_else_is(
    served: Any, admin: Admin, key_factory: Any
) -> None:
    ingest = key_factory("ingest", name="vscode")
    mark = last_id(served)
    r = httpx.post(served.url + "/admin/rollback", headers={"Authorization": f"Bearer {ingest}"})
    assert r.status_code == 403
    (row,) = rows(served, mark)
    assert (row["action"], row["outcome"], row["key_id"], row["key_name"]) == (
        "rollback",
        "403",
        ingest.split("_")[1],
        "vscode",
    )
    assert row["detail"]["error"]["code"] == "forbidden"

    # no key, a malformed or unknown one, a revoked one: no admin action, no row
    revoked = admin.http.post("/admin/keys", json={"name": "gone", "scopes": ["admin"]}).json()
    assert admin.http.delete(f"/admin/keys/{revoked['id']}").status_code == 200
    mark = last_id(served)
    for auth in (None, "Bearer garbage", "Bearer tlk_nope_nope", f"Bearer {revoked['token']}"):
        headers = {"Authorization": auth} if auth else {}
        r = httpx.post(served.url + "/admin/training/pause", headers=headers)
        assert r.status_code == 401
    assert rows(served, mark) == []
    # reading is no action
    assert admin.http.get("/admin/audit").status_code == 200
    assert admin.http.get("/admin/policies").status_code == 200
    assert rows(served, mark) == []


@pytest.mark.parametrize("served_overrides", [{"rate_limit_per_s": 0.001, "rate_limit_burst": 2}])
def test_a_key_over_its_rate_limit_writes_no_rows(served: Any, key_factory: Any) -> None:
    ingest = key_factory("ingest")
    mark = last_id(served)
    statuses = [
        httpx.post(
            served.url + "/admin/rollback", headers={"Authorization": f"Bearer {ingest}"}
        ).status_code
        for _ in range(5)
    ]
    assert statuses == [403, 403, 429, 429, 429]
    assert [r["outcome"] for r in rows(served, mark)] == ["403", "403"]


@pytest.mark.parametrize("mode", ["embedded"])
def test_the_action_and_its_row_commit_together(
    served: Any, admin: Admin, tiny_checkpoint_factory: Any
) -> None:
    """When its row cannot be written, the deploy does not happen either: the database refuses
    the row (a trigger here, a full disk or a constraint elsewhere), the transaction rolls back,
    and the failed attempt is recorded by itself."""
    _register(admin, tiny_checkpoint_factory)
    with served.app.state.ctx.engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TRIGGER refuse_deploy_rows BEFORE INSERT ON audit_log "
            "WHEN NEW.action = 'deploy' AND NEW.outcome = 'ok' "
            "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
        )
    mark, deployed = last_id(served), timeline_length(served)
    r = admin.http.post("/admin/policies/2/deploy", json={"canary_fraction": 0.5})
    assert r.status_code == 500
    assert timeline_length(served) == deployed
    (row,) = rows(served, mark)
    assert (row["action"], row["target"], row["outcome"]) == ("deploy", "2", "500")


# --- secrets -----------------------------------------------------------------------------------


def test_no_row_holds_a_token_or_its_secret(
    served: Any, admin: Admin, tiny_checkpoint_factory: Any
) -> None:
    made = admin.http.post("/admin/keys", json={"name": "plugin", "scopes": ["ingest"]}).json()
    token = made["token"]
    secrets = [token.split("_", 2)[2], admin.token.split("_", 2)[2]]
    # tokens pasted where they do not belong: a path, a reason, the request id
    assert admin.http.delete(f"/admin/keys/{token}").status_code == 404
    _register(admin, tiny_checkpoint_factory)
    r = admin.http.post(
        "/admin/policies/2/deploy",
        headers={"X-Request-ID": admin.token},
        json={"canary_fraction": 0.5, "reason": f"by {admin.token}"},
    )
    assert r.status_code == 200
    assert admin.http.delete(f"/admin/keys/{made['id']}").status_code == 200
    everything = json.dumps(rows(served), default=str)
    listed = admin.http.get("/admin/audit").text
    for secret in secrets:
        assert secret not in everything and secret not in listed
    (refused,) = [r for r in rows(served) if r["action"] == "key.revoke" and r["outcome"] == "404"]
    assert refused["target"] == f"tlk_{made['id']}_***"
    (deployed,) = [r for r in rows(served) if r["action"] == "deploy"]
    assert deployed["detail"]["reason"] == f"by tlk_{admin.key_id}_***"
    assert deployed["request_id"] == f"tlk_{admin.key_id}_***"


# --- GET /admin/audit --------------------------------------------------------------------------


def test_pages_newest_first_with_filters(served: Any, admin: Admin, key_factory: Any) -> None:
    other = key_factory("admin", name="other")
    for _ in range(4):
        assert admin.http.post("/admin/training/pause").status_code == 200
        assert (
            httpx.post(
                served.url + "/admin/training/resume", headers={"Authorization": f"Bearer {other}"}
            ).status_code
            == 200
        )
    newest_first = [r["id"] for r in reversed(rows(served))]

    seen: list[int] = []
    before: int | None = None
    while True:
        params: dict[str, Any] = {"limit": 3, **({"before": before} if before else {})}
        page = admin.http.get("/admin/audit", params=params).json()
        assert len(page["entries"]) <= 3
        seen += [e["id"] for e in page["entries"]]
        before = page["next_before"]
        if before is None:
            break
        assert before == seen[-1]
    assert seen == newest_first  # every row once, newest first

    def ids(**params: Any) -> list[int]:
        r = admin.http.get("/admin/audit", params=params)
        assert r.status_code == 200, r.text
        return [e["id"] for e in r.json()["entries"]]

    by_action = admin.http.get("/admin/audit", params={"action": "training.pause"}).json()
    assert {e["action"] for e in by_action["entries"]} == {"training.pause"}
    assert len(by_action["entries"]) == 4
    other_id = other.split("_")[1]
    by_key = admin.http.get("/admin/audit", params={"key_id": other_id}).json()["entries"]
    assert len(by_key) == 4 and {(e["key_name"], e["action"]) for e in by_key} == {
        ("other", "training.resume")
    }
    assert ids(action="training.resume", key_id=admin.key_id) == []
    assert ids(since=(utcnow() + timedelta(hours=1)).isoformat()) == []
    assert ids(since="2000-01-01T00:00:00Z") == newest_first[:100]
    assert ids(since="2000-01-01T00:00:00") == newest_first[:100]  # no zone: UTC
    for bad in (
        {"limit": 0},
        {"limit": 1001},
        {"before": 0},
        {"since": "yesterday"},
        {"since": "1700000000"},
    ):
        assert admin.http.get("/admin/audit", params=bad).status_code == 422, bad


def test_the_log_is_append_only_and_survives_a_purge(served: Any, admin: Admin) -> None:
    for route in endpoints(served.app):
        if getattr(route, "path", "").startswith("/admin/audit"):
            assert set(route.methods) <= {"GET", "HEAD"}, route.path
    before = rows(served)
    assert admin.http.delete("/admin/users/u-42").status_code == 200
    after = rows(served)
    assert after[: len(before)] == before  # no row changed or went away
    assert after[-1]["action"] == "purge" and after[-1]["target"] == "u-42"
    for method in ("DELETE", "PUT", "PATCH", "POST"):
        assert admin.http.request(method, "/admin/audit").status_code == 405
