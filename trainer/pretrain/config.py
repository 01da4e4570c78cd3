"""Pretraining's settings: the model sizes, the run's configuration, and the pure helpers of its
schedule (learning rate, budget) and its figures (bits per byte)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tabloop.core.policy.model import ModelConfig
from trainer.pretrain.data import corpus_split


@dataclass(frozen=True)
class Size:
    """A named base size (`--size`): the architecture (its vocab_size is the tokenizer's) and the
    sequences per step."""

    model: ModelConfig
    batch_size: int


SIZES: dict[str, Size] = {
    # the shipped base's architecture, sized for a CPU
    "cpu": Size(ModelConfig(n_layer=3, n_head=6, n_embd=192, block_size=192), batch_size=24),
    # about 27 M parameters with a 4096-token vocabulary, a longer context, for one GPU
    "gpu": Size(ModelConfig(n_layer=8, n_head=8, n_embd=512, block_size=512), batch_size=64),
}
DEFAULT_SIZE = "cpu"


@dataclass
class PretrainConfig:
    out_dir: Path  # checkpoint directory to write (resume state goes to out_dir/resume)
    corpus: Path | None = None  # a directory of code to train on (None: the standard library)
    # share of training rows in fill-in-the-middle order (0: left to right only, and the
    # tokenizer has no sentinels). Bavarian et al. 2022 train with 0.5; at this model size and a
    # 24-minute budget a FIM base completes lines half as often as a left-to-right one
    # (docs/MODEL.md), so the default is 0
    fim_rate: float = 0.0
    fim_max_new_tokens: int = 32  # longest FIM middle (serving's default max_new_tokens)
    # continue from this checkpoint (its tokenizer, architecture and weights) instead of
    # starting from scratch; with fim_rate > 0 and a left-to-right checkpoint, the three
    # sentinels are appended to its vocabulary and get new embedding rows
    init: Path | None = None
    minutes: float = 20.0  # wall-clock budget of the training loop
    seed: int = 0  # seeds init, data order, gate-fitting samples
    resume: bool = False  # continue from out_dir/resume if it exists
    max_iters: int | None = None  # exact iteration budget instead of minutes (reproducible)
    model: ModelConfig = field(
        default_factory=lambda: replace(SIZES[DEFAULT_SIZE].model)
    )  # the shipped base's architecture
    vocab_size: int = 4096  # BPE vocabulary (overrides model.vocab_size)
    batch_size: int = SIZES[DEFAULT_SIZE].batch_size  # sequences per step
    learning_rate: float = 3e-3  # peak learning rate (3e-3 beat 1e-3 in a 200-step trial)
    min_lr: float = 2e-4  # learning rate at the end of the cosine
    warmup_iters: int = 100  # linear warmup steps
    weight_decay: float = 0.1  # AdamW decay on matrices
    beta2: float = 0.99  # AdamW beta2 (small model, small batches)
    grad_clip: float = 1.0  # global gradient-norm clip (0: off)
    # where to train: "auto" (a CUDA GPU if torch sees one, else the CPU), "cpu", "cuda",
    # "cuda:N" (tabloop.core.policy.device.resolve)
    device: str = "auto"
    # bf16 autocast on the CPU: None = where the CPU computes bf16 natively (cpu_has_bf16:
    # about 1.6x faster than fp32 there; without it, emulated, about 10x slower). On a GPU the
    # passes always run in bf16 autocast
    amp: bool | None = None
    threads: int | None = None  # torch threads (None: leave torch's default)
    eval_every: int = 250  # iterations between held-out evaluations
    eval_windows: int = 96  # held-out windows per periodic evaluation (final: all)
    save_every_s: float = 120.0  # seconds between resume-state saves
    max_files: int | None = None  # use only the first N train/held-out files (smoke tests)
    gate_examples: int = 1500  # train-split completions used to fit the gate (0: keep init)
    progress: bool = True  # show the rich progress bar
    keep_state: bool = False  # keep out_dir/resume after a finished run


# --- pure helpers ------------------------------------------------------------------------
def get_lr(it: int, progress: float, cfg: PretrainConfig) -> float:
    """Linear warmup over iterations, then cosine from the peak to min_lr over the budget."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    p = min(max(progress, 0.0), 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (cfg.learning_rate - cfg.min_lr)


def budget_progress(it: int, elapsed_s: float, cfg: PretrainConfig) -> float:
    """Fraction of the budget used: iterations if max_iters is set, else wall-clock."""
    if cfg.max_iters is not None:
        return it / cfg.max_iters if cfg.max_iters > 0 else 1.0  # 0: no step at all
    return elapsed_s / max(cfg.minutes * 60.0, 1e-9)


def bits_per_byte(loss_nats_per_token: float, n_tokens: int, n_bytes: int) -> float:
    return loss_nats_per_token / math.log(2) * n_tokens / max(n_bytes, 1)


def config_json(cfg: PretrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["out_dir"] = str(cfg.out_dir)
    d["corpus"] = None if cfg.corpus is None else str(cfg.corpus)
    d["init"] = None if cfg.init is None else str(cfg.init)
    return d


def split_files(cfg: PretrainConfig) -> tuple[list[Path], list[Path]]:
    """The train and held-out files of the configured corpus (the stdlib, or cfg.corpus)."""
    return corpus_split(cfg.corpus, cfg.max_files)
