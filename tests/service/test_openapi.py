"""The OpenAPI document: every admin operation is described, with examples of its bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.app import create_app
from tests.service.conftest import make_settings

METHODS = ("get", "post", "put", "patch", "delete")


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _has_example(doc: dict[str, Any], media: dict[str, Any]) -> bool:
    """An example on the media type, or on its schema (through a $ref, an optional body's
    anyOf, or a list's items)."""
    if "example" in media or "examples" in media:
        return True
    schema = _resolve(doc, media.get("schema", {}))
    options = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    for option in options:
        option = _resolve(doc, option)
        if option.get("type") == "array":
            option = _resolve(doc, option.get("items", {}))
        if "example" in option or "examples" in option:
            return True
    return False


def test_every_admin_operation_has_a_description_and_body_examples(tmp_path: Path) -> None:
    doc = create_app(make_settings(tmp_path)).openapi()
    missing: list[str] = []
    admin = {p: ops for p, ops in doc["paths"].items() if p.startswith("/admin")}
    assert "/admin/users/{user_id}" in admin and "/admin/keys" in admin
    for path, ops in admin.items():
        for method in METHODS:
            if method not in ops:
                continue
            op, where = ops[method], f"{method.upper()} {path}"
            if not op.get("summary") or not op.get("description"):
                missing.append(f"{where}: summary and description")
            body = op.get("requestBody")
            if body is not None:
                for kind, media in body["content"].items():
                    if not _has_example(doc, media):
                        missing.append(f"{where}: an example of the {kind} request body")
            for status, response in op.get("responses", {}).items():
                if not status.startswith("2") or "content" not in response:
                    continue
                media = response["content"].get("application/json")  # not an HTML page
                if media is not None and not _has_example(doc, media):
                    missing.append(f"{where}: an example of the {status} response")
    assert not missing, "\n".join(missing)
