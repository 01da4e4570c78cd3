"""A completion is a rollout: sample it, then record it with its outbox row in one transaction."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
import torch
from starlette.concurrency import run_in_threadpool

from service.completions.schemas import CompleteRequest
from service.deps import AppContext
from service.errors import Unavailable, Unprocessable
from service.events.ingest import store_derived
from service.metrics import COMPLETIONS, UNSUPPORTED_LANGUAGE
from tabloop.core.config import Settings
from tabloop.core.memory import SNIPPETS, remember, typed_through
from tabloop.core.outbox import outbox_row
from tabloop.core.person import History, PersonContext, moment_of, read_history
from tabloop.core.policy.actions import Completion
from tabloop.core.policy.context import following_lines
from tabloop.core.policy.languages import metric_label, request_language, supports
from tabloop.core.policy.sampling import Prompt, unsupported_language
from tabloop.core.privacy import rollout_without_code
from tabloop.core.recall import Text, propose
from tabloop.core.reward_store import default_spec
from tabloop.core.stream.topics import ROLLOUTS
from tabloop.core.tables import outbox, rollouts, utcnow

log = logging.getLogger(__name__)


def prompt_of(
    req: CompleteRequest,
    settings: Settings,
    memory: Text | None = None,
    history: History | Future[History] | None = None,
) -> Prompt:
    """The request as the policy reads it: the bounded prefix and suffix, the token budget,
    a generator of its own, the copy proposal from all of the request's text and from the
    workspace `memory`, and the person and the moment (`history`: what the service recorded of
    the person; None in privacy mode, where the decisions read nothing of them)."""
    return Prompt(
        prefix=req.prefix[-settings.max_prefix_chars :],
        suffix=req.suffix[: settings.max_suffix_chars],
        max_new_tokens=min(req.max_new_tokens, settings.max_new_tokens_limit),
        generator=torch.Generator().manual_seed(int.from_bytes(uuid.uuid4().bytes[:8], "big")),
        proposal=propose(
            req.prefix[-settings.max_recall_chars :],
            request_context(req, settings.max_recall_chars),
            memory,
            more_lines=not req.suffix.split("\n", 1)[0].strip(),  # nothing right of the cursor
        ),
        person=None
        if history is None
        else PersonContext(history, moment_of(req.prefix, req.suffix)),
    )


def person_history(
    ctx: AppContext, req: CompleteRequest, api_key_id: str | None
) -> Future[History] | None:
    """What the service recorded of the person (tabloop.core.person.read_history), read on the
    context's own threads while the model reads the prompt: the decisions wait for it only when
    they are drawn. None in privacy mode or with TABLOOP_PERSON_FEATURES off. A read that fails
    (the database went away) reads as nothing known, logged: the decisions read what they are
    logged with, and the rollout's own write reports the database."""
    settings = ctx.settings
    if req.no_train or not settings.person_features:
        return None
    pending_s = default_spec(settings.profile).decision_window_s

    def read() -> History:
        try:
            with ctx.engine.connect() as conn:
                return read_history(
                    conn,
                    user_id=req.user_id,
                    api_key_id=api_key_id,
                    now=utcnow(),
                    pending_s=pending_s,
                )
        except sa.exc.SQLAlchemyError as e:
            log.warning("person history unavailable, read as nothing known: %s", e)
            return History()

    return ctx.people.submit(read)


def request_context(req: CompleteRequest, budget: int) -> list[str]:
    """The request's text besides the prefix that a proposal may copy from, `budget` characters
    at most: the lines after the cursor's line, then the snippets in the order sent."""
    out = []
    for text in (following_lines(req.suffix), *(s.body for s in req.snippets)):
        if budget <= 0:
            break
        if text:
            out.append(text[:budget])
            budget -= len(out[-1])
    return out


def abstain_for_language(language: str | None, settings: Settings) -> tuple[Completion, float]:
    """A request in a language the policy was not trained on: no model call, an abstention
    recorded like any rollout (stop_reason "language"; the trainer never trains on it)."""
    started = time.perf_counter()
    UNSUPPORTED_LANGUAGE.labels(language=metric_label(language or "")).inc()
    completion = unsupported_language(settings.temperature, settings.top_p)
    return completion, (time.perf_counter() - started) * 1000


