"""A Hugging Face causal LM as the policy: any open code model, with a LoRA adapter and the
decision heads on top.

The built-in transformer (tabloop.core.policy.model.GPT) and this backend offer the same
surface, which is all that sampling, scoring, the trainer's update, the deploy check and the
checkpoints use:

    config.{n_embd, block_size, vocab_size}   sizes
    hidden(idx, cache=None, last=None)          final (post-norm) hidden states
    logits(h)                                   next-token logits over the tokenizer's vocabulary
    forward(idx, targets)                       logits and mean cross-entropy (held-out loss)
    gate, gate_logit(h, features, person)       the decision heads (model.Gate), unchanged
    new_cache(batch, device, positions)         the decoding cache (`ragged`: more than 1 row)
    requires_grad_(flag)                        what an update may train
    holds_reference, reference()                the KL reference, where the policy holds it
    distributable                               data-parallel ranks can rebuild it

The base model is loaded from a local directory (`local_files_only`, `trust_remote_code=False`,
safetensors only) and stays frozen. The policy's own weights are a LoRA adapter (peft) on its
linear layers and the decision heads: that is all a checkpoint of this backend stores, a few
megabytes against the base's gigabytes (tabloop.core.policy.checkpoint). A fresh adapter has
B = 0, so it computes exactly what the base computes; `base_only()` turns it off for the KL
reference.

Decoding keeps one row per cache (a transformers DynamicCache): the HF models' ragged batching
needs attention masks the built-in model does without, and batched serving of large models is
the job of a serving engine such as vLLM (docs/MODEL.md).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tabloop.core.policy.model import GPT, Gate, ModelConfig, init_gate
from tabloop.core.policy.tokenizer import CodeTokenizer, HFTokenizer

# the largest context the policy uses, whatever the model's own limit: prefill time and the
# cache grow with it, and a completion needs the nearby code, not the whole file
MAX_BLOCK_SIZE = 2048
# the base's linear layers a fresh adapter adapts: attention and MLP projections
LORA_TARGETS = "all-linear"
# config fields of models whose forward scales or caps the logits (Gemma 2's softcapping,
# Granite's scaling): the policy's logits are the output layer's, so these are refused
UNSUPPORTED_LOGITS = ("final_logit_softcapping", "logits_scaling", "logit_scale")


class HFModelError(ValueError):
    """A model directory that cannot be the policy (missing files, pickled weights, logits its
    forward transforms), or a manifest that does not fit its base."""


@dataclass
class HFConfig(ModelConfig):
    """What a checkpoint of this backend carries about its model (manifest `config`): the sizes
    the rest of the code reads (vocab_size: the tokenizer's, logits are cut to it; block_size:
    context and completion tokens at most; n_embd: the hidden size the heads read), and:"""

    base_dir: str = ""  # the base model's directory (local, safetensors)
    base_sha256: str = ""  # base_sha256(base_dir): the base's identity, checked on load
    model_type: str = ""  # transformers' model_type (qwen2, llama, starcoder2, ...)
    lora_r: int = 8  # the adapter's rank; 0: no adapter, every weight trains (small models)
    lora_alpha: int = 16  # its scale is lora_alpha / lora_r
    backend: str = "hf"  # what load_checkpoint dispatches on


def base_sha256(directory: Path | str) -> str:
    """The base's identity: sha256 over the sha256 of its config, its tokenizer (and its
    tokenizer_config.json, where there is one) and each weights file."""
    d = Path(directory)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise HFModelError(f"{d} has no *.safetensors weights (pickled weights are refused)")
    h = hashlib.sha256()
    for f in [d / "config.json", d / "tokenizer.json", *files]:
        if not f.is_file():
            raise HFModelError(f"{f} is missing")
        h.update(f"{f.name}:{_file_sha256(f)}\n".encode())
    extra = d / "tokenizer_config.json"  # where it is: it names the end-of-text token
    if extra.is_file():
        h.update(f"{extra.name}:{_file_sha256(extra)}\n".encode())
    return h.hexdigest()


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    """A file's sha256, remembered per (path, size, mtime): a base is gigabytes, and every
    policy version checks it."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _SHA_CACHE[key] = h.hexdigest()
    return _SHA_CACHE[key]


