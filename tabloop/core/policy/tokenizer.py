"""Byte-level BPE over code (HF `tokenizers`), plus token healing.

Token healing: a cursor usually sits inside a token ("    return sel|"). Encoding the prefix as
is would end the context on a token the model rarely saw there (" sel" instead of " self"), and
the model would have to continue from that unnatural split. So `heal()` backs off the tokens of
the prefix's last pre-token word (at most `max_tokens` of them / `max_bytes` bytes), and returns
the text they covered as a *constraint*: generation must first re-emit exactly those bytes (each
constrained step only allows tokens consistent with the remaining bytes, see `allowed_tokens`),
and the completion shown to the user is what comes after them.

Control tokens: `<|eof|>` separates files in training and ends a generation. A tokenizer trained
for fill-in-the-middle (`train_tokenizer(..., fim=True)`) also has the three sentinels of the
PSM layout (`<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`, tabloop/core/policy/context.py);
their presence is what makes a checkpoint read the suffix.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOF_TOKEN = "<|eof|>"  # separates files in training; ends a generation
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
FIM_TOKENS = (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)  # fill-in-the-middle sentinels, PSM order
SPECIAL_TOKENS = (EOF_TOKEN, *FIM_TOKENS)  # every control token a tokenizer may have


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the byte-level alphabet back to raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass(frozen=True)
class Healing:
    """The prefix after token healing."""

    context_ids: list[int]  # prefix tokens with the healed tail removed
    constraint: bytes  # bytes generation must re-emit first (empty: no healing)


class CodeTokenizer:
    """A trained byte-level BPE tokenizer; special tokens in *input text* are plain text."""

    def __init__(
        self,
        tk: Tokenizer,
        eof: str = EOF_TOKEN,
        fim_tokens: tuple[str, str, str] | None = FIM_TOKENS,
        control: Iterable[int] = (),
    ):
        """`eof`: the token that ends a generation; `fim_tokens`: the (prefix, suffix, middle)
        sentinels, if the vocabulary has them (None: it has none); `control`: more control
        tokens (ids)."""
        self.tk = tk
        # user code containing "<|eof|>" (or a sentinel) must not turn into the control token
        self.tk.encode_special_tokens = True
        eof_id = tk.token_to_id(eof)
        assert eof_id is not None, f"tokenizer has no {eof} token"
        self.eof_id: int = eof_id
        fim = [i for i in (tk.token_to_id(t) for t in fim_tokens or ()) if i is not None]
        assert len(fim) in (0, 3), "a tokenizer has all three FIM sentinels or none"
        # (prefix, suffix, middle) sentinel ids; None: a left-to-right tokenizer
        self.fim_ids: tuple[int, int, int] | None = (fim[0], fim[1], fim[2]) if fim else None
        # control tokens: no bytes, never produced by encoding text, and end a generation
        self.special_ids: frozenset[int] = frozenset([eof_id, *(self.fim_ids or ()), *control])
        self._mask_cache: dict[bytes, torch.Tensor] = {}

    # --- serialisation -------------------------------------------------------------------
    @classmethod
    def from_json(cls, s: str) -> CodeTokenizer:
        return cls(Tokenizer.from_str(s))

    def to_json(self) -> str:
        return self.tk.to_str()

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    @property
    def fim(self) -> bool:
        """Trained for fill-in-the-middle: has the PSM sentinels."""
        return self.fim_ids is not None

    # --- encode / decode -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        tb = self.token_bytes
        return b"".join(tb[i] for i in ids)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Raw bytes of every token id (special tokens: empty, they never match text)."""
        out = [b""] * self.vocab_size
        for tok, i in self.tk.get_vocab().items():
            if i not in self.special_ids:
                out[i] = self._piece_bytes(tok, i)
        return out

    def _piece_bytes(self, piece: str, token_id: int) -> bytes:
        """A vocabulary piece's raw bytes: byte-level BPE's alphabet mapped back to bytes."""
        dec = _byte_decoder()
        return bytes(dec[c] for c in piece)

    @cached_property
    def _newline_ids(self) -> frozenset[int]:
        return frozenset(i for i, b in enumerate(self.token_bytes) if b"\n" in b)

    def has_newline(self, token_id: int) -> bool:
        return token_id in self._newline_ids

    @cached_property
    def _sorted_bytes(self) -> tuple[list[bytes], list[int]]:
        pairs = sorted((b, i) for i, b in enumerate(self.token_bytes) if b)
        return [b for b, _ in pairs], [i for _, i in pairs]

    @cached_property
    def _id_of_bytes(self) -> dict[bytes, int]:
        return {b: i for i, b in enumerate(self.token_bytes) if b}

    # --- token healing -------------------------------------------------------------------
    def heal(
        self,
        ids: list[int],
        word_ids: list[int | None] | None = None,
        max_tokens: int = 3,
        max_bytes: int = 24,
    ) -> Healing:
        """Back off the trailing tokens of the last pre-token word (bounded)."""
        if not ids:
            return Healing([], b"")
        n = 1
        if word_ids is not None and word_ids[-1] is not None:
            while (
                n < min(max_tokens, len(ids))
                and word_ids[-1 - n] == word_ids[-1]
                and len(self.decode_bytes(ids[-1 - n :])) <= max_bytes
            ):
                n += 1
        constraint = self.decode_bytes(ids[-n:])
        if len(constraint) > max_bytes:  # one huge token (a long whitespace run): keep it
            return Healing(list(ids), b"")
        return Healing(list(ids[:-n]), constraint)

    def encode_healed(self, text: str, max_tokens: int = 3, max_bytes: int = 24) -> Healing:
        """Encode text and heal its end in one go."""
        enc = self.tk.encode(text, add_special_tokens=False)
        return self.heal(enc.ids, enc.word_ids, max_tokens, max_bytes)

    def allowed_tokens(self, remaining: bytes) -> list[int]:
        """Tokens consistent with the remaining constraint: a prefix of it, or extending it."""
        assert remaining, "no constraint left"
        ids = self._id_of_bytes
        out = [ids[remaining[:k]] for k in range(1, len(remaining)) if remaining[:k] in ids]
        keys, vals = self._sorted_bytes
        lo = bisect.bisect_left(keys, remaining)
        hi = (
            len(keys) if (succ := _successor(remaining)) is None else bisect.bisect_left(keys, succ)
        )
        return out + vals[lo:hi]  # the tokens starting with `remaining` are one sorted run

    def allowed_mask(self, remaining: bytes) -> torch.Tensor:
        """`allowed_tokens` as a (vocab,) bool mask; cached (constraints repeat). Read-only."""
        mask = self._mask_cache.get(remaining)
        if mask is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[self.allowed_tokens(remaining)] = True
            if len(self._mask_cache) >= 4096:
                self._mask_cache.clear()
            self._mask_cache[remaining] = mask
        return mask