def _storable(text: str) -> str:
    """Byte-level tokens can spell NUL, which PostgreSQL text refuses; token ids stay exact."""
    return text.replace("\x00", "\ufffd")


def _storable_recall(recall: dict[str, Any]) -> dict[str, Any]:
    out = {**recall, "text": _storable(recall["text"])}
    if "more" in recall:
        out["more"] = _storable(recall["more"])
    return out


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` up to (not including) the earliest of the `stop` strings; True if one was found.

    The sampled tokens are the action and stay whole; the cut is what a client that asked for
    stop strings is shown, so it is also the rollout's text, which the reward measures."""
    ends = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(ends)], True) if ends else (text, False)


def rollout_record(
    suggestion_id: str,
    req: CompleteRequest,
    version: int,
    c: Completion,
    latency_ms: float,
    text: str | None = None,
    api_key_id: str | None = None,
) -> dict[str, Any]:
    """The rollout as stored and as published on `tabloop.rollouts` (plus schema_version).
    `text`: the suggestion as the client shows it, when that is not all of `c.text`.
    `api_key_id`: the key that asked for it; feedback about it counts only through that key.
    In privacy mode (`req.no_train`) `record_rollout` stores it without its code."""
    stored = _storable(c.text if text is None else text)
    return {
        "suggestion_id": suggestion_id,
        "user_id": req.user_id,
        "session_id": req.session_id,
        "workspace_id": req.workspace_id,
        "language": req.language,
        "file_path": req.file_path,
        "policy_version": version,
        "context_token_ids": c.context_token_ids,
        "heal_text": c.heal_text,  # from the prefix, which is NUL-free
        "token_ids": c.token_ids,
        "token_logprobs": c.token_logprobs,
        "text": stored,
        "text_chars": len(stored),
        "shown": c.shown,
        "recall": None if c.recall is None else _storable_recall(c.recall),
        "person": c.person,
        "extend": c.extend,
        "gate_prob_show": c.gate_prob_show,
        "decision_logprob": c.decision_logprob,
        "logprob_total": c.logprob_total,
        "temperature": c.temperature,
        "top_p": c.top_p,
        "stop_reason": c.stop_reason,
        "latency_ms": round(latency_ms, 3),
        "reports_views": req.reports_views,
        "api_key_id": api_key_id,
        "no_train": req.no_train,
    }


@dataclass(frozen=True)
class Document:
    """What a request leaves in its workspace's memory (tabloop/core/memory.py)."""

    workspace: str
    scope: str | None
    document: str | None
    prefix: str
    suffix: str
    snippets: str  # the editor's snippets, joined ("" when none)


def document_of(req: CompleteRequest, workspace: str | None, settings: Settings) -> Document | None:
    """The request's document as it stands, for its key's workspace; None in privacy mode or
    without a workspace (no key)."""
    if workspace is None or req.no_train:
        return None
    cap = settings.max_recall_chars
    snippets = "\n\n".join(s.body for s in req.snippets)[:cap]
    return Document(
        workspace, req.workspace_id, req.file_path, req.prefix[-cap:], req.suffix[:cap], snippets
    )


def record_rollout(
    engine: sa.Engine,
    record: dict[str, Any],
    *,
    embedded: bool,
    document: Document | None = None,
) -> None:
    """Store the rollout and its `tabloop.rollouts` message in one transaction, with the
    request's `document` in its workspace's memory; in privacy mode the rollout without its
    code and no document (service/privacy.py). In the same transaction, the `typed_through`
    event of the person's previous suggestion in that document, when this request shows they
    typed it (tabloop.core.memory.typed_through): read before the document is replaced, it
    commits with it, and costs the request no second transaction."""
    if record.get("no_train"):
        record, document = rollout_without_code(record), None
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(rollouts.insert().values(created_at=now, **record))
        if document is not None:
            typed = typed_through(
                conn,
                workspace=document.workspace,
                scope=document.scope,
                user_id=record["user_id"],
                document=document.document,
                prefix=document.prefix,
                api_key_id=record["api_key_id"],
            )
            if typed is not None:  # the person typed their previous suggestion: no rejection
                store_derived(
                    conn,
                    [typed],
                    api_key_id=record["api_key_id"],
                    embedded=embedded,
                    source="completions",
                )
            remember(
                conn,
                workspace=document.workspace,
                scope=document.scope,
                user_id=record["user_id"],
                document=document.document,
                prefix=document.prefix,
                suffix=document.suffix,
                suggestion_id=record["suggestion_id"],
            )
            if document.snippets:  # the latest snippets the person's editor sent, in a row apart
                remember(
                    conn,
                    workspace=document.workspace,
                    scope=document.scope,
                    user_id=record["user_id"],
                    document=SNIPPETS,
                    prefix=document.snippets,
                    suffix="",
                )
        conn.execute(
            outbox.insert(),
            [
                outbox_row(
                    ROLLOUTS,
                    record["user_id"],
                    {**record, "created_at": now.isoformat().replace("+00:00", "Z")},
                    now=now,
                    embedded=embedded,
                )
            ],
        )
    COMPLETIONS.labels(
        version=str(record["policy_version"]), shown="true" if record["shown"] else "false"
    ).inc()


@dataclass(frozen=True)
class Served:
    """A recorded rollout, as every completion API answers it."""

    suggestion_id: str
    policy_version: int
    text: str  # empty when the policy abstains
    shown: bool
    latency_ms: float
    # the sampler's ("newline", "eof", "length", "confidence"), "language" when the policy was
    # not trained on the request's language, or "stop_sequence" when one of the client's stop
    # strings cut the text
    stop_reason: str
    context_tokens: int = 0  # prompt tokens the policy read
    sampled_tokens: int = 0  # tokens it sampled (also when it abstained)


async def serve(
    ctx: AppContext,
    req: CompleteRequest,
    *,
    stop: Sequence[str] = (),
    api_key_id: str | None = None,
    workspace: str | None = None,
) -> Served:
    """One rollout of the policy routed for `req.user_id` (live or canary), recorded with its
    outbox row before it is answered. The native, Tabby and OpenAI-style APIs all end here.

    `stop`: strings that end the suggestion for this client (OpenAI's `stop`). The text is cut
    before the earliest one, and the rollout records the cut text: what was shown is what the
    reward measures. The tokens and their log-probabilities are recorded whole.

    `api_key_id`: the requesting key, recorded with the rollout: the suggestion belongs to it,
    and feedback about it counts only through it (service/events/trust.py). `workspace`: the
    key's workspace, whose memory the policy copies from and the request's document joins
    (tabloop/core/memory.py)."""
    settings = ctx.settings
    if req.max_new_tokens > settings.max_new_tokens_limit:
        raise Unprocessable(f"max_new_tokens: at most {settings.max_new_tokens_limit}")
    if not ctx.health.db_usable():
        raise Unavailable(
            "the database is unavailable", headers={"Retry-After": str(settings.retry_after_s)}
        )
    policy = ctx.policies.route(req.user_id)
    language = request_language(req.language, req.file_path)
    if supports(policy.languages, language):
        memory = None if workspace is None else ctx.memory.lookup(workspace, req.workspace_id)
        prompt = prompt_of(req, settings, memory, person_history(ctx, req, api_key_id))
        completion, latency_ms = await ctx.inference.sample(policy, prompt)
    else:
        completion, latency_ms = abstain_for_language(language, settings)
    suggestion_id = str(uuid.uuid4())
    text, cut = cut_at_stop(completion.text, stop)
    record = rollout_record(
        suggestion_id, req, policy.version, completion, latency_ms, text, api_key_id=api_key_id
    )
    await run_in_threadpool(
        record_rollout,
        ctx.engine,
        record,
        embedded=settings.embedded,
        document=document_of(req, workspace, settings),
    )
    return Served(
        suggestion_id=suggestion_id,
        policy_version=policy.version,
        text=record["text"] if completion.shown else "",
        shown=completion.shown,
        latency_ms=latency_ms,
        stop_reason="stop_sequence" if cut else completion.stop_reason,
        context_tokens=len(completion.context_token_ids),
        sampled_tokens=len(completion.token_ids),
    )
