"""``--init-from`` onto a mesh: a checkpoint in the release layout read straight into sharded parameters.

:func:`load_sharded` builds every parameter as a global ``jax.Array`` with ``jax.make_array_from_callback``: for
each shard this process holds it reads only the layers (and experts) the shard spans, one checkpoint tensor at a
time from the memory-mapped safetensors files, converts it to the Flax layout (:func:`k3_jax.convert.transforms.
to_flax`; MXFP4 experts decoded or bf16 experts packed when the wanted format differs from the stored one), slices
the shard's part and casts it to the parameter's dtype. The whole model is never on the host: a process holds one
shard being assembled plus a few converted tensors (a small cache, so devices holding the same rows do not re-read
them). Each process reads only what its own devices hold, so it also works multi-process.

Contract: ``abstract`` is the model's parameter tree (shapes and dtypes, e.g. ``Trainer._abstract_base``) with
experts in the wanted format; the checkpoint must provide exactly its leaves in those shapes (else
:class:`k3_jax.convert.hf.CheckpointError` naming the leaf). Floating leaves are cast to the abstract dtype
(bf16 checkpoint -> fp32 masters); ``u8`` MXFP4 codes and scales are kept as stored.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from k3_jax.config import K3Config, config_from_dict
from k3_jax.convert import names as N
from k3_jax.convert.hf import (
    CheckpointError,
    ShardReader,
    checkpoint_format,
    layer_slots,
    param_path,
    read_index,
    read_raw_config,
    verify,
)
from k3_jax.convert.transforms import pack_mxfp4_np, to_flax, unpack_mxfp4_np

Fetch = Callable[[int | None, int | None], np.ndarray]  # (repeat r, expert e) -> the Flax value of one slot


def _sources(reader: ShardReader, cfg: K3Config, fmt: str, experts: str) -> dict[tuple[str, ...], dict]:
    """``{leaf path: {"stack": 0 | 1 | 2 (leading stacked axes), "slots": {(r, e): fetch-args}}}`` for every
    parameter the checkpoint fills (in the wanted expert format)."""
    sym = N.dims(cfg)
    slots = layer_slots(cfg)
    out: dict[tuple[str, ...], dict] = {}

    def add(path: tuple[str, ...], r: int | None, e: int | None, how: tuple) -> None:
        entry = out.setdefault(path, {"stack": (r is not None) + (e is not None), "slots": {}})
        entry["slots"][(r, e)] = how

    for name, res in N.expected_text_names(cfg, fmt):
        rule = res.rule
        path, r = param_path(slots, res)
        shape = N.hf_shape(rule, sym)
        if rule.scope != "expert" or fmt == experts:
            add(path, r, res.expert, ("plain", name, rule, shape))
        elif fmt == "mxfp4":  # stored packed, wanted bf16: decode [out, in] -> [in, out]
            if rule.param[-1] == "weight_scale":
                continue  # read with its weight_packed
            scale_rule = next(x for x in N.TEXT_RULES if x.pattern == rule.pattern.replace("packed", "scale"))
            scale = (name.replace("weight_packed", "weight_scale"), scale_rule, N.hf_shape(scale_rule, sym))
            add(path[:-1], r, res.expert, ("decode", name, rule, shape, scale))
        else:  # stored bf16 [out, in], wanted MXFP4: pack
            for part in ("weight_packed", "weight_scale"):
                add((*path, part), r, res.expert, ("pack", name, rule, shape, part))
    return out


def _fetcher(reader: ShardReader, sym: Mapping[str, int], slots: dict, cache_size: int) -> Fetch:
    @functools.lru_cache(maxsize=cache_size)
    def fetch(r: int | None, e: int | None) -> np.ndarray:
        how = slots[(r, e)]
        kind, name, rule, shape = how[:4]
        x = reader.get(name, rule.dtype, shape)
        if kind == "plain":
            return to_flax(rule, x, dict(sym), name)
        if kind == "decode":
            s_name, s_rule, s_shape = how[4]
            w = unpack_mxfp4_np(x, reader.get(s_name, s_rule.dtype, s_shape)).astype(ml_dtypes.bfloat16)
            return np.ascontiguousarray(w.T)
        return pack_mxfp4_np(x.astype(np.float32))[0 if how[4] == "weight_packed" else 1]

    return fetch


def _indices(index: tuple, shape: tuple[int, ...], stack: int) -> tuple[list[range], tuple]:
    """The stacked axes' index ranges and the remaining axes' slices of one shard's ``index``."""
    full = tuple(index) + (slice(None),) * (len(shape) - len(index))
    ranges = [range(*full[i].indices(shape[i])) for i in range(stack)]
    return ranges, full[stack:]


