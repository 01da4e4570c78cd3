"""Looking for code text: markers in every table, topic and file, and a policy that shows.

Shared by the privacy-mode and code-retention tests: code sent with distinctive markers is
searched for as text, inside JSON, and inside any list of token ids (decoded with the policy's
tokenizer), in every column of every table the database has, in the Kafka topics, and in the
SQLite files themselves."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import sqlalchemy as sa
import torch

from service.relay import Relay
from tabloop.core.db import make_engine
from tabloop.core.policy.checkpoint import save_checkpoint
from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.stream.topics import ALL_TOPICS
from tabloop.core.tables import outbox, utcnow
from tabloop.testing.factories import event
from tabloop.testing.kafka import consume_all


def showing_checkpoint(tokenizer: CodeTokenizer, out: Path) -> Path:
    """A tiny random policy whose gate shows every non-empty suggestion, saved under `out`."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
    )
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.gate.features.weight.zero_()
        model.gate.features.bias.fill_(30.0)
    return save_checkpoint(
        out, model, tokenizer, version=0, parent=None, summary={"gate": "shows"}, overwrite=True
    )


class Markers:
    """Distinctive code: the prefix's last identifiers (so the policy's context holds them), a
    suffix, and settled text."""

    def __init__(self, tag: str) -> None:
        h = uuid.uuid4().hex[:10]
        self.prefix, self.suffix, self.settled = (f"{tag}pfx{h}", f"{tag}sfx{h}", f"{tag}stl{h}")
        self.all = (self.prefix, self.suffix, self.settled)

    def code(self) -> tuple[str, str]:
        return (
            f"import os\n\n\ndef {self.prefix}(path):\n    return {self.prefix}",
            f"(path)\n    # {self.suffix}\n",
        )


def now_rfc3339() -> str:
    return utcnow().isoformat().replace("+00:00", "Z")


def client_for(served: Any, token: str, **headers: str) -> httpx.Client:
    return httpx.Client(
        base_url=served.url, timeout=30, headers={"Authorization": f"Bearer {token}", **headers}
    )


def complete_everywhere(
    c: httpx.Client, user: str, m: Markers, tabby: bool = True, **body: Any
) -> list[tuple[str, str, str]]:
    """One completion through each API: (api, suggestion id, text shown)."""
    prefix, suffix = m.code()
    native = c.post(
        "/v1/complete",
        json={"user_id": user, "prefix": prefix, "suffix": suffix, "max_new_tokens": 8, **body},
    )
    oa = c.post(
        "/openai/v1/completions",
        json={"prompt": prefix, "suffix": suffix, "max_tokens": 8, "user": user, **body},
    )
    for r in (native, oa):
        assert r.status_code == 200, r.text
    made = [
        ("native", native.json()["suggestion_id"], native.json()["text"]),
        ("openai", oa.json()["id"], oa.json()["choices"][0]["text"]),
    ]
    if tabby:
        t = c.post(
            "/tabby/v1/completions",
            json={
                "language": "python",
                "user": user,
                "segments": {"prefix": prefix, "suffix": suffix},
            },
        )
        assert t.status_code == 200, t.text
        choices = t.json()["choices"]
        made.append(
            ("tabby", t.json()["id"].removeprefix("cmpl-"), choices[0]["text"] if choices else "")
        )
    return made


