"""KDA chunk backward for the Mosaic GPU forward (:mod:`.mosaic_gpu`): gradients for ``q, k, v, g`` (the per-token
log-decay before the cumulative sum, as the API takes it), ``beta`` and the initial state. Same contract as the
forward (:func:`.mosaic_gpu.supports_reason`: bf16, ``K = V = 128``, chunk 64, the K3 gate bound, no packed
sequences).

Split as the forward, per chunk ``c`` with the per-chunk tensors ``qg, kd, wn = -W, x = X', aqk, decay`` (the
outputs of :mod:`.mosaic_gpu_intra`), ``S_c`` the state entering the chunk, ``dS'_c`` the cotangent of the state
leaving it:

1. The per-chunk tensors: :func:`intra_f32` (plain JAX, fp32, factored decay on 16-token tiles; its VJP is kept
   for step 4), stored bf16 for the two passes.
2. The two sequential passes on Mosaic GPU (:mod:`.mosaic_gpu_bwd_state`): the forward sweep (``S_c`` and
   ``V~ = X' v + (-W) S``, bf16) and the reverse pass (``dS'_c`` bf16, ``dV~``, the initial state's cotangent).
3. The per-chunk cotangents of the step-1 tensors on Mosaic GPU (:mod:`.mosaic_gpu_bwd_chunk`, all chunks in
   parallel): ``d qg = dO S^T``, ``d wn = dV~ S^T``, ``d kd = V~ dS'^T``, ``d decay = rowsum(S * dS')``,
   ``d aqk = tril(dO V~^T)``, ``d x = tril(dV~ v^T)``, and ``dv = X'^T dV~``.
4. ``dq, dk, dg, dbeta`` by the VJP of :func:`intra_f32` at those cotangents.

Steps 1 and 4 are plain JAX for now (the Mosaic GPU kernel for the per-chunk forward and its VJP - through the
inverse and the factored decay products - is still to be written); this module is not selected by the registry
(:mod:`.ops` takes the Triton backward behind the Mosaic GPU forward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda import mosaic_gpu
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.mosaic_gpu_bwd_chunk import chunk_state_cotangents
from pallas_kernels.kda.mosaic_gpu_bwd_state import state_grad_pass, state_sweep
from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, SUB, interpret_params

HP = lax.Precision.HIGHEST


def _ein(eq: str, *xs):
    return jnp.einsum(eq, *xs, precision=HP, preferred_element_type=F32)


def _chunks(x, n: int):
    """``[B, Tp, H, D]`` -> ``[B, H, n, 64, D]``."""
    B, _, H, D = x.shape
    return jnp.moveaxis(x.reshape(B, n, CHUNK, H, D), 3, 1)


def _tokens(x):
    """``[B, H, n, 64, D]`` -> ``[B, n * 64, H, D]``."""
    B, H, n, C, D = x.shape
    return jnp.moveaxis(x, 1, 3).reshape(B, n * C, H, D)


def intra_f32(q, k, g, beta, *, scale: float):
    """The per-chunk tensors of :mod:`.mosaic_gpu_intra` in fp32 (``precision=HIGHEST``), differentiable, memory
    ``O(T K)`` (the decay products on 16-token tiles, :func:`.reference._decay_products`). ``q, k, g [B, Tp, H,
    128]`` f32 (``Tp`` a multiple of 64), ``beta [B, Tp, H]`` f32. Returns ``(qg, kd, wn, x, aqk)`` as ``[B, H, n,
    64, D]`` and ``decay [B, H, n, 128]``."""
    n = q.shape[1] // CHUNK
    qc, kc = _chunks(q, n), _chunks(k, n)
    G = jnp.cumsum(_chunks(g, n), axis=-2)
    bc = _chunks(beta[..., None], n)[..., 0]  # [B, H, n, C]
    g_last = G[..., -1:, :]
    both = ref._decay_products(jnp.stack([kc, qc * scale], axis=-3), kc, G, SUB, strict=False)
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool), -1)
    akk = jnp.where(lower, both[..., 0, :, :], 0.0)
    aqk = both[..., 1, :, :]
    x = ref._unit_lower_inverse(bc[..., :, None] * akk) * bc[..., None, :]
    wn = -_ein("...ij,...jd->...id", x, kc * jnp.exp(G))
    return qc * jnp.exp(G) * scale, kc * jnp.exp(g_last - G), wn, x, aqk, jnp.exp(g_last[..., 0, :])


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
    qf, kf, gf, bf = (padt(x.astype(F32)) for x in (q, k, g, beta))
    do_p = padt(do.astype(BF16))
    n = qf.shape[1] // CHUNK
    h0 = jnp.zeros((B, H, K, K), F32) if initial_state is None else initial_state.astype(F32)
    dht_t = jnp.zeros((B, H, K, K), F32) if dht is None else jnp.swapaxes(dht.astype(F32), -1, -2)

    parts, intra_vjp = jax.vjp(lambda *a: intra_f32(*a, scale=float(scale)), qf, kf, gf, bf)
    qg, kd, wn, x, aqk, decay = (*(_tokens(t).astype(BF16) for t in parts[:5]), parts[5])
    interpret = interpret_params(interpret)
    if v_split is None:
        v_split = mosaic_gpu.default_v_split(B, H, mosaic_gpu.DEFAULT_SMS if interpret is not None else None)
    v16 = padt(v.astype(BF16))
    vt, h_t, _ = state_sweep(kd, wn, x, v16, decay, jnp.swapaxes(h0, -1, -2), v_split=v_split, interpret=interpret)
    dvt, dh_t, dh0_t = state_grad_pass(qg, kd, wn, aqk, decay, do_p, dht_t, v_split=v_split, interpret=interpret)
    d_qg, d_kd, d_wn, d_x, d_aqk, d_decay, dv = chunk_state_cotangents(h_t, dh_t, vt, dvt, do_p, v16, x,
                                                                       interpret=interpret)
    dq, dk, dg, dbeta = intra_vjp((*(_chunks(t, n) for t in (d_qg, d_kd, d_wn, d_x, d_aqk)), d_decay))
    cut = lambda t, like: t[:, :T].astype(like.dtype)
    return (cut(dq, q), cut(dk, k), cut(dv, v), cut(dg, g), cut(dbeta, beta),
            jnp.swapaxes(dh0_t, -1, -2))
