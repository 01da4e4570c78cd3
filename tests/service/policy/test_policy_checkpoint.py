"""Checkpoints: round trip, hash verification, no unpickling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tabloop.core.policy.checkpoint import (
    MANIFEST_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    sha256_file,
)
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer


def _logits(model: GPT, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def test_round_trip(tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer) -> None:
    d = save_checkpoint(
        tmp_path / "v3", tiny_model, tiny_tokenizer, version=3, parent=2, summary={"steps": 10}
    )
    model, tok, manifest = load_checkpoint(d)
    ids = tiny_tokenizer.encode("def f(x):\n    return x")
    assert torch.equal(_logits(model, ids), _logits(tiny_model, ids))
    assert tok.to_json() == tiny_tokenizer.to_json()
    assert (manifest.version, manifest.parent, manifest.summary) == (3, 2, {"steps": 10})
    assert manifest.weights_sha256 == sha256_file(d / WEIGHTS_FILE)
    assert manifest.tokenizer_sha256 == sha256_file(d / TOKENIZER_FILE)
    assert manifest.config == tiny_model.config.to_dict()
    assert read_manifest(d) == manifest
    assert not model.training


def test_bfloat16_storage_loads_as_float32(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    d = save_checkpoint(tmp_path / "bf16", tiny_model, tiny_tokenizer, 0, None, dtype="bfloat16")
    model, _, manifest = load_checkpoint(d)
    assert manifest.weights_dtype == "bfloat16"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tiny_tokenizer.encode("import json")
    torch.testing.assert_close(_logits(model, ids), _logits(tiny_model, ids), atol=0.05, rtol=0.05)


def test_tampered_weights_are_refused(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 1, 0)
    data = bytearray((d / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0x01
    (d / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(d)


def test_tampered_tokenizer_is_refused(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 1, 0)
    (d / TOKENIZER_FILE).write_text((d / TOKENIZER_FILE).read_text().replace("<|eof|>", "<|eoF|>"))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(d)


def test_missing_or_bad_manifest(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    with pytest.raises(CheckpointError, match="no manifest"):
        load_checkpoint(tmp_path / "nothing")
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 1, 0)
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    manifest["format"] = "something-else"
    (d / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format"):
        load_checkpoint(d)
    (d / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not JSON"):
        load_checkpoint(d)


def test_no_silent_overwrite(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 1, 0)
    with pytest.raises(CheckpointError, match="already"):
        save_checkpoint(d, tiny_model, tiny_tokenizer, 2, 1)
    save_checkpoint(d, tiny_model, tiny_tokenizer, 2, 1, overwrite=True)
    assert read_manifest(d).version == 2
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [MANIFEST_FILE, WEIGHTS_FILE, TOKENIZER_FILE]
    )


def test_loading_never_unpickles(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 1, 0)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load / pickle must not be used to load a checkpoint")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr("pickle.load", refuse)
    monkeypatch.setattr("pickle.loads", refuse)
    load_checkpoint(d)


# --- languages and fill-in-the-middle in the manifest ---------------------------------------
BASE = Path(__file__).resolve().parents[3] / "tabloop" / "core" / "policy" / "base"


def test_the_shipped_base_is_python_and_says_whether_it_reads_the_suffix() -> None:
    """The shipped base loads, names python, and its manifest's `fim` is its tokenizer's."""
    _, tok, manifest = load_checkpoint(BASE)
    assert manifest.languages == ("python",)
    assert manifest.fim is tok.fim


def test_a_manifest_without_languages_or_fim_reads_as_python_left_to_right(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    """A checkpoint written before both fields: absent means python and no FIM."""
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 0, None)
    raw = json.loads((d / MANIFEST_FILE).read_text())
    for field in ("languages", "fim", "fim_format"):
        raw.pop(field, None)
    (d / MANIFEST_FILE).write_text(json.dumps(raw))
    manifest = read_manifest(d)
    assert manifest.languages == ("python",) and manifest.fim is False
    assert load_checkpoint(d)[2].fim is False


def test_languages_and_fim_round_trip(
    tmp_path: Path, tiny_model: GPT, small_code: list[str]
) -> None:
    from tabloop.core.policy.model import ModelConfig
    from tabloop.core.policy.tokenizer import train_tokenizer

    fim_tok = train_tokenizer(small_code, vocab_size=400, fim=True)
    cfg = ModelConfig.from_dict({**tiny_model.config.to_dict(), "vocab_size": 400})
    d = save_checkpoint(
        tmp_path / "fim", GPT(cfg), fim_tok, 0, None, languages=["rust", "typescript"]
    )
    raw = json.loads((d / MANIFEST_FILE).read_text())
    assert raw["languages"] == ["rust", "typescript"]
    assert raw["fim"] is True and raw["fim_format"] == "psm"
    _, tok, manifest = load_checkpoint(d)
    assert manifest.languages == ("rust", "typescript") and manifest.fim and tok.fim


def test_a_manifest_that_disagrees_with_its_tokenizer_is_refused(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer
) -> None:
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 0, None)
    raw = json.loads((d / MANIFEST_FILE).read_text())
    assert raw["fim"] is False and "fim_format" not in raw
    (d / MANIFEST_FILE).write_text(json.dumps({**raw, "fim": True, "fim_format": "psm"}))
    with pytest.raises(CheckpointError, match="sentinels"):
        load_checkpoint(d)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"languages": "python"}, "languages"),
        ({"languages": ["python", 3]}, "languages"),
        ({"fim": "yes"}, "fim"),
        ({"fim": True}, "format"),
        ({"fim": True, "fim_format": "spm"}, "format"),
    ],
)
def test_bad_language_or_fim_fields(
    tmp_path: Path, tiny_model: GPT, tiny_tokenizer: CodeTokenizer, fields: dict, error: str
) -> None:
    d = save_checkpoint(tmp_path / "c", tiny_model, tiny_tokenizer, 0, None)
    raw = json.loads((d / MANIFEST_FILE).read_text())
    raw.pop("fim_format", None)
    (d / MANIFEST_FILE).write_text(json.dumps({**raw, **fields}))
    with pytest.raises(CheckpointError, match=error):
        read_manifest(d)
