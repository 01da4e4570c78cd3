"""Block labels: how much of a copy's next lines stands in what the person wrote.

A copy whose proposal goes on with whole lines draws whether to show them too (the lines head,
tabloop.core.policy.sampling). Its rewards say little about that draw: a block is taken a few
dozen times in a run, each verdict a person's coin flip, and only where it was shown. What the
person wrote says more, for every such copy, shown with its lines or without: the workspace
memory holds each person's document as their latest request in the file sent it
(tabloop.core.memory), and once they have written past a rollout's block, the lines after its
cursor say how much of the proposed ones they wrote. `block_labels` reads that (a share from 0
to 1), and trainer.update.lines fits the lines head to it.

Where the rollout's cursor is in today's document: the tail of the prefix it was sampled after
(its logged context, decoded, and the healed bytes), found once and only once. A label is given
once the person has written as many whole lines after the cursor's line as the block holds.
The documents are read, never logged: a label is a number. Privacy-mode requests leave no
document and no rollout the trainer reads, and purging a person deletes both (docs/PRIVACY.md).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from tabloop.core.policy.actions import lines_drawn
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.tables import workspace_code

ANCHOR_CHARS = 96  # the prefix tail that must occur exactly once in the person's document


def prefix_tail(tokenizer: CodeTokenizer, context_ids: Sequence[int], heal_text: str) -> str:
    """The end of the prefix a rollout was sampled after: its context's prefix part, decoded
    (special tokens decode to nothing), and the healed bytes it re-emitted."""
    ids = list(context_ids)
    if tokenizer.fim_ids is not None and ids and ids[0] == tokenizer.fim_ids[0]:
        end = ids.index(tokenizer.fim_ids[1]) if tokenizer.fim_ids[1] in ids else len(ids)
        ids = ids[1:end]
    return tokenizer.decode(ids) + heal_text


def block_label(document: str, tail: str, more: str) -> float | None:
    """How much of `more` (whole lines) stands in the lines after the cursor's line, the cursor
    being after the prefix `tail` in `document` (`stands`), once the document holds as many whole
    lines after the cursor's line as `more` has; None where that cannot be told yet, or where
    the tail is not found exactly once."""
    anchor = tail[-ANCHOR_CHARS:]
    if not anchor or not more:
        return None
    at = document.find(anchor)
    if at < 0 or document.find(anchor, at + 1) >= 0:
        return None
    written = document[at + len(anchor) :].split("\n")[1:]  # the lines after the cursor's
    lines = more.count("\n") + 1
    if len(written) <= lines:  # not written that far yet: its last line is not whole
        return None
    return stands(more, "\n".join(written[:lines]))


def stands(proposed: str, written: str) -> float:
    """How alike the proposed lines and the lines written in their place are: difflib's ratio,
    2 x the characters they share in order / both their lengths (1.0 the same, 0.0 nothing in
    common), each line's indentation and trailing whitespace ignored (two different lines at one
    indentation share no more than two different lines anywhere)."""
    a, b = (_trimmed(t) for t in (proposed, written))
    if a == b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def _trimmed(text: str) -> str:
    return "\n".join(line.strip() for line in text.split("\n"))


def block_labels(
    engine: sa.Engine, tokenizer: CodeTokenizer, rows: Sequence[Any]
) -> list[float | None]:
    """One label per rollout row (block_label; None where the row drew no lines or has no
    document), from its person's latest document of its file in the memory."""
    wanted = [
        i
        for i, r in enumerate(rows)
        if lines_drawn(r) is not None and r.recall.get("more") and r.file_path
    ]
    out: list[float | None] = [None] * len(rows)
    if not wanted:
        return out
    people = sorted({rows[i].user_id for i in wanted})
    paths = sorted({rows[i].file_path for i in wanted})
    docs: dict[tuple[str, str, str], list[str]] = {}
    with engine.connect() as conn:
        for chunk in _chunks(people, 500):
            for d in conn.execute(
                sa.select(
                    workspace_code.c.user_id,
                    workspace_code.c.scope,
                    workspace_code.c.document,
                    workspace_code.c.text,
                ).where(
                    workspace_code.c.user_id.in_(chunk),
                    # a batch's file paths: at most its size, under the bound-parameter limit
                    workspace_code.c.document.in_(paths),
                )
            ):
                docs.setdefault((d.user_id, d.scope, d.document), []).append(d.text)
    for i in wanted:
        r = rows[i]
        texts = docs.get((r.user_id, r.workspace_id or "", r.file_path), [])
        tail = prefix_tail(tokenizer, r.context_token_ids, r.heal_text)
        found = {block_label(t, tail, r.recall["more"]) for t in texts} - {None}
        out[i] = found.pop() if len(found) == 1 else None  # two workspaces that disagree: none
    return out


def _chunks(items: list[str], n: int) -> list[list[str]]:
    return [items[i : i + n] for i in range(0, len(items), n)]
