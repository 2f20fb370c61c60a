"""Vocabulary parallelism: embedding lookup, lm_head and cross-entropy with the vocabulary split over ``tensor``.

Rank ``r`` of the vocab axis holds rows ``[r·V/n, (r+1)·V/n)`` of the embedding ``[V, D]`` and the matching
columns of ``lm_head`` ``[D, V]``. The cross-entropy never forms the full ``[N, V]`` logits anywhere: each rank
computes its ``[N, V/n]`` slice, and the log-sum-exp is assembled from a ``pmax`` of the partial maxima and a
``psum`` of the partial sums; the target logit comes from the one rank that owns it (``psum`` of a masked pick).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3_jax.parallel.mesh_axes import axis_sizes, mesh_or_active, split_axes

HIGHEST = jax.lax.Precision.HIGHEST


def embed_local(tokens: jax.Array, table: jax.Array, axis_name: str) -> jax.Array:
    """Per-shard lookup: ``tokens [...] i32`` in a ``table [V/n, D]`` slice → ``[..., D]`` (psum over ranks)."""
    v_loc = table.shape[0]
    first = jax.lax.axis_index(axis_name) * v_loc
    local = tokens - first
    ok = (local >= 0) & (local < v_loc)
    rows = jnp.take(table, jnp.clip(local, 0, v_loc - 1), axis=0)
    rows = jnp.where(ok[..., None], rows, jnp.zeros((), table.dtype))
    return jax.lax.psum(rows, axis_name)


def cross_entropy_local(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, axis_name: str,
                        logit_dtype: jnp.dtype = jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Per-shard vocab-parallel CE: ``hidden [N, D]``, ``kernel [D, V/n]``, ``labels [N] i32`` →
    ``(loss [N] f32 = logsumexp − logit[label], logsumexp [N] f32)``."""
    v_loc = kernel.shape[1]
    first = jax.lax.axis_index(axis_name) * v_loc
    prec = HIGHEST if hidden.dtype == jnp.float32 else None
    logits = jnp.matmul(hidden, kernel.astype(hidden.dtype), precision=prec,
                        preferred_element_type=jnp.float32).astype(logit_dtype).astype(jnp.float32)
    m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis_name)  # [N], a constant shift
    s = jax.lax.psum(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1), axis_name)
    lse = jnp.log(s) + m
    local = labels - first
    ok = (local >= 0) & (local < v_loc)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, v_loc - 1)[:, None], axis=-1)[:, 0]
    target = jax.lax.psum(jnp.where(ok, picked, 0.0), axis_name)
    return lse - target, lse


def vocab_parallel_embed(tokens: jax.Array, table: jax.Array, *, mesh: Mesh | None = None, axis: str = "tensor",
                         batch_axes: Sequence[str] | None = ("data", "fsdp", "expert")) -> jax.Array:
    """``table[tokens]`` with ``table [V, D]`` split over ``axis`` by rows; ``tokens [B, T]`` → ``[B, T, D]``."""
    mesh = mesh_or_active(mesh, "vocab parallel")
    sizes = axis_sizes(mesh)
    vx = split_axes(axis, sizes, table.shape[0])
    bx = split_axes(batch_axes, sizes, tokens.shape[0])
    if vx is None:
        return jnp.take(table, tokens, axis=0)
    fn = jax.shard_map(lambda t, w: embed_local(t, w, axis), mesh=mesh, in_specs=(P(bx), P(vx, None)),
                       out_specs=P(bx), check_vma=False)
    return fn(tokens, table)


def vocab_parallel_cross_entropy(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, *,
                                 mesh: Mesh | None = None, axis: str = "tensor",
                                 token_axes: Sequence[str] | None = ("data", "fsdp", "expert"),
                                 weights: jax.Array | None = None,
                                 logit_dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Token-level CE against ``lm_head`` without full logits on any device.

    Args:
      hidden: ``[N, D]`` final normed hidden states (any float dtype; ``[B, T, D]`` is flattened).
      kernel: ``lm_head`` ``[D, V]``, split over ``axis`` by columns.
      labels: ``[N]`` (or ``[B, T]``) int target ids.
      weights: optional ``[N]`` loss mask / weights.
      logit_dtype: dtype the logits are rounded to before the f32 softmax (bf16 to mimic bf16 logits).
    Returns:
      ``(mean loss f32 scalar (weighted), per-token loss [N] f32)``.
    """
    mesh = mesh_or_active(mesh, "vocab parallel")
    sizes = axis_sizes(mesh)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).astype(jnp.int32)
    n = hidden.shape[0]
    vx = split_axes(axis, sizes, kernel.shape[1])
    tx = split_axes(token_axes, sizes, n)
    if vx is None:
        logits = jnp.matmul(hidden, kernel.astype(hidden.dtype), precision=HIGHEST,
                            preferred_element_type=jnp.float32).astype(logit_dtype).astype(jnp.float32)
        per_tok = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]
    else:
        fn = jax.shard_map(lambda h, w, y: cross_entropy_local(h, w, y, axis, logit_dtype)[0], mesh=mesh,
                           in_specs=(P(tx, None), P(None, vx), P(tx)), out_specs=P(tx), check_vma=False)
        per_tok = fn(hidden, kernel, labels)
    if weights is None:
        return jnp.mean(per_tok), per_tok
    w = weights.reshape(-1).astype(jnp.float32)
    return jnp.sum(per_tok * w) / jnp.maximum(jnp.sum(w), 1.0), per_tok