def send_feedback(c: httpx.Client, user: str, m: Markers, made: list[tuple[str, str, str]]) -> None:
    """An accept (a Tabby select for Tabby's), settled text, and a settled text too long to
    take (dead-lettered, raw) about every suggestion, through the key that asked for it."""
    batch = []
    for api, sid, text in made:
        if api == "tabby" and text:
            r = c.post(
                "/tabby/v1/events",
                json={"type": "select", "completion_id": f"cmpl-{sid}", "choice_index": 0},
            )
            assert r.status_code == 202 and r.json()["accepted"] == 1, r.text
        elif text:  # shown (an empty suggestion is not): accepted whole
            batch.append(
                event(
                    "accept",
                    user_id=user,
                    suggestion_id=sid,
                    occurred_at=now_rfc3339(),
                    accepted_chars=None,
                )
            )
        batch += [
            event(
                "code_settled",
                user_id=user,
                suggestion_id=sid,
                occurred_at=now_rfc3339(),
                text=f"return {m.settled}(path)",
            ),
            event(
                "code_settled",
                user_id=user,
                suggestion_id=sid,
                occurred_at=now_rfc3339(),
                text=f"{m.settled} " + "x" * 1000,
            ),
        ]
    r = c.post("/v1/events", json={"events": batch})
    assert r.status_code == 202, r.text
    assert [x["index"] for x in r.json()["rejected"]] == [
        i for i, e in enumerate(batch) if len(e.get("text", "")) > 1000
    ], r.json()


def publish(settings: Any, engine: sa.Engine) -> None:
    """Full mode: run the relay until the outbox is drained."""
    stop = threading.Event()
    relay = Relay(settings, make_engine(settings))
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 90
        while True:
            with engine.connect() as conn:
                left = conn.execute(
                    sa.select(sa.func.count())
                    .select_from(outbox)
                    .where(outbox.c.published_at.is_(None))
                ).scalar_one()
            if left == 0:
                return
            assert time.monotonic() < deadline, "the relay did not drain the outbox"
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(timeout=60)


def found_in(value: Any, markers: tuple[str, ...], tokenizer: CodeTokenizer) -> set[str]:
    """The markers in a stored value: in its text, in its JSON, or in a list of token ids
    (decoded)."""
    if value is None or isinstance(value, bool | int | float):
        return set()
    if isinstance(value, bytes | memoryview):
        data = bytes(value)
        return {m for m in markers if m.encode() in data}
    if isinstance(value, str):
        hits = {m for m in markers if m in value}
        if value[:1] in "[{":
            with contextlib.suppress(orjson.JSONDecodeError):
                hits |= found_in(orjson.loads(value), markers, tokenizer)
        return hits
    if isinstance(value, dict):
        return set().union(*(found_in(v, markers, tokenizer) for v in value.values()), set())
    if isinstance(value, list):
        if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            if all(0 <= v < tokenizer.vocab_size for v in value):
                decoded = tokenizer.decode_bytes(value).decode("utf-8", errors="replace")
                return {m for m in markers if m in decoded}
            return set()
        return set().union(*(found_in(v, markers, tokenizer) for v in value), set())
    return found_in(str(value), markers, tokenizer)


def in_database(
    engine: sa.Engine, markers: tuple[str, ...], tokenizer: CodeTokenizer
) -> dict[str, set[str]]:
    """table.column -> the markers found there, over every table the database has."""
    found: dict[str, set[str]] = {}
    meta = sa.MetaData()
    meta.reflect(engine)
    with engine.connect() as conn:
        for table in meta.sorted_tables:
            for row in conn.execute(sa.select(table)).mappings():
                for column, value in row.items():
                    hits = found_in(value, markers, tokenizer)
                    if hits:
                        found.setdefault(f"{table.name}.{column}", set()).update(hits)
    return found


def in_topics(
    settings: Any, markers: tuple[str, ...], tokenizer: CodeTokenizer
) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for topic in ALL_TOPICS:
        for record in consume_all(settings.kafka_bootstrap_servers, topic, timeout_s=30):
            hits = found_in(record.value.decode(), markers, tokenizer)
            if hits:
                found.setdefault(topic, set()).update(hits)
    return found


def in_files(data_dir: Path, markers: tuple[str, ...]) -> set[str]:
    """Markers anywhere in the SQLite files, free pages and the write-ahead log included."""
    found: set[str] = set()
    for path in data_dir.glob("tabloop.db*"):
        data = path.read_bytes()
        found |= {m for m in markers if m.encode() in data}
    return found
