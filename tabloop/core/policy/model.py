"""The policy: a small nanoGPT-style decoder-only transformer over code, plus a show/abstain gate.

The language-model part is plain GPT-2 (learned positions, pre-LayerNorm blocks, tied input and
output embeddings). The gate is a logistic head that decides, *after* a completion has been
sampled, whether to show it. It reads the final hidden state at the completion's last token and
a few confidence features (the completion's summed and mean log-probability under the sampling
distribution, and its length), so the decision is conditioned on both the completion and how sure
the model was of it. The gate's copy head decides, before that, whether to show a copy proposal
instead (tabloop.core.recall): a logistic head on the proposal's evidence, on how the sampled
completion agrees with it and on the same hidden state the gate reads. See docs/MODEL.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Self

import torch
import torch.nn as nn
from torch.nn import functional as F

from tabloop.core.person import PERSON_INPUTS
from tabloop.core.policy.device import activation_dtype, compute, model_device
from tabloop.core.recall import COPY_INIT, RECALL_INPUTS

# Gate inputs besides the hidden state, in this order (see `gate_features`).
GATE_FEATURES = ("mean_logprob", "sum_logprob", "log1p_tokens", "log1p_bytes")


@dataclass
class ModelConfig:
    vocab_size: int = 4096  # tokenizer vocabulary, special tokens included
    block_size: int = 256  # longest sequence (context + completion) the model sees, in tokens
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 256  # width of the residual stream
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * n_embd
    dropout: float = 0.0  # dropout in attention/MLP/embeddings during training
    gate_scale: float = 4.0  # initial gate: slope of logit(show) in the mean token log-prob
    gate_threshold: float = -0.7  # initial gate: mean token log-prob (nats) where p(show) = 1/2

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


class KVCache:
    """Preallocated keys/values for incremental decoding of one batch (written in place), on
    `device`, in the dtype activations come out in there (bf16 under a GPU's autocast), for
    `positions` tokens per row (default: the whole block)."""

    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        device: torch.device | None = None,
        positions: int | None = None,
    ):
        device = device or torch.device("cpu")
        hs = config.n_embd // config.n_head
        positions = config.block_size if positions is None else positions
        assert 0 < positions <= config.block_size, "a cache of 1 to block_size positions"
        shape = (config.n_layer, batch, config.n_head, positions, hs)
        dtype = activation_dtype(device)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = 0  # tokens already in the cache


class RaggedKVCache(KVCache):
    """A batch of sequences of different lengths decoded together: the prompts are prefilled
    right-padded (causal attention keeps every real position off the padding), then each step
    writes one token per row at that row's own length and attends to its own positions only.
    `lengths` is set after the prefill (each row's real prompt length); a row that is not
    `advance`d by a step keeps its length (its write lands on a position it never reads)."""

    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        device: torch.device | None = None,
        positions: int | None = None,
    ):
        super().__init__(config, batch, device, positions)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.k.device)  # real tokens
        self.advance = torch.ones(batch, dtype=torch.bool, device=self.k.device)  # real steps

    def write_index(self) -> torch.Tensor:
        """Each row's position for this step (a finished row at the end of the block rewrites
        its last slot: it is never read again)."""
        return self.lengths.clamp(max=self.k.size(3) - 1)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices, in their new order): the others' keys and values are
        dropped, so later steps compute nothing for them."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self.advance = self.advance.index_select(0, rows)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if isinstance(cache, RaggedKVCache) and cache.pos > 0:
            assert T == 1, "a ragged cache decodes one token per row at a time"
            at = cache.write_index()
            rows = torch.arange(B, device=x.device)
            cache.k[layer, rows, :, at] = k[:, :, 0]
            cache.v[layer, rows, :, at] = v[:, :, 0]
            end = int(at.max()) + 1
            keys = torch.arange(end, device=x.device) <= at.unsqueeze(
                1
            )  # (B, end): each row's own positions
            y = F.scaled_dot_product_attention(
                q,
                cache.k[layer, :B, :, :end],
                cache.v[layer, :B, :, :end],
                attn_mask=keys[:, None, None, :],
            )
        else:
            causal = True
            if cache is not None:
                # prefill (empty cache, causal over the prompt) or one new token attending to all
                assert cache.pos == 0 or T == 1, "KV cache: a prefill or one token at a time"
                end = cache.pos + T
                cache.k[layer, :B, :, cache.pos : end] = k
                cache.v[layer, :B, :, cache.pos : end] = v
                k, v = cache.k[layer, :B, :, :end], cache.v[layer, :B, :, :end]
                causal = cache.pos == 0
            if last is not None:  # only each row's query at `last`, over the keys up to it
                assert causal, "`last` is for a prompt's pass, not a decoding step"
                q = q[torch.arange(B, device=x.device), :, last].unsqueeze(2)
                keys = torch.arange(T, device=x.device) <= last.unsqueeze(1)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=keys[:, None, None, :])
                y = y.transpose(1, 2).contiguous().view(B, 1, C)
                projected: torch.Tensor = self.c_proj(y)
                return projected
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=causal and T > 1,
                dropout_p=self.dropout if self.training else 0.0,
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd)
        self.c_proj = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))
        return out


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`last` (B,): compute each row's output at that position only, (B, 1, C); the keys
        and values of every position still go into the cache."""
        a = self.attn(self.ln_1(x), cache, layer, last)
        if last is not None:
            x = x[torch.arange(x.size(0), device=x.device), last].unsqueeze(1)
        x = x + a
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class CopyHead(nn.Module):
    """logit p(copy) = w . inputs + b + w_h . h + w_p . person: a linear logit on the copy
    proposal's inputs (its evidence), plus one on the hidden state the gate reads (h, at the end
    of the model's own completion), so that the loop can learn where in the code copies are kept
    or rejected, and one on the person and the moment (tabloop.core.person). `hidden` and
    `person` start at 0: the evidence alone decides until the loop has learned otherwise. Its
    parameters are made without drawing from the random generator (set by init_copy), so that
    the rest of the model initialises from a seed exactly as it did before the head existed."""

    def __init__(self, inputs: int, n_embd: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, inputs))
        self.bias = nn.Parameter(torch.zeros(1))
        self.hidden = nn.Parameter(torch.zeros(1, n_embd))
        self.person = nn.Parameter(torch.zeros(1, len(PERSON_INPUTS)))

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, person: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, 1) from the inputs (B, len(RECALL_INPUTS)), the hidden states (B, n_embd) and
        the person's inputs (B, len(PERSON_INPUTS); None: nothing known, all 0)."""
        out = F.linear(x, self.weight, self.bias) + F.linear(h, self.hidden)
        return out if person is None else out + F.linear(person, self.person)