class HFCache:
    """One row's decoding cache: a transformers DynamicCache and the tokens in it."""

    def __init__(self, config: Any):
        from transformers import DynamicCache

        self.past = DynamicCache(config=config)
        self.pos = 0


class HFPolicy(GPT):
    """A causal LM from a local directory, a LoRA adapter on it and the decision heads.

    A GPT to the code that takes a policy: it overrides every method that reads the built-in
    transformer (module docstring), and builds none of it."""

    ragged = False  # decodes one row per cache (module docstring)
    distributable = False  # one process updates it

    @property
    def embedding_names(self) -> tuple[str, ...]:  # type: ignore[override]
        """The base's token embedding (and its output layer where tied): frozen with the base
        under an adapter, left as pretrained in full fine-tuning unless train_embeddings."""
        emb = self.lm.get_input_embeddings().weight
        return tuple(n for n, p in self.named_parameters() if p is emb)

    @property
    def holds_reference(self) -> bool:  # type: ignore[override]
        """With an adapter, its KL reference is its own base (`reference()`)."""
        return self.adapted

    def reference(self) -> contextlib.AbstractContextManager[None]:
        return self.base_only()

    def __init__(self, lm: Any, config: HFConfig):
        nn.Module.__init__(self)  # not GPT's: no built-in transformer
        self.config: HFConfig = config
        self.lm: Any = lm  # a transformers PreTrainedModel
        self.gate = Gate(config)
        init_gate(self.gate, config.gate_scale, config.gate_threshold)
        self.requires_grad_(False)

    # --- what an update trains -----------------------------------------------------------
    @property
    def adapted(self) -> bool:
        """A LoRA adapter on a frozen base (else full fine-tuning: every weight trains)."""
        return self.config.lora_r > 0

    def trainable_names(self) -> list[str]:
        """The policy's own weights: the adapter's and the heads' (all, without an adapter)."""
        return [
            n
            for n, _ in self.named_parameters()
            if not self.adapted or "lora_" in n or n.startswith("gate.")
        ]

    def requires_grad_(self, requires_grad: bool = True) -> HFPolicy:
        """Only the adapter and the heads ever train; the base stays frozen."""
        own = set(self.trainable_names())
        for n, p in self.named_parameters():
            p.requires_grad_(requires_grad and n in own)
        return self

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The adapter's and the heads' weights: what a checkpoint stores."""
        params = dict(self.named_parameters())
        return {n: params[n] for n in self.trainable_names()}

    def load_policy_state(self, state: dict[str, torch.Tensor]) -> None:
        own = self.trainable_names()
        # made before the lines head: it keeps its initial weights (tabloop.core.policy.model)
        missing = set(own) - state.keys() - {n for n in own if n.startswith("gate.lines.")}
        extra = state.keys() - set(own)
        if missing or extra:
            raise HFModelError(
                f"adapter does not fit the base: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(extra)[:3]}"
            )
        params = dict(self.named_parameters())
        with torch.no_grad():
            for n in own:
                if n not in state:
                    continue
                if params[n].shape != state[n].shape:
                    raise HFModelError(
                        f"{n}: {tuple(state[n].shape)}, base wants {tuple(params[n].shape)}"
                    )
                params[n].copy_(state[n].to(params[n].dtype))

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """The base model alone: the adapter turned off (the KL reference). Only with an
        adapter: a fully fine-tuned policy no longer holds its base."""
        assert self.adapted, "a fully fine-tuned policy has no adapter to turn off"
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.lm.modules() if isinstance(m, BaseTunerLayer)]
        # peft's enable_adapters(True) makes the adapter trainable: what is frozen stays so
        flags = [(p, p.requires_grad) for p in self.parameters()]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m in layers:
                m.enable_adapters(True)
            for p, flag in flags:
                p.requires_grad_(flag)

    # --- the model surface (module docstring) --------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> HFPolicy:
        """A copy with its own adapter and heads; with an adapter the frozen base's tensors
        stay shared (the trainer copies the live policy for every candidate)."""
        if self.adapted:
            own = set(self.trainable_names())
            for n, t in [*self.named_parameters(), *self.named_buffers()]:
                if n not in own:
                    memo[id(t)] = t
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def new_cache(  # type: ignore[override]  # its own cache type
        self, batch: int, device: torch.device, positions: int
    ) -> HFCache:
        assert batch == 1, "this backend decodes one row per cache"
        return HFCache(self.lm.config)

    def hidden(  # type: ignore[override]  # its own cache type
        self, idx: torch.Tensor, cache: HFCache | None = None, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final (post-norm) hidden states for token ids idx (B, T), right-padded rows allowed
        (causal attention keeps every real position off the padding); `last` (B,): only each
        row's state at that position, (B, 1, C)."""
        start = 0 if cache is None else cache.pos
        T = idx.size(1)
        assert start + T <= self.config.block_size, (
            f"sequence of {start + T} tokens exceeds block_size {self.config.block_size}"
        )
        out = self.lm.get_decoder()(
            input_ids=idx,
            cache=None if cache is None else cache.past,
            use_cache=cache is not None,
        )
        if cache is not None:
            cache.pos += T
        h: torch.Tensor = out.last_hidden_state
        if last is not None:
            h = h[torch.arange(h.size(0), device=h.device), last].unsqueeze(1)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits over the tokenizer's tokens (a model's embedding rows past them
        are padding, never sampled)."""
        head = self.lm.get_output_embeddings()
        v = self.config.vocab_size
        return F.linear(h, head.weight[:v], None if head.bias is None else head.bias[:v])


def load_base(directory: Path | str, dtype: torch.dtype = torch.float32) -> Any:
    """The causal LM in `directory`: local files only, no remote code, safetensors only."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise HFModelError(f"{d} is not a Hugging Face model directory (no config.json)")
    if not list(d.glob("*.safetensors")):
        raise HFModelError(f"{d} has no *.safetensors weights (pickled weights are refused)")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        lm: Any = AutoModelForCausalLM.from_pretrained(
            d, local_files_only=True, trust_remote_code=False, use_safetensors=True, dtype=dtype
        )
    except (OSError, ValueError, KeyError) as e:
        raise HFModelError(f"cannot load the model in {d}: {e}") from e
    for name in UNSUPPORTED_LOGITS:  # what the model's own forward does to its logits
        if getattr(lm.config, name, None) not in (None, 1, 1.0):
            raise HFModelError(
                f"{lm.config.model_type} transforms its logits ({name}): not supported yet"
            )
    return lm.eval()


