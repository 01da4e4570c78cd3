"""Hugging Face causal LMs as the policy (tabloop.core.policy.hf): tiny random-weight Qwen2, Llama
and Starcoder2 models built here from their configs, with tokenizers trained here; no network.

Exact log-probabilities through sampling and rescoring, a fresh adapter equal to the base, an
update's adapter saved and loaded into a fresh process's policy, sentinels in user code kept as
text, and the checkpoint's size."""

from __future__ import annotations

import copy
import hashlib
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from tabloop.core.policy.checkpoint import (
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from tabloop.core.policy.context import prepare_context
from tabloop.core.policy.hf import HFModelError, HFPolicy, load_base, new_policy
from tabloop.core.policy.sampling import Prompt, complete_batch
from tabloop.core.policy.scoring import score_actions
from tabloop.core.policy.tokenizer import FIM_FAMILIES, CodeTokenizer, HFTokenizer
from tabloop.testing.hf_models import ARCHITECTURES, make_model_dir

SETTINGS = [(0.3, None), (0.7, 0.9), (1.0, 0.5), (1.6, 1.0)]


@pytest.fixture(scope="module")
def code() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8") for p in sorted((stdlib / "json").glob("*.py"))]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(arch: str, tmp_path_factory: pytest.TempPathFactory, code: list[str]) -> Path:
    # 7 embedding rows past the tokenizer's: real models pad theirs, and those are never drawn
    return make_model_dir(tmp_path_factory.mktemp(arch), arch, code, pad_vocab=7)


def _prompts(code: list[str], n: int, fim: bool, seed: int) -> list[Prompt]:
    gen = torch.Generator().manual_seed(seed)
    text = "\n".join(code)
    step = len(text) // (n + 1)
    return [
        Prompt(text[: (i + 1) * step], text[(i + 1) * step :][:300] if fim else "", 16, gen)
        for i in range(n)
    ]


def _mixed_gate(model: HFPolicy) -> None:
    with torch.no_grad():
        model.gate.features.weight.zero_()
        model.gate.features.bias.fill_(0.0)


def _sample(model: HFPolicy, tok: CodeTokenizer, code: list[str], seed: int = 1) -> list:
    out = []
    for i, (temp, top_p) in enumerate(SETTINGS):
        prompts = _prompts(code, 6, fim=i % 2 == 0, seed=seed + i)
        out += complete_batch(model, tok, prompts, temp, top_p)
    return out


def test_logged_logprobs_equal_recomputed(model_dir: Path, code: list[str]) -> None:
    model, tok = new_policy(model_dir)
    _mixed_gate(model)
    comps = _sample(model, tok, code)
    with torch.no_grad():
        scores = score_actions(model, tok, comps)
    logged = torch.tensor([c.logprob_total for c in comps])
    torch.testing.assert_close(scores.total, logged, atol=1e-5, rtol=0)
    per_token = torch.tensor([lp for c in comps for lp in c.token_logprobs])
    torch.testing.assert_close(scores.token_logprobs, per_token, atol=1e-5, rtol=0)
    assert any(c.shown for c in comps) and not all(c.shown for c in comps)
    assert any(c.heal_text for c in comps)
    assert all(t < tok.vocab_size for c in comps for t in c.token_ids)  # never a padding row


def test_fresh_adapter_is_the_base(model_dir: Path) -> None:
    model, _ = new_policy(model_dir)
    base = load_base(model_dir)
    ids = torch.randint(
        0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = base(input_ids=ids).logits[..., : model.config.vocab_size]
        got, _ = model(ids)
    assert torch.equal(got, want)


def test_an_update_saved_and_loaded_scores_the_same(
    model_dir: Path, code: list[str], tmp_path: Path
) -> None:
    model, tok = new_policy(model_dir)
    _mixed_gate(model)
    comps = _sample(model, tok, code)
    with torch.no_grad():
        before = score_actions(model, tok, comps).total
    model.requires_grad_(True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(
        ("lora_" in n or n.startswith("gate.")) == p.requires_grad
        for n, p in model.named_parameters()
    )
    opt = torch.optim.Adam(trainable, lr=1e-2)
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(comps))])
    for _ in range(3):
        loss = -(score_actions(model, tok, comps).total * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.requires_grad_(False)
    with torch.no_grad():
        after = score_actions(model, tok, comps).total
        with model.base_only():
            base_only = score_actions(model, tok, comps).tokens
    assert (after - before).abs().max() > 1e-3  # the adapter moved the policy
    fresh, _ = new_policy(model_dir)
    with torch.no_grad():
        fresh_tokens = score_actions(fresh, tok, comps).tokens
    torch.testing.assert_close(base_only, fresh_tokens, atol=1e-5, rtol=0)  # the KL reference

    ckpt = save_checkpoint(tmp_path / "v2", model, tok, version=2, parent=1)
    loaded, loaded_tok, manifest = load_checkpoint(ckpt)
    assert isinstance(loaded, HFPolicy) and manifest.config["backend"] == "hf"
    with torch.no_grad():
        again = score_actions(loaded, loaded_tok, comps).total
    torch.testing.assert_close(again, after, atol=1e-5, rtol=0)


def test_the_checkpoint_is_the_adapter_and_heads_only(model_dir: Path, tmp_path: Path) -> None:
    model, tok = new_policy(model_dir)
    ckpt = save_checkpoint(tmp_path / "v1", model, tok, version=1, parent=None)
    own = sum(p.numel() for p in model.policy_state().values())
    adapter = (ckpt / WEIGHTS_FILE).stat().st_size
    base = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    assert adapter <= 4 * own + 64 * 1024  # float32 weights and the safetensors header
    assert adapter < base / 2
    assert own < sum(p.numel() for p in model.parameters()) / 4


def test_a_changed_base_is_refused(model_dir: Path, tmp_path: Path, code: list[str]) -> None:
    base = make_model_dir(tmp_path / "base", "qwen2", code[:2])
    model, tok = new_policy(base)
    ckpt = save_checkpoint(tmp_path / "v1", model, tok, version=1, parent=None)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0}))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(ckpt)


