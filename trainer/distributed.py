"""Data-parallel updates: `update()` (trainer/update/step.py) on several processes at once.

One update of the shipped policy spends nearly all its time in the forward and backward passes
of its minibatches, and those split by rows: every term of the policy-gradient loss is a mean
over the minibatch's rows (the advantages are computed beforehand on the whole batch), and the
settled-text loss is a mean over its target tokens. So, as DDP does, each of W ranks computes
the loss of its share of a minibatch (rows rank, rank + W, ...) times its share of the rows (or
tokens), the ranks' losses add up to the minibatch's, and the gradients summed over the ranks
before the global-norm clip and the optimizer step are the minibatch's gradients: every rank
takes the step one process would take on the whole minibatch, up to float rounding. Shuffles
are drawn on rank 0 (from its global RNG, as update() draws them on one process) and broadcast,
so all ranks read the same minibatches. The gate's forward passes (the gate fit and the gate
passes) are shared out the same way and gathered; their small fits run on every rank on the
gathered inputs, and rank 0's gate is broadcast at the end so all ranks finish identical.

Two ways to get ranks:
- `UpdatePool(nproc)`: rank 0 is the calling process (the trainer); it spawns nproc - 1 worker
  processes that form a gloo group with it over 127.0.0.1 (NCCL with device="cuda") and wait
  for jobs. `pool.update(...)` sends every worker the job (the tokenizer, the models' configs
  and weights, the batches, the optimizer's state) and runs update() on all ranks, so the
  workers need no database.
- torchrun: each process reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; rank 0 calls
  `UpdatePool.from_env()` and runs the trainer, the others call `worker_loop()`.

A rank that dies or fails during an update fails the update with `RankFailed` on rank 0 within
the collective timeout (a peer's closed socket usually fails it at once). The models and the
optimizer that rank 0 passed are then partly stepped: the caller discards them (the trainer
updates a copy of the live policy). A pool whose update failed starts new workers at its next
update. Each pool's process group is an object of its own (not torch.distributed's default
group), so a failed one is dropped and a new one made in the same process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.ranks import DataParallel, RankFailed
from trainer.update import Batch, UpdateConfig, UpdateInputs, update

POLL_S = 0.05  # how often an idle worker looks for a job (and for its parent)
PREFIX = "tabloop/update"  # the pool's keys in a shared store (torchrun's)


# --- the job: what rank 0 sends the other ranks ------------------------------------------
@dataclass(frozen=True)
class Logged:
    """What update() reads of a logged rollout (the Action protocol): rollout rows (database
    rows) become these before they are sent."""

    context_token_ids: list[int]
    token_ids: list[int]
    heal_text: str
    temperature: float
    top_p: float | None
    shown: bool
    recall: dict[str, Any] | None = (
        None  # the copy proposal's record (tabloop.core.policy.sampling)
    )
    person: dict[str, Any] | None = None  # what the decisions read of the person
    extend: dict[str, Any] | None = None  # the extend draw

    @classmethod
    def of(cls, a: Any) -> Logged:
        return cls(
            list(a.context_token_ids),
            list(a.token_ids),
            a.heal_text,
            float(a.temperature),
            None if a.top_p is None else float(a.top_p),
            bool(a.shown),
            a.recall,
            getattr(a, "person", None),
            getattr(a, "extend", None),
        )


def _portable(batch: Batch | None) -> Batch | None:
    if batch is None:
        return None
    return dataclasses.replace(batch, actions=[Logged.of(a) for a in batch.actions])


@dataclass
class Job:
    """One update's arguments, as the other ranks rebuild them."""

    tokenizer: str  # CodeTokenizer.to_json()
    model: tuple[dict[str, Any], dict[str, torch.Tensor]]  # (config, state_dict)
    ref_model: tuple[dict[str, Any], dict[str, torch.Tensor]]
    requires_grad: list[bool]  # model.parameters()' flags (the trainer sets them)
    optimizer: tuple[Any, list[list[int]], dict[str, Any]]  # (class, groups' params, state)
    cfg: UpdateConfig
    batch: Batch
    replay: Batch | None
    settled_replay: Batch | None
    generic: torch.Tensor | None

    @classmethod
    def of(cls, inputs: UpdateInputs) -> Job:
        model, optimizer = inputs.model, inputs.optimizer
        index = {id(p): i for i, p in enumerate(model.parameters())}
        groups = [[index[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        portable = _portable(inputs.batch)
        assert portable is not None
        return cls(
            tokenizer=inputs.tokenizer.to_json(),
            model=(model.config.to_dict(), model.state_dict()),
            ref_model=(inputs.ref_model.config.to_dict(), inputs.ref_model.state_dict()),
            requires_grad=[p.requires_grad for p in model.parameters()],
            optimizer=(type(optimizer), groups, optimizer.state_dict()),
            cfg=inputs.cfg,
            batch=portable,
            replay=_portable(inputs.replay),
            settled_replay=_portable(inputs.settled_replay),
            generic=inputs.generic,
        )

    def run(self, group: DataParallel) -> dict[str, float]:
        """update() on this rank with the job's arguments, on fresh copies on the rank's device
        (its GPU with NCCL)."""
        model = _model(*self.model).to(group.device)
        ref_model = _model(*self.ref_model).to(group.device)
        for p, flag in zip(model.parameters(), self.requires_grad, strict=True):
            p.requires_grad_(flag)
        cls, groups, state = self.optimizer
        params = list(model.parameters())
        optimizer = cls([{"params": [params[i] for i in g]} for g in groups])
        optimizer.load_state_dict(state)  # the moments and every group's settings
        tokenizer = CodeTokenizer.from_json(self.tokenizer)
        inputs = UpdateInputs(
            model,
            ref_model,
            tokenizer,
            self.batch,
            optimizer,
            self.cfg,
            self.replay,
            self.settled_replay,
            self.generic,
        )
        return update(inputs, group=group)


def _model(config: dict[str, Any], state: dict[str, torch.Tensor]) -> GPT:
    model = GPT(ModelConfig.from_dict(config))
    model.load_state_dict(state)
    return model


def send_job(group: DataParallel, job: Job) -> None:
    """Broadcast `job` from rank 0 (its length, then its bytes: torch.save's pickle)."""
    buf = io.BytesIO()
    torch.save(job, buf)
    data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    group.broadcast(torch.tensor([len(data)]))
    group.broadcast(data)


def receive_job(group: DataParallel) -> Job:
    """The job rank 0 broadcasts with send_job."""
    (n,) = group.broadcast(torch.zeros(1, dtype=torch.long)).tolist()
    data = group.broadcast(torch.empty(n, dtype=torch.uint8))
    job = torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)
    assert isinstance(job, Job), f"not a job: {type(job)}"
    return job


# --- a worker ----------------------------------------------------------------------------
def serve(
    group: DataParallel, store: Store, alive: Callable[[], bool], hold_s: float = 0.0
) -> None:
    """A worker's loop: wait for each job's doorbell in the store (`job/<n>`: "update" or
    "close") without a timeout, polling so it notices when `alive()` turns false, then run
    the job with rank 0. A failed job leaves its message under `error/<rank>` and ends the
    loop (raising): the group is broken, and rank 0 fails the update with RankFailed.
    `hold_s` (a test hook): wait this long after each doorbell, so a test can kill the worker
    in the middle of an update."""
    n = 0
    while True:
        key = f"job/{n}"
        while not store.check([key]):
            if not alive():
                return
            time.sleep(POLL_S)
        if store.get(key) == b"close":
            return
        n += 1
        time.sleep(hold_s)
        try:
            receive_job(group).run(group)
        except BaseException as e:
            store.set(f"error/{group.rank}", f"{type(e).__name__}: {e}")
            raise


def _worker_main(
    rank: int, world: int, port: int, device: str, threads: int, timeout_s: float, hold_s: float
) -> None:
    """A spawned worker: join the pool's store and group, serve until closed or orphaned."""
    torch.set_num_threads(threads)
    store = TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    store.set(f"ready/{rank}", "1")
    group = _group(store, rank, world, device, timeout_s)
    parent = mp.parent_process()
    try:
        serve(group, store, lambda: parent is None or parent.is_alive(), hold_s)
    except BaseException:
        os._exit(1)  # no teardown of a broken group (it can block); the error is in the store


def _group(store: Store, rank: int, world: int, device: str, timeout_s: float) -> DataParallel:
    """A process group of its own (not torch.distributed's default, so a pool can drop a
    broken one and make another in the same process): gloo on the loopback for the CPU, NCCL
    on the rank's GPU for cuda. Blocks until every rank has joined."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = PrefixStore("pg", store)
    if device == "cuda":
        gpu = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return DataParallel(dist.ProcessGroupNCCL(prefixed, rank, world, opts), rank, world, gpu)
    assert device == "cpu", f"device must be cpu or cuda, not {device!r}"
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return DataParallel(dist.ProcessGroupGloo(prefixed, rank, world, gloo), rank, world)


def worker_loop(threads: int = 1, timeout_s: float = 60.0) -> None:
    """Under torchrun, every rank but 0: serve rank 0's updates (UpdatePool.from_env) until it
    closes its pool."""
    group, store = _env_group(timeout_s)
    assert group.rank != 0, "rank 0 runs the trainer with UpdatePool.from_env()"
    torch.set_num_threads(threads)
    serve(group, store, lambda: True)  # torchrun ends the ranks when one of them dies


def _env_group(timeout_s: float) -> tuple[DataParallel, Store]:
    """torchrun's ranks as a DataParallel (its default group, made here unless it exists) and
    the pool's keys in its store (MASTER_ADDR:MASTER_PORT)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restart's keys are new
    return DataParallel(dist.group.WORLD, rank, world, device), PrefixStore(
        f"{PREFIX}/{restart}", store
    )


# --- rank 0 ------------------------------------------------------------------------------
class UpdatePool:
    """Rank 0 of a data-parallel update, and the workers it started (or torchrun's ranks).

    `update()` takes update()'s arguments and runs it on every rank; the metrics are rank 0's
    (the whole minibatches' figures). Rank 0 computes in the calling process with the caller's
    torch thread count; each worker uses `threads_per_rank`. With nproc=1 it is update().

    device="cuda" makes the group NCCL's on one GPU per rank (rank r on GPU r mod the GPUs);
    every rank computes where its models are: rank 0 where the caller placed them, the others
    on their group's device.
    """

    def __init__(
        self,
        nproc: int,
        threads_per_rank: int = 1,
        device: str = "cpu",
        timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        *,
        hold_s: float = 0.0,
    ) -> None:
        """`timeout_s`: how long any collective may wait for a rank before the update fails;
        `start_timeout_s`: for the workers to start (import torch) and join. `hold_s`: a test
        hook (see `serve`)."""
        assert nproc >= 1, "nproc must be >= 1"
        self.nproc, self.threads, self.device = nproc, threads_per_rank, device
        self.timeout_s, self.start_timeout_s, self.hold_s = timeout_s, start_timeout_s, hold_s
        self.group: DataParallel | None = None
        self._store: Store | None = None
        self._procs: list[Any] = []  # mp spawn context Processes
        self._jobs = 0
        self._broken = False
        self._restartable = True
        self._start()

    @classmethod
    def from_env(cls, timeout_s: float = 60.0) -> UpdatePool:
        """Rank 0 under torchrun: the ranks torchrun started, which run `worker_loop()`."""
        group, store = _env_group(timeout_s)
        assert group.rank == 0, "ranks other than 0 run worker_loop()"
        pool = cls.__new__(cls)
        pool.nproc, pool.threads, pool.device = group.world, 1, group.device.type
        pool.timeout_s, pool.start_timeout_s, pool.hold_s = timeout_s, timeout_s, 0.0
        pool.group, pool._store, pool._procs = (group if group.world > 1 else None), store, []
        pool._jobs, pool._broken, pool._restartable = 0, False, False
        return pool

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the workers this pool started (rank 1, 2, ...)."""
        return [p.pid for p in self._procs]

    def _start(self) -> None:
        if self.nproc == 1:
            return
        store = TCPStore(
            "127.0.0.1",
            0,  # a free port
            self.nproc,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.start_timeout_s),
        )
        ctx = mp.get_context("spawn")
        for rank in range(1, self.nproc):
            args = (rank, self.nproc, store.port, self.device, self.threads, self.timeout_s)
            proc = ctx.Process(target=_worker_main, args=(*args, self.hold_s), daemon=True)
            proc.start()
            self._procs.append(proc)
        self._store, self._jobs, self._broken = store, 0, False
        try:
            self._await_workers()
            self.group = _group(store, 0, self.nproc, self.device, self.timeout_s)
        except BaseException:
            self.close()
            raise

    def _await_workers(self) -> None:
        """Until every worker has joined the store (its group then connects at once), failing
        fast if one exits first."""
        assert self._store is not None
        deadline = time.monotonic() + self.start_timeout_s
        ready = [f"ready/{rank}" for rank in range(1, self.nproc)]
        while not self._store.check(ready):
            dead = [p for p in self._procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise RankFailed(f"workers did not start: {self._failures() or 'timed out'}")
            time.sleep(POLL_S)

    def update(self, inputs: UpdateInputs) -> dict[str, float]:
        """update() of `inputs` on every rank; rank 0's metrics. Raises RankFailed when a rank
        dies or fails: the model and the optimizer are then partly stepped (discard them), and
        the next update starts new workers first."""
        if self._broken:
            if not self._restartable:
                raise RankFailed("a rank failed earlier: torchrun's ranks cannot be restarted")
            self.restart()
        group = self.group
        assert group is not None or self.nproc == 1, "the pool is closed"
        if group is None:
            return update(inputs)
        assert self._store is not None
        try:
            self._store.set(f"job/{self._jobs}", "update")
            self._jobs += 1
            send_job(group, Job.of(inputs))
            return update(inputs, group=group)
        except RankFailed as e:
            self._broken = True
            raise RankFailed(f"{e}; {self._failures() or 'no rank reported an error'}") from e
        except BaseException:
            self._broken = True  # the workers are left in a collective: start afresh
            raise

    def _failures(self) -> str:
        """What the workers left: their errors in the store, or how they exited (a killed
        worker's sockets close as it exits: give it a moment to be reaped)."""
        out = []
        deadline = time.monotonic() + 1.0
        for rank, proc in enumerate(self._procs, start=1):
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            key = f"error/{rank}"
            try:
                if self._store is not None and self._store.check([key]):
                    out.append(f"rank {rank}: {self._store.get(key).decode()}")
                    continue
            except RuntimeError:
                pass  # a store that fails says nothing more
            if proc.exitcode is not None:
                out.append(f"rank {rank} exited with {proc.exitcode}")
        return "; ".join(out)

    def restart(self) -> None:
        """Close, then start nproc - 1 new workers and a new group."""
        self.close()
        self._start()

    def close(self) -> None:
        """Tell the workers to stop, end those that do not, and drop the group and the store.
        Under torchrun, tell its ranks to return from worker_loop()."""
        if self._store is not None and not self._broken:
            with contextlib.suppress(RuntimeError):  # a failing store: they are ended below
                self._store.set(f"job/{self._jobs}", "close")
        for proc in self._procs:
            proc.join(timeout=5 if not self._broken else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self.group, self._store = [], None, None

    def __enter__(self) -> UpdatePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
