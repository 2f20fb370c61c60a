"""Training data: token shards -> packed ``[B, T+1]`` sequences with segment ids (grain, resumable).

Every row of the global batch is its own stream, so the batch does not depend on how many processes read it:
row ``r`` of every step comes from stream ``r`` on whichever process owns that row of the batch sharding, and
1, 2 or 4 processes (or a restart with another process count) see the same global batches. Stream ``r``
(deterministic for a given seed; every stage is a grain dataset, so its iterator state is a small JSON-able
dict stored in checkpoints)::

    document indices of the split, every B-th starting at r (all of them if the split has fewer than B docs)
      -> shuffle(seed, r), reshuffled every epoch, repeated forever
      -> [BOS] doc [EOS] as int32 arrays
      -> concat-then-split packing into rows of T+1 tokens (documents longer than the remaining room are
         split and continue in the stream's next row) with ``segment_ids`` 1, 2, ... per document piece in a row

A process's batch stacks the rows it owns in ascending row order:
``{"tokens": [n, T+1] i32, "segment_ids": [n, T+1] i32}``; :func:`to_global_batch` places them into the global
``[B, T+1]`` array. The step feeds ``tokens[:, :-1]`` with ``segment_ids[:, :-1]`` to the model (KDA state and
MLA attention reset where the id changes) and predicts ``tokens[:, 1:]`` where :func:`loss_mask` is 1 (the
target lies in the same document piece as the input and is not padding). Rows are always full (infinite
repetition), so padding never occurs in training batches.

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


def contiguous_rows(batch_size: int, process_index: int = 0, process_count: int = 1) -> tuple[int, ...]:
    """Rows ``[p·B/P, (p+1)·B/P)`` of a ``B``-row batch: process ``p``'s share when rows split evenly in order."""
    if batch_size % process_count:
        raise ValueError(f"batch_size {batch_size} not divisible by process_count {process_count}")
    n = batch_size // process_count
    return tuple(range(process_index * n, (process_index + 1) * n))


def process_rows(sharding: Any | None, batch_size: int) -> tuple[int, ...]:
    """The global batch rows whose data lives on this process's devices under ``sharding`` (None: all rows)."""
    if sharding is None:
        return tuple(range(batch_size))
    index_map = sharding.addressable_devices_indices_map((batch_size, 1))
    return tuple(sorted({r for idx in index_map.values() for r in range(*idx[0].indices(batch_size))}))


def to_global_batch(local: dict[str, np.ndarray], rows: Sequence[int], sharding: Any | None,
                    batch_size: int) -> dict[str, Any]:
    """This process's rows (stacked in ``rows`` order) -> global ``[batch_size, ...]`` arrays on ``sharding``.

    Each device shard takes its rows from ``local``; works for any batch sharding, rows contiguous or not.
    """
    import jax
    import jax.numpy as jnp

    if sharding is None:
        return {k: jnp.asarray(v) for k, v in local.items()}
    pos = {r: i for i, r in enumerate(rows)}

    def make(x: np.ndarray):
        def shard(index):
            wanted = range(*index[0].indices(batch_size))
            missing = [r for r in wanted if r not in pos]
            if missing:
                raise ValueError(f"rows {missing} of the global batch are not among this process's rows")
            return x[[pos[r] for r in wanted]][(slice(None), *index[1:])]

        return jax.make_array_from_callback((batch_size, *x.shape[1:]), sharding, shard)

    return {k: make(v) for k, v in local.items()}


# documents are read in the calling thread: a row needs a few documents per step, and grain's default (16
# prefetch threads per iterator) would start 16 threads for every row stream
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _stream_seed(seed: int, row: int) -> int:
    return int(np.random.SeedSequence([seed, row]).generate_state(1)[0] >> 1)


@dataclasses.dataclass(frozen=True)
class RowStreams:
    """One packed grain stream of ``[T+1]`` rows per owned row of the global batch (``{row: dataset}``)."""

    streams: dict[int, grain.IterDataset]

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sorted(self.streams))


