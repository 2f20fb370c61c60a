"""Training data: token shards -> packed ``[B, T+1]`` sequences with segment ids (grain, resumable).

Pipeline (deterministic for a given seed; every stage is a grain dataset so the iterator state is a small
JSON-able dict stored in checkpoints)::

    document indices (this process's slice) -> shuffle(seed), reshuffled every epoch, repeated forever
      -> [BOS] doc [EOS] as int32 arrays
      -> concat-then-split packing into rows of T+1 tokens (documents longer than the remaining room are
         split and continue in the next row) with ``segment_ids`` 1, 2, ... per document piece in a row
      -> batch of B rows (B = per-process batch)

A batch is ``{"tokens": [B, T+1] i32, "segment_ids": [B, T+1] i32}``; the step feeds ``tokens[:, :-1]`` with
``segment_ids[:, :-1]`` to the model (KDA state and MLA attention reset where the id changes) and predicts
``tokens[:, 1:]`` where :func:`loss_mask` is 1 (the target lies in the same document piece as the input and
is not padding). Rows are always full (infinite repetition), so padding never occurs in training batches.

Token shards are ``.npz`` files with ``tokens`` [N] (u16/u32) and ``offsets`` [D+1] (see
:mod:`k3_jax.training.corpus`; make them with ``python -m k3_jax.training.tokenize``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

from k3_jax.training.corpus import TOKENS_FILE, load_token_shard

EVAL_EVERY = 50  # every 50th document is held out for evaluation


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are packed."""

    paths: tuple[str, ...] = ()  # token shards (.npz); empty = the bundled corpus
    seq_len: int = 256  # T: model input length (rows hold T+1 tokens)
    batch_size: int = 8  # global batch (rows per step, all processes)
    seed: int = 0
    bos_id: int = 1
    eos_id: int = 2


class TokenDocuments:
    """Random access to the documents of one or more token shards (a grain-compatible source)."""

    def __init__(self, paths: Sequence[str | Path] = ()):
        paths = [Path(p) for p in paths] or [TOKENS_FILE]
        self._shards: list[tuple[np.ndarray, np.ndarray]] = [load_token_shard(p) for p in paths]
        counts = [len(o) - 1 for _, o in self._shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_tokens = int(sum(len(t) for t, _ in self._shards))
        self.max_token = int(max(int(t.max()) if len(t) else 0 for t, _ in self._shards))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        tokens, offsets = self._shards[s]
        j = int(i - self._starts[s])
        return tokens[offsets[j]:offsets[j + 1]]


def _doc_indices(n: int, split: str) -> np.ndarray:
    idx = np.arange(n)
    if split == "train":
        return idx[idx % EVAL_EVERY != EVAL_EVERY - 1] if n >= EVAL_EVERY else idx
    if split == "eval":
        return idx[idx % EVAL_EVERY == EVAL_EVERY - 1] if n >= EVAL_EVERY else idx
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def make_dataset(cfg: DataConfig, *, split: str = "train", process_index: int = 0,
                 process_count: int = 1, docs: TokenDocuments | None = None) -> grain.IterDataset:
    """The packed, batched grain dataset of this process (``cfg.batch_size / process_count`` rows)."""
    if cfg.batch_size % process_count:
        raise ValueError(f"batch_size {cfg.batch_size} not divisible by process_count {process_count}")
    docs = docs if docs is not None else TokenDocuments(cfg.paths)
    if len(docs) == 0:
        raise ValueError(f"no documents in {cfg.paths or TOKENS_FILE}")
    indices = _doc_indices(len(docs), split)[process_index::process_count]
    if len(indices) == 0:
        raise ValueError(f"process {process_index}/{process_count} has no {split} documents")
    bos, eos = np.array([cfg.bos_id], np.int32), np.array([cfg.eos_id], np.int32)

    def to_example(i: int) -> dict[str, np.ndarray]:
        return {"tokens": np.concatenate([bos, docs[int(indices[i])].astype(np.int32), eos])}

    ds = grain.MapDataset.range(len(indices)).shuffle(seed=cfg.seed).repeat(None).map(to_example)
    packed = ConcatThenSplitIterDataset(ds.to_iter_dataset(), length_struct={"tokens": cfg.seq_len + 1})
    return packed.map(_rename).batch(cfg.batch_size // process_count, drop_remainder=True)


def _rename(ex: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"tokens": ex["tokens"].astype(np.int32), "segment_ids": ex["tokens_segment_ids"].astype(np.int32)}


class DataIterator:
    """Resumable batches: ``next(it)`` -> batch dict; ``get_state()``/``set_state()`` JSON-able."""

    def __init__(self, dataset: grain.IterDataset):
        self._ds = dataset
        self._it = iter(dataset)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._it.get_state()))  # tuples -> lists: what a JSON checkpoint holds

    def set_state(self, state: dict[str, Any]) -> None:
        self._it = iter(self._ds)
        self._it.set_state(state)


def loss_mask(segment_ids: np.ndarray, tokens: np.ndarray | None = None, pad_id: int | None = None):
    """``[B, T]`` 1 where target ``t+1`` continues the document piece of input ``t`` (works on np or jnp).

    ``segment_ids``/``tokens`` are the ``[B, T+1]`` rows. Padding (segment id 0 or ``pad_id`` targets) is 0.
    """
    seg_in, seg_tgt = segment_ids[:, :-1], segment_ids[:, 1:]
    mask = (seg_in == seg_tgt) & (seg_tgt > 0)
    if tokens is not None and pad_id is not None:
        mask = mask & (tokens[:, 1:] != pad_id)
    return mask
