"""Policy checkpoints: a directory of safetensors weights, the tokenizer JSON and a manifest.

    <dir>/model.safetensors   weights (float32, or bfloat16 to halve the size; loaded as float32)
    <dir>/tokenizer.json      the HF tokenizers JSON
    <dir>/manifest.json       {"format", "version", "parent", "weights": {file, sha256, dtype,
                              bytes}, "tokenizer": {file, sha256}, "config", "languages",
                              "fim", ["fim_format",] "summary", "created_at"}

`languages`: the language ids (tabloop/core/policy/languages.py) the base was pretrained on; a
manifest without the field is read as ["python"] (every checkpoint written before the field
existed, the shipped base among them, was pretrained on the Python standard library). `fim`:
the tokenizer has the fill-in-the-middle sentinels and the model reads the suffix in
`fim_format` (tabloop/core/policy/context.py); absent means false. It is written from the tokenizer,
and loading refuses a manifest that disagrees with its tokenizer.

Loading checks both SHA-256 sums before reading a byte of either file's content into a model,
and never unpickles (safetensors only). Each file is written to a temporary name and renamed
into place, the manifest last, so a reader sees either a consistent checkpoint or a hash
mismatch (CheckpointError), never a half-written file. Other entries in the directory (such as
pretraining's `resume/` state) are left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tabloop.core.person import PERSON_INPUTS
from tabloop.core.policy.hf import (
    HFConfig,
    HFPolicy,
    new_policy,
    policy_from_config,
)
from tabloop.core.policy.languages import DEFAULT_LANGUAGES, EXTENSION_LANGUAGES
from tabloop.core.policy.model import GPT, ModelConfig
from tabloop.core.policy.tokenizer import CodeTokenizer

FORMAT = "tabloop-policy/1"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
FIM_FORMAT = "psm"  # <|fim_prefix|> prefix <|fim_suffix|> following lines <|fim_middle|>
COPY_HEAD = frozenset({"gate.copy.weight", "gate.copy.bias"})
COPY_HIDDEN = "gate.copy.hidden"  # the copy head's hidden-state weights (0 where absent)
# the heads' weights on the person and the moment (tabloop.core.person; 0 where absent)
PERSON_WEIGHTS = ("gate.person", "gate.copy.person")
EXTEND_HEAD = frozenset({"gate.extend.bias", "gate.extend.hidden", "gate.extend.person"})
LINES_HEAD = frozenset({"gate.lines.bias", "gate.lines.hidden", "gate.lines.person"})
ALL_LANGUAGES = tuple(sorted(set(EXTENSION_LANGUAGES.values())))
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckpointError(Exception):
    """A checkpoint is missing, malformed, or its files do not match their recorded hashes."""


@dataclass(frozen=True)
class Manifest:
    version: int  # policy version (the service's number; 0 for the pretrained base)
    parent: int | None  # version this one was trained from (None for the base)
    weights_sha256: str  # sha256 of model.safetensors: the artifact's identity
    weights_dtype: str  # storage dtype of the weights ("float32" or "bfloat16")
    weights_bytes: int  # size of model.safetensors
    tokenizer_sha256: str  # sha256 of tokenizer.json
    config: dict[str, Any]  # ModelConfig as a dict
    summary: dict[str, Any] = field(default_factory=dict)  # training summary (free-form JSON)
    created_at: str = ""  # RFC 3339 UTC
    languages: tuple[str, ...] = DEFAULT_LANGUAGES  # language ids the base was pretrained on
    fim: bool = False  # reads the suffix (fill-in-the-middle, FIM_FORMAT)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "parent": self.parent,
            "weights": {
                "file": WEIGHTS_FILE,
                "sha256": self.weights_sha256,
                "dtype": self.weights_dtype,
                "bytes": self.weights_bytes,
            },
            "tokenizer": {"file": TOKENIZER_FILE, "sha256": self.tokenizer_sha256},
            "config": self.config,
            "languages": list(self.languages),
            "fim": self.fim,
            **({"fim_format": FIM_FORMAT} if self.fim else {}),
            "summary": self.summary,
            "created_at": self.created_at,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        if d.get("format") != FORMAT:
            raise CheckpointError(f"unknown checkpoint format {d.get('format')!r}")
        languages = d.get("languages", list(DEFAULT_LANGUAGES))
        if not isinstance(languages, list) or not all(isinstance(x, str) for x in languages):
            raise CheckpointError(f"manifest languages must be a list of ids, not {languages!r}")
        fim = d.get("fim", False)
        if not isinstance(fim, bool):
            raise CheckpointError(f"manifest fim must be true or false, not {fim!r}")
        if fim and d.get("fim_format") != FIM_FORMAT:
            raise CheckpointError(f"unknown fill-in-the-middle format {d.get('fim_format')!r}")
        try:
            return cls(
                version=int(d["version"]),
                parent=None if d["parent"] is None else int(d["parent"]),
                weights_sha256=str(d["weights"]["sha256"]),
                weights_dtype=str(d["weights"]["dtype"]),
                weights_bytes=int(d["weights"]["bytes"]),
                tokenizer_sha256=str(d["tokenizer"]["sha256"]),
                config=dict(d["config"]),
                summary=dict(d.get("summary") or {}),
                created_at=str(d.get("created_at", "")),
                languages=tuple(languages),
                fim=fim,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"malformed manifest: {e!r}") from e


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(
    out_dir: Path | str,
    model: GPT,
    tokenizer: CodeTokenizer,
    version: int,
    parent: int | None,
    summary: dict[str, Any] | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    languages: Sequence[str] = DEFAULT_LANGUAGES,
) -> Path:
    """Write a checkpoint into out_dir (created if needed); returns its path.

    `languages`: what the base was pretrained on (a trained policy keeps its base's); `fim`
    comes from the tokenizer.

    Overwriting first removes the old manifest, so the directory is not a checkpoint (rather
    than a mismatched one) until the new manifest lands.
    """
    out = Path(out_dir)
    if dtype not in _DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    if (out / MANIFEST_FILE).exists() and not overwrite:
        raise CheckpointError(f"{out} already holds a checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    # a Hugging Face policy stores its own weights only: the adapter and the heads
    own = model.policy_state() if isinstance(model, HFPolicy) else model.state_dict()
    state = {k: v.detach().to("cpu", _DTYPES[dtype]).contiguous() for k, v in own.items()}
    weights = _write_atomic(out / WEIGHTS_FILE, lambda p: save_file(state, str(p)))
    tok = _write_atomic(
        out / TOKENIZER_FILE, lambda p: p.write_text(tokenizer.to_json(), encoding="utf-8")
    )
    manifest = Manifest(
        version=version,
        parent=parent,
        weights_sha256=sha256_file(weights),
        weights_dtype=dtype,
        weights_bytes=weights.stat().st_size,
        tokenizer_sha256=sha256_file(tok),
        config=model.config.to_dict(),
        summary=summary or {},
        created_at=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        languages=tuple(languages),
        fim=tokenizer.fim,
    )
    text = json.dumps(manifest.to_json(), indent=2) + "\n"
    # the manifest goes last: it commits the files above (a reader verifies their hashes)
    _write_atomic(out / MANIFEST_FILE, lambda p: p.write_text(text, encoding="utf-8"))
    return out


def rewrite_checkpoint(
    ckpt_dir: Path | str,
    model: GPT,
    tokenizer: CodeTokenizer,
    manifest: Manifest,
    summary: dict[str, Any],
) -> Path:
    """Write the checkpoint `manifest` describes again in place, with `model`'s weights and
    `summary`: its version, parent, weights dtype and languages kept (a refit or calibration of
    heads, not a new policy)."""
    return save_checkpoint(
        ckpt_dir,
        model,
        tokenizer,
        version=manifest.version,
        parent=manifest.parent,
        summary=summary,
        dtype=manifest.weights_dtype,
        overwrite=True,
        languages=manifest.languages,
    )


def _write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """Write via a temporary file in the same directory and rename over `path`."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        tmp.chmod(0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_manifest(ckpt_dir: Path | str) -> Manifest:
    """The manifest alone (no hashing, no weights): for registering a checkpoint."""
    path = Path(ckpt_dir) / MANIFEST_FILE
    try:
        return Manifest.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError as e:
        raise CheckpointError(f"no manifest at {path}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"manifest {path} is not JSON: {e}") from e


def verify_checkpoint(ckpt_dir: Path | str) -> Manifest:
    """Check both files against the manifest's SHA-256 sums; raise CheckpointError if not."""
    d = Path(ckpt_dir)
    manifest = read_manifest(d)
    for name, want in (
        (WEIGHTS_FILE, manifest.weights_sha256),
        (TOKENIZER_FILE, manifest.tokenizer_sha256),
    ):
        if not (d / name).is_file():
            raise CheckpointError(f"{d / name} is missing")
        got = sha256_file(d / name)
        if got != want:
            raise CheckpointError(
                f"{d / name} has sha256 {got}, manifest says {want}: refusing to load"
            )
    return manifest


def load_checkpoint(ckpt_dir: Path | str) -> tuple[GPT, CodeTokenizer, Manifest]:
    """Verify, then load (float32, eval mode). Never unpickles."""
    d = Path(ckpt_dir)
    manifest = verify_checkpoint(d)
    if manifest.config.get("backend") == "hf":
        hf, hf_tokenizer = _load_hf(d, manifest)
        return hf, hf_tokenizer, manifest
    config = ModelConfig.from_dict(manifest.config)
    try:
        state = load_file(str(d / WEIGHTS_FILE))
        tokenizer = CodeTokenizer.from_json((d / TOKENIZER_FILE).read_text(encoding="utf-8"))
    except Exception as e:  # safetensors/tokenizers raise their own or bare Exception types
        raise CheckpointError(f"cannot read checkpoint {d}: {e}") from e
    model = GPT(config)
    weights = {k: v.to(torch.float32) for k, v in state.items()}
    if not COPY_HEAD & weights.keys():
        # made before the gate's copy head: that head starts as fit offline (init_copy)
        weights.update({k: v for k, v in model.state_dict().items() if k in COPY_HEAD})
    if COPY_HIDDEN not in weights:
        # made before the copy head read the hidden state: the evidence alone decides, as then
        weights[COPY_HIDDEN] = torch.zeros(1, config.n_embd)
    for name in PERSON_WEIGHTS:
        # made before the heads read the person: they decide as they did then
        weights.setdefault(name, torch.zeros(1, len(PERSON_INPUTS)))
    if not EXTEND_HEAD & weights.keys():
        # made before the extend head: it starts as init_extend sets it (GPT() did)
        weights.update({k: v for k, v in model.state_dict().items() if k in EXTEND_HEAD})
    if not LINES_HEAD & weights.keys():
        # made before the lines head: likewise
        weights.update({k: v for k, v in model.state_dict().items() if k in LINES_HEAD})
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"weights in {d} do not fit the manifest's config: {e}") from e
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tokenizer.vocab_size} tokens, model expects {config.vocab_size}"
        )
    if tokenizer.fim != manifest.fim:
        raise CheckpointError(
            f"manifest says fim={manifest.fim}, but the tokenizer "
            f"{'has' if tokenizer.fim else 'lacks'} the fill-in-the-middle sentinels"
        )
    return model.eval(), tokenizer, manifest


