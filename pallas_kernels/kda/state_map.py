"""Affine state maps of KDA token ranges, for sequence (context) parallelism.

The KDA state update is affine in the incoming state: over any token range,
``S_out = M @ S_in + U`` with ``M [B, H, K, K]`` (acts on the key axis of the ``[K, V]`` state) and
``U [B, H, K, V]``. A shard of a sequence computes its map without knowing ``S_in``; maps of consecutive
shards combine with :func:`compose_state_maps` (associative, so ``jax.lax.associative_scan`` gives every
shard's incoming state from the per-shard maps), then each shard reruns its range with
``initial_state = apply_state_map(prefix_map, S0)``.

Semantics equal :func:`pallas_kernels.kda.reference.recurrent_kda`'s state recurrence, including packed
documents: if the state resets anywhere in the range, ``M`` is 0 (nothing of ``S_in`` survives).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda.reference import HIGHEST, chunk_state_maps, segment_resets

__all__ = ["StateMap", "chunk_affine_state_map", "compose_state_maps", "apply_state_map", "identity_state_map"]

StateMap = tuple[jax.Array, jax.Array]  # (M [..., K, K] f32, U [..., K, V] f32)


def _ein(eq: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(eq, *operands, precision=HIGHEST, preferred_element_type=jnp.float32)


def compose_state_maps(first: StateMap, second: StateMap) -> StateMap:
    """Map of ``first`` followed by ``second``: ``(M2 @ M1, M2 @ U1 + U2)``.

    Works on any leading batch axes (``[..., K, K]``, ``[..., K, V]``), so it can be passed directly as the
    combine function of ``jax.lax.associative_scan`` over a stacked axis of per-range maps (earlier ranges
    first).
    """
    m1, u1 = first
    m2, u2 = second
    return _ein("...kj,...jl->...kl", m2, m1), _ein("...kj,...jv->...kv", m2, u1) + u2


def apply_state_map(state_map: StateMap, state: jax.Array) -> jax.Array:
    """``M @ S + U`` for ``S [..., K, V]``; returns fp32."""
    m, u = state_map
    return _ein("...kj,...jv->...kv", m, state.astype(jnp.float32)) + u


def identity_state_map(batch: int, heads: int, key_dim: int, value_dim: int) -> StateMap:
    """``(I, 0)``: the map of an empty range."""
    eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, heads, key_dim, key_dim))
    return eye, jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)


@functools.partial(jax.jit, static_argnames=("chunk_size", "sub_chunk_size"))
def chunk_affine_state_map(
    k: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    prev_segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    sub_chunk_size: int = 16,
) -> StateMap:
    """Affine map ``S_out = M @ S_in + U`` of the token range ``[0, T)``.

    Args:
      k: ``[B, T, H, K]`` keys (already L2-normalised, as passed to ``chunk_kda``).
      g: ``[B, T, H, K]`` log-decay.
      beta: ``[B, T, H]``.
      v: ``[B, T, H, V]``.
      segment_ids: ``[B, T]`` int (optional); the state resets before t where the id changes from t-1.
      prev_segment_ids: ``[B]`` int (optional): id of the token just before this range (the previous shard's
        last token), so that a document starting exactly at the range start resets too.

    Returns:
      ``(M [B, H, K, K] f32, U [B, H, K, V] f32)``; ``M`` is 0 for rows with a reset inside the range.
      Computed with the chunked UT/WY form (per-chunk maps, composed by a scan over chunks).
    """
    if k.ndim != 4 or g.shape != k.shape:
        raise ValueError(f"chunk_affine_state_map: k and g must both be [B, T, H, K], got {k.shape} and {g.shape}")
    B, T, H, K = k.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"chunk_affine_state_map: v must be [B, T, H, V]=[{B}, {T}, {H}, V], got {v.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"chunk_affine_state_map: beta must be [B, T, H]=[{B}, {T}, {H}], got {beta.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"chunk_affine_state_map: segment_ids must be [B, T]=[{B}, {T}], got {segment_ids.shape}")
    if prev_segment_ids is not None and prev_segment_ids.shape != (B,):
        raise ValueError(f"chunk_affine_state_map: prev_segment_ids must be [B]=[{B}], got {prev_segment_ids.shape}")
    if segment_ids is None and prev_segment_ids is not None:
        raise ValueError("chunk_affine_state_map: prev_segment_ids needs segment_ids")
    reset = segment_resets(segment_ids, B, T, prev_segment_ids)
    M, Bm = chunk_state_maps(
        k, v, g, beta, reset, chunk_size=chunk_size, sub_chunk_size=min(sub_chunk_size, chunk_size)
    )
    # M, Bm: [B, H, N, ...]; compose sequentially over chunks.
    V = v.shape[-1]

    def step(acc, mb):
        return compose_state_maps(acc, mb), None

    out, _ = jax.lax.scan(step, identity_state_map(B, H, K, V), (jnp.moveaxis(M, 2, 0), jnp.moveaxis(Bm, 2, 0)))
    return out