def add_adapter(lm: Any, r: int, alpha: int) -> Any:
    """A fresh LoRA adapter (B = 0: the base's outputs unchanged) on the base's linear layers;
    r = 0: none (full fine-tuning)."""
    if r == 0:
        return lm
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return inject_adapter_in_model(cfg, lm)


def new_policy(
    directory: Path | str, r: int = 8, alpha: int = 16
) -> tuple[HFPolicy, CodeTokenizer]:
    """The base in `directory` as a policy: a fresh adapter and heads as the built-in model's
    start (the gate a confidence threshold)."""
    d = Path(directory).resolve()
    sha = base_sha256(d) if (d / "config.json").is_file() else ""
    lm = add_adapter(_base_for(d, sha, r), r, alpha)
    tokenizer = HFTokenizer.from_dir(d)
    config = HFConfig(
        n_layer=int(lm.config.num_hidden_layers),
        n_head=int(lm.config.num_attention_heads),
        base_dir=str(d),
        base_sha256=sha,
        model_type=str(lm.config.model_type),
        n_embd=int(lm.config.hidden_size),
        block_size=_position_limit(lm.config),
        vocab_size=tokenizer.vocab_size,
        lora_r=r,
        lora_alpha=alpha,
    )
    return HFPolicy(lm, config).eval(), tokenizer


