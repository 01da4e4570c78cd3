"""Pretrain the base policy on code: `tabloop pretrain --out DIR [--corpus SRC] ...`.

The corpus is the Python standard library, or with `--corpus` a directory of the operator's own
code (any extensions, tabloop/core/corpus.py); the manifest lists the languages its files'
extensions name. A share `fim_rate` of the training rows is fill-in-the-middle (trainer/fim.py),
which gives the tokenizer the FIM sentinels and makes the checkpoint read the suffix when
serving.

One loop in nanoGPT order (learning rate, evaluate/save, update, log, stop check), on the train
split only. The budget is wall-clock minutes (or an exact iteration count): the cosine schedule
runs on the fraction of the budget used, so a run always ends with a decayed learning rate. The
run is resumable: every `save_every_s` the model, optimizer moments and data-sampler state are
written under DIR/resume/ as safetensors + JSON (nothing pickled), and `--resume` continues from
there. At the end the gate is fitted on train-split completions (see `fit_gate`) and the
checkpoint (manifest, weights, tokenizer) is written to DIR; DIR/resume/ is then removed.
`--calibrate` then moves the copy head and the gate to the reward's optimum on a package written
top to bottom (trainer/pretrain/calibrate.py).

`--device` (default: `TABLOOP_DEVICE`, else auto) is where it trains: "auto" (a CUDA GPU when
torch sees one, else the CPU), "cpu", "cuda" or "cuda:N" (tabloop/core/policy/device.py). On a
GPU the passes run in bf16 autocast; on the CPU in bf16 autocast where the CPU computes bf16
natively, else in fp32. Weights and AdamW moments stay float32, and everything written to disk
is CPU tensors, so a run started on a GPU resumes on a CPU and the other way round. `--size`
names the base: "cpu" (the shipped base's architecture, batch 24) or "gpu" (8 layers of width
512, 8 heads, 512-token context, batch 64), in `SIZES`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tabloop.core.corpus import cursors_from, read_text
from tabloop.core.policy.checkpoint import load_checkpoint, save_checkpoint
from tabloop.core.policy.device import DeviceError, compute, resolve
from tabloop.core.policy.languages import languages_of_paths
from tabloop.core.policy.model import (
    GPT,
    ModelConfig,
    configure_optimizer,
    heldout_loss,
    init_gate,
)
from tabloop.core.policy.tokenizer import FIM_TOKENS, CodeTokenizer, train_tokenizer
from trainer.fim import FimSource
from trainer.pretrain.calibrate import calibrate
from trainer.pretrain.config import (
    DEFAULT_SIZE,
    SIZES,
    PretrainConfig,
    bits_per_byte,
    budget_progress,
    config_json,
    get_lr,
    split_files,
)
from trainer.pretrain.data import (
    CorpusError,
    get_batch,
    tokenize_files,
    tokenize_texts,
)
from trainer.pretrain.gate import (
    fit_gate,
    refit_gate,
)
from trainer.pretrain.state import (
    load_state,
    save_state,
)

log = logging.getLogger(__name__)


# --- data --------------------------------------------------------------------------------
def stream_loss(
    model: GPT, data: np.ndarray, block: int, max_windows: int | None = None, batch: int = 16
) -> float:
    """Mean next-token loss (nats) over non-overlapping windows of a token stream (an evenly
    spaced subset of at most `max_windows`), by the core's `heldout_loss`."""
    # a stream shorter than one window (a small corpus's held-out files) is one shorter window
    starts = list(range(0, max(len(data) - block - 1, 1), block))
    if max_windows is not None and len(starts) > max_windows:
        starts = [starts[i * len(starts) // max_windows] for i in range(max_windows)]
    rows = np.stack([data[s : s + block + 1].astype(np.int64) for s in starts])
    return heldout_loss(model, torch.from_numpy(rows), batch)


# --- the loop ----------------------------------------------------------------------------
def from_checkpoint(ckpt: Path, fim: bool) -> tuple[GPT, CodeTokenizer, dict[str, Any]]:
    """The model and tokenizer of checkpoint `ckpt` to continue pretraining from. With `fim`
    and a left-to-right tokenizer, the three sentinels are appended to the vocabulary (the
    ids of every other token stay the same) and their embedding rows start at the mean of
    the others. Returns them with a record of the checkpoint for the summary."""
    model, tokenizer, manifest = load_checkpoint(ckpt)
    if fim and not tokenizer.fim:
        tk = tokenizer.tk
        tk.add_special_tokens(list(FIM_TOKENS))
        tokenizer = CodeTokenizer(tk)
        old = model.wte.weight.detach()
        extra = tokenizer.vocab_size - old.shape[0]
        grown = GPT(
            ModelConfig.from_dict(dict(model.config.to_dict(), vocab_size=tokenizer.vocab_size))
        )
        state = model.state_dict()
        state["wte.weight"] = torch.cat([old, old.mean(0, keepdim=True).expand(extra, -1)])
        grown.load_state_dict(state)
        model = grown
    info = {
        "path": str(ckpt),
        "version": manifest.version,
        "weights_sha256": manifest.weights_sha256,
    }
    return model, tokenizer, info


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX, as oneDNN sees it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def pretrain(cfg: PretrainConfig) -> Path:
    """Train (or resume), fit the gate, write the checkpoint to cfg.out_dir; return it.
    DeviceError if cfg.device cannot be used here."""
    device = resolve(cfg.device)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    state_dir = out / "resume"
    if state_dir.exists() and not cfg.resume:
        raise FileExistsError(f"{state_dir} exists: pass resume=True (--resume) or remove it")
    resuming = cfg.resume and (state_dir / "state.json").exists()
    assert 0.0 <= cfg.fim_rate <= 1.0, "fim_rate must be in [0, 1]"

    train_paths, heldout_paths = split_files(cfg)
    languages = languages_of_paths(train_paths)
    train_texts = [read_text(p) for p in train_paths]
    init = cfg.init
    if resuming:
        saved_cfg = json.loads((state_dir / "state.json").read_text()).get("config", {})
        if init is None:  # a run started with --init resumes from the same checkpoint
            init = None if saved_cfg.get("init") is None else Path(saved_cfg["init"])
        saved_model = saved_cfg.get("model")
        if saved_model:  # and with the architecture (the --size) it started with
            if ModelConfig.from_dict(saved_model) != cfg.model:
                log.info("resuming with the architecture the run started with: %s", saved_model)
            cfg = replace(cfg, model=ModelConfig.from_dict(saved_model))
    cfg = replace(cfg, init=init)  # what the state and the summary record
    init_model, init_info = None, None
    if init is not None:
        init_model, tokenizer, init_info = from_checkpoint(init, fim=cfg.fim_rate > 0)
    if resuming:
        tokenizer = CodeTokenizer.from_json((state_dir / "tokenizer.json").read_text())
    elif init_model is not None:
        log.info("continuing from %s (version %s)", init, init_info and init_info["version"])
    else:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(train_texts, cfg.vocab_size, fim=cfg.fim_rate > 0)
        log.info("tokenizer: %d tokens in %.1fs", tokenizer.vocab_size, time.perf_counter() - t0)
    train = tokenize_texts(tokenizer, train_texts)
    heldout = tokenize_files(tokenizer, heldout_paths)
    log.info(
        "train %d files %d tokens, held-out %d files %d tokens, languages %s",
        train.files,
        len(train.tokens),
        heldout.files,
        len(heldout.tokens),
        ", ".join(languages) or "none named by an extension",
    )
    arch = cfg.model if init_model is None else init_model.config  # --init: the checkpoint's
    block = arch.block_size
    if len(train.tokens) <= block + 1:
        raise CorpusError(
            f"the training files hold {len(train.tokens)} tokens: fewer than one window of "
            f"{block + 1}"
        )
    fim = None
    if cfg.fim_rate > 0:
        fim = FimSource(tokenizer, train_texts, train.tokens, train.starts, cfg.fim_max_new_tokens)

    mcfg = ModelConfig.from_dict(dict(arch.to_dict(), vocab_size=tokenizer.vocab_size))
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)  # initialized on the CPU: the same weights whatever the device
    if init_model is not None:
        model.load_state_dict(init_model.state_dict())
    model.to(device)  # float32: the optimizer's master weights
    opt = configure_optimizer(model, cfg.weight_decay, cfg.learning_rate, (0.9, cfg.beta2))
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)  # data order: on the CPU
    it, elapsed, tokens_seen, history = 0, 0.0, 0, []
    if resuming:
        meta = load_state(state_dir, model, opt, gen)
        it, elapsed, tokens_seen, history = (
            meta["iter"],
            meta["elapsed_s"],
            meta["tokens_seen"],
            meta["history"],
        )
        log.info("resumed at iteration %d (%.0fs trained)", it, elapsed)
    else:
        out.mkdir(parents=True, exist_ok=True)
    log.info("model: %d parameters", model.num_params())
    if device.type == "cuda":
        bf16 = True
        where = f"{device} ({torch.cuda.get_device_name(device)})"
    else:
        bf16 = cpu_has_bf16() if cfg.amp is None else cfg.amp
        where = str(device)
    log.info("device: %s, precision: %s", where, "bf16 autocast" if bf16 else "fp32")

    def snapshot() -> None:
        meta = {
            "iter": it,
            "elapsed_s": elapsed,
            "tokens_seen": tokens_seen,
            "history": history,
            "config": config_json(cfg),
        }
        save_state(state_dir, model, opt, gen, meta)
        (state_dir / "tokenizer.json").write_text(tokenizer.to_json())

    columns = [
        TextColumn("[bold]pretrain"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TextColumn("it {task.fields[it]}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    model.train()
    last_save = loop_t0 = time.perf_counter()
    elapsed_before = elapsed  # from the resumed state
    loss_ema: float | None = None
    with Progress(*columns, disable=not cfg.progress) as bar:
        task = bar.add_task("pretrain", total=1.0, it=it, loss="-", tps="-")
        while True:
            progress = budget_progress(it, elapsed, cfg)
            if progress >= 1.0:
                break
            lr = get_lr(it, progress, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            if it % cfg.eval_every == 0 and it > 0:
                ho = stream_loss(model, heldout.tokens, block, cfg.eval_windows)
                history.append(
                    {
                        "iter": it,
                        "train_loss": loss_ema,
                        "heldout_loss": ho,
                        "heldout_bpb": bits_per_byte(ho, len(heldout.tokens), heldout.n_bytes),
                    }
                )
                log.info(
                    "it %d: train %.3f held-out %.3f (%.3f bits/byte)",
                    it,
                    loss_ema or 0,
                    ho,
                    history[-1]["heldout_bpb"],
                )
            if time.perf_counter() - last_save > cfg.save_every_s:
                snapshot()
                last_save = time.perf_counter()

            t0 = time.perf_counter()
            # drawn on the CPU with its generator, then moved
            x, y = get_batch(train.tokens, block, cfg.batch_size, gen, fim, cfg.fim_rate)
            x, y = x.to(device), y.to(device)
            with compute(device, bf16=bf16):  # the forward pass (backward: outside autocast)
                _, loss = model(x, y)
            assert loss is not None
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            lv = loss.item()  # waits for the step (on a GPU) before the clock is read
            dt = time.perf_counter() - t0

            it += 1
            elapsed = elapsed_before + time.perf_counter() - loop_t0  # evals/saves included
            tokens_seen += x.numel()
            loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
            bar.update(
                task,
                completed=min(budget_progress(it, elapsed, cfg), 1.0),
                it=it,
                loss=f"{loss_ema:.3f}",
                tps=f"{x.numel() / dt:,.0f}",
            )

    model.eval()
    final_ho = stream_loss(model, heldout.tokens, block)
    bpb = bits_per_byte(final_ho, len(heldout.tokens), heldout.n_bytes)
    log.info("final held-out loss %.4f nats/token, %.4f bits/byte", final_ho, bpb)
    gate_fit: dict[str, float] = {}
    if cfg.gate_examples > 0:
        if init_model is not None:  # fit from the initial gate, as a base from scratch does
            init_gate(model.gate, model.config.gate_scale, model.config.gate_threshold)
        cursors = cursors_from(train_paths, cfg.gate_examples, cfg.seed)
        gate_fit = fit_gate(model, tokenizer, cursors, cfg.seed)
        log.info("gate fitted: %s", gate_fit)
    summary = {
        "kind": "pretrain",
        "iters": it,
        "tokens_seen": tokens_seen,
        "train_seconds": elapsed,
        "train_loss_ema": loss_ema,
        "heldout_loss": final_ho,
        "heldout_bits_per_byte": bpb,
        "train_files": train.files,
        "train_tokens": int(len(train.tokens)),
        "heldout_files": heldout.files,
        "heldout_tokens": int(len(heldout.tokens)),
        "params": model.num_params(),
        "gate_fit": gate_fit,
        "init": init_info,
        "config": config_json(cfg),
        "history": history,
    }
    save_checkpoint(
        out,
        model,
        tokenizer,
        version=0,
        parent=None,
        summary=summary,
        dtype="bfloat16",
        overwrite=True,
        languages=languages,
    )
    if not cfg.keep_state:
        shutil.rmtree(state_dir, ignore_errors=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`tabloop pretrain --out DIR [--corpus SRC] [--device D] [--size cpu|gpu] --minutes M
    --seed S [--resume]` (the CLI forwards argv)."""
    p = argparse.ArgumentParser(prog="tabloop pretrain", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="a directory of code to train on, any file extensions (default: the "
        "Python standard library)",
    )
    p.add_argument(
        "--fim-rate",
        type=float,
        default=PretrainConfig.fim_rate,
        help="share of fill-in-the-middle training rows (0: left to right only)",
    )
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        help="continue from this checkpoint instead of starting from scratch (with "
        "--fim-rate above 0, a left-to-right one gains the FIM sentinels)",
    )
    p.add_argument("--minutes", type=float, default=20.0, help="training-loop budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/resume")
    p.add_argument("--max-iters", type=int, default=None, help="exact iterations instead")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--device",
        default=os.environ.get("TABLOOP_DEVICE", PretrainConfig.device),
        metavar="{auto,cpu,cuda,cuda:N}",
        help="where to train: auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or "
        "cuda:N; bf16 autocast on a GPU (default: $TABLOOP_DEVICE, else auto)",
    )
    p.add_argument(
        "--size",
        choices=list(SIZES),
        default=DEFAULT_SIZE,
        help="the base's architecture and batch size: "
        + "; ".join(
            f"{name}: {s.model.n_layer} layers, width {s.model.n_embd}, {s.model.n_head} heads, "
            f"{s.model.block_size}-token context, batch {s.batch_size}"
            for name, s in SIZES.items()
        )
        + f" (default: {DEFAULT_SIZE}; with --init, the checkpoint's architecture)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per step (default: the --size's)",
    )
    p.add_argument("--lr", type=float, default=PretrainConfig.learning_rate)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--refit-gate",
        action="store_true",
        help="only fit the gate of the checkpoint in OUT again (language model kept)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="only calibrate the copy head and the gate of the checkpoint in OUT to the default "
        "reward spec, on --corpus written top to bottom (docs/MODEL.md); use a package the "
        "benchmarks do not measure on",
    )
    p.add_argument(
        "--cursors",
        type=int,
        default=3000,
        help="with --calibrate: writing cursors to observe for each of three seeds from --seed",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        device = resolve(args.device)
    except DeviceError as e:
        print(f"tabloop pretrain: {e}", file=sys.stderr)
        return 2
    if args.calibrate:
        torch.set_num_threads(args.threads or 1)  # one thread, as serving samples
        try:
            record = calibrate(
                args.out,
                args.corpus,
                args.cursors,
                [args.seed + i for i in range(3)],
                progress=not args.no_progress,
            )
        except (CorpusError, ValueError) as e:
            print(f"tabloop pretrain: {e}", file=sys.stderr)
            return 2
        print(f"calibrated {args.out}: {json.dumps(record)}")
        return 0
    if args.refit_gate:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        try:
            fit = refit_gate(args.out, PretrainConfig.gate_examples, args.seed, args.corpus, device)
        except CorpusError as e:
            print(f"tabloop pretrain: {e}", file=sys.stderr)
            return 2
        print(f"gate refitted in {args.out}: {fit}")
        return 0
    if not 0.0 <= args.fim_rate <= 1.0:
        p.error("--fim-rate must be between 0 and 1")
    size = SIZES[args.size]
    cfg = PretrainConfig(
        out_dir=args.out,
        corpus=args.corpus,
        fim_rate=args.fim_rate,
        init=args.init,
        minutes=args.minutes,
        seed=args.seed,
        resume=args.resume,
        max_iters=args.max_iters,
        threads=args.threads,
        model=replace(size.model),
        batch_size=size.batch_size if args.batch_size is None else args.batch_size,
        learning_rate=args.lr,
        device=args.device,
        progress=not args.no_progress,
    )
    try:
        out = pretrain(cfg)
    except (CorpusError, DeviceError) as e:
        print(f"tabloop pretrain: {e}", file=sys.stderr)
        return 2
    print(f"checkpoint written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
