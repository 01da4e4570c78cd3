"""Pretraining data: the corpus split, its token streams, and the training batches (windows of
the stream, with fill-in-the-middle rows mixed in at the configured rate)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from tabloop.core.corpus import corpus_files, directory_files, is_heldout, read_text, stdlib_root
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.fim import FimSource


class CorpusError(ValueError):
    """The corpus cannot make a base: no files, or too little text for one training window."""


@dataclass
class TokenData:
    tokens: np.ndarray  # uint16 stream, each file preceded by <|eof|>
    n_bytes: int  # UTF-8 bytes of the text it encodes
    files: int
    starts: np.ndarray  # offset of each file's <|eof|> in the stream


def tokenize_texts(tokenizer: CodeTokenizer, texts: Sequence[str]) -> TokenData:
    chunks = [
        np.array([tokenizer.eof_id] + ids, dtype=np.uint16)
        for ids in tokenizer.encode_batch(list(texts))
    ]
    assert tokenizer.vocab_size <= 65536, "token ids must fit uint16"
    starts = np.cumsum([0] + [len(c) for c in chunks[:-1]]).astype(np.int64)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    return TokenData(tokens, sum(len(t.encode()) for t in texts), len(texts), starts)


def tokenize_files(tokenizer: CodeTokenizer, paths: Sequence[Path]) -> TokenData:
    return tokenize_texts(tokenizer, [read_text(p) for p in paths])


def corpus_split(
    corpus: Path | None, max_files: int | None = None
) -> tuple[list[Path], list[Path]]:
    """The train and held-out files of a corpus: the standard library (None) or a directory;
    `max_files` keeps the first N train files and N // 10 held-out ones (smoke tests)."""
    if corpus is None:
        root = stdlib_root()
        train, heldout = corpus_files("train"), corpus_files("heldout")
    else:
        root = Path(corpus).resolve()
        if not root.is_dir():
            raise CorpusError(f"--corpus {corpus} is not a directory")
        train, heldout = directory_files("train", root), directory_files("heldout", root)
        if not train or not heldout:
            raise CorpusError(
                f"{corpus} has {len(train) + len(heldout)} text files: at least 2 are needed "
                "(one is held out for evaluation)"
            )
    if max_files is not None:
        train, heldout = train[:max_files], heldout[: max(1, max_files // 10)]
    assert not set(train) & set(heldout), "a file is in both splits"
    if corpus is None:
        for p in train:  # the held-out split must never be trained on
            rel = PurePosixPath(p.relative_to(root).as_posix())
            assert not is_heldout(rel), f"{p} is held out"
    return train, heldout


def get_batch(
    data: np.ndarray,
    block: int,
    batch: int,
    gen: torch.Generator,
    fim: FimSource | None = None,
    fim_rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random windows of the stream (x, and y shifted by one); with `fim`, each row is
    instead a FIM row (trainer/fim.py) with probability fim_rate, its sentinel targets -1."""
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen).tolist()
    rows = [data[i : i + block + 1].astype(np.int64) for i in ix]
    if fim is not None and fim_rate > 0:
        chosen = (torch.rand(batch, generator=gen) < fim_rate).tolist()
        rows = [fim.row(block, gen) if c else r for r, c in zip(rows, chosen, strict=True)]
    xy = torch.from_numpy(np.stack(rows))
    x, y = xy[:, :-1], xy[:, 1:]
    return x, (y if fim is None else fim.mask_targets(y))