# logit p(extend) of a checkpoint made before the extend head: about one request in eight is
# sampled to the end of its line rather than cut at the confidence stop, so the loop sees what
# longer suggestions earn where the people are (tabloop.core.policy.sampling)
EXTEND_INIT = -2.0
# logit p(more lines) of a checkpoint made before the lines head: no leaning either way, half the
# copies with lines after their first show them, and the loop learns where they pay
LINES_INIT = 0.0


class ExtendHead(nn.Module):
    """How far to suggest: logit p(longer) = b + w_h . h + w_p . person. As `extend`, drawn at
    the first token the confidence stop would cut: go on to the end of the line (`h` the hidden
    state at the last token kept). As `lines`, drawn after a copy whose proposal has lines after
    its first: show them too (`h` the hidden state at the end of the sampled completion).
    `person`: the person and the moment (tabloop.core.person) on the longer text. Made without
    drawing from the random generator (set by init_extend)."""

    def __init__(self, n_embd: int, bias: float = EXTEND_INIT):
        super().__init__()
        self.bias = nn.Parameter(torch.full((1,), bias))
        self.hidden = nn.Parameter(torch.zeros(1, n_embd))
        self.person = nn.Parameter(torch.zeros(1, len(PERSON_INPUTS)))

    def forward(self, h: torch.Tensor, person: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) from the hidden states (B, n_embd) and the person's inputs (None: all 0)."""
        out = F.linear(h, self.hidden, self.bias)
        if person is not None:
            out = out + F.linear(person, self.person)
        squeezed: torch.Tensor = out.squeeze(-1)
        return squeezed


