"""`tabloop pretrain --device D --size S`: where it trains and how big a base it builds. A GPU
asked for where torch sees none is one line and exit 2; the gpu size builds (and trains, here on
the CPU); resume state is CPU tensors whatever the device; the CPU default is the shipped base's
configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainer.pretrain.run as pretrain_module
from tabloop.cli import main as cli_main
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.model import GPT, ModelConfig, configure_optimizer
from trainer.pretrain import SIZES, PretrainConfig, load_state, pretrain, save_state

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TABLOOP = str(Path(sys.executable).parent / "tabloop")
SHIPPED = ModelConfig(n_layer=3, n_head=6, n_embd=192, block_size=192)  # the shipped base's


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four standard-library files: a small corpus, well over one 512-token window."""
    root = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "string.py", "json/decoder.py", "json/encoder.py"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((STDLIB / name).read_text(encoding="utf-8"), encoding="utf-8")
    return root


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[PretrainConfig]:
    """The configurations `main` would train with (nothing is trained)."""
    cfgs: list[PretrainConfig] = []

    def record(cfg: PretrainConfig) -> Path:
        cfgs.append(cfg)
        return cfg.out_dir

    monkeypatch.delenv("TABLOOP_DEVICE", raising=False)
    monkeypatch.setattr(pretrain_module, "pretrain", record)
    return cfgs


