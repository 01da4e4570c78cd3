"""`tabloop pretrain --corpus DIR`: a base pretrained on an operator's own code, any extensions.
Which files are read, the split, the languages in the manifest, and that the result serves."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from tabloop.cli import main as cli_main
from tabloop.core.corpus import MAX_FILE_BYTES, directory_files, read_text
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.model import ModelConfig
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import train_tokenizer
from trainer.pretrain import PretrainConfig, pretrain, split_files
from trainer.pretrain.data import CorpusError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
RUST = """use std::collections::HashMap;

fn count(words: &[&str]) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for w in words {
        *out.entry(w.to_string()).or_insert(0) += 1;
    }
    out
}
"""
TS = """export function clamp(x: number, lo: number, hi: number): number {
  return Math.min(hi, Math.max(lo, x));
}
"""


def _write(root: Path, rel: str, data: str | bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Python, Rust and TypeScript code, a file of an unknown extension, and what is skipped."""
    root = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "string.py", "json/decoder.py", "json/encoder.py"):
        _write(root, f"py/{name}", (STDLIB / name).read_text(encoding="utf-8"))
    for i in range(6):
        _write(root, f"rs/src/count{i}.rs", RUST.replace("count", f"count{i}"))
        _write(root, f"web/clamp{i}.ts", TS.replace("clamp", f"clamp{i}"))
    _write(root, "tools/build.zzcode", "step one\nstep two\n")  # trained on, names no language
    skipped: dict[str, str | bytes] = {
        "blob.bin": b"\x00\x01\x02 binary",
        "latin1.py": "caf\xe9 = 1\n".encode("latin-1"),  # not UTF-8: binary to us
        "huge.py": "x = 1\n" * (MAX_FILE_BYTES // 6 + 10),
        ".git/config": "[core]\n",
        ".venv/lib/site.py": "import os\n",
        "myenv/pyvenv.cfg": "home = /usr\n",
        "myenv/lib/mod.py": "import os\n",
        "node_modules/left-pad/index.js": "module.exports = 1\n",
        "__pycache__/x.py": "x = 1\n",
        ".env": "SECRET=1\n",
        "web/package-lock.json": "{}\n",
        "web/app.min.js": "var a=1;\n",
    }
    for rel, data in skipped.items():
        _write(root, rel, data)
    (root / "link.py").symlink_to(root / "py/textwrap.py")
    return root


def test_directory_corpus_files_and_split(corpus: Path) -> None:
    train, heldout = directory_files("train", corpus), directory_files("heldout", corpus)
    rels = {p.relative_to(corpus).as_posix() for p in train + heldout}
    assert rels == (
        {f"py/{n}" for n in ("textwrap.py", "string.py", "json/decoder.py", "json/encoder.py")}
        | {f"rs/src/count{i}.rs" for i in range(6)}
        | {f"web/clamp{i}.ts" for i in range(6)}
        | {"tools/build.zzcode"}
    )
    assert heldout and not set(train) & set(heldout)  # a small corpus still holds one out
    assert train == sorted(train)
    assert (train, heldout) == (
        directory_files("train", corpus),
        directory_files("heldout", corpus),
    )  # deterministic


def test_pretrain_on_a_directory(corpus: Path, tmp_path: Path) -> None:
    out = pretrain(
        PretrainConfig(
            out_dir=tmp_path / "base",
            corpus=corpus,
            vocab_size=300,
            batch_size=4,
            max_iters=8,
            warmup_iters=2,
            eval_every=100,
            gate_examples=10,
            progress=False,
            fim_rate=0.5,
            model=ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64),
        )
    )
    model, tok, manifest = load_checkpoint(out)
    assert manifest.languages == ("python", "rust", "typescript")  # from the extensions seen
    assert manifest.fim and tok.fim
    train, heldout = split_files(PretrainConfig(out_dir=out, corpus=corpus))
    assert manifest.summary["train_files"] == len(train)
    assert manifest.summary["heldout_files"] == len(heldout)
    assert manifest.summary["config"]["corpus"] == str(corpus)
    assert manifest.summary["heldout_bits_per_byte"] > 0
    # the tokenizer is this corpus's (its training split's), with the FIM sentinels
    own = train_tokenizer([read_text(p) for p in train], 300, fim=True)
    assert tok.to_json() == own.to_json()
    gen = torch.Generator().manual_seed(0)
    comps = [
        complete(model, tok, RUST[:60], RUST[60:], 8, 0.7, 0.95, gen, stop_logprob=None)
        for _ in range(4)
    ]
    assert all(c.token_ids and "\n" not in c.text for c in comps)
    with torch.no_grad():
        total = score_actions(model, tok, comps).total
    torch.testing.assert_close(
        total, torch.tensor([c.logprob_total for c in comps]), atol=1e-4, rtol=0
    )