class Gate(nn.Module):
    """logit p(show) = w_h . h + w_f . features + b + w_p . person; starts as a pure confidence
    threshold. `person` (tabloop.core.person.PERSON_INPUTS) starts at 0 and draws nothing from
    the random generator, like the copy head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.hidden = nn.Linear(config.n_embd, 1, bias=False)
        self.features = nn.Linear(len(GATE_FEATURES), 1)
        # logit p(copy) from tabloop.core.recall.recall_inputs (a proposal's evidence)
        self.copy = CopyHead(len(RECALL_INPUTS), config.n_embd)
        self.person = nn.Parameter(torch.zeros(1, len(PERSON_INPUTS)))
        # how far to suggest (ExtendHead): past the confidence stop, and a copy's next lines
        self.extend = ExtendHead(config.n_embd)
        self.lines = ExtendHead(config.n_embd, LINES_INIT)

    def forward(
        self, h: torch.Tensor, features: torch.Tensor, person: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.hidden(h) + self.features(features)
        if person is not None:
            out = out + F.linear(person, self.person)
        squeezed: torch.Tensor = out.squeeze(-1)
        return squeezed


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.vocab_size > 0 and config.block_size > 0, "empty vocabulary or context"
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.gate = Gate(config)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        init_gate(self.gate, config.gate_scale, config.gate_threshold)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # decodes rows of different lengths in one cache (RaggedKVCache); a backend that does not
    # (tabloop.core.policy.hf) gets its rows one at a time
    ragged = True
    # data-parallel ranks rebuild it from its config and weights (trainer/distributed.py)
    distributable = True
    # the token embedding (tied to the output layer) and the positions: what an update leaves
    # as pretrained unless UpdateConfig.train_embeddings
    embedding_names: tuple[str, ...] = ("wte.weight", "wpe.weight")
    # the KL reference of its updates is a separate model, the lineage's pretrained root; a
    # policy that holds its own (a LoRA adapter's base) says so and enters `reference()`
    holds_reference = False

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Compute as the KL reference, where the policy holds its own (holds_reference)."""
        raise NotImplementedError("the built-in model's reference is a separate model")

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once and excluding nothing else."""
        return sum(p.numel() for p in self.parameters())

    def new_cache(self, batch: int, device: torch.device, positions: int) -> KVCache:
        """A decoding cache for `batch` rows of at most `positions` tokens; one row gets the
        plain cache (its decode step skips the ragged bookkeeping, ~7% of a request)."""
        if batch > 1:
            return RaggedKVCache(self.config, batch, device, positions)
        return KVCache(self.config, 1, device, positions)

    def hidden(
        self, idx: torch.Tensor, cache: KVCache | None = None, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final (post-LayerNorm) hidden states for token ids idx (B, T).

        `last` (B,): a prompt's pass that needs only each row's state at that position (its
        last real token), (B, 1, C). The final block then computes the output of that position
        alone (a quarter of a prefill's work at 3 layers); every position's keys and values
        still go into `cache`."""
        B, T = idx.size()
        ragged_step = isinstance(cache, RaggedKVCache) and cache.pos > 0
        start = cache.pos if cache is not None and not ragged_step else 0
        assert start + T <= self.config.block_size, (
            f"sequence of {start + T} tokens exceeds block_size {self.config.block_size}"
        )
        if isinstance(cache, RaggedKVCache) and ragged_step:
            pos = cache.write_index().unsqueeze(1)  # (B, 1): each row at its own position
        else:
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.h):
            x = block(x, cache, i, last if i == len(self.h) - 1 else None)
        if isinstance(cache, RaggedKVCache) and ragged_step:
            cache.lengths += cache.advance.long()
        elif cache is not None:
            cache.pos += T
        out: torch.Tensor = self.ln_f(x)
        return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Next-token logits from hidden states (output embedding tied to wte)."""
        return F.linear(h, self.wte.weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training/eval entry point: logits for every position and the mean cross-entropy."""
        logits = self.logits(self.hidden(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

    def gate_logit(
        self, h_last: torch.Tensor, features: torch.Tensor, person: torch.Tensor | None = None
    ) -> torch.Tensor:
        """logit p(show) for a batch: h_last (B, C), gate_features(...) (B, 4) and the person's
        inputs (B, len(PERSON_INPUTS); None: all 0)."""
        out: torch.Tensor = self.gate(h_last, features, person)
        return out


def init_gate(gate: Gate, scale: float, threshold: float) -> None:
    """p(show) = sigmoid(scale * (mean_logprob - threshold)); hidden-state and person weights
    start at 0."""
    with torch.no_grad():
        gate.hidden.weight.zero_()
        gate.person.zero_()
        init_extend(gate)
        gate.features.weight.zero_()
        gate.features.weight[0, GATE_FEATURES.index("mean_logprob")] = scale
        gate.features.bias.fill_(-scale * threshold)
        init_copy(gate)


def init_extend(gate: Gate) -> None:
    """The extend and lines heads as a checkpoint made before them starts: their biases alone
    (EXTEND_INIT, LINES_INIT)."""
    with torch.no_grad():
        for head, bias in ((gate.extend, EXTEND_INIT), (gate.lines, LINES_INIT)):
            head.bias.fill_(bias)
            head.hidden.zero_()
            head.person.zero_()


def init_copy(gate: Gate) -> None:
    """The copy head as fit offline (tabloop.core.recall.COPY_INIT): a checkpoint made before
    the copy head had none, and starts from this."""
    with torch.no_grad():
        *weights, bias = COPY_INIT
        gate.copy.weight.copy_(torch.tensor([weights]))
        gate.copy.bias.fill_(bias)
        gate.copy.hidden.zero_()
        gate.copy.person.zero_()


def gate_features(
    sum_logprob: torch.Tensor, n_tokens: torch.Tensor, n_bytes: torch.Tensor
) -> torch.Tensor:
    """The gate's confidence/length inputs (B, 4); callers pass detached log-probs."""
    n = n_tokens.to(torch.float32)
    mean = sum_logprob / n.clamp(min=1.0)
    return torch.stack(
        [mean, sum_logprob, torch.log1p(n), torch.log1p(n_bytes.to(torch.float32))], dim=-1
    )


def configure_optimizer(
    model: GPT, weight_decay: float, learning_rate: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (nanoGPT); biases, norms and the gate are not decayed."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and not name.startswith("gate.") else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


@torch.no_grad()
def heldout_loss(model: GPT, rows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) per token over `rows` (N, T+1) of token ids, with
    dropout off, on the model's device (bf16 autocast on a GPU; the loss in float32). The
    pretraining evaluation and the deploy check both measure held-out code with it."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with compute(device):
            for i in range(0, rows.size(0), batch):
                chunk = rows[i : i + batch].to(device)
                _, loss = model(chunk[:, :-1], chunk[:, 1:])
                assert loss is not None
                total += float(loss) * chunk[:, 1:].numel()
                count += chunk[:, 1:].numel()
    finally:
        model.train(was_training)
    return total / max(count, 1)
