"""KDA decode (one token per sequence) on Pallas Mosaic GPU (sm_90), in place on a state pool.

One CTA (one warpgroup) per ``(V-tile, sequence * H + head)``. It TMA-loads the sequence's pool row index, its
token vectors and the ``[K, block_v]`` fp32 slice of its state, runs the step of
:func:`pallas_kernels.kda.reference.recurrent_kda` in fp32 registers

``S <- diag(exp g) S``, ``S <- S + (beta k) (v - S^T k)^T``, ``o = S^T (scale q)``

and TMA-writes ``o`` and the slice back into the pool. The pool enters the kernel as a mutable ref
(``jax.new_ref``), so the custom call aliases it (in place when the caller donates it). Every copy between
device and shared memory has at most one integer index: the pool as a ``[P * H * K, V]`` view, the token vectors
as ``[B * H, D]`` views. The per-token vectors enter as one fp32 ``[B * H * 4, K]`` pack (``scale q``, ``k``,
``exp g``, ``beta k``) built by XLA beside the kernel.

Contract: bf16 or fp32 ``q, k, v``, ``K = V = 128``, distinct slots. Any ``g <= 0`` (no gate bound needed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import F32, HEAD_DIM, interpret_params, tiled

BLOCK_V = 64
"""Columns of V per CTA (its state slice is ``[K, BLOCK_V]`` fp32 in shared memory and registers)."""
ROW_PAD = 32
"""The per-(sequence, head) pool row index travels as ``[B * H, ROW_PAD]`` i32 (copies move multiples of 128
bytes)."""


def supports_reason(*, dtype: str, k: int, v: int) -> str | None:
    """None when a decode call fits this kernel, else why not (the registry's reason)."""
    if dtype not in ("bfloat16", "float32"):
        return f"takes bfloat16 or float32 inputs, got {dtype}"
    if k != HEAD_DIM or v != HEAD_DIM:
        return f"needs K = V = {HEAD_DIM}, got K={k}, V={v}"
    return None


def _decode_kernel(rows_ref, vecs_ref, v_ref, pool_ref, o_ref, row_s, vec_s, v_s, s_s, o_s,
                   bar_row, bar_tok, bar_state, *, block_v: int):
    j, bh = lax.axis_index("j"), lax.axis_index("bh")
    cols = pl.ds(j * block_v, block_v)
    plgpu.copy_gmem_to_smem(rows_ref.at[bh], row_s, bar_row)
    plgpu.copy_gmem_to_smem(vecs_ref.at[pl.ds(bh * 4, 4)], vec_s, bar_tok)
    plgpu.copy_gmem_to_smem(v_ref.at[bh, cols], v_s, bar_tok)
    plgpu.barrier_wait(bar_row)
    rows = pl.ds(row_s[0], HEAD_DIM)
    plgpu.copy_gmem_to_smem(pool_ref.at[rows, cols], s_s, bar_state)
    plgpu.barrier_wait(bar_tok)
    per_row = lambda i: lax.broadcast_in_dim(  # [K] -> [K, block_v]
        plgpu.load(vec_s.at[i], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False), (HEAD_DIM, block_v), [0])
    per_col = lambda x: lax.broadcast_in_dim(x, (HEAD_DIM, block_v), [1])  # [block_v] -> [K, block_v]
    v = plgpu.load(v_s, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False).astype(F32)
    plgpu.barrier_wait(bar_state)
    s = plgpu.layout_cast(s_s[...], plgpu.Layout.WGMMA) * per_row(2)
    pred = jnp.sum(per_row(1) * s, axis=0)
    s = s + per_row(3) * per_col(v - pred)
    o = jnp.sum(per_row(0) * s, axis=0)
    s_s[...] = s
    o_s[...] = o.astype(o_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_s, pool_ref.at[rows, cols])
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[bh, cols])
    plgpu.wait_smem_to_gmem(0)


def decode_step(q, k, v, g, beta, scale: float, state_pool, state_slots, block_v: int = BLOCK_V, interpret=False):
    """One recurrent KDA step in place on a state pool (the contract of :func:`pallas_kernels.kda.gpu.decode_step`).

    ``q, k, g [B, H, K]``, ``v [B, H, V]``, ``beta [B, H]``, ``state_pool [P, H, K, V] f32``, ``state_slots [B]
    i32`` (distinct). Returns ``(o [B, H, V] in v.dtype, new_pool)``; the pool buffer is aliased (donate it).
    ``block_v`` in (64, 128); ``interpret``: False, True or a ``plgpu.InterpretGPUParams`` (CPU interpreter).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    reason = supports_reason(dtype=jnp.promote_types(q.dtype, v.dtype).name, k=K, v=V)
    if reason is not None:
        raise ValueError(f"mosaic_gpu_decode.decode_step: {reason}")
    if block_v not in (64, 128):
        raise ValueError(f"mosaic_gpu_decode.decode_step: block_v must be 64 or 128, got {block_v}")
    if state_pool.ndim != 4 or state_pool.shape[1:] != (H, K, V) or state_pool.dtype != F32:
        raise ValueError(f"mosaic_gpu_decode.decode_step: state_pool must be [P, {H}, {K}, {V}] float32, got "
                         f"{state_pool.shape} {state_pool.dtype}")
    P = state_pool.shape[0]
    f = lambda x: x.astype(F32)
    kf = f(k)
    vecs = jnp.stack([f(q) * scale, kf, jnp.exp(f(g)), f(beta)[..., None] * kf], axis=2).reshape(B * H * 4, K)
    rows = (state_slots.astype(jnp.int32)[:, None] * H + jnp.arange(H, dtype=jnp.int32)) * K
    rows = jnp.broadcast_to(rows.reshape(B * H, 1), (B * H, ROW_PAD))
    vb = v.reshape(B * H, V)
    scratch = [
        plgpu.SMEM((ROW_PAD,), jnp.int32),
        plgpu.SMEM((4, K), F32),
        plgpu.SMEM((block_v,), vb.dtype),
        plgpu.SMEM((K, block_v), F32, transforms=tiled(F32)),
        plgpu.SMEM((block_v,), vb.dtype),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=1),
    ]
    pool = jax.new_ref(state_pool.reshape(P * H * K, V))
    o = plgpu.kernel(
        lambda *refs: _decode_kernel(*refs, block_v=block_v),
        out_type=jax.ShapeDtypeStruct((B * H, V), vb.dtype),
        scratch_types=scratch,
        grid=(V // block_v, B * H),
        grid_names=("j", "bh"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params(interpret),
    )(rows, vecs, vb, pool)
    pool = jax.freeze(pool)
    return o.reshape(B, H, V), pool.reshape(P, H, K, V)