def _successor(b: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with b (None: no bound)."""
    stripped = b.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, fim: bool = False
) -> CodeTokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenizer regex, all 256 bytes in the base alphabet);
    `<|eof|>` is its first token, then with `fim` the three FIM sentinels (vocab_size counts
    them)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOF_TOKEN, *(FIM_TOKENS if fim else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    return CodeTokenizer(tk)


# fill-in-the-middle sentinels of the open code models, (prefix, suffix, middle) in PSM order:
# the layout tabloop.core.policy.context builds for every one of them
FIM_FAMILIES: dict[str, tuple[str, str, str]] = {
    "qwen": FIM_TOKENS,  # Qwen2.5-Coder (the same strings as our own)
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    "deepseek": (
        "<\uff5cfim\u2581begin\uff5c>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<\uff5cfim\u2581end\uff5c>",
    ),  # DeepSeek-Coder
    # CodeLlama: its pieces carry SentencePiece's space mark; plain ones in other conversions
    "codellama": ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"),
    "codellama-plain": ("<PRE>", "<SUF>", "<MID>"),
}
# the tokens that end a generation, the first the vocabulary has
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|eot_id|>", "<eos>")
# more tokens that end one: CodeLlama's end of an infilling
END_TOKENS = ("\u2581<EOT>", "<EOT>")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer(CodeTokenizer):
    """A model directory's own `tokenizer.json` (a Hugging Face fast tokenizer), with its own
    end-of-text token and fill-in-the-middle sentinels. Byte-level BPE (Qwen2.5-Coder,
    StarCoder2, DeepSeek-Coder, Llama 3) maps tokens to bytes as our own tokenizer does;
    a SentencePiece-style vocabulary (CodeLlama) maps `\u2581` to a space and `<0xNN>` to its
    byte, and other pieces to their UTF-8."""

    def __init__(self, tk: Tokenizer, eos: str | None = None):
        vocab = tk.get_vocab()
        eof = eos if eos in vocab else next((t for t in EOS_CANDIDATES if t in vocab), None)
        if eof is None:
            raise ValueError(f"no end-of-text token in the tokenizer (looked for {EOS_CANDIDATES})")
        self.fim_family = next(
            (k for k, f in FIM_FAMILIES.items() if all(t in vocab for t in f)), ""
        )
        added = [i for i, t in tk.get_added_tokens_decoder().items() if t.special]
        added += [vocab[t] for t in END_TOKENS if t in vocab]
        super().__init__(tk, eof, FIM_FAMILIES.get(self.fim_family), added)
        # byte-level BPE (its decoder maps the GPT-2 alphabet back to bytes), or SentencePiece
        self.byte_level = isinstance(tk.decoder, decoders.ByteLevel)
        self._added = frozenset(tk.get_added_tokens_decoder())

    @classmethod
    def from_dir(cls, directory: Path | str) -> HFTokenizer:
        """`tokenizer.json` of a model directory; its eos token from tokenizer_config.json."""
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"{d} has no tokenizer.json (a fast tokenizer is required)")
        eos = None
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            tok = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
            eos = tok.get("content") if isinstance(tok, dict) else tok
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), eos)

    def _piece_bytes(self, piece: str, token_id: int) -> bytes:
        if token_id in self._added:  # added text tokens are plain text, not byte-level
            return piece.encode("utf-8")
        if self.byte_level and all(c in _byte_decoder() for c in piece):
            return super()._piece_bytes(piece, token_id)
        if (m := _BYTE_TOKEN.fullmatch(piece)) is not None:  # SentencePiece's byte fallback
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
