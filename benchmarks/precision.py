"""One pretraining step (forward, backward, AdamW) of the base model's shape, in fp32 and under
bf16 autocast: whether bf16 pays on this CPU.

    python benchmarks/precision.py [--threads 1] [--steps 6] [--batch 24]

Prints the median seconds a step for each precision (the first step, warm-up, left out) and
whether oneDNN reports native bf16 (trainer.pretrain.cpu_has_bf16, which `tabloop pretrain`
follows). Random tokens: the cost of a step does not depend on the data.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

# the repository first: benchmarks/training.py would shadow the trainer package
from tabloop.core.policy.model import GPT, ModelConfig
from trainer.pretrain import cpu_has_bf16


def step_seconds(bf16: bool, steps: int, batch: int) -> float:
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(vocab_size=4096, block_size=192, n_layer=3, n_head=6, n_embd=192)
    ).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 4096, (batch, 192))
    y = torch.randint(0, 4096, (batch, 192))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with autocast:
            _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"native bf16 {cpu_has_bf16()}, {args.threads} thread(s), batch {args.batch} x 192"
    )
    for name, bf16 in (("fp32", False), ("bf16 autocast", True)):
        print(f"  {name:<14} {step_seconds(bf16, args.steps, args.batch):.2f} s a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
