"""Calibrating the copy head and the gate to a reward spec (trainer/pretrain/calibrate.py): the
expected figures are the arithmetic of the draws, the best calibration follows the spec, the
heads move as documented, and `tabloop pretrain --calibrate` writes it once."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import trainer.pretrain.run as pretrain_module
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.model import GATE_FEATURES, GPT, ModelConfig
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.recall import RECALL_INPUTS
from tabloop.core.reward_spec import RewardSpec
from trainer.pretrain import PretrainConfig, pretrain
from trainer.pretrain.calibrate import (
    SHIFTS,
    Calibration,
    Observation,
    Option,
    apply,
    best_calibration,
    expected,
    observe,
    undo,
)

LINEAR = RewardSpec(chars_exponent=1.0, reject_penalty=0.1)


def test_expected_is_the_arithmetic_of_the_draws() -> None:
    """Cursor 1: a right 10-character copy at p(copy) 1/2, else a wrong own completion at
    p(show) 1/2. Cursor 2: no proposal, a right 4-character completion (not the whole line)
    shown with p 3/4."""
    obs = [
        Observation(copy=Option(0.0, 10, True), own=Option(0.0, 0, False)),
        Observation(copy=None, own=Option(math.log(3.0), 4, False)),
    ]
    figs = expected(obs, Calibration(), LINEAR)
    # shown: 1/2 (copy) + 1/4 (own, not copied) + 3/4
    assert figs["shown"] == pytest.approx((0.5 + 0.25 + 0.75) / 2)
    assert figs["useful_per_100"] == pytest.approx(100 * (0.5 * 10 + 0.75 * 4) / 2)
    assert figs["wrong"] == pytest.approx(0.25 / 2)
    assert figs["whole"] == pytest.approx(0.5 / 2)
    assert figs["exact_of_shown"] == pytest.approx(0.5 / 1.5)
    # an accept is worth 0.75 * chars / 20 under the linear spec, a wrong one costs 0.1
    reward = 0.5 * 0.75 * 10 / 20 - 0.25 * 0.1 + 0.75 * 0.75 * 4 / 20
    assert figs["reward"] == pytest.approx(reward / 2)
    # sharper and shifted: p(copy) = sigmoid(2 * (0 + 1))
    p = 1 / (1 + math.exp(-2.0))
    sharp = expected(obs, Calibration(copy_shift=1.0, show_shift=0.0, sharpness=2.0), LINEAR)
    p_own2 = 1 / (1 + math.exp(-2 * math.log(3.0)))
    assert sharp["shown"] == pytest.approx((p + (1 - p) * 0.5 + p_own2) / 2)


def test_the_best_calibration_follows_the_spec() -> None:
    """Copies always right and own completions always wrong: copy all, show none of the own.
    With a reject penalty of 0 and own completions always right, show all of them."""
    copies = [Observation(Option(-1.0, 12, True), Option(0.5, 0, False)) for _ in range(20)]
    cal = best_calibration(copies, LINEAR)
    assert (cal.copy_shift, cal.show_shift) == (max(SHIFTS), min(SHIFTS))
    own = [Observation(None, Option(-2.0, 5, False)) for _ in range(20)]
    assert best_calibration(own, RewardSpec(reject_penalty=0.0)).show_shift == max(SHIFTS)


def test_apply_moves_both_heads_as_documented() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=16))
    with torch.no_grad():  # a gate and a copy head that read the hidden state too
        model.gate.hidden.weight.normal_()
        model.gate.copy.hidden.normal_()
    x = torch.randn(5, len(RECALL_INPUTS))
    h, f = torch.randn(5, 16), torch.randn(5, len(GATE_FEATURES))
    with torch.no_grad():
        copy0, show0 = model.gate.copy(x, h)[:, 0], model.gate_logit(h, f)
        apply(model, Calibration(copy_shift=1.5, show_shift=-0.75, sharpness=2.0))
        copy1, show1 = model.gate.copy(x, h)[:, 0], model.gate_logit(h, f)
    assert torch.allclose(copy1, 2.0 * (copy0 + 1.5), atol=1e-5)
    assert torch.allclose(show1, 2.0 * (show0 - 0.75), atol=1e-5)
    with torch.no_grad():  # and back
        undo(model, Calibration(copy_shift=1.5, show_shift=-0.75, sharpness=2.0))
        assert torch.allclose(model.gate.copy(x, h)[:, 0], copy0, atol=1e-5)
        assert torch.allclose(model.gate_logit(h, f), show0, atol=1e-5)


def test_observed_inputs_give_each_heads_logit_again(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, tmp_path: Path
) -> None:
    """`observe(..., inputs=True)` keeps what each head read: the copy head's inputs, and the
    gate's hidden state and features scored again from the completion; each head on them
    gives the logit observed (benchmarks/calibration.py --fit-heads fits the heads on them)."""
    with torch.no_grad():  # a gate and a copy head that read the hidden state too
        tiny_model.gate.hidden.weight.normal_(0.0, 0.5)
        tiny_model.gate.copy.hidden.normal_(0.0, 0.5)
    for i in range(3):
        body = "".join(f"    total_{j} = add(total_{j - 1}, {j})\n" for j in range(1, 20))
        (tmp_path / f"m{i}.py").write_text(f"def run_{i}(total_0):\n{body}    return 1\n")
    paths = sorted(tmp_path.glob("*.py"))
    obs = observe(tiny_model, tiny_tokenizer, paths, 40, seed=0, progress=False, inputs=True)
    copies = [o.copy for o in obs if o.copy is not None]
    owns = [o.own for o in obs if o.own is not None]
    assert copies and owns, "the corpus repeats itself: proposals, and completions to show"
    with torch.no_grad():
        read = torch.tensor([c.inputs for c in copies])
        x, h = read[:, : len(RECALL_INPUTS)], read[:, len(RECALL_INPUTS) :]
        assert h.shape[1] == tiny_model.config.n_embd
        assert torch.allclose(
            tiny_model.gate.copy(x, h)[:, 0], torch.tensor([c.logit for c in copies]), atol=1e-4
        )
        read = torch.tensor([o.inputs for o in owns])
        h, f = read[:, : tiny_model.config.n_embd], read[:, tiny_model.config.n_embd :]
        assert f.shape[1] == len(GATE_FEATURES)
        # observed as logit(p(show)), p clamped to [1e-9, 1 - 1e-9]: about +-20.7 at most
        edge = math.log(1e9)
        logits = tiny_model.gate_logit(h, f).clamp(-edge, edge)
    assert torch.allclose(logits, torch.tensor([o.logit for o in owns]), atol=1e-3)
    plain = observe(tiny_model, tiny_tokenizer, paths, 40, seed=0, progress=False)
    assert [o.own.logit for o in plain if o.own] == [o.logit for o in owns]
    assert all(o.own.inputs == () for o in plain if o.own)


def test_pretrain_calibrate_writes_the_calibration_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = PretrainConfig(
        out_dir=tmp_path / "base",
        max_files=6,
        vocab_size=300,
        batch_size=4,
        eval_every=10,
        warmup_iters=2,
        gate_examples=0,
        progress=False,
        max_iters=4,
        model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64),
    )
    out = pretrain(cfg)
    fresh = shutil.copytree(out, tmp_path / "fresh")
    package = tmp_path / "pkg"
    package.mkdir()
    for i in range(4):
        body = "".join(f"    value_{j} = compute(value_{j - 1}, {i})\n" for j in range(1, 30))
        (package / f"mod{i}.py").write_text(f"def build_{i}(value_0):\n{body}    return value_29\n")
    argv = ["--out", str(out), "--calibrate", "--corpus", str(package), "--cursors", "60"]
    assert pretrain_module.main([*argv, "--no-progress"]) == 0
    _, _, manifest = load_checkpoint(out)
    record = manifest.summary["calibration"]
    assert record["corpus"] == "pkg" and record["sharpness"] == 2.0
    assert record["copy_shift"] in SHIFTS and record["show_shift"] in SHIFTS
    assert record["spec"] == RewardSpec().to_dict() and record["seeds"] == [0, 1, 2]
    assert record["cursors"] > 60  # three seeds' cursors, pooled
    assert manifest.summary["iters"] == 4  # the rest of the summary is kept
    # a second calibration would sharpen the heads twice: refused
    assert pretrain_module.main([*argv, "--no-progress"]) == 2
    assert "calibrated already" in capsys.readouterr().err
    # nothing to write: a clear error, not a calibration on no cursors
    (tmp_path / "js").mkdir()
    (tmp_path / "js" / "app.js").write_text("const a = 1;\n")
    empty = ["--out", str(fresh), "--calibrate", "--corpus", str(tmp_path / "js")]
    assert pretrain_module.main([*empty, "--no-progress"]) == 2
    assert "no *.py files" in capsys.readouterr().err