def test_a_corpus_too_small_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    one = tmp_path / "one"
    _write(one, "main.rs", RUST)
    with pytest.raises(CorpusError, match="at least 2"):
        split_files(PretrainConfig(out_dir=tmp_path / "x", corpus=one))
    tiny = tmp_path / "tiny"
    _write(tiny, "a.rs", "fn a() {}\n")
    _write(tiny, "b.rs", "fn b() {}\n")
    with pytest.raises(CorpusError, match="fewer than one window"):
        pretrain(
            PretrainConfig(out_dir=tmp_path / "y", corpus=tiny, vocab_size=300, progress=False)
        )
    # the command line says why, in one line, and exits 2
    assert cli_main(["pretrain", "--out", str(tmp_path / "z"), "--corpus", str(one)]) == 2
    assert "at least 2" in capsys.readouterr().err
    missing = str(tmp_path / "missing")
    assert cli_main(["pretrain", "--out", str(tmp_path / "z"), "--corpus", missing]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_continue_from_a_left_to_right_base_into_fill_in_the_middle(
    corpus: Path, tmp_path: Path
) -> None:
    """`--init CKPT --fim-rate R`: the sentinels are appended to the base's vocabulary (every
    other token keeps its id and its embedding), the architecture and weights are the base's."""
    small = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)
    common = dict(
        corpus=corpus,
        vocab_size=300,
        batch_size=4,
        warmup_iters=2,
        eval_every=100,
        gate_examples=10,
        progress=False,
        model=small,
    )
    base = pretrain(PretrainConfig(out_dir=tmp_path / "base", max_iters=4, **common))
    base_model, base_tok, base_manifest = load_checkpoint(base)
    assert not base_tok.fim
    # zero steps: exactly the base, grown by three rows at the mean embedding
    grown = pretrain(
        PretrainConfig(out_dir=tmp_path / "grown", init=base, fim_rate=0.5, max_iters=0, **common)
    )
    model, tok, manifest = load_checkpoint(grown)
    assert manifest.fim and tok.fim_ids == (300, 301, 302) and tok.vocab_size == 303
    assert manifest.summary["init"] == {
        "path": str(base),
        "version": 0,
        "weights_sha256": base_manifest.weights_sha256,
    }
    text = (STDLIB / "textwrap.py").read_text(encoding="utf-8")[:2000]
    assert tok.encode(text) == base_tok.encode(text)
    new_rows = model.wte.weight[300:]
    torch.testing.assert_close(model.wte.weight[:300], base_model.wte.weight)
    torch.testing.assert_close(
        new_rows, base_model.wte.weight.mean(0).expand(3, -1), atol=1e-2, rtol=0
    )  # bfloat16 storage
    torch.testing.assert_close(model.h[0].mlp.c_fc.weight, base_model.h[0].mlp.c_fc.weight)
    # and steps train it: the suffix-reading checkpoint completes with the suffix
    fim = pretrain(
        PretrainConfig(out_dir=tmp_path / "fim", init=base, fim_rate=0.5, max_iters=4, **common)
    )
    model, tok, manifest = load_checkpoint(fim)
    assert manifest.fim and manifest.summary["iters"] == 4
    comp = complete(
        model,
        tok,
        RUST[:60],
        RUST[60:],
        8,
        0.7,
        0.95,
        torch.Generator().manual_seed(0),
        stop_logprob=None,
    )
    assert tok.fim_ids is not None and tok.fim_ids[1] in comp.context_token_ids