def test_a_gpu_where_torch_sees_none_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # so on a GPU machine too
    monkeypatch.delenv("TABLOOP_DEVICE", raising=False)
    out = tmp_path / "base"
    for argv, named in (
        (["--device", "cuda"], "'cuda'"),
        (["--device", "cuda:1"], "'cuda:1'"),
        (["--device", "tpu"], "'tpu'"),
        (["--device", "cuda", "--refit-gate"], "'cuda'"),
    ):
        assert cli_main(["pretrain", "--out", str(out), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and named in err, err
        assert err.startswith("tabloop pretrain: ") and "Traceback" not in err
    monkeypatch.setenv("TABLOOP_DEVICE", "cuda")  # the default comes from the environment
    assert cli_main(["pretrain", "--out", str(out)]) == 2
    assert "'cuda'" in capsys.readouterr().err
    assert not out.exists()  # refused before anything was read or written


@pytest.mark.integration  # the `tabloop` program in a subprocess
def test_the_program_refuses_a_missing_gpu_without_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TABLOOP_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # torch sees no GPU, whatever the machine has
    run = subprocess.run(
        [TABLOOP, "pretrain", "--out", str(tmp_path / "base"), "--device", "cuda"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "'cuda'" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""


def test_the_cpu_default_is_the_shipped_base(captured: list[PretrainConfig]) -> None:
    cfg = PretrainConfig(out_dir=Path("."))
    assert cfg.model == SHIPPED and cfg.batch_size == 24 and cfg.vocab_size == 4096
    assert cfg.device == "auto" and cfg.amp is None
    assert SIZES["cpu"].model == SHIPPED and SIZES["cpu"].batch_size == 24
    assert cli_main(["pretrain", "--out", "x"]) == 0  # no --size, no --device
    (cfg,) = captured
    assert cfg.model == SHIPPED and cfg.batch_size == 24 and cfg.vocab_size == 4096
    assert cfg.device == "auto"
    assert cfg.model is not SIZES["cpu"].model  # a copy: the table is never changed through it


def test_flags_pick_the_size_batch_and_device(
    captured: list[PretrainConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = ModelConfig(n_layer=8, n_head=8, n_embd=512, block_size=512)
    assert SIZES["gpu"].model == gpu and SIZES["gpu"].batch_size == 64
    assert cli_main(["pretrain", "--out", "x", "--size", "gpu", "--device", "cpu"]) == 0
    assert cli_main(["pretrain", "--out", "x", "--size", "gpu", "--batch-size", "8"]) == 0
    monkeypatch.setenv("TABLOOP_DEVICE", "cpu")
    assert cli_main(["pretrain", "--out", "x"]) == 0
    a, b, c = captured
    assert (a.model, a.batch_size, a.device) == (gpu, 64, "cpu")
    assert (b.model, b.batch_size, b.device) == (gpu, 8, "auto")
    assert (c.model, c.batch_size, c.device) == (SHIPPED, 24, "cpu")
    assert a.vocab_size == b.vocab_size == c.vocab_size == 4096  # the tokenizer's, any size


def test_the_gpu_size_builds_and_trains_on_the_cpu(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--device cpu --size gpu`: one step of the gpu architecture, a checkpoint that says so."""
    real = pretrain_module.pretrain
    seen: list[PretrainConfig] = []

    def few_gate_examples(cfg: PretrainConfig) -> Path:  # main has no flag for it
        seen.append(cfg)
        return real(replace(cfg, gate_examples=2))

    monkeypatch.setattr(pretrain_module, "pretrain", few_gate_examples)
    out = tmp_path / "gpu-base"
    argv = ["--out", str(out), "--corpus", str(corpus), "--device", "cpu", "--size", "gpu"]
    argv += ["--max-iters", "1", "--batch-size", "2", "--no-progress"]
    assert cli_main(["pretrain", *argv]) == 0
    model, tok, manifest = load_checkpoint(out)
    config = json.loads((out / "manifest.json").read_text())["config"]
    assert (config["n_embd"], config["n_layer"], config["n_head"]) == (512, 8, 8)
    assert config["block_size"] == 512 and config["vocab_size"] == tok.vocab_size
    assert model.config == replace(SIZES["gpu"].model, vocab_size=tok.vocab_size)
    assert seen[0].vocab_size == 4096  # the BPE asked for; a small corpus may give fewer
    summary = manifest.summary
    assert summary["iters"] == 1 and summary["tokens_seen"] == 2 * 512
    assert summary["config"]["device"] == "cpu" and summary["config"]["batch_size"] == 2
    assert summary["gate_fit"]["examples"] == 2


@pytest.mark.parametrize(
    "where",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
        ),
    ],
)
def test_resume_state_is_cpu_tensors(where: str, tmp_path: Path) -> None:
    """Saved from a model on `where`, read back into a model on the CPU: the moments are CPU
    tensors on disk and after loading, equal to the ones saved; the generator stays a CPU one."""
    device = torch.device(where)

    def make() -> tuple[GPT, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
        return model, configure_optimizer(model, 0.1, 1e-3, (0.9, 0.99))

    model, opt = make()
    model.to(device)
    x = torch.randint(64, (2, 16), device=device)
    _, loss = model(x, x)
    assert loss is not None
    loss.backward()
    opt.step()
    gen = torch.Generator(device="cpu").manual_seed(3)
    torch.rand(5, generator=gen)
    save_state(tmp_path / "resume", model, opt, gen, {"iter": 1})

    on_disk = load_file(str(tmp_path / "resume" / "optim.safetensors"))
    assert on_disk and all(t.device.type == "cpu" for t in on_disk.values())
    weights = load_file(str(tmp_path / "resume" / "model.safetensors"))
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in weights.values())

    model2, opt2 = make()
    gen2 = torch.Generator(device="cpu")
    assert load_state(tmp_path / "resume", model2, opt2, gen2)["iter"] == 1
    saved = opt.state_dict()["state"]
    loaded = opt2.state_dict()["state"]
    assert loaded.keys() == saved.keys()
    for i, state in loaded.items():
        for name, value in state.items():
            assert value.device.type == "cpu", (i, name)
            assert torch.equal(value, saved[i][name].cpu()), (i, name)
            if name != "step":
                assert value.dtype == torch.float32, (i, name)  # the master copy's moments
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a.cpu(), b)
    assert torch.equal(gen2.get_state(), gen.get_state()) and gen2.device.type == "cpu"


def test_a_resumed_run_keeps_the_architecture_it_started_with(corpus: Path, tmp_path: Path) -> None:
    """State left by a run of one size resumes with that size's architecture, whatever the
    configuration resuming it says (a run of `--size gpu` resumed without the flag)."""
    small = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)
    common = dict(
        out_dir=tmp_path / "base",
        corpus=corpus,
        vocab_size=300,
        batch_size=2,
        warmup_iters=1,
        gate_examples=0,
        progress=False,
        device="cpu",
        save_every_s=0.0,
    )
    pretrain(PretrainConfig(model=small, max_iters=3, keep_state=True, **common))  # type: ignore[arg-type]
    assert (tmp_path / "base" / "resume" / "state.json").exists()
    out = pretrain(PretrainConfig(max_iters=4, resume=True, **common))  # type: ignore[arg-type]
    model, _, manifest = load_checkpoint(out)
    assert model.config == replace(small, vocab_size=model.config.vocab_size)
    assert manifest.summary["iters"] == 4
