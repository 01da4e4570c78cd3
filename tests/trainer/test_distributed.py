"""The data-parallel update (trainer/distributed.py): two gloo ranks on a tiny policy take the
same steps as update() on one process, and a rank killed in the middle of an update fails it
with RankFailed, after which a new pool works."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tabloop.core.policy.actions import Completion
from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.tokenizer import CodeTokenizer, train_tokenizer
from tests.conftest import SMALL_SOURCES, STDLIB
from trainer.deploy_check import heldout_sample
from trainer.distributed import RankFailed, UpdatePool
from trainer.update import Batch, UpdateConfig, UpdateInputs, carry_state, make_optimizer, update

# every test starts worker ranks in processes of their own (tests/conftest.py, the marker)
pytestmark = pytest.mark.integration

torch.set_num_threads(1)

PROMPTS = [
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    ret",
]
REWARDS = (0.75, -0.25, 0.75, -0.25, -0.25)

# learning rate 1e-3: the attention's key biases have no gradient in exact arithmetic (softmax
# ignores them), so Adam turns their float rounding, which differs with the row split, into
# steps of up to the learning rate; at 1e-3 they stay within the tolerance.
# What each case exercises: uneven shares and a last minibatch of 1 row (rank 1 has none);
# several epochs; the settled-text passes with the generic mix (rows shared out too); a
# minibatch of one row throughout (rank 1 never has a row); the gate passes; the gate fit
CASES = {
    "pg": UpdateConfig(learning_rate=1e-3, minibatch_size=5, epochs=2, settled_epochs=0),
    "settled": UpdateConfig(
        learning_rate=1e-3, minibatch_size=4, settled_epochs=2, generic_mix=1.0, generic_rows=3
    ),
    "one-row": UpdateConfig(
        learning_rate=1e-3, minibatch_size=1, settled_epochs=1, generic_mix=1.0, generic_rows=1
    ),
    "gate-passes": UpdateConfig(
        learning_rate=1e-3, minibatch_size=4, settled_epochs=0, gate_epochs=2
    ),
    "gate-fit": UpdateConfig(
        learning_rate=1e-3, settled_epochs=0, gate_fit=True, gate_fit_min_shown=0
    ),
}


@pytest.fixture(scope="module")
def pool() -> Iterator[UpdatePool]:
    with UpdatePool(2, timeout_s=30) as p:
        yield p


@pytest.fixture
def job(tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]) -> dict[str, Any]:
    return make_job(tiny_model, tiny_tokenizer, small_code)


def make_job(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> dict[str, Any]:
    """A batch the tiny model sampled, with settled texts and weights, a replay batch for the
    gate fit, generic code, and an optimizer state from an earlier update (Adam's moments)."""
    with torch.no_grad():  # p(show) = 1/2 whatever the completion: some shown, some not
        tiny_model.gate.features.weight.zero_()
        tiny_model.gate.features.bias.zero_()
    g = torch.Generator().manual_seed(0)
    comps: list[Completion] = [
        complete(tiny_model, tiny_tokenizer, p, "", 6, 0.8, 0.95, g, stop_logprob=None)
        for p in PROMPTS
        for _ in range(4)
    ]
    n = len(comps)
    rewards = [REWARDS[i % len(REWARDS)] if c.shown else 0.0 for i, c in enumerate(comps)]
    assert {r for r, c in zip(rewards, comps, strict=True) if c.shown} == {0.75, -0.25}
    settled = [None if i % 3 == 0 else "x = load(path)" for i in range(n)]
    weights = [0.5 + (i % 3) * 0.5 for i in range(n)]
    batch = Batch.of(comps[:9], rewards[:9], settled[:9], weights[:9])
    replay = Batch.of(comps[9:], rewards[9:], settled[9:])
    generic = heldout_sample(tiny_tokenizer, "\n".join(small_code), rows=8, length=24, seed=1)
    model = copy.deepcopy(tiny_model).requires_grad_(True)
    cfg = UpdateConfig(learning_rate=1e-3, settled_epochs=0)
    optimizer = make_optimizer(model, cfg)
    update(UpdateInputs(model, tiny_model, tiny_tokenizer, batch, optimizer, cfg))
    return {
        "model": model,
        "ref_model": tiny_model,
        "tokenizer": tiny_tokenizer,
        "batch": batch,
        "replay": replay,
        "settled_replay": replay,
        "generic": generic,
        "state": optimizer.state_dict(),
    }


def run(
    job: dict[str, Any], cfg: UpdateConfig, pool: UpdatePool | None
) -> tuple[GPT, dict[str, float], dict[str, Any]]:
    """An update of a copy of the job's model, from the job's optimizer state, seeded: the
    model, the metrics and the optimizer's state after it."""
    model = copy.deepcopy(job["model"])
    optimizer = make_optimizer(model, cfg)
    carry_state(optimizer, copy.deepcopy(job["state"]))  # Adam steps its moments in place
    inputs = UpdateInputs(
        model,
        job["ref_model"],
        job["tokenizer"],
        job["batch"],
        optimizer,
        cfg,
        job["replay"],
        job["settled_replay"],
        job["generic"],
    )
    torch.manual_seed(7)  # the shuffles: rank 0's global RNG, as on one process
    metrics = update(inputs) if pool is None else pool.update(inputs)
    return model, metrics, optimizer.state_dict()


def assert_same(a: GPT, b: GPT) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_take_the_steps_of_one(pool: UpdatePool, job: dict[str, Any], case: str) -> None:
    cfg = CASES[case]
    one, expected, state = run(job, cfg, None)
    two, metrics, carried = run(job, cfg, pool)
    name = "h.0.attn.c_attn.weight"
    assert not torch.equal(one.state_dict()[name], job["model"].state_dict()[name])
    assert_same(one, two)
    # the moments the trainer carries to its next update
    torch.testing.assert_close(state["state"], carried["state"], atol=1e-5, rtol=1e-3)
    assert metrics.keys() == expected.keys()
    for k, v in expected.items():
        assert metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    if case == "gate-fit":
        assert metrics["gate_fit/fitted"] == 1.0


def test_a_rank_killed_mid_update_fails_it_and_a_new_pool_works(job: dict[str, Any]) -> None:
    """Worker 1 holds each job (the test hook) while rank 0 waits in the job's broadcast; killed
    there, rank 0 gets RankFailed at once (well within the collective timeout). A new pool in
    the same process then updates as one process does; a worker killed between updates fails
    the next one, and the one after starts new workers by itself."""
    cfg = CASES["pg"]
    expected, _, _ = run(job, cfg, None)
    timeout = 20.0
    pool = UpdatePool(2, timeout_s=timeout, hold_s=60)
    try:
        (pid,) = pool.worker_pids
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RankFailed, match="exited with -9"):
            run(job, cfg, pool)
        assert time.monotonic() - start < timeout
        killer.join()
    finally:
        pool.close()

    with UpdatePool(2, timeout_s=timeout) as pool:
        model, _, _ = run(job, cfg, pool)
        assert_same(expected, model)
        (pid,) = pool.worker_pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankFailed):
            run(job, cfg, pool)
        model, _, _ = run(job, cfg, pool)  # a broken pool restarts first
        assert_same(expected, model)
        assert pool.worker_pids != [pid]


