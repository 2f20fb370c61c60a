"""KDA chunk backward for the Mosaic GPU forward (:mod:`.mosaic_gpu`): gradients for ``q, k, v, g`` (the per-token
log-decay before the cumulative sum, as the API takes it), ``beta`` and the initial state, in five Mosaic GPU
kernels. Same contract as the forward (:func:`.mosaic_gpu.supports_reason`: bf16, ``K = V = 128``, chunk 64, the
K3 gate bound, no packed sequences).

Split as the forward, per chunk ``c`` with the per-chunk tensors ``qg, kd, wn = -W, x = X', aqk, decay``, ``S_c``
the state entering the chunk, ``dS'_c`` the cotangent of the state leaving it:

1. The per-chunk tensors: the forward's per-chunk kernel (:func:`.mosaic_gpu_intra.intra_chunks`), all chunks in
   parallel.
2. The two sequential passes (:mod:`.mosaic_gpu_bwd_state`): the forward sweep (``S_c`` and ``V~ = X' v + (-W) S``,
   bf16) and the reverse pass (``dS'_c`` bf16, ``dV~``, the initial state's cotangent).
3. The per-chunk cotangents of the step-1 tensors (:mod:`.mosaic_gpu_bwd_chunk`, all chunks in parallel):
   ``d qg = dO S^T``, ``d wn = dV~ S^T``, ``d kd = V~ dS'^T``, ``d decay = rowsum(S * dS')``,
   ``d aqk = tril(dO V~^T)`` (written transposed per chunk), ``d x = tril(dV~ v^T)``, and ``dv = X'^T dV~``
   (bf16).
4. ``dq, dk, dg, dbeta``: each chunk's forward recomputed and differentiated (:mod:`.mosaic_gpu_bwd_intra`, all
   chunks in parallel).

Between the kernels (plain JAX): padding to whole chunks, the transposed state layouts.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.kda import mosaic_gpu
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.mosaic_gpu_bwd_chunk import chunk_state_cotangents
from pallas_kernels.kda.mosaic_gpu_bwd_intra import chunk_intra_grads
from pallas_kernels.kda.mosaic_gpu_bwd_state import state_grad_pass, state_sweep
from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, interpret_params
from pallas_kernels.kda.mosaic_gpu_intra import intra_chunks


def transpose_chunks(t):
    """``[B, Tp, H, 64]`` per-chunk ``[64, 64]`` matrices (row ``t`` = the chunk's row of token ``t``) -> the same
    layout holding each chunk's transpose."""
    B, Tp, H, C = t.shape
    return jnp.swapaxes(t.reshape(B, Tp // C, C, H, C), 2, 4).reshape(B, Tp, H, C)


def chunk_kda_bwd(q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, do=None, dht=None,
                  chunk_size: int = CHUNK, interpret=False, v_split: int | None = None):
    """Gradients of :func:`.mosaic_gpu.chunk_kda_fwd` (module docstring). Inputs as the forward, ``do [B, T, H,
    128]`` (output cotangent), ``dht [B, H, 128, 128]`` (final-state cotangent; None = zeros). Returns ``(dq, dk,
    dv, dg, dbeta)`` in the dtypes of ``q, k, v, g, beta`` and ``dh0 [B, H, K, V] f32``. ``interpret``: False,
    True or a ``plgpu.InterpretGPUParams``; ``v_split``: the reverse pass's V-parts (None: as the forward's)."""
    name = "mosaic_gpu_bwd.chunk_kda_bwd"
    ref._check_inputs(q, k, v, g, beta, initial_state, segment_ids, name)
    B, T, H, K = q.shape
    reason = mosaic_gpu.supports_reason(dtype=jnp.promote_types(q.dtype, v.dtype).name, k=K, v=v.shape[-1],
                                        chunk_size=chunk_size, packed=segment_ids is not None)
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    if do is None or do.shape != v.shape:
        raise ValueError(f"{name}: do must be [B, T, H, V]={v.shape}, got {None if do is None else do.shape}")
    if dht is not None and dht.shape != (B, H, K, K):
        raise ValueError(f"{name}: dht must be [B, H, K, V]={(B, H, K, K)}, got {dht.shape}")
    pad = (-T) % CHUNK
    padt = lambda x: x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q16, k16, v16, do16 = (padt(x.astype(BF16)) for x in (q, k, v, do))
    g32 = padt(g.astype(F32))
    beta_t = jnp.swapaxes(padt(beta.astype(F32)), 1, 2)  # [B, H, Tp]
    h0_t = jnp.zeros((B, H, K, K), F32) if initial_state is None else jnp.swapaxes(initial_state.astype(F32), -1, -2)
    dht_t = jnp.zeros((B, H, K, K), F32) if dht is None else jnp.swapaxes(dht.astype(F32), -1, -2)
    interpret = interpret_params(interpret)
    if v_split is None:
        v_split = mosaic_gpu.default_v_split(B, H, mosaic_gpu.DEFAULT_SMS if interpret is not None else None)

    qg, kd, wn, x, aqk, decay = intra_chunks(q16, k16, g32, beta_t, scale=float(scale), interpret=interpret)
    vt, h_t, _ = state_sweep(kd, wn, x, v16, decay, h0_t, v_split=v_split, interpret=interpret)
    dvt, dh_t, dh0_t = state_grad_pass(qg, kd, wn, aqk, decay, do16, dht_t, v_split=v_split, interpret=interpret)
    d_qg, d_kd, d_wn, d_x, d_aqk_t, d_decay, dv = chunk_state_cotangents(h_t, dh_t, vt, dvt, do16, v16, x,
                                                                       interpret=interpret)
    dq, dk, dg, dbeta = chunk_intra_grads(q16, k16, g32, beta_t, d_qg, d_kd, d_wn, d_x, d_aqk_t, d_decay,
                                          scale=float(scale), interpret=interpret)
    cut = lambda t, like: t[:, :T].astype(like.dtype)
    return (cut(dq, q), cut(dk, k), cut(dv, v), cut(dg, g), cut(jnp.swapaxes(dbeta, 1, 2), beta),
            jnp.swapaxes(dh0_t, -1, -2))