def load_sharded(hf_dir: str | os.PathLike[str], abstract: Any, shardings: Any, *, experts: str,
                 cache_size: int = 4) -> dict:
    """The parameters of the checkpoint ``hf_dir`` as global arrays laid out by ``shardings`` (a tree of
    ``jax.sharding.Sharding`` like ``abstract``), read shard by shard (see the module docstring). ``experts``:
    the routed experts' format wanted (``"bf16"`` or ``"mxfp4"``), converted from the stored one if needed."""
    idx = read_index(hf_dir)
    rep = verify(hf_dir)
    if not rep.ok:
        raise CheckpointError(f"{hf_dir}: checkpoint failed verification ({len(rep.errors)} problem(s)):\n  "
                              + "\n  ".join(rep.errors))
    raw = read_raw_config(idx.root)
    cfg = config_from_dict(raw)
    fmt = checkpoint_format(raw)
    if experts not in ("bf16", "mxfp4"):
        raise ValueError(f"experts must be 'bf16' or 'mxfp4', got {experts!r}")
    cfg = cfg.replace(expert_format=experts)
    sym = N.dims(cfg)
    reader = ShardReader(idx)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    flat_shardings = treedef.flatten_up_to(shardings)
    try:
        sources = _sources(reader, cfg, fmt, experts)
        leaves = []
        for (kp, leaf), sharding in zip(flat, flat_shardings, strict=True):
            path = tuple(str(getattr(k, "key", k)) for k in kp)
            src = sources.pop(path, None)
            if src is None:
                raise CheckpointError(f"{hf_dir}: no tensor fills parameter {'/'.join(path)} "
                                      f"{leaf.dtype}{list(leaf.shape)}")
            leaves.append(_build(hf_dir, path, leaf, sharding, src, _fetcher(reader, sym, src["slots"], cache_size)))
        if sources:
            extra = ", ".join("/".join(p) for p in sorted(sources)[:5])
            raise CheckpointError(f"{hf_dir}: tensors for parameters the model does not have: {extra}")
    finally:
        reader.close()
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _build(hf_dir: Any, path: tuple[str, ...], leaf: Any, sharding: Any, src: dict, fetch: Fetch) -> jax.Array:
    stack, slots = src["stack"], src["slots"]
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    counts = [len({k[i] for k in slots}) for i in range(stack)]
    one = fetch(*next(iter(slots)))
    if tuple(counts) + one.shape != shape:
        raise CheckpointError(f"{hf_dir}: parameter {'/'.join(path)}: the model has shape {list(shape)}, the "
                              f"checkpoint gives {list(tuple(counts) + one.shape)}")

    def shard(index: tuple) -> np.ndarray:
        ranges, rest = _indices(index, shape, stack)
        if stack == 0:
            return np.asarray(fetch(None, None)[rest], dtype)
        keys = [(r, None) for r in ranges[0]] if stack == 1 else [(r, e) for r in ranges[0] for e in ranges[1]]
        out = None
        for i, key in enumerate(keys):
            part = fetch(*key)[rest]
            if out is None:
                out = np.empty((len(keys), *part.shape), dtype)
            out[i] = part
        return out.reshape(*(len(x) for x in ranges), *out.shape[1:])

    return jax.make_array_from_callback(shape, sharding, shard)
