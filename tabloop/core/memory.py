"""The workspace memory: the code a workspace's editors sent, searchable for copy proposals.

What it holds. Every API key belongs to one workspace (`tabloop keys create --workspace`; by
default the key's own). Each completion request of a key that may be trained on leaves its
document as it stood, the prefix and the suffix joined (capped at TABLOOP_MAX_RECALL_CHARS
each), in `workspace_code`: one row per (workspace, scope, person, file path), the latest
replacing the one before. The row remembers that request's suggestion and cursor: an `accept` of
it puts the accepted text at the cursor, and a `code_settled` report puts its text there in
place of the rest of the cursor's line (`settle`), until the person's next request in the file
replaces the row with the document as it then stands. The editor's snippets (`snippets`; Tabby's
declarations, snippets of changed files and clipboard) of a person's latest request that sent
any are a row of their own (document SNIPPETS). Nothing from a `no_train` key or request
is written; `DELETE /admin/users/{id}` deletes the person's rows; TABLOOP_CODE_RETENTION_DAYS
deletes rows not written for that long.

What a request reads. The memory of its key's workspace: all of its rows, or, when the request
names a `workspace_id` (Tabby: `git_url`), only the rows written under that name. The name
narrows what is read, never widens it: rows of another workspace are never read.

Bounds, and what one person can do. A memory reads each person's newest documents up to
TABLOOP_MEMORY_PERSON_BYTES, and the workspace's newest up to TABLOOP_MEMORY_WORKSPACE_BYTES;
older ones are left out (evicted) until written again. A match's occurrences count once per
person (tabloop.core.recall.Text's owners): someone who pastes a line ten thousand times weighs
as one occurrence of it, so the copy head sees one person's word, never a crowd's. And a
proposal from the memory needs a match of at least 16 bytes of the text before the cursor
(tabloop.core.recall.MIN_MATCH): a person's text is proposed only where a teammate's cursor
follows the same text.

Freshness. Each API process keeps, for every workspace (and scope) asked about in the last hour,
a suffix-array index of it (tabloop.core.recall.Text), and a background thread rebuilds one when
its rows changed (their count or newest write), checked every TABLOOP_MEMORY_REFRESH_S seconds.
Every process reads the same table, in PostgreSQL in full mode, so every API process sees the
same memory within about that time, and a restart rebuilds it from the table. Requests never
wait for a build: until the first one is done, a workspace's requests propose from their own
text only.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from tabloop.core.recall import SEPARATOR, Text
from tabloop.core.tables import rollouts, utcnow, workspace_code

log = logging.getLogger(__name__)

IDLE_S = 3600.0  # a workspace nobody asked about for this long is dropped from memory

Key = tuple[str, str | None]  # (workspace, scope or None for all of it)


SETTLING = ("accept", "code_settled")  # the feedback whose text joins a document
SNIPPETS = "<snippets>"  # the document of a person's latest snippets


def remember(
    conn: sa.Connection,
    *,
    workspace: str,
    scope: str | None,
    user_id: str,
    document: str | None,
    prefix: str,
    suffix: str,
    suggestion_id: str | None = None,
) -> None:
    """Write (or replace) a person's document in the workspace's memory: `prefix` + `suffix`,
    the cursor between them, for the request whose rollout is `suggestion_id`."""
    prefix, suffix = prefix.replace("\x00", ""), suffix.replace("\x00", "")
    line = suffix.find("\n")
    values = {
        "workspace": workspace,
        "scope": scope or "",
        "user_id": user_id,
        "document": document or "",
        "text": prefix + suffix,
        "updated_at": utcnow(),
        "suggestion_id": suggestion_id,
        "cursor_at": len(prefix),
        "line_end": len(prefix) + (len(suffix) if line < 0 else line),
        "prefix_tail": prefix[-(TYPED_ANCHOR_CHARS + 1) :],
    }
    dialect = sqlite if conn.dialect.name == "sqlite" else postgresql
    stmt = dialect.insert(workspace_code).values(**values)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["workspace", "scope", "user_id", "document"],
            set_={
                k: stmt.excluded[k]
                for k in (
                    "text",
                    "updated_at",
                    "suggestion_id",
                    "cursor_at",
                    "line_end",
                    "prefix_tail",
                )
            },
        )
    )


# Typed through: the person's next request in the same file shows what they typed after the
# cursor. A shown suggestion they typed themselves (its first line whole, or at least half of
# it, and nothing that disagrees with it) was no rejection (docs/REWARD.md, Typed through).
TYPED_THROUGH_WITHIN_S = 600.0  # a request this long after the suggestion is not compared
TYPED_ANCHOR_CHARS = 256  # the tail of the earlier prefix that the next one must contain
TYPED_THROUGH_NAMESPACE = uuid.UUID("8f0a5c3e-2d41-4b7a-9e6c-1a2b3c4d5e6f")  # uuid5 event ids


def typed_since(before: str, now: str) -> str | None:
    """What was typed at the end of prefix `before` to make prefix `now` (both may be cut to
    their last characters); None when `now` does not continue `before`."""
    if len(before) <= TYPED_ANCHOR_CHARS:
        return now[len(before) :] if now.startswith(before) else None
    tail = before[-TYPED_ANCHOR_CHARS:]
    at = now.rfind(tail)
    return None if at < 0 else now[at + len(tail) :]


def typed_chars(suggestion: str, typed: str) -> int:
    """How many characters of the suggestion's first line the person typed themselves: the
    whole line when `typed` begins with it, the typed part when `typed` is a prefix of the
    line at least half as long as it, else 0 (they wrote something else, or too little)."""
    line = suggestion.split("\n", 1)[0]
    if not line or not typed:
        return 0
    if typed.startswith(line):
        return len(line)
    return len(typed) if line.startswith(typed) and 2 * len(typed) >= len(line) else 0


def typed_through(
    conn: sa.Connection,
    *,
    workspace: str,
    scope: str | None,
    user_id: str,
    document: str | None,
    prefix: str,
    api_key_id: str | None,
) -> dict[str, Any] | None:
    """The `typed_through` event of the person's previous shown suggestion in this document,
    when `prefix` (their new request's) shows they typed it themselves; None otherwise. Read
    before `remember` replaces the row."""
    now = utcnow()
    row = conn.execute(
        sa.select(
            workspace_code.c.prefix_tail,
            rollouts.c.suggestion_id,
            rollouts.c.text.label("suggested"),
        )
        .join(rollouts, rollouts.c.suggestion_id == workspace_code.c.suggestion_id)
        .where(
            workspace_code.c.workspace == workspace,
            workspace_code.c.scope == (scope or ""),
            workspace_code.c.user_id == user_id,
            workspace_code.c.document == (document or ""),
            rollouts.c.shown,
            rollouts.c.created_at >= now - timedelta(seconds=TYPED_THROUGH_WITHIN_S),
            rollouts.c.api_key_id.is_not_distinct_from(api_key_id),
        )
    ).first()
    if row is None or row.prefix_tail is None or not row.suggested:
        return None  # (no tail: a row written before the tail was kept)
    typed = typed_since(row.prefix_tail, prefix.replace("\x00", ""))
    chars = typed_chars(row.suggested, typed or "")
    if not chars:
        return None
    return {
        "event_id": str(uuid.uuid5(TYPED_THROUGH_NAMESPACE, row.suggestion_id)),
        "type": "typed_through",
        "user_id": user_id,
        "suggestion_id": row.suggestion_id,
        "occurred_at": now.isoformat().replace("+00:00", "Z"),
        "typed_chars": chars,
    }


def settle(conn: sa.Connection, feedback: list[dict[str, Any]]) -> int:
    """Put the text of stored `accept` and `code_settled` events (in batch order) into the
    documents whose latest request they are about; the documents changed. An accept inserts
    the suggestion's accepted characters at the cursor; a settled report's text replaces what
    stood from the cursor to the end of its line (a withheld text, None, changes nothing).
    Only the rollout's own person's feedback counts (the trust checks refuse the rest first).
    A read, then a write: of two batches about one document at the same moment, the later write
    wins (the memory is derived from what is stored; the events themselves are all kept)."""
    about = [e for e in feedback if e["type"] in SETTLING and e.get("suggestion_id")]
    if not about:
        return 0
    ids = list({e["suggestion_id"] for e in about})
    rows = conn.execute(
        sa.select(
            workspace_code.c.id,
            workspace_code.c.user_id,
            workspace_code.c.suggestion_id,
            workspace_code.c.text,
            workspace_code.c.cursor_at,
            workspace_code.c.line_end,
            rollouts.c.text.label("suggested"),
            rollouts.c.shown,
        )
        .join(rollouts, rollouts.c.suggestion_id == workspace_code.c.suggestion_id)
        .where(workspace_code.c.suggestion_id.in_(ids))
    ).all()
    docs = {r.suggestion_id: r for r in rows}
    changed: dict[int, dict[str, Any]] = {}
    for e in about:
        row = docs.get(e["suggestion_id"])
        if row is None or row.user_id != e["user_id"] or row.cursor_at is None:
            continue
        if e["type"] == "accept":
            if not row.shown:
                continue
            chars = e.get("accepted_chars")
            insert = row.suggested if chars is None else row.suggested[:chars]
        else:
            insert = e.get("text")
            if insert is None:
                continue
        doc = changed.get(row.id, {"text": row.text, "line_end": row.line_end})
        at = row.cursor_at
        changed[row.id] = {
            "text": doc["text"][:at] + insert + doc["text"][doc["line_end"] :],
            "line_end": at + len(insert),
        }
    if changed:
        now = utcnow()
        conn.execute(
            workspace_code.update()
            .where(workspace_code.c.id == sa.bindparam("row_id"))
            .values(
                text=sa.bindparam("new_text"),
                line_end=sa.bindparam("new_line_end"),
                updated_at=now,
            ),
            [
                {"row_id": i, "new_text": d["text"], "new_line_end": d["line_end"]}
                for i, d in changed.items()
            ],
        )
    return len(changed)


def forget_user(conn: sa.Connection, user_id: str) -> int:
    """Delete what a person contributed; the rows removed."""
    return conn.execute(workspace_code.delete().where(workspace_code.c.user_id == user_id)).rowcount


def expire(conn: sa.Connection, cutoff: object) -> int:
    """Delete documents last written before `cutoff`; the rows removed."""
    return conn.execute(
        workspace_code.delete().where(workspace_code.c.updated_at < cutoff)
    ).rowcount


@dataclass(frozen=True)
class Built:
    """One workspace's (or scope's) index, and what it was built from."""

    text: Text
    fingerprint: tuple[int, object]  # (rows, newest updated_at) when it was built
    documents: int
    people: int


def _where(key: Key) -> list[sa.ColumnElement[bool]]:
    workspace, scope = key
    out = [workspace_code.c.workspace == workspace]
    if scope is not None:
        out.append(workspace_code.c.scope == scope)
    return out


def build(conn: sa.Connection, key: Key, person_bytes: int, workspace_bytes: int) -> Built:
    """The index of a workspace's documents, newest first within the per-person and workspace
    byte caps (module docstring); each document's bytes are owned by its person."""
    rows = conn.execute(
        sa.select(workspace_code.c.user_id, workspace_code.c.text, workspace_code.c.updated_at)
        .where(*_where(key))
        .order_by(workspace_code.c.updated_at.desc(), workspace_code.c.id.desc())
    ).all()
    fingerprint = (len(rows), rows[0].updated_at if rows else None)
    per_person: dict[str, int] = {}
    total, kept = 0, []
    for r in rows:
        data = r.text.encode("utf-8")
        used = per_person.get(r.user_id, 0)
        if used + len(data) > person_bytes or total + len(data) > workspace_bytes:
            continue
        per_person[r.user_id] = used + len(data)
        total += len(data)
        kept.append((r.user_id, data))
    kept.reverse()  # oldest first: the nearest occurrence of a match is the newest document
    people = sorted({u for u, _ in kept})
    owner_of = {u: i for i, u in enumerate(people)}
    starts, owners, chunks, at = [], [], [], 0
    for user_id, data in kept:
        starts.append(at)
        owners.append(owner_of[user_id])
        chunks.append(data)
        at += len(data) + len(SEPARATOR)
    text = Text(SEPARATOR.join(chunks), starts, owners)
    return Built(text, fingerprint, len(kept), len(people))


