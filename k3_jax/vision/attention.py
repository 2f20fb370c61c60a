"""Packed, non-causal self-attention for the vision tower: a patch attends to every patch of its own media item.

Plain-XLA reference path: fp32 scores and softmax (the release's ``softmax(dtype=float32)``), probabilities in
the value dtype, fp32 accumulation. Queries are processed in blocks of :data:`QUERY_BLOCK` (``lax.map``) so the
scores held at once are ``[H, block, Np]``, not ``[H, Np, Np]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.layers.common import einsum_f32

QUERY_BLOCK = 1024


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array, scale: float) -> jax.Array:
    s = einsum_f32("qhd,khd->hqk", q, k) * scale
    same = seg_q[:, None] == seg_k[None, :]
    s = jnp.where(same[None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return einsum_f32("hqk,khd->qhd", p, v).astype(v.dtype)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     block: int = QUERY_BLOCK) -> jax.Array:
    """``q, k, v [Np, H, Dh]``, ``segment_ids [Np]`` int (item index; equal ids attend) -> ``[Np, H, Dh]``.

    Scale ``Dh ** -0.5``. Every query has at least itself in its segment, so no row is fully masked.
    """
    n, h, dh = q.shape
    scale = dh ** -0.5
    seg = segment_ids.astype(jnp.int32)
    if n <= block:
        return _attend(q, k, v, seg, seg, scale)
    nb = -(-n // block)
    pad = nb * block - n
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    sp = jnp.pad(seg, (0, pad), constant_values=-2)  # padded queries see nothing real; their rows are dropped
    qb = qp.reshape(nb, block, h, dh)
    sb = sp.reshape(nb, block)

    def one(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        qi, si = args
        # a padded query row (segment -2) matches no key: give it key 0 so its softmax is finite
        s_eff = jnp.where(si == -2, seg[0], si)
        return _attend(qi, k, v, s_eff, seg, scale)

    out = jax.lax.map(one, (qb, sb))
    return out.reshape(nb * block, h, dh)[:n]
