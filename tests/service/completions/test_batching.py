"""Batched inference (service/completions/batching.py): concurrent requests are sampled
together, each as it would have been alone, and a failing batch fails no other request."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch

from service.completions.batching import Batcher, SamplingSettings
from service.completions.serving import LoadedPolicy
from tabloop.core.policy.actions import Completion
from tabloop.core.policy.model import GPT
from tabloop.core.policy.sampling import Prompt, complete
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer

SAMPLING = SamplingSettings(temperature=0.7, top_p=0.95, stop_logprob=None)


def _prompts(small_code: list[str], n: int) -> list[tuple[str, int]]:
    rng = random.Random(11)
    out = []
    for _ in range(n):
        text = rng.choice(small_code)
        out.append((text[: rng.randint(1, len(text) - 1)], rng.randint(1, 16)))
    return out


async def _all(batcher: Batcher, jobs: list[tuple[LoadedPolicy, Prompt]]) -> list[Completion]:
    results = await asyncio.gather(*(batcher.sample(policy, p) for policy, p in jobs))
    return [c for c, _ in results]


def _alone(policy: LoadedPolicy, prefix: str, budget: int, seed: int) -> Completion:
    return complete(
        policy.model,
        policy.tokenizer,
        prefix,
        "",
        budget,
        SAMPLING.temperature,
        SAMPLING.top_p,
        torch.Generator().manual_seed(seed),
        stop_logprob=None,
    )


def test_concurrent_requests_are_batched_and_sampled_as_alone(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """Two policies (live and canary) and 40 requests at once on one thread: they queue, are
    taken in batches of at most 8, each policy's apart, and each request gets what it would have
    got alone with its generator; the logged log-probs are the recomputed ones."""
    live = LoadedPolicy(1, tiny_model, tiny_tokenizer)
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        other.gate.features.bias.add_(1.0)
    canary = LoadedPolicy(2, other, tiny_tokenizer)
    prompts = _prompts(small_code, 40)
    jobs = [
        (live if i % 3 else canary, Prompt(prefix, "", budget, torch.Generator().manual_seed(i)))
        for i, (prefix, budget) in enumerate(prompts)
    ]
    sizes: list[tuple[int, int]] = []  # (requests, policies) of each batch sampled

    class Recording(Batcher):
        def _sample(self, group: list) -> None:  # type: ignore[type-arg]
            sizes.append((len(group), len({id(j.policy) for j in group})))
            super()._sample(group)

    batcher = Recording(SAMPLING, threads=1, max_batch=8, wait_ms=5)
    try:
        got = asyncio.run(_all(batcher, jobs))
    finally:
        batcher.close()
    assert max(n for n, _ in sizes) > 1 and all(n <= 8 for n, _ in sizes)  # batched, capped
    assert all(policies == 1 for _, policies in sizes)  # one policy per batch
    assert sum(n for n, _ in sizes) == 40
    for i, ((policy, _), c) in enumerate(zip(jobs, got, strict=True)):
        want = _alone(policy, prompts[i][0], prompts[i][1], i)
        assert (c.token_ids, c.shown, c.text) == (want.token_ids, want.shown, want.text)
        assert c.logprob_total == pytest.approx(want.logprob_total, abs=1e-4)
    for policy in (live, canary):
        mine = [c for (p, _), c in zip(jobs, got, strict=True) if p is policy]
        with torch.no_grad():
            total = score_actions(policy.model, policy.tokenizer, mine).total
        torch.testing.assert_close(
            total, torch.tensor([c.logprob_total for c in mine]), atol=1e-4, rtol=0
        )


def test_a_failing_batch_fails_only_its_bad_request(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """A request the model cannot sample (max_new_tokens 0 trips an assertion) in a batch of
    good ones: the batch is retried one request at a time, the good ones are answered."""
    policy = LoadedPolicy(1, tiny_model, tiny_tokenizer)
    prompts = [
        Prompt(prefix, "", budget, torch.Generator().manual_seed(i))
        for i, (prefix, budget) in enumerate(_prompts(small_code, 6))
    ]
    prompts[3] = Prompt(prompts[3].prefix, "", 0, torch.Generator().manual_seed(3))
    batcher = Batcher(SAMPLING, threads=1, max_batch=8, wait_ms=20)

    async def run() -> list[object]:
        return await asyncio.gather(
            *(batcher.sample(policy, p) for p in prompts), return_exceptions=True
        )

    try:
        results = asyncio.run(run())
    finally:
        batcher.close()
    assert isinstance(results[3], RuntimeError)
    assert all(
        isinstance(r, tuple) and isinstance(r[0], Completion)
        for i, r in enumerate(results)
        if i != 3
    )


def test_close_finishes_what_is_queued(tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    policy = LoadedPolicy(1, tiny_model, tiny_tokenizer)
    batcher = Batcher(SAMPLING, threads=2, max_batch=4, wait_ms=0)

    async def run() -> list[tuple[Completion, float]]:
        prompt = Prompt("def f(x):\n    return ", "", 4)
        tasks = [asyncio.ensure_future(batcher.sample(policy, prompt)) for _ in range(10)]
        await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    batcher.close()
    assert len(results) == 10 and all(ms >= 0 for _, ms in results)


def test_a_closed_batcher_refuses(tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    batcher = Batcher(SAMPLING, threads=1, max_batch=4, wait_ms=0)
    batcher.close()
    policy = LoadedPolicy(1, tiny_model, tiny_tokenizer)
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(batcher.sample(policy, Prompt("x = ", "", 4)))