def fingerprint(conn: sa.Connection, key: Key) -> tuple[int, object]:
    row = conn.execute(
        sa.select(sa.func.count(), sa.func.max(workspace_code.c.updated_at)).where(*_where(key))
    ).one()
    return int(row[0]), row[1]


class WorkspaceMemory:
    """The API process's indexes of the workspaces it was asked about (module docstring)."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        refresh_s: float,
        person_bytes: int,
        workspace_bytes: int,
    ) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self.person_bytes, self.workspace_bytes = person_bytes, workspace_bytes
        self._built: dict[Key, Built] = {}
        self._asked: dict[Key, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def lookup(self, workspace: str, scope: str | None = None) -> Text | None:
        """The index to propose from for a request of `workspace` naming `scope`, if built."""
        key = (workspace, scope or None)
        self._asked[key] = time.monotonic()
        built = self._built.get(key)
        if built is None:
            self._wake.set()  # build it now rather than at the next refresh
            return None
        return built.text

    def refresh(self) -> None:
        """One pass: drop idle workspaces, rebuild the ones whose rows changed."""
        now = time.monotonic()
        for key, asked in list(self._asked.items()):
            if now - asked > IDLE_S:
                self._asked.pop(key, None)
                self._built.pop(key, None)
                continue
            with self.engine.connect() as conn:
                current = self._built.get(key)
                if current is not None and fingerprint(conn, key) == current.fingerprint:
                    continue
                started = time.perf_counter()
                built = build(conn, key, self.person_bytes, self.workspace_bytes)
            self._built[key] = built
            log.info(
                "workspace memory built",
                extra={
                    "workspace": key[0],
                    "scope": key[1],
                    "documents": built.documents,
                    "people": built.people,
                    "bytes": len(built.text),
                    "seconds": round(time.perf_counter() - started, 3),
                },
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except sa.exc.SQLAlchemyError as e:  # the database is down: try again next time
                log.warning("workspace memory refresh failed: %s", e)
            self._wake.wait(self.refresh_s)
            self._wake.clear()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="workspace-memory", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
