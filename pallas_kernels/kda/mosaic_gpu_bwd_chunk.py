"""KDA chunk backward on Mosaic GPU (sm_90): the products of each chunk with its forward state and state cotangent,
one CTA (one warpgroup) per ``(chunk, sequence * H + head)``, all chunks in parallel, every product on wgmma (bf16
operands, fp32 accumulation), every operand from shared memory.

Per chunk, with ``S`` the state entering it and ``dS'`` the cotangent of the state leaving it (both as the
transposed ``[V, K]`` bf16 that :mod:`.mosaic_gpu_bwd_state` writes), ``V~`` / ``dV~`` from its two sweeps, ``dO``,
``v`` and ``X'`` (the forward's per-chunk tensors, :mod:`.mosaic_gpu_intra`), the cotangents of the per-chunk
tensors and ``dv``:

``d qg = dO S^T``, ``d wn = dV~ S^T``, ``d kd = V~ dS'^T``, ``d decay = sum_v S * dS'`` (per key),
``d aqk^T = triu(V~ dO^T)`` (transposed: the layout :mod:`.mosaic_gpu_bwd_intra` takes), ``d x = tril(dV~ v^T)``,
``dv = X'^T dV~``; each written once in bf16 (the dtype the next kernel reads; ``d decay`` fp32).

Every copy between device and shared memory has one integer index: the token tensors as ``[B * Tp, H, D]`` views,
the states as ``[B * H * n_chunks * V, K]``, ``d decay`` as ``[B * H * n_chunks, 128]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, HEAD_DIM, tiled

HALF = HEAD_DIM // 2


@dataclasses.dataclass(frozen=True)
class _Smem:
    s: object  # [V, K] bf16: S^T
    ds: object  # [V, K] bf16: dS'^T
    vt: object  # [64, V] bf16: V~
    dvt: object  # [64, V] bf16: dV~
    do: object  # [64, V] bf16
    v: object  # [64, V] bf16
    x: object  # [64, 64] bf16: X'
    out: object  # [64, 128] bf16: staging of the [64, 128] results
    out_c: object  # [64, 64] bf16: staging of the [64, 64] results
    ddecay: object  # [128] f32


def _product(a, b, width: int, mask=None):
    """``a @ b`` (both shared-memory refs) as a ``[64, width]`` f32 value; ``mask``: ``"lower"`` / ``"upper"``
    keeps that triangle (the diagonal included)."""

    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    out = pl.run_scoped(run, plgpu.ACC((CHUNK, width), F32))
    if mask:
        iota = lambda d: plgpu.broadcasted_iota(jnp.int32, (CHUNK, width), d, layout=plgpu.Layout.WGMMA)
        keep = iota(0) >= iota(1) if mask == "lower" else iota(0) <= iota(1)
        out = jnp.where(keep, out, 0.0)
    return out


def _store(value, buf, dst):
    """``value`` (cast to ``buf``'s dtype) -> ``buf`` -> ``dst`` (device memory), waiting for the previous store
    from ``buf`` first."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    buf[...] = value.astype(buf.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, dst)


def _decay_cotangent(s: _Smem):
    """``sum_v S^T * dS'^T`` over the V rows (two halves of 64 rows): ``[128]`` f32."""
    total = None
    for rows in (slice(0, HALF), slice(HALF, HEAD_DIM)):
        load = lambda ref, rows=rows: plgpu.layout_cast(ref[rows, :], plgpu.Layout.WGMMA).astype(F32)
        part = jnp.sum(load(s.s) * load(s.ds), axis=0)
        total = part if total is None else total + part
    return total


def chunk_state_cotangents(h_t, dh_t, vt, dvt, do, v, x, *, interpret=None):
    """The per-chunk products (module docstring). ``h_t, dh_t [B, H, n, V, K]`` bf16 (:mod:`.mosaic_gpu_bwd_state`'s
    per-chunk states), ``vt, dvt, do, v [B, Tp, H, 128]`` bf16, ``x [B, Tp, H, 64]`` bf16. Returns ``(d_qg, d_kd,
    d_wn [B, Tp, H, 128], d_x, d_aqk_t [B, Tp, H, 64] (``d_aqk_t``: row ``t`` holds column ``t`` of its chunk's
    ``d aqk``), d_decay [B, H, n, 128] f32, dv [B, Tp, H, 128])``, all but ``d_decay`` bf16.
    ``interpret``: None or a ``plgpu.InterpretGPUParams``."""
    B, Tp, H, V = vt.shape
    n_chunks = Tp // CHUNK
    K = h_t.shape[-1]
    buf = lambda r, d, dt=BF16: plgpu.SMEM((r, d), dt, transforms=tiled(dt))
    smem = _Smem(s=buf(V, K), ds=buf(V, K), vt=buf(CHUNK, V), dvt=buf(CHUNK, V), do=buf(CHUNK, V),
                 v=buf(CHUNK, V), x=buf(CHUNK, CHUNK), out=buf(CHUNK, HEAD_DIM), out_c=buf(CHUNK, CHUNK),
                 ddecay=plgpu.SMEM((K,), F32))
    fields = tuple(getattr(smem, f.name) for f in dataclasses.fields(smem))
    rows_view = lambda t: t.reshape(B * Tp, H, t.shape[-1])
    states_view = lambda t: t.reshape(B * H * n_chunks * V, K)

    def kda_chunk_bwd_products_mosaic_gpu(h_ref, dh_ref, vt_ref, dvt_ref, do_ref, v_ref, x_ref, dqg_ref, dkd_ref,
                                          dwn_ref, dx_ref, daqk_ref, ddecay_ref, dv_ref, smem_refs, loaded):
        s = _Smem(*smem_refs)
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        h = lax.rem(bh, H)
        rows = pl.ds(lax.div(bh, H) * Tp + c * CHUNK, CHUNK)  # this chunk's rows of the [B * Tp, H, D] views
        state = pl.ds((bh * n_chunks + c) * V, V)  # this chunk's rows of the [B * H * n * V, K] views
        plgpu.copy_gmem_to_smem(h_ref.at[state], s.s, loaded)
        plgpu.copy_gmem_to_smem(dh_ref.at[state], s.ds, loaded)
        for src, dst in ((vt_ref, s.vt), (dvt_ref, s.dvt), (do_ref, s.do), (v_ref, s.v), (x_ref, s.x)):
            plgpu.copy_gmem_to_smem(src.at[rows, h], dst, loaded)
        plgpu.barrier_wait(loaded)
        at = lambda ref: ref.at[rows, h]
        _store(_product(s.do, s.s, K), s.out, at(dqg_ref))
        _store(_product(s.vt, s.ds, K), s.out, at(dkd_ref))
        _store(_product(s.dvt, s.s, K), s.out, at(dwn_ref))
        _store(_product(s.x.T, s.dvt, V), s.out, at(dv_ref))
        _store(_product(s.dvt, s.v.T, CHUNK, mask="lower"), s.out_c, at(dx_ref))
        _store(_product(s.vt, s.do.T, CHUNK, mask="upper"), s.out_c, at(daqk_ref))
        _store(_decay_cotangent(s), s.ddecay, ddecay_ref.at[bh * n_chunks + c])
        plgpu.wait_smem_to_gmem(0)

    tok = lambda d: jax.ShapeDtypeStruct((B * Tp, H, d), BF16)
    dqg, dkd, dwn, dx, daqk, ddecay, dv = plgpu.kernel(
        kda_chunk_bwd_products_mosaic_gpu,
        out_type=(tok(K), tok(K), tok(K), tok(CHUNK), tok(CHUNK), jax.ShapeDtypeStruct((B * H * n_chunks, K), F32),
                  tok(V)),
        scratch_types=(fields, plgpu.Barrier(num_arrivals=7)),
        grid=(n_chunks, B * H),
        grid_names=("c", "bh"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(states_view(h_t), states_view(dh_t), *(rows_view(t) for t in (vt, dvt, do, v, x)))
    shape = lambda t: t.reshape(B, Tp, H, -1)
    return (shape(dqg), shape(dkd), shape(dwn), shape(dx), shape(daqk), ddecay.reshape(B, H, n_chunks, K),
            shape(dv))