def test_sentinels_in_user_code_stay_text(arch: str, model_dir: Path) -> None:
    _, tok = new_policy(model_dir)
    family = ARCHITECTURES[arch]
    sentinels = FIM_FAMILIES[family or "qwen"]
    code = f"x = '{sentinels[0]}'  # {sentinels[1]} {sentinels[2]} <|endoftext|>\ny = "
    ids = tok.encode(code)
    assert not set(ids) & tok.special_ids
    assert tok.decode(ids) == code
    healing = prepare_context(tok, code, 256, 16, suffix="\nz = 1\n")
    if family:
        pre, suf, mid = tok.fim_ids or ()
        assert healing.context_ids[0] == pre and healing.context_ids[-1] == mid
        assert healing.context_ids.count(pre) == healing.context_ids.count(suf) == 1
    else:  # no sentinels: the prefix alone, after the end-of-text token at a file's start
        assert tok.fim_ids is None and healing.context_ids[0] == tok.eof_id
        assert not set(healing.context_ids[1:]) & tok.special_ids


def test_the_kl_reference_is_the_base_with_the_adapter_off(
    model_dir: Path, code: list[str]
) -> None:
    """The update's KL term reads the policy's own base with the adapter off, never a second
    model: 0 for a fresh adapter, above 0 once the adapter has moved."""
    from trainer.update import UpdateConfig
    from trainer.update.batch import Batch
    from trainer.update.loss import pg_loss

    model, tok = new_policy(model_dir)
    _mixed_gate(model)
    comps = _sample(model, tok, code)
    batch = Batch.of(comps, [float(i % 3 == 0) for i in range(len(comps))])
    cfg = UpdateConfig()
    _, fresh = pg_loss(model, None, tok, batch, cfg)  # type: ignore[arg-type]  # never read
    assert fresh["losses/kl"] == pytest.approx(0.0, abs=1e-6)
    model.requires_grad_(True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        loss, _ = pg_loss(model, None, tok, batch, cfg)  # type: ignore[arg-type]
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, moved = pg_loss(model, None, tok, batch, cfg)  # type: ignore[arg-type]
    assert moved["losses/kl"] > 1e-4


def test_bf16_drift_is_small_and_measured(model_dir: Path, code: list[str]) -> None:
    """What a GPU runs, on the CPU: sampling in bf16 autocast logs log-probs that bf16 scoring
    recomputes closely, and that float32 scoring (the trainer's on the CPU) stays near."""
    from tabloop.core.policy.device import compute

    model, tok = new_policy(model_dir)
    _mixed_gate(model)
    with compute(torch.device("cpu"), bf16=True):
        comps = complete_batch(model, tok, _prompts(code, 8, fim=True, seed=3), 0.8, 0.95)
        bf16 = score_actions(model, tok, comps)
    logged = torch.tensor([c.logprob_total for c in comps])
    assert bf16.total.dtype == torch.float32
    torch.testing.assert_close(bf16.total, logged, atol=5e-2, rtol=0)
    with torch.no_grad():
        fp32 = score_actions(model, tok, comps).total
    torch.testing.assert_close(fp32, logged, atol=0.25, rtol=0)


def test_full_fine_tuning_trains_and_stores_every_weight(
    model_dir: Path, code: list[str], tmp_path: Path
) -> None:
    """Without an adapter (lora_r 0, for small models) every weight trains against a loaded
    copy of the base as the KL reference, and a checkpoint holds them all."""
    from trainer.update import UpdateConfig
    from trainer.update.batch import Batch
    from trainer.update.loss import pg_loss

    model, tok = new_policy(model_dir, r=0)
    ref, _ = new_policy(model_dir, r=0)
    assert not model.adapted and set(model.trainable_names()) == {
        n for n, _ in model.named_parameters()
    }
    _mixed_gate(model)
    _mixed_gate(ref)
    comps = _sample(model, tok, code)
    batch = Batch.of(comps, [float(i % 3 == 0) for i in range(len(comps))])
    model.requires_grad_(True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(2):
        loss, metrics = pg_loss(model, ref, tok, batch, UpdateConfig())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.requires_grad_(False)
    _, moved = pg_loss(model, ref, tok, batch, UpdateConfig())
    assert moved["losses/kl"] > 0
    ckpt = save_checkpoint(tmp_path / "v2", model, tok, version=2, parent=1)
    base = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    assert (ckpt / WEIGHTS_FILE).stat().st_size >= base * 0.9
    loaded, _, _ = load_checkpoint(ckpt)
    with torch.no_grad():
        torch.testing.assert_close(
            score_actions(loaded, tok, comps).total,
            score_actions(model, tok, comps).total,
            atol=1e-5,
            rtol=0,
        )


def test_versions_on_one_base_share_its_weights(model_dir: Path, code: list[str]) -> None:
    """Two policies on one base (live and canary) and the trainer's copy of one hold the
    base's frozen weights once: the same tensors; each its own adapter. Training the copy
    changes neither the other policies nor the base."""
    a, tok = new_policy(model_dir)
    b, _ = new_policy(model_dir)
    copy_ = copy.deepcopy(a)

    def base_weights(m: HFPolicy) -> dict[str, torch.Tensor]:
        own = set(m.trainable_names())
        return {n: p for n, p in m.named_parameters() if n not in own}

    wa, wb, wc = base_weights(a), base_weights(b), base_weights(copy_)
    assert wa and wa.keys() == wb.keys() == wc.keys()
    assert all(wa[n].data_ptr() == wb[n].data_ptr() == wc[n].data_ptr() for n in wa)
    own = [n for n in a.trainable_names() if "lora_" in n]
    pa, pc = dict(a.named_parameters()), dict(copy_.named_parameters())
    assert own and all(pa[n].data_ptr() != pc[n].data_ptr() for n in own)
    _mixed_gate(a)
    _mixed_gate(copy_)
    comps = _sample(a, tok, code)
    with torch.no_grad():
        before = score_actions(a, tok, comps).total
    copy_.requires_grad_(True)
    opt = torch.optim.Adam([p for p in copy_.parameters() if p.requires_grad], lr=1e-2)
    loss = -score_actions(copy_, tok, comps).total.mean()
    loss.backward()
    opt.step()
    with torch.no_grad():
        assert torch.equal(score_actions(a, tok, comps).total, before)
        assert not torch.equal(score_actions(copy_, tok, comps).total, before)


def test_a_tampered_or_broken_checkpoint_is_a_checkpoint_error(
    tmp_path: Path, code: list[str]
) -> None:
    """What a manifest says must fit its base, and unreadable weights are refused as such
    (an upload gets a 422, never a policy that fails every request)."""
    base = make_model_dir(tmp_path / "base", "qwen2", code[:2])
    model, tok = new_policy(base)
    ckpt = save_checkpoint(tmp_path / "v1", model, tok, version=1, parent=None)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for change in ({"n_embd": 16}, {"block_size": 0}, {"block_size": 10**6}, {"lora_r": -1}):
        bad = json.loads(json.dumps(manifest))
        bad["config"].update(change)
        (ckpt / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError):
            load_checkpoint(ckpt)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (ckpt / WEIGHTS_FILE).write_bytes(b"not safetensors")
    manifest["weights"]["sha256"] = hashlib.sha256(b"not safetensors").hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint(ckpt)


def test_a_model_that_transforms_its_logits_is_refused(tmp_path: Path, code: list[str]) -> None:
    base = make_model_dir(tmp_path / "base", "llama", code[:2])
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "logits_scaling": 4.0}))
    with pytest.raises(HFModelError, match="logits_scaling"):
        new_policy(base)


