"""A completion is a rollout: sample it, then record it with its outbox row in one transaction."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
import torch
from starlette.concurrency import run_in_threadpool

from service.completions.schemas import CompleteRequest
from service.completions.serving import LoadedPolicy
from service.config import Settings
from service.deps import AppContext
from service.errors import Unavailable, Unprocessable
from service.metrics import COMPLETE_SECONDS, COMPLETIONS
from service.outbox import outbox_row
from service.policy.sampling import Completion, complete
from service.stream.topics import ROLLOUTS
from service.tables import outbox, rollouts, utcnow


def sample(
    policy: LoadedPolicy, req: CompleteRequest, settings: Settings
) -> tuple[Completion, float]:
    """Run the policy on the bounded context; returns the completion and its latency in ms."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(int.from_bytes(uuid.uuid4().bytes[:8], "big"))
    completion = complete(
        policy.model,
        policy.tokenizer,
        prefix=req.prefix[-settings.max_prefix_chars :],
        suffix=req.suffix[: settings.max_suffix_chars],
        max_new_tokens=min(req.max_new_tokens, settings.max_new_tokens_limit),
        temperature=settings.temperature,
        top_p=settings.top_p,
        generator=generator,
        stop_logprob=settings.stop_logprob,
    )
    elapsed = time.perf_counter() - started
    COMPLETE_SECONDS.observe(elapsed)
    return completion, elapsed * 1000


def _storable(text: str) -> str:
    """Byte-level tokens can spell NUL, which PostgreSQL text refuses; token ids stay exact."""
    return text.replace("\x00", "\ufffd")


def rollout_record(
    suggestion_id: str, req: CompleteRequest, version: int, c: Completion, latency_ms: float
) -> dict[str, Any]:
    """The rollout as stored and as published on `tabloop.rollouts` (plus schema_version)."""
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
        "text": _storable(c.text),
        "shown": c.shown,
        "gate_prob_show": c.gate_prob_show,
        "decision_logprob": c.decision_logprob,
        "logprob_total": c.logprob_total,
        "temperature": c.temperature,
        "top_p": c.top_p,
        "stop_reason": c.stop_reason,
        "latency_ms": round(latency_ms, 3),
    }


def record_rollout(engine: sa.Engine, record: dict[str, Any], *, embedded: bool) -> None:
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(rollouts.insert().values(created_at=now, **record))
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
    stop_reason: str


async def serve(ctx: AppContext, req: CompleteRequest) -> Served:
    """One rollout of the policy routed for `req.user_id` (live or canary), recorded with its
    outbox row before it is answered. The native, Tabby and OpenAI-style APIs all end here."""
    settings = ctx.settings
    if req.max_new_tokens > settings.max_new_tokens_limit:
        raise Unprocessable(f"max_new_tokens: at most {settings.max_new_tokens_limit}")
    if not ctx.health.db_usable():
        raise Unavailable(
            "the database is unavailable", headers={"Retry-After": str(settings.retry_after_s)}
        )
    policy = ctx.policies.route(req.user_id)
    loop = asyncio.get_running_loop()
    completion, latency_ms = await loop.run_in_executor(
        ctx.inference, sample, policy, req, settings
    )
    suggestion_id = str(uuid.uuid4())
    record = rollout_record(suggestion_id, req, policy.version, completion, latency_ms)
    await run_in_threadpool(record_rollout, ctx.engine, record, embedded=settings.embedded)
    return Served(
        suggestion_id=suggestion_id,
        policy_version=policy.version,
        text=record["text"] if completion.shown else "",
        shown=completion.shown,
        latency_ms=latency_ms,
        stop_reason=completion.stop_reason,
    )
