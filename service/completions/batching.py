"""Batched inference: concurrent completions of one policy share their forward passes.

Each inference thread takes the oldest waiting request, then every other request already
waiting (up to `max_batch`, after waiting at most `wait_ms` for more), and samples those of the
same policy together with `complete_batch`: one forward pass over all the prompts, then one per
decoding step (tabloop/core/policy/sampling.py). Requests queue only while every thread is busy, so
a lone request is sampled at once, alone, exactly as before; under load the batches grow with
the queue. Each request keeps its own random generator, and its logged log-probabilities are
those of its own sampling distribution (tested against single-request scoring to 1e-4).

A batch that fails is sampled again one request at a time, so an error stays with the request
that caused it (a retried request draws on from where its generator stopped, so it may not
sample what it would have alone; its logged log-probabilities are still its own).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from service.completions.serving import LoadedPolicy
from service.metrics import COMPLETE_BATCH_SIZE, COMPLETE_QUEUE_SECONDS, COMPLETE_SECONDS
from tabloop.core.policy.actions import Completion
from tabloop.core.policy.sampling import Prompt, complete_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    """How every request of a process is sampled (tabloop.core.config.Settings)."""

    temperature: float
    top_p: float | None
    stop_logprob: float | None


@dataclass
class _Job:
    policy: LoadedPolicy
    prompt: Prompt
    future: asyncio.Future[tuple[Completion, float]]
    loop: asyncio.AbstractEventLoop
    queued: float = field(default_factory=time.perf_counter)


class Batcher:
    """`threads` inference threads serving batches of up to `max_batch` requests."""

    def __init__(
        self, sampling: SamplingSettings, threads: int, max_batch: int, wait_ms: float
    ) -> None:
        assert threads >= 1 and max_batch >= 1 and wait_ms >= 0
        self.sampling = sampling
        self.max_batch = max_batch
        self.wait_s = wait_ms / 1000
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"inference-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    async def sample(self, policy: LoadedPolicy, prompt: Prompt) -> tuple[Completion, float]:
        """The completion and its model time in ms (the batch's; the wait before it is the
        `tabloop_complete_queue_seconds` metric). RuntimeError once closed."""
        if self._closed:
            raise RuntimeError("inference is shut down")
        loop = asyncio.get_running_loop()
        job = _Job(policy, prompt, loop.create_future(), loop)
        self._jobs.put(job)
        return await job.future

    def close(self) -> None:
        """Finish what is queued, then stop the threads; later requests are refused."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()

    # -- the inference threads --------------------------------------------------------------
    def _take(self, first: _Job) -> tuple[list[_Job], bool]:
        """`first` and what else is waiting (up to max_batch); True if a stop was taken."""
        jobs, deadline = [first], time.perf_counter() + self.wait_s
        while len(jobs) < self.max_batch:
            remaining = deadline - time.perf_counter()
            try:
                if remaining > 0:
                    job = self._jobs.get(timeout=remaining)
                else:
                    job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _run(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            jobs, stop = self._take(first)
            groups: dict[int, list[_Job]] = {}
            for job in jobs:  # live and canary requests are sampled by different models
                groups.setdefault(id(job.policy), []).append(job)
            for group in groups.values():
                self._sample(group)
            if stop:
                return

    def _sample(self, jobs: list[_Job]) -> None:
        policy, s = jobs[0].policy, self.sampling
        started = time.perf_counter()
        try:
            completions = complete_batch(
                policy.model,
                policy.tokenizer,
                [j.prompt for j in jobs],
                s.temperature,
                s.top_p,
                stop_logprob=s.stop_logprob,
            )
        except Exception:
            if len(jobs) == 1:
                log.exception("sampling failed")
                _resolve(jobs[0], None, started)
                return
            log.exception("a batch of %d failed; sampling them one at a time", len(jobs))
            for job in jobs:
                self._sample([job])
            return
        COMPLETE_BATCH_SIZE.observe(len(jobs))
        for job, completion in zip(jobs, completions, strict=True):
            _resolve(job, completion, started)


def _resolve(job: _Job, completion: Completion | None, started: float) -> None:
    """Hand the result to the request's event loop. The latency is the batch's model time (what
    `complete` alone measured); the wait before it is `tabloop_complete_queue_seconds`."""
    model_s = time.perf_counter() - started
    COMPLETE_QUEUE_SECONDS.observe(max(0.0, started - job.queued))
    if completion is not None:
        COMPLETE_SECONDS.observe(model_s)

    def settle() -> None:
        if job.future.done():  # the request was cancelled (client gone)
            return
        if completion is None:
            job.future.set_exception(RuntimeError("sampling failed"))
        else:
            job.future.set_result((completion, model_s * 1000))

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the request's event loop is gone (shutting down): nobody waits
        log.debug("a completion finished after its event loop closed")