def test_the_reference_leaves_what_is_frozen_frozen(model_dir: Path) -> None:
    model, _ = new_policy(model_dir)
    assert not any(p.requires_grad for p in model.parameters())
    with model.reference():
        pass
    assert not any(p.requires_grad for p in model.parameters())


def test_a_sentencepiece_vocabulary_maps_to_utf8_and_codellama_sentinels(tmp_path: Path) -> None:
    """CodeLlama-style: SentencePiece pieces with byte fallback, and FIM pieces that carry the
    space mark; the bytes of every token are its UTF-8 (not GPT-2's byte alphabet)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    text = ["caf\u00e9 na\u00e7\u00e3o \u0120x = 1\n" * 20, "def f(x):\n    return x\n" * 20]
    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    pieces = ["<unk>", "</s>", "\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", "\u2581<EOT>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=pieces + [f"<0x{b:02X}>" for b in range(256)],
        show_progress=False,
    )
    tk.train_from_iterator(text, trainer)
    (tmp_path / "tokenizer.json").write_text(tk.to_str())
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.fim_family == "codellama" and not tok.byte_level
    assert tk.token_to_id("\u2581<EOT>") in tok.special_ids
    for s in ("caf\u00e9 na\u00e7\u00e3o", "\u0120x = 1"):
        assert tok.decode_bytes(tok.encode(s)).lstrip(b" ") == s.encode("utf-8")


@pytest.mark.parametrize("rank", [8, 0], ids=["adapter", "full"])
def test_an_update_leaves_the_embeddings_as_pretrained(
    model_dir: Path, code: list[str], rank: int
) -> None:
    """The trainer's update (train_embeddings off, the default) moves the policy's own weights
    but not the token embedding, with an adapter and in full fine-tuning alike."""
    from trainer.update import UpdateConfig, UpdateInputs, make_optimizer, update
    from trainer.update.batch import Batch

    model, tok = new_policy(model_dir, r=rank)
    ref, _ = new_policy(model_dir, r=rank)
    _mixed_gate(model)
    comps = _sample(model, tok, code)
    emb = model.embedding_names
    assert emb and all("embed" in n for n in emb)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.requires_grad_(True)
    cfg = UpdateConfig(settled_epochs=0, learning_rate=1e-2)
    batch = Batch.of(comps, [float(i % 3 == 0) for i in range(len(comps))])
    update(UpdateInputs(model, ref, tok, batch, make_optimizer(model, cfg), cfg))
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in emb)
    moved = [n for n in model.trainable_names() if not torch.equal(before[n], after[n])]
    assert moved and all(n not in emb for n in moved)
