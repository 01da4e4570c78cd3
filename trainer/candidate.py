"""One candidate policy from one batch: the trainer's step, with no database, clock or HTTP.

The trainer (trainer/loop.py) reads the batch from the database, calls `train_candidate`, runs
the deploy check and deploys; benchmarks/learning.py calls the same step on rollouts it
simulates, so an update rule measured offline is the one the live loop runs.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.distributed import UpdatePool
from trainer.update import (
    Batch,
    UpdateConfig,
    UpdateInputs,
    carry_state,
    make_optimizer,
    update,
)

T = TypeVar("T")


@dataclass
class Candidate:
    model: GPT  # in eval mode, no gradients
    metrics: dict[str, float]  # update()'s
    optimizer_state: dict[str, Any]  # Adam's moments, for the next candidate (carry_state)


def split_for_check(rows: Sequence[T], check_fraction: float) -> tuple[list[T], list[T]]:
    """The rows to train on and the rows held back for the deploy check's reward estimate
    (the last `check_fraction`, at least one). Rows in random order (the trainer sorts by
    random suggestion ids) make it an unbiased split."""
    n_check = max(1, int(len(rows) * check_fraction))
    return list(rows[:-n_check]), list(rows[-n_check:])


def train_candidate(
    live: GPT,
    ref: GPT,
    tokenizer: CodeTokenizer,
    batch: Batch,
    cfg: UpdateConfig,
    optimizer_state: dict[str, Any] | None = None,
    replay: Batch | None = None,
    settled_replay: Batch | None = None,
    generic: torch.Tensor | None = None,
    pool: UpdatePool | None = None,
) -> Candidate:
    """A copy of `live` after one update on `batch` (trainer/update/), with Adam's moments
    carried over from `optimizer_state`; `live` and `ref` are only read. With `pool`, the
    update runs data-parallel on its ranks (trainer/distributed.py); its RankFailed leaves
    nothing behind but the discarded copy."""
    model = copy.deepcopy(live)
    model.requires_grad_(True)
    optimizer = make_optimizer(model, cfg)
    carry_state(optimizer, optimizer_state)
    inputs = UpdateInputs(
        model, ref, tokenizer, batch, optimizer, cfg, replay, settled_replay, generic
    )
    metrics = pool.update(inputs) if pool is not None else update(inputs)
    model.eval()
    model.requires_grad_(False)
    return Candidate(model, metrics, copy.deepcopy(optimizer.state_dict()))
