"""The trainer's copies of deployed policies, and the samples of generic code it checks and
mixes them with.

A policy is loaded from the registry's blobs (written to DATA_DIR/trainer/vN once) onto the
trainer's device, frozen; the cache keeps the base and the three newest versions. The samples
are made once per tokenizer and context size: the deploy check's held-out sample (the standard
library's training split, which the people never edit, so the check measures forgetting, not
what the people's own code taught) and the windows the settled passes mix in (the same split
with another seed, which the check's sample must not train)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa
import torch

from tabloop.core.config import Settings
from tabloop.core.corpus import read_corpus
from tabloop.core.db import blob_transaction
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.registry import artifact_files, write_files
from trainer import store
from trainer.deploy_check import heldout_sample

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

KEEP = 3  # the newest versions kept besides the base


def lineage_root(parents: Mapping[int, int | None], version: int) -> int:
    """The root of `version`'s lineage in `parents` (version -> parent), followed parent by
    parent: a base registered later (pretrained on another corpus) is the root of its own
    descendants, not the oldest base. A cycle or a missing parent ends the walk."""
    seen = {version}
    while (parent := parents.get(version)) is not None and parent not in seen:
        version = parent
        seen.add(version)
    return version


@dataclass
class _Sample:
    """A sample of the training split, remade when the tokenizer or the context size changes."""

    rows: int
    seed: int
    key: tuple[int, int] | None = None
    tokens: torch.Tensor | None = None

    def get(self, tokenizer: CodeTokenizer, length: int) -> torch.Tensor:
        key = (hash(tokenizer.to_json()), length)
        if self.tokens is None or self.key != key:
            self.tokens = heldout_sample(
                tokenizer, read_corpus("train"), self.rows, length, seed=self.seed
            )
            self.key = key
        return self.tokens


class Policies:
    def __init__(
        self, settings: Settings, engine: sa.Engine, device: torch.device, cfg: TrainerConfig
    ) -> None:
        self.settings, self.engine, self.device, self.cfg = settings, engine, device, cfg
        self._loaded: dict[int, tuple[GPT, CodeTokenizer]] = {}
        self.languages: dict[int, tuple[str, ...]] = {}  # per version: its base's languages
        self._heldout = _Sample(cfg.heldout_rows, seed=0)
        self._generic = _Sample(cfg.generic_rows, seed=1)

    def base_version(self, version: int) -> int:
        """The pretrained base `version` descends from: the KL reference of its updates."""
        return lineage_root(store.parents(self.engine), version)

    def get(self, version: int) -> tuple[GPT, CodeTokenizer]:
        """The policy `version` and its tokenizer (the model frozen, on the trainer's device)."""
        if version not in self._loaded:
            directory = self.settings.data_dir / "trainer" / f"v{version}"
            if not (directory / "manifest.json").exists():
                with blob_transaction(self.engine) as conn:
                    write_files(directory, artifact_files(conn, version))
            model, tokenizer, manifest = load_checkpoint(directory)
            model.requires_grad_(False)
            model.to(self.device)
            self._loaded[version] = (model, tokenizer)
            self.languages[version] = manifest.languages
            if len(self._loaded) > KEEP + 1:  # keep the base and the recent ones
                base = self.base_version(version)
                for v in sorted(self._loaded)[:-KEEP]:
                    if v != base:
                        del self._loaded[v]
        return self._loaded[version]

    def heldout(self, tokenizer: CodeTokenizer, model: GPT) -> torch.Tensor:
        """The deploy check's fixed sample of generic code."""
        return self._heldout.get(tokenizer, self._length(model))

    def generic(self, tokenizer: CodeTokenizer, model: GPT) -> torch.Tensor:
        """Windows of generic code for the settled passes' pretraining mix."""
        return self._generic.get(tokenizer, self._length(model))

    def _length(self, model: GPT) -> int:
        return min(self.cfg.heldout_len, model.config.block_size - 1)