# rank 0 updates through the ranks torchrun started, then compares with one process
TORCHRUN_SCRIPT = """
import os

import torch

from trainer.distributed import UpdatePool, worker_loop

torch.set_num_threads(1)
if int(os.environ["RANK"]) != 0:
    worker_loop()
else:
    from tests.trainer.test_distributed import CASES, assert_same, make_job, run, tiny

    job = make_job(*tiny())
    pool = UpdatePool.from_env()
    one, _, _ = run(job, CASES["pg"], None)
    two, _, _ = run(job, CASES["pg"], pool)
    pool.close()
    assert_same(one, two)
    print("rank 0: the same steps as one process")
"""


def tiny() -> tuple[GPT, CodeTokenizer, list[str]]:
    """tests/conftest.py's tiny model, tokenizer and code, outside pytest."""
    code = [(STDLIB / p).read_text(encoding="utf-8") for p in SMALL_SOURCES]
    tokenizer = train_tokenizer(code, vocab_size=400)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32
    )
    return GPT(cfg).eval(), tokenizer, code


def test_torchrun_ranks_serve_rank_0(tmp_path: Path) -> None:
    script = tmp_path / "update.py"
    script.write_text(TORCHRUN_SCRIPT)
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(script)],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0: the same steps as one process" in done.stdout
