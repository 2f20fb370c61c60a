"""Shared input preparation for the KDA Pallas kernels (TPU and GPU).

The kernels see one (batch, head) row at a time, so the wrapper moves heads next to batch and pads T to a
multiple of the chunk size. Everything here is cheap elementwise / transpose work that XLA fuses:

* ``q, k [BH, Tp, K]``, ``v [BH, Tp, V]`` in the caller's dtype (padding tokens are zeros);
* ``gam [BH, Tp, K] f32``: chunk-local cumulative log-decay ``G_i = sum_{s<=i in chunk} g_s`` (padding
  ``g = 0``, so padding tokens neither decay nor write the state);
* ``beta [BH, Tp, 1] f32`` (padding ``beta = 0``);
* ``seg_col [B, Tp, 1] i32`` and ``seg_row [B, N, 1, C] i32``: number of document starts inside the chunk
  up to and including token i (0 = still the document that entered the chunk with the carried state);
  both layouts are passed so the kernel never has to transpose a vector;
* ``h0t [BH, V, K] f32``: the initial state, transposed (V-first) so per-key decay is a row broadcast.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.kda import reference as ref


class ChunkInputs(NamedTuple):
    q: jax.Array  # [BH, Tp, K]
    k: jax.Array  # [BH, Tp, K]
    v: jax.Array  # [BH, Tp, V]
    gam: jax.Array  # [BH, Tp, K] f32
    beta: jax.Array  # [BH, Tp, 1] f32
    seg_col: jax.Array  # [B, Tp, 1] i32
    seg_row: jax.Array  # [B, N, 1, C] i32
    h0t: jax.Array  # [BH, V, K] f32


class ChunkResiduals(NamedTuple):
    """Per-chunk results of a chunked forward that the GPU backward (:func:`pallas_kernels.kda.gpu_bwd.chunk_kda_bwd`)
    takes instead of recomputing them; T padded to ``Tp = N C``, ``X = (I + diag(beta) A_kk)^-1`` per chunk,
    ``W = X diag(beta) (e^G k)``, every mask for packed sequences applied (one document; ``qg`` / ``W`` the document
    entering the chunk, ``kd`` the one leaving it). Written by the Mosaic GPU forward
    (:func:`pallas_kernels.kda.mosaic_gpu.chunk_kda_fwd` with ``residuals=True``), or by the backward's own
    recomputation in the same layouts."""

    qg: jax.Array  # [B, Tp, H, K] matmul dtype: q e^G scale
    kd: jax.Array  # [B, Tp, H, K] matmul dtype: e^{G_C - G} k
    wn: jax.Array  # [B, Tp, H, K] matmul dtype: -W
    xb: jax.Array  # [B, Tp, H, C] matmul dtype: X' = X diag(beta), row t = token t's row of its chunk
    aqk: jax.Array  # [B, Tp, H, C] matmul dtype: causal A_qk (scale included)
    decay: jax.Array  # [B, H, N, K] f32: e^{G_C}, 0 for a chunk where a document starts
    x_inv: jax.Array  # [B*H, Tp, C] f32: X
    akk: jax.Array  # [B*H, Tp, C] f32: A_kk, strictly lower, one document, no beta


def check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size: int, name: str) -> None:
    """Shape checks (delegated to the reference) plus the kernel's own constraints."""
    ref._check_inputs(q, k, v, g, beta, initial_state, segment_ids, name)
    if chunk_size % 16 or chunk_size < 16:
        raise ValueError(f"{name}: chunk_size must be a positive multiple of 16, got {chunk_size}")


def chunk_document_starts(segment_ids, batch: int, length: int, chunk_size: int) -> jax.Array:
    """``[B, N, C] i32``: document starts inside each chunk up to and including each token (0 = the document that
    entered the chunk with the carried state), T padded to ``N`` chunks of ``C`` (padding continues the last
    document); zeros without ``segment_ids``."""
    n = -(-length // chunk_size)
    reset = ref.segment_resets(segment_ids, batch, length).astype(jnp.int32)
    reset = jnp.pad(reset, [(0, 0), (0, n * chunk_size - length)]).reshape(batch, n, chunk_size)
    return jnp.cumsum(reset, axis=-1)


def prepare_chunk_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size: int) -> ChunkInputs:
    """Reshape ``[B, T, H, D]`` inputs to the kernels' ``[B*H, Tp, D]`` layout (see module docstring)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    Tp = N * C
    pad = Tp - T

    def heads_first(x):  # [B, T, H, D] -> [B*H, Tp, D]
        x = jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)])
        return jnp.swapaxes(x, 1, 2).reshape(B * H, Tp, x.shape[-1])

    gp = heads_first(g.astype(jnp.float32)).reshape(B * H, N, C, K)
    gam = jnp.cumsum(gp, axis=2).reshape(B * H, Tp, K)
    bp = heads_first(beta.astype(jnp.float32)[..., None])  # [BH, Tp, 1]
    seg = chunk_document_starts(segment_ids, B, T, C)  # [B, N, C]
    seg_col = seg.reshape(B, Tp, 1)
    seg_row = seg.reshape(B, N, 1, C)
    if initial_state is None:
        h0t = jnp.zeros((B * H, V, K), jnp.float32)
    else:
        h0t = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2).reshape(B * H, V, K)
    return ChunkInputs(heads_first(q), heads_first(k), heads_first(v), gam, bp, seg_col, seg_row, h0t)


def finish_chunk_outputs(o: jax.Array, ht: jax.Array, B: int, T: int, H: int) -> tuple[jax.Array, jax.Array]:
    """``o [BH, Tp, V] -> [B, T, H, V]``; ``ht [BH, V, K] -> [B, H, K, V] f32``."""
    V = o.shape[-1]
    K = ht.shape[-1]
    o = jnp.swapaxes(o.reshape(B, H, -1, V), 1, 2)[:, :T]
    return o, jnp.swapaxes(ht.reshape(B, H, V, K), -1, -2)


def blocked_unit_lower_inverse(n_tile, tiles: int, size: int, dot) -> list[list]:
    """``X = (I + N)^-1`` for strictly lower-triangular ``N`` given as ``tiles x tiles`` blocks of ``size``.

    ``n_tile(a, c)`` returns block ``N_ac [size, size]`` (called for ``c <= a`` only, once each); the result
    is the nested list of blocks ``X[a][b]`` for ``b <= a`` (``None`` above the diagonal): ``X_aa = D_a^-1``
    by :func:`pallas_kernels.kda.reference.unit_lower_inverse` and ``X_ab = -X_aa sum_{b <= c < a} N_ac X_cb``
    (blocked substitution, all matmuls ``dot(p, q)``). For Triton kernels, which cannot slice values: the blocks
    are loaded from refs.
    """
    x = [[None] * tiles for _ in range(tiles)]
    for a in range(tiles):
        n_row = [n_tile(a, c) for c in range(a + 1)]
        dinv = ref.unit_lower_inverse(n_row[a], size, dot)
        x[a][a] = dinv
        for b in range(a):
            acc = dot(n_row[b], x[b][b])
            for c in range(b + 1, a):
                acc = acc + dot(n_row[c], x[c][b])
            x[a][b] = -dot(dinv, acc)
    return x