def make_dataset(cfg: DataConfig, *, split: str = "train", rows: Sequence[int] | None = None,
                 process_index: int = 0, process_count: int = 1,
                 docs: TokenDocuments | None = None) -> RowStreams:
    """The streams of ``rows`` of the global ``cfg.batch_size``-row batch (default: process ``process_index``'s
    contiguous share of ``process_count``, see :func:`contiguous_rows`)."""
    rows = tuple(rows) if rows is not None else contiguous_rows(cfg.batch_size, process_index, process_count)
    bad = [r for r in rows if not 0 <= r < cfg.batch_size]
    if bad or not rows:
        raise ValueError(f"rows {list(rows)} must be a non-empty subset of 0..{cfg.batch_size - 1}")
    docs = docs if docs is not None else TokenDocuments(cfg.paths)
    if len(docs) == 0:
        raise ValueError(f"no documents in {cfg.paths or TOKENS_FILE}")
    split_indices = _doc_indices(len(docs), split)
    bos, eos = np.array([cfg.bos_id], np.int32), np.array([cfg.eos_id], np.int32)

    def stream(row: int) -> grain.IterDataset:
        own = split_indices[row::cfg.batch_size] if len(split_indices) >= cfg.batch_size else split_indices

        def to_example(i: int) -> dict[str, np.ndarray]:
            return {"tokens": np.concatenate([bos, docs[int(own[i])].astype(np.int32), eos])}

        ds = grain.MapDataset.range(len(own)).shuffle(seed=_stream_seed(cfg.seed, row)).repeat(None)
        packed = ConcatThenSplitIterDataset(ds.map(to_example).to_iter_dataset(_READ),
                                            length_struct={"tokens": cfg.seq_len + 1})
        return packed.map(_rename)

    return RowStreams({r: stream(r) for r in rows})


def _rename(ex: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"tokens": ex["tokens"].astype(np.int32), "segment_ids": ex["tokens_segment_ids"].astype(np.int32)}


class DataIterator:
    """Resumable batches of this process's rows: ``next(it)`` -> batch dict (rows in ascending order).

    ``get_state()`` is ``{"rows": {"<row>": grain_state}}`` for the owned rows (JSON-able); ``set_state``
    accepts any such dict that holds at least the owned rows (e.g. all processes' states merged by
    :func:`merge_row_states`), so a checkpoint resumes under any process count that splits the same batch.
    """

    def __init__(self, dataset: RowStreams):
        self._ds = dataset
        self._its = {r: iter(d) for r, d in dataset.streams.items()}

    @property
    def rows(self) -> tuple[int, ...]:
        return self._ds.rows

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        items = [next(self._its[r]) for r in self.rows]
        return {k: np.stack([it[k] for it in items]) for k in items[0]}

    def get_state(self) -> dict[str, Any]:
        # tuples -> lists: what a JSON checkpoint holds
        return {"rows": {str(r): json.loads(json.dumps(self._its[r].get_state())) for r in self.rows}}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("rows")
        if saved is None:
            raise ValueError("data-iterator state has no per-row streams (keys "
                             f"{sorted(state)}): it was written by an older k3-jax; start a fresh run")
        missing = [r for r in self.rows if str(r) not in saved]
        if missing:
            raise ValueError(f"data-iterator state lacks rows {missing} (it has {len(saved)} rows; the batch "
                             "size must match the checkpoint's)")
        for r in self.rows:
            it = iter(self._ds.streams[r])
            it.set_state(_from_json(saved[str(r)]))
            self._its[r] = it


def _from_json(state: Any) -> Any:
    """A grain iterator state as :meth:`DataIterator.get_state` stored it, with its tuples back (JSON made them
    lists): grain compares some entries to tuples, e.g. the packer's empty-remainder sentinel ``(-1, -1)``, which
    as a list would read as a remainder and skip a document on restore."""
    if isinstance(state, dict):
        return {k: _from_json(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return tuple(_from_json(v) for v in state)
    return state


def merge_row_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several processes' :meth:`DataIterator.get_state` dicts -> one ``{"rows": {...}}`` (rows disjoint)."""
    merged: dict[str, Any] = {}
    for st in states:
        for r, v in st.get("rows", {}).items():
            if r in merged:
                raise ValueError(f"data-iterator row {r} is owned by two processes")
            merged[r] = v
    return {"rows": dict(sorted(merged.items(), key=lambda kv: int(kv[0])))}


def loss_mask(segment_ids: np.ndarray, tokens: np.ndarray | None = None, pad_id: int | None = None):
    """``[B, T]`` 1 where target ``t+1`` continues the document piece of input ``t`` (works on np or jnp).

    ``segment_ids``/``tokens`` are the ``[B, T+1]`` rows. Padding (segment id 0 or ``pad_id`` targets) is 0.
    """
    seg_in, seg_tgt = segment_ids[:, :-1], segment_ids[:, 1:]
    mask = (seg_in == seg_tgt) & (seg_tgt > 0)
    if tokens is not None and pad_id is not None:
        mask = mask & (tokens[:, 1:] != pad_id)
    return mask
