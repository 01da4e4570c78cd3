"""The ranks of a data-parallel update, as `update()` uses them (trainer/distributed.py starts
them): whose rows are whose, and the collectives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank died, failed or timed out during a data-parallel update (or while starting).

    The update is lost: rank 0's model and optimizer are partly stepped and must be discarded.
    """


@dataclass
class DataParallel:
    """The ranks of one update, as update() uses them: whose rows are whose, and the
    collectives (each raises RankFailed when a rank dies, fails or times out)."""

    pg: Any  # a gloo or NCCL backend, or torch.distributed's default group (torchrun)
    rank: int
    world: int
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def shard(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a minibatch: idx[rank], idx[rank + W], ... (empty when the
        minibatch has fewer rows than rank + 1)."""
        return idx[self.rank :: self.world]

    def randperm(self, n: int) -> torch.Tensor:
        """Rank 0's torch.randperm(n) (its global RNG, as on one process), on every rank."""
        perm = torch.randperm(n) if self.rank == 0 else torch.empty(n, dtype=torch.long)
        return self.broadcast(perm)

    def randint(self, high: int, size: int) -> torch.Tensor:
        """Rank 0's torch.randint(0, high, (size,)), on every rank."""
        draw = torch.randint(0, high, (size,)) if self.rank == 0 else torch.empty(size).long()
        return self.broadcast(draw)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` (every rank passes one of the same shape and dtype)."""
        buf = t.to(self.device).contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(lambda: self.pg.broadcast([buf], opts))
        return buf.to(t.device)

    def broadcast_params(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Overwrite `params` with rank 0's, in one broadcast."""
        params = list(params)
        flat = self.broadcast(torch.cat([p.detach().reshape(-1) for p in params]))
        with torch.no_grad():
            for p, v in zip(params, torch.split(flat, [p.numel() for p in params]), strict=True):
                p.copy_(v.view_as(p))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over the ranks."""
        buf = t.to(self.device).contiguous()
        self._wait(lambda: self.pg.allreduce([buf], dist.AllreduceOptions()))  # SUM
        return buf.to(t.device)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """(W, *t.shape): every rank's `t` (all the same shape), by rank."""
        buf = t.to(self.device).contiguous()
        out = [torch.empty_like(buf) for _ in range(self.world)]
        self._wait(lambda: self.pg.allgather([out], [buf]))
        return torch.stack(out).to(t.device)

    def gather_rows(self, mine: torch.Tensor, n: int) -> torch.Tensor:
        """The (n, ...) rows whose shares (`shard` of range(n)) the ranks hold, on all ranks."""
        per = -(-n // self.world)  # all_gather wants equal shapes: pad every share to this
        padded = mine.new_zeros((per, *mine.shape[1:]))
        padded[: len(mine)] = mine
        parts = self.all_gather(padded)
        out = mine.new_empty((n, *mine.shape[1:]))
        for r in range(self.world):
            rows = range(r, n, self.world)
            out[r :: self.world] = parts[r, : len(rows)]
        return out

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of the parameters that require one over the ranks, in one
        all-reduce. A parameter no rank has a gradient for keeps none (the optimizer then skips
        it, as on one process, e.g. the gate in the settled passes); a rank without rows
        contributes zeros."""
        params = [p for p in params if p.requires_grad]
        if not params:
            return
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        has = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype)
        flat = self.all_reduce(torch.cat([g.reshape(-1) for g in grads] + [has]))
        sizes = [p.numel() for p in params]
        parts = torch.split(flat, [*sizes, len(params)])
        for p, g, present in zip(params, parts, parts[-1].tolist(), strict=False):
            p.grad = g.view_as(p).to(p.dtype) if present > 0 else None

    def _wait(self, start: Callable[[], Any]) -> None:
        try:
            start().wait()
        except RuntimeError as e:  # gloo/NCCL: a closed connection, a timeout, an abort
            raise RankFailed(f"rank {self.rank}: a collective failed: {e}") from e