def policy_from_config(config: HFConfig) -> tuple[HFPolicy, CodeTokenizer]:
    """The policy a checkpoint describes, before its own weights are loaded: the base checked
    against its recorded sha256."""
    d = Path(config.base_dir)
    got = base_sha256(d)
    if got != config.base_sha256:
        raise HFModelError(
            f"the base model in {d} has sha256 {got}, the policy was trained on "
            f"{config.base_sha256}: refusing to load"
        )
    tokenizer = HFTokenizer.from_dir(d)
    if tokenizer.vocab_size != config.vocab_size:
        raise HFModelError(
            f"{d}'s tokenizer has {tokenizer.vocab_size} tokens, the policy {config.vocab_size}"
        )
    if config.lora_r < 0 or (config.lora_r > 0 and config.lora_alpha <= 0):
        raise HFModelError(
            f"lora_r {config.lora_r}, lora_alpha {config.lora_alpha}: not an adapter"
        )
    lm = add_adapter(
        _base_for(d, config.base_sha256, config.lora_r), config.lora_r, config.lora_alpha
    )
    limit = _position_limit(lm.config)
    if config.n_embd != lm.config.hidden_size or not 0 < config.block_size <= limit:
        raise HFModelError(
            f"the manifest's n_embd {config.n_embd} and block_size {config.block_size} do not "
            f"fit the base (hidden size {lm.config.hidden_size}, at most {limit} positions)"
        )
    return HFPolicy(lm, config).eval(), tokenizer


def _position_limit(cfg: Any) -> int:
    """The most positions the policy reads: the base's own limit, at most MAX_BLOCK_SIZE."""
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return min(int(limit or MAX_BLOCK_SIZE), MAX_BLOCK_SIZE)


# the loaded bases of this process, by (directory, sha256): every adapted policy on one base
# shares its frozen weights (live, canary, the trainer's versions and candidates), so a second
# version costs its adapter, not another copy of the model
_BASES: dict[tuple[str, str], Any] = {}
_BASES_LOCK = threading.Lock()


def _base_for(d: Path, sha256: str, r: int) -> Any:
    """A model for a policy on the base in `d`: with an adapter (r > 0), a new module tree whose
    frozen weights and buffers are those of the process's one copy of the base; without (full
    fine-tuning, whose weights train), a copy of its own."""
    if r == 0:
        return load_base(d)
    key = (str(d), sha256)
    with _BASES_LOCK:  # the policy refresh, the trainer and an upload's check may all load it
        if key not in _BASES:
            _BASES[key] = load_base(d).requires_grad_(False)
        base = _BASES[key]
    return _sharing(base)


def _sharing(base: Any) -> Any:
    """A model of `base`'s architecture built on the meta device (no memory), then given
    `base`'s own parameter and buffer objects: the same tensors, a separate module tree for
    an adapter to be injected into."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm: Any = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)  # type: ignore[no-untyped-call]
    tensors = dict(base.named_parameters(remove_duplicate=False))
    tensors.update(dict(base.named_buffers(remove_duplicate=False)))
    for name, module in lm.named_modules():
        for kind in ("_parameters", "_buffers"):
            for leaf in list(getattr(module, kind)):
                full = f"{name}.{leaf}" if name else leaf
                if full in tensors:
                    getattr(module, kind)[leaf] = tensors[full]
    missing = [n for n, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    assert not missing, f"weights the base does not have: {missing[:3]}"
    return lm.eval()