def import_model(
    model_dir: Path | str, out_dir: Path | str, overwrite: bool = False, lora_r: int = 8
) -> Path:
    """A Hugging Face model directory as a base policy checkpoint (version 0, no parent): a
    fresh adapter of rank `lora_r` (the base's own outputs) and the heads as the built-in model
    starts them; `lora_r` 0: no adapter, the whole model trains and every checkpoint holds it
    (small models). Every language the service knows is its own (a code model is
    multilingual)."""
    try:
        model, tokenizer = new_policy(model_dir, r=lora_r)
    except ImportError:
        raise  # the hf extra is missing: the caller says what to install
    except Exception as e:  # a directory that is not a model: transformers' own errors too
        raise CheckpointError(str(e)) from e
    return save_checkpoint(
        out_dir,
        model,
        tokenizer,
        version=0,
        parent=None,
        summary={"base_model": model.config.base_dir, "model_type": model.config.model_type},
        overwrite=overwrite,
        languages=ALL_LANGUAGES,
    )


def _load_hf(d: Path, manifest: Manifest) -> tuple[HFPolicy, CodeTokenizer]:
    """A Hugging Face policy: its base (checked against the recorded sha256), a fresh adapter,
    then the checkpoint's adapter and heads."""
    try:
        model, tokenizer = policy_from_config(HFConfig.from_dict(manifest.config))
        model.load_policy_state(load_file(str(d / WEIGHTS_FILE)))
    except ImportError as e:
        raise CheckpointError(
            f"{d} is a Hugging Face policy: it needs `pip install 'tabloop[hf]'` ({e.name} is "
            "missing)"
        ) from e
    except Exception as e:  # safetensors, transformers and peft raise their own types
        raise CheckpointError(f"cannot load the Hugging Face policy in {d}: {e}") from e
    return model.eval(), tokenizer
