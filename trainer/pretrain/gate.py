"""The show/abstain gate of a pretrained base: fitted at the end of a run on completions of
the training split, as P(accept) turned into p(show) under the default reward spec
(`show_offset`), or fitted again on a finished checkpoint (`refit_gate`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

from tabloop.core.corpus import Cursor, cursors_from, prefix_match
from tabloop.core.policy.checkpoint import load_checkpoint, rewrite_checkpoint
from tabloop.core.policy.device import compute, model_device
from tabloop.core.policy.model import (
    GATE_FEATURES,
    GPT,
    init_gate,
)
from tabloop.core.policy.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, complete
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.reward_spec import RewardSpec
from trainer.pretrain.config import PretrainConfig, split_files

log = logging.getLogger(__name__)


# the default reward spec (DESIGN.md), which turns the gate's P(accept) into a show decision
_SPEC = RewardSpec()


def show_offset() -> tuple[float, float]:
    """(bias, log1p_bytes weight) that turn logit P(accept) into logit p(show) under the spec.

    Showing pays P * accept * s - (1 - P) * reject with s = (chars / norm) ** exponent, so it is
    worth it iff logit P + log(accept / reject) + exponent * log(chars / norm) > 0.
    """
    return (
        math.log(_SPEC.accept_reward / _SPEC.reject_penalty)
        - _SPEC.chars_exponent * math.log(_SPEC.chars_norm),
        _SPEC.chars_exponent,
    )


# --- the gate ----------------------------------------------------------------------------
def fit_gate(
    model: GPT,
    tokenizer: CodeTokenizer,
    cursors: Sequence[Cursor],
    seed: int,
    max_new_tokens: int = 32,
) -> dict[str, float]:
    """Fit the gate on train-split cursors, then shift it to a reward-aware show decision.

    Label: the sampled completion (serving temperature/top-p) is non-empty and a prefix of the
    true rest of the line (what a simulated user would accept). A logistic regression on the
    gate's inputs (L2 on the hidden-state weights) estimates P(accept); the spec offset
    (`show_offset`) then turns it into p(show), so p(show) > 1/2 where showing pays.

    On the model's device: sampling and scoring as serving does there (bf16 autocast on a
    GPU, draws from a CPU generator), the regression in float32.
    """
    device = model_device(model)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    model.eval()
    with compute(device):
        comps = [
            complete(
                model,
                tokenizer,
                c.prefix,
                c.suffix,
                max_new_tokens,
                DEFAULT_TEMPERATURE,
                DEFAULT_TOP_P,
                gen,
            )
            for c in cursors
        ]
        with torch.no_grad():
            parts = [
                score_actions(model, tokenizer, comps[i : i + 128])
                for i in range(0, len(comps), 128)
            ]
    labels = torch.tensor(
        [
            float(prefix_match(c.text, cur.rest_of_line))
            for c, cur in zip(comps, cursors, strict=True)
        ],
        device=device,
    )
    h = torch.cat([p.gate_hidden for p in parts]).to(device, torch.float32)
    x = torch.cat([p.gate_inputs for p in parts]).to(device, torch.float32)
    nonempty = torch.tensor([bool(c.text) for c in comps], device=device)
    h, x, y = h[nonempty], x[nonempty], labels[nonempty]
    if not len(y):  # nothing to fit on (a model too young to be sure of any token): keep it
        return {"examples": len(comps), "nonempty": 0}
    gate = model.gate
    params = list(gate.parameters())
    opt = torch.optim.Adam(params, lr=0.05)
    for _ in range(400):
        logit = gate(h, x)
        loss = (
            F.binary_cross_entropy_with_logits(logit, y) + 1e-3 * gate.hidden.weight.square().sum()
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        p = torch.sigmoid(gate(h, x))
        fit_loss = float(F.binary_cross_entropy(p, y))
        bias, w_bytes = show_offset()
        gate.features.bias.add_(bias)
        gate.features.weight[0, GATE_FEATURES.index("log1p_bytes")] += w_bytes
    return {
        "examples": len(comps),
        "nonempty": int(nonempty.sum()),
        "accept_rate": float(y.mean()) if len(y) else 0.0,
        "bce": fit_loss,
    }


def refit_gate(
    ckpt: Path,
    examples: int,
    seed: int,
    corpus: Path | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Fit the gate of the checkpoint at `ckpt` again from its initial state, on `examples`
    train-split completions sampled as serving samples them now (after a change to sampling,
    such as the confidence stop), keeping the language model; rewrites the checkpoint in
    place, with its version, and records the fit in the summary as `gate_refit`. The cursors
    come from `corpus`, else the corpus the checkpoint was pretrained on. Sampled on `device`
    (default: the CPU)."""
    model, tokenizer, manifest = load_checkpoint(ckpt)
    model.to(device or torch.device("cpu"))
    init_gate(model.gate, model.config.gate_scale, model.config.gate_threshold)
    if corpus is None:
        trained_on = manifest.summary.get("config", {}).get("corpus")
        corpus = None if trained_on is None else Path(trained_on)
    train_paths, _ = split_files(PretrainConfig(out_dir=ckpt, corpus=corpus))
    fit = fit_gate(model, tokenizer, cursors_from(train_paths, examples, seed), seed)
    summary = {**manifest.summary, "gate_refit": {**fit, "seed": seed}}
    rewrite_checkpoint(ckpt, model, tokenizer, manifest, summary)
    return fit
