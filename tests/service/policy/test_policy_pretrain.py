"""Pretraining: schedule helpers, a seconds-long smoke run, resume (with the default share of
fill-in-the-middle rows, so a resumed run draws the same FIM rows too), FIM or not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import trainer.pretrain.run as pretrain_module
from tabloop.core.corpus import corpus_files
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.model import ModelConfig
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.scoring import score_actions
from trainer.pretrain import PretrainConfig, pretrain, split_files
from trainer.pretrain.config import bits_per_byte, get_lr
from trainer.pretrain.gate import refit_gate

TINY = dict(
    max_files=12,
    vocab_size=300,
    batch_size=4,
    eval_every=10,
    warmup_iters=5,
    gate_examples=30,
    progress=False,
    model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64),
)


def _cfg(out: Path, **kw: object) -> PretrainConfig:
    return PretrainConfig(out_dir=out, **{**TINY, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("it", "progress", "expected"),
    [
        (0, 0.0, 1e-3 * 1 / 11),  # first warmup step
        (9, 0.0, 1e-3 * 10 / 11),  # last warmup step
        (10, 0.0, 1e-3),  # peak
        (50, 0.5, 1e-4 + 0.5 * (1e-3 - 1e-4)),  # half-way down the cosine
        (99, 1.0, 1e-4),  # the end
        (120, 1.7, 1e-4),  # past the budget: clamped
    ],
)
def test_get_lr(it: int, progress: float, expected: float) -> None:
    cfg = PretrainConfig(out_dir=Path("."), learning_rate=1e-3, min_lr=1e-4, warmup_iters=10)
    assert math.isclose(get_lr(it, progress, cfg), expected, rel_tol=1e-9)


def test_bits_per_byte() -> None:
    assert math.isclose(bits_per_byte(math.log(2), n_tokens=100, n_bytes=400), 0.25)


def test_heldout_files_are_never_trained_on() -> None:
    train, heldout = split_files(PretrainConfig(out_dir=Path(".")))
    assert train == corpus_files("train") and heldout == corpus_files("heldout")
    assert not set(train) & set(heldout)


def test_smoke_run_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = pretrain(_cfg(tmp_path / "base", minutes=2 / 60))
    model, tok, manifest = load_checkpoint(out)
    assert manifest.version == 0 and manifest.parent is None
    assert manifest.summary["iters"] > 0 and manifest.summary["heldout_bits_per_byte"] > 0
    assert manifest.summary["gate_fit"]["examples"] == 30
    assert not (out / "resume").exists()
    c = complete(model, tok, "import os\nx = os.pa", "", 8, 0.7, 0.95, None)
    assert "\n" not in c.text


def test_resume_after_a_crash_matches_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = pretrain(_cfg(tmp_path / "straight", max_iters=16, gate_examples=0))

    calls = {"n": 0}
    real_get_batch = pretrain_module.get_batch

    def crash_on_ninth(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt("killed")
        return real_get_batch(*args, **kwargs)

    out = tmp_path / "crashed"
    monkeypatch.setattr(pretrain_module, "get_batch", crash_on_ninth)
    with pytest.raises(KeyboardInterrupt):
        pretrain(_cfg(out, max_iters=16, save_every_s=0.0, gate_examples=0))
    monkeypatch.setattr(pretrain_module, "get_batch", real_get_batch)
    assert (out / "resume" / "state.json").exists()
    with pytest.raises(FileExistsError):  # a leftover run is never silently overwritten
        pretrain(_cfg(out, max_iters=16, gate_examples=0))
    pretrain(_cfg(out, max_iters=16, resume=True, gate_examples=0))

    a, _, ma = load_checkpoint(straight)
    b, _, mb = load_checkpoint(out)
    assert mb.summary["iters"] == 16 and mb.summary["tokens_seen"] == 16 * 4 * 64
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_refit_gate_fits_only_the_gate_again(tmp_path: Path) -> None:
    out = pretrain(_cfg(tmp_path / "base", max_iters=16, gate_examples=0))
    before, _, m0 = load_checkpoint(out)
    fit = refit_gate(out, examples=40, seed=0)
    after, tok, m1 = load_checkpoint(out)
    assert fit["examples"] == 40 and m1.summary["gate_refit"] == {**fit, "seed": 0}
    assert (m1.version, m1.parent, m1.weights_dtype) == (m0.version, m0.parent, m0.weights_dtype)
    assert m1.summary["iters"] == m0.summary["iters"]  # the rest of the summary is kept
    old, new = before.state_dict(), after.state_dict()
    for name in old:
        if name.startswith("gate."):
            continue
        assert torch.equal(old[name], new[name]), f"{name} changed"
    assert not torch.equal(old["gate.features.bias"], new["gate.features.bias"])


def test_fim_pretraining_makes_a_checkpoint_that_reads_the_suffix(tmp_path: Path) -> None:
    """--fim-rate 0.5: half the rows fill in the middle. The tokenizer gets the sentinels, the
    manifest records it, serving lays the suffix out in the context, and what it logs rescores
    exactly."""
    out = pretrain(_cfg(tmp_path / "fim", max_iters=16, gate_examples=10, fim_rate=0.5))
    model, tok, manifest = load_checkpoint(out)
    assert manifest.fim and tok.fim_ids is not None and manifest.languages == ("python",)
    assert manifest.summary["config"]["fim_rate"] == 0.5
    pre, suf, mid = tok.fim_ids
    gen = torch.Generator().manual_seed(0)
    comps = [
        complete(
            model,
            tok,
            "import os\nx = os.pa",
            "th.join('a')\nprint(x)\n",
            8,
            0.7,
            0.95,
            gen,
            stop_logprob=None,
        )
        for _ in range(6)
    ]
    for c in comps:
        ctx = c.context_token_ids
        assert ctx[0] == pre and ctx[-1] == mid
        assert tok.decode(ctx[ctx.index(suf) + 1 : -1]) == "print(x)\n"  # the following line
    with torch.no_grad():
        scores = score_actions(model, tok, comps)
    torch.testing.assert_close(
        scores.total, torch.tensor([c.logprob_total for c in comps]), atol=1e-4, rtol=0
    )


def test_by_default_pretraining_is_left_to_right_only(tmp_path: Path) -> None:
    out = pretrain(_cfg(tmp_path / "l2r", max_iters=4, gate_examples=0))
    model, tok, manifest = load_checkpoint(out)
    assert not manifest.fim and not tok.fim and tok.special_ids == {tok.eof_id}
    c = complete(model, tok, "import os\nx = os.pa", "th\nprint(x)\n", 8, 0.7, 0.95, None)
    assert tok.eof_id in c.context_token_ids[:1]  # the plain layout: the file start, the prefix
