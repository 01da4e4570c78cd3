"""Hugging Face model directories built locally, for tests and benchmarks: random weights from
a transformers config, and a byte-level BPE tokenizer trained here with the family's
fill-in-the-middle sentinels. Nothing is downloaded; the shapes are the real architectures'.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tabloop.core.policy.tokenizer import FIM_FAMILIES

EOS = "<|endoftext|>"
# the architectures the tests build, with their sentinel family (tokenizer.FIM_FAMILIES)
ARCHITECTURES: dict[str, str] = {"qwen2": "qwen", "llama": "", "starcoder2": "starcoder"}
# a tiny model: two layers, grouped-query attention as the real ones have
TINY: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
# Qwen2.5-Coder-0.5B's shape (its config.json), for benchmarks on a GPU
QWEN_05B: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}
QWEN_VOCAB_ROWS = 151936  # its embedding rows (tied to the output layer)


def train_family_tokenizer(texts: Iterable[str], vocab_size: int, family: str) -> Tokenizer:
    """A byte-level BPE as the open code models have, `EOS` and the family's sentinels added
    as special tokens ("" for none)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    special = [EOS, *(FIM_FAMILIES[family] if family else ())]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    return tk


def make_model_dir(
    out: Path | str,
    architecture: str,
    texts: Iterable[str],
    shape: dict[str, Any] | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    pad_vocab: int = 0,
) -> Path:
    """A model directory as `save_pretrained` writes it (config.json, model.safetensors) with
    tokenizer.json and tokenizer_config.json; `pad_vocab` more embedding rows than tokens, as
    real models pad theirs."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    family = ARCHITECTURES.get(architecture, "qwen")
    tk = train_family_tokenizer(texts, vocab_size, family)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}) + "\n")
    eos = tk.token_to_id(EOS)
    config = AutoConfig.for_model(
        architecture,
        vocab_size=tk.get_vocab_size() + pad_vocab,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=True,
        **(shape or TINY),
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(d, safe_serialization=True)
    return d


def main(argv: list[str] | None = None) -> None:
    """`python -m tabloop.testing.hf_models --out DIR [--arch qwen2] [--shape tiny|0.5b]`: a
    random-weight model directory for trying and benchmarking the Hugging Face backend without
    a download (its suggestions are noise; its sizes and speeds are the real shape's)."""
    import argparse
    import sysconfig

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else "")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen2")
    ap.add_argument("--shape", choices=("tiny", "0.5b"), default="tiny")
    ap.add_argument("--vocab", type=int, default=4096, help="tokens of the trained tokenizer")
    args = ap.parse_args(argv)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib.glob("*.py")]
    shape = TINY if args.shape == "tiny" else QWEN_05B
    # the real shape's embedding rows: a tokenizer trained here has fewer tokens
    pad = 0 if args.shape == "tiny" else QWEN_VOCAB_ROWS - args.vocab
    d = make_model_dir(args.out, args.arch, texts, shape, vocab_size=args.vocab, pad_vocab=pad)
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    print(f"{args.arch} ({args.shape}) written to {d}: {size / 1e6:.1f} MB of weights")


if __name__ == "__main__":
    main()
