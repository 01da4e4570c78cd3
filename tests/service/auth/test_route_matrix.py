"""Every route x every kind of key, generated from `app.routes`: a new route cannot skip it.

A route is classified by rule, not by a hand list: the scopes it needs are read from its
`require_scope` dependency (AdminKey, DeployKey, IngestKey in service/deps.py); only the paths in
PUBLIC may have none. A route that is neither fails the test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import fastapi.routing
import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.keys import SCOPES, create_key, revoke_key

# Meant to be reachable without a key: probes, Prometheus, the API docs, the dashboard's page
# and its static files (the dashboard's data comes from admin routes, which need a key).
PUBLIC = {
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/admin/",
    "/admin/static",
}


def required_scopes(dependant: Any, path: str) -> frozenset[str] | None:
    """The scopes a route admits (any one suffices), from its dependency tree; None if none."""
    found: list[frozenset[str]] = []

    def walk(dependant: Any) -> None:
        for dep in dependant.dependencies:
            scopes = getattr(dep.call, "scopes", None)
            if scopes is not None:
                found.append(scopes)
            walk(dep)

    walk(dependant)
    assert len(set(found)) <= 1, f"{path} has several scope checks: {found}"
    return found[0] if found else None


def endpoints(app: Any) -> list[Any]:
    """The app's routes with their effective paths and dependencies (recent FastAPI includes
    routers lazily: `app.routes` then holds the routers, and iter_route_contexts flattens them)."""
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    return list(flatten(app.routes)) if flatten else list(app.routes)


def classify(app: Any) -> Iterator[tuple[str, str, frozenset[str] | None]]:
    """(method, path, scopes) for every endpoint of the app; fails on an unclassifiable route."""
    for route in endpoints(app):
        path, methods = route.path, set(getattr(route, "methods", None) or ())
        dependant = getattr(route, "dependant", None)
        if dependant is None:  # starlette routes: the docs pages, mounted static files
            assert path in PUBLIC, f"{sorted(methods)} {path} is not classified"
            for method in sorted(methods - {"HEAD"}) or ["GET"]:
                yield method, path, None
            continue
        scopes = required_scopes(dependant, path)
        if scopes is None:
            assert path in PUBLIC, (
                f"{sorted(methods)} {path} needs no API key and is not in PUBLIC: "
                "give it AdminKey/DeployKey/IngestKey, or make it public here on purpose"
            )
        else:
            assert path not in PUBLIC, f"{path} is listed PUBLIC but needs {sorted(scopes)}"
        for method in sorted(methods - {"HEAD"}):
            yield method, path, scopes


def concrete(path: str) -> str:
    """A request path for a template: every parameter a value that exists nowhere."""
    return re.sub(r"\{(\w+)(:\w+)?\}", lambda m: "1" if "version" in m[1] else "no-such-id", path)


@pytest.fixture
def keys(engine: sa.Engine) -> dict[str, str]:
    """A token per single scope, one holding every scope, and a revoked every-scope one."""
    out: dict[str, str] = {}
    with engine.begin() as conn:
        for scope in SCOPES:
            out[scope] = create_key(conn, name=scope, scopes=frozenset({scope}))[1]
        out["all"] = create_key(conn, name="all", scopes=frozenset(SCOPES))[1]
        key, out["revoked"] = create_key(conn, name="revoked", scopes=frozenset(SCOPES))
        revoke_key(conn, key.id)
    return out


def test_every_route_is_classified(service: Any) -> None:
    table = list(classify(service.app))
    protected = {(m, p) for m, p, s in table if s is not None}
    # the contract's routes are all there, so the classification is not vacuous
    assert ("POST", "/v1/events") in protected and ("POST", "/v1/complete") in protected
    assert ("POST", "/admin/policies") in protected
    assert ("DELETE", "/admin/keys/{key_id}") in protected
    assert ("GET", "/admin/audit") in protected


def test_route_scope_matrix(service: Any, keys: dict[str, str]) -> None:
    checked = 0
    with httpx.Client(base_url=service.url, timeout=30) as c:
        for method, path, scopes in classify(service.app):
            url = concrete(path)

            def call(auth: str | None, method: str = method, url: str = url) -> httpx.Response:
                headers = {"Authorization": auth} if auth is not None else {}
                return c.request(method, url, headers=headers)

            where = f"{method} {path}"
            if scopes is None:
                r = call(None)
                assert r.status_code not in (401, 403), (where, r.status_code)
                continue
            for auth in (
                None,
                "",
                "Bearer",
                "Bearer garbage",
                "Bearer tlk_nope_nope",
                "Basic " + keys["all"],
                "Bearer " + keys["all"][:-2] + "xx",
                "Bearer " + keys["revoked"],
            ):
                r = call(auth)
                assert r.status_code == 401, (where, auth, r.status_code, r.text)
                assert r.json()["error"]["code"] == "unauthorized"
                assert r.headers.get("WWW-Authenticate") == "Bearer"
            for scope in SCOPES:
                r = call("Bearer " + keys[scope])
                if scope in scopes:
                    assert r.status_code not in (401, 403), (where, scope, r.status_code, r.text)
                else:
                    assert r.status_code == 403, (where, scope, r.status_code, r.text)
                    assert r.json()["error"]["code"] == "forbidden"
            r = call("Bearer " + keys["all"])
            assert r.status_code not in (401, 403), (where, "all", r.status_code, r.text)
            checked += 1
    assert checked >= 15, f"only {checked} protected endpoints found"
