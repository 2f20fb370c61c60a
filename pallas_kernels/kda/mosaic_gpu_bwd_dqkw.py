"""KDA chunk backward, step 6 on Mosaic GPU (sm_90): the state products of :mod:`pallas_kernels.kda.gpu_bwd`'s
``_dqkw_kernel``, one for one in place of it (same arrays in, same arrays out).

Per chunk ``c`` of one ``(sequence, head)``, with ``S_in^T = h[c]``, ``dS_out^T = dh[c]`` (``[V, K]``):
``dqe = dO S_in``, ``dkd = V~ dS_out``, ``dW = -dV~ S_in``, ``ddl = sum_V(S_in * dS_out)``; then, with the gate
factors ``e^G`` (tokens of the document that entered the chunk, else 0), ``e^{G_C - G}`` (tokens of the chunk's
last document, else 0), ``kd = k e^{G_C - G}`` and the chunk decay ``dl = e^{G_C}`` (0 where a document starts in
the chunk): ``dw = dW``, ``dqp = dqe e^G``, ``dkp = dkd e^{G_C - G}``, ``dgp = dqe q e^G scale - dkd kd`` plus, in
the chunk's last row, ``sum_C(dkd kd) + ddl dl``.

Contract (:func:`supports_reason`): bf16 ``q, k, do, vt, dvt, h, dh``, ``K = V = 128``, chunk 64. Inputs in the
layouts ``chunk_kda_bwd`` hands its Triton kernel: ``q, k [B, Tp, H, K]``, ``gam [B, Tp, H, K]`` f32 (``G``, the
chunk-local cumsum of ``g``), ``seg_col [B, Tp, 1]`` i32 (document starts inside the chunk up to each token),
``do [B, Tp, H, V]``, ``vt, dvt [B*H, Tp, V]``, ``h, dh [B*H, N, V, K]``; outputs ``dw [B*H, Tp, K]`` f32,
``dqp, dkp [B*H, Tp, K]`` bf16, ``dgp [B*H, Tp, K]`` f32 (``Tp = 64 N``).

Layout: grid ``(N, B*H)``, one CTA per chunk, two warpgroups, warpgroup ``j`` owning the K columns
``[64 j, 64 j + 64)`` (every result is per K column, so the halves are independent). Warpgroup 0 TMA-loads the
chunk's ``dO, V~, dV~`` tiles ``[64, 128]`` (the A operands both share), its document starts ``[64]`` and the row
of ``G`` at its last token ``[128]``; each warpgroup loads its half of ``h, dh`` (``[128, 64]``), ``G``, ``q`` and
``k`` (``[64, 64]``). Every product runs on wgmma with **both operands in shared memory** (bf16, fp32
accumulation; see :mod:`.mosaic_gpu_intra` for why no register A operands): the three ``[64, 128] x [128, 64]``
state products, then the column sums of ``dkd kd`` and of ``S_in * dS_out * dl`` (its two 64-row halves added in
fp32 first) as products with a ``[64, 64]`` ones operand, each summand split into two bf16 terms ``hi + lo``, so
the sums are exact to ~2^-17 relative (the Triton kernel sums in fp32). The split terms and the four output tiles
are staged in shared memory over the warpgroup's inputs once those are read (``_Half``), and each output is
TMA-stored as soon as it is final (``dw``, then ``dqp``, ``dkp``, then ``dgp``), so registers hold at most the
three accumulators, or two of their results and the gate factors, at a time (no spills). Shared memory: 194 KiB
(one CTA a multiprocessor).
Every copy between device and shared memory has at most one integer index (token tensors as ``[B * Tp, H, D]``
views, the rest flattened to 2-D or 1-D).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import (
    BF16,
    CHUNK,
    F32,
    HEAD_DIM,
    bcast_cols,
    interpret_params,
    load_f32,
    shape_reason,
    split_bf16,
    tiled,
)

__all__ = ["dqkw", "supports_reason", "KERNEL_NAME"]

KERNEL_NAME = "kda_bwd_dqkw_mosaic_gpu"
HALF = HEAD_DIM // 2
I32 = jnp.int32


def supports_reason(*, dtype: str, k: int, v: int, chunk_size: int, state_dtype: str = "bfloat16") -> str | None:
    """None when step 6 of a backward call fits :func:`dqkw`, else why not. ``dtype``: the matmul dtype of the call
    (the promoted dtype of ``q, k, v``); ``state_dtype``: the storage dtype of ``h`` / ``dh``."""
    return shape_reason(dtype=dtype, k=k, v=v, chunk_size=chunk_size, state_dtype=state_dtype)


@dataclasses.dataclass(frozen=True)
class _Half:
    """Shared memory of warpgroup ``j`` (its K half). Inputs ``h, dh [128, 64]`` bf16, ``g [64, 64]`` f32 (``G``),
    ``qk [128, 64]`` bf16 (``q`` in rows 0-63, ``k`` in 64-127). Over them once read, the bf16 ``hi`` / ``lo`` terms
    (``[64, 64]`` each) of the column-sum operands (``shi, slo`` over ``dh``; ``phi, plo`` over ``g``) and the
    outputs: ``dw`` f32 over ``h``, ``dqp, dkp`` bf16 over ``qk``, ``dgp`` f32 over ``dh`` (after the column sums).
    ``ones [64, 64]`` bf16."""

    h: object
    dh: object
    g: object
    qk: object
    dw: object
    shi: object
    slo: object
    phi: object
    plo: object
    dqp: object
    dkp: object
    dgp: object
    ones: object


def _products(s: _Half, shared):
    """``(dqe, dkd, dwn)`` (f32 ``[64, 64]``): ``dO S_in``, ``V~ dS_out``, ``dV~ S_in`` for this K half."""
    do_s, vt_s, dvt_s, _, _ = shared

    def run(acc_q, acc_k, acc_w):
        plgpu.wgmma(acc_q, do_s, s.h)
        plgpu.wgmma(acc_k, vt_s, s.dh)
        plgpu.wgmma(acc_w, dvt_s, s.h)
        return acc_q[...], acc_k[...], acc_w[...]

    return pl.run_scoped(run, *(plgpu.ACC((CHUNK, HALF), F32) for _ in range(3)))


def _gated(s: _Half, seg, seg_last, g_last, scale: float, dqe, dkd):
    """``(dqp, dkp, dgp, part)``: ``dqp = dqe e^G``, ``dkp = dkd e^{G_C - G}`` (bf16), ``dgp = dqe q e^G scale -
    part`` and ``part = dkd kd`` (f32), with the document masks of the module docstring (``seg`` per row,
    ``seg_last`` scalar, ``g_last`` per column)."""
    gam = load_f32(s.g)
    eg = jnp.where(seg == 0, jnp.exp(gam), 0.0)
    ekl = jnp.where(seg == seg_last, jnp.exp(g_last - gam), 0.0)
    dqp = (dqe * eg).astype(BF16)
    dgp = dqe * (load_f32(s.qk.at[pl.ds(0, CHUNK)]) * (eg * scale))
    dkp = (dkd * ekl).astype(BF16)
    part = dkd * (load_f32(s.qk.at[pl.ds(CHUNK, CHUNK)]) * ekl)
    return dqp, dkp, dgp - part, part


def _half(j: int, s: _Half, shared, scale: float, outs, rows_out):
    """Warpgroup ``j``'s K half, once its tiles landed (module docstring): products; ``S_in * dS_out * dl`` summed
    over its two 64-row halves (its column sums are ``ddl dl``) into shared memory and ``dw`` stored; gate factors,
    ``dqp`` and ``dkp`` stored; the column sums of both terms by wgmma; ``dgp`` stored. Registers hold at most the
    three accumulators, or two of their results and the gate factors, at a time."""
    wg = plgpu.Layout.WGMMA
    _, _, _, seg_s, glast_s = shared
    cols = pl.ds(HALF * j, HALF)
    dw_ref, dqp_ref, dkp_ref, dgp_ref = outs
    store = lambda src, dst: plgpu.copy_smem_to_gmem(src, dst.at[rows_out, cols])
    seg = lax.broadcast_in_dim(plgpu.layout_cast(seg_s[...], wg.reduce(1)), (CHUNK, HALF), [0])
    seg_last = seg_s[CHUNK - 1]
    g_last = bcast_cols(plgpu.layout_cast(glast_s[cols], wg.reduce(0)))

    dqe, dkd, dwn = _products(s, shared)
    dl = jnp.where(seg_last == 0, jnp.exp(g_last), 0.0)  # the chunk decay, per column
    sdl = sum(load_f32(s.h.at[pl.ds(CHUNK * r, CHUNK)]) * load_f32(s.dh.at[pl.ds(CHUNK * r, CHUNK)]) * dl
              for r in range(HEAD_DIM // CHUNK))
    plgpu.commit_smem()  # every warp's products and every thread have read h, dh before dw, sdl land over them
    s.dw[...] = -dwn
    split_bf16(sdl, s.shi, s.slo)
    plgpu.commit_smem()
    store(s.dw, dw_ref)

    dqp, dkp, dgp, part = _gated(s, seg, seg_last, g_last, scale, dqe, dkd)
    plgpu.commit_smem()  # every thread has read g, q, k before dqp, dkp, part land over them
    s.dqp[...] = dqp
    s.dkp[...] = dkp
    split_bf16(part, s.phi, s.plo)
    s.ones[...] = jnp.where(plgpu.broadcasted_iota(I32, (CHUNK, CHUNK), 0, layout=wg) >= 0, 1.0, 0.0).astype(BF16)
    plgpu.commit_smem()
    store(s.dqp, dqp_ref)
    store(s.dkp, dkp_ref)

    def column_sums(acc):
        for ref in (s.shi, s.slo, s.phi, s.plo):
            plgpu.wgmma(acc, s.ones, ref)
        return acc[...]

    dglast = pl.run_scoped(column_sums, plgpu.ACC((CHUNK, HALF), F32))  # every row: sum_C(dkd kd) + ddl dl
    plgpu.commit_smem()  # every warp's column sums have read shi, slo before dgp lands over them
    row = plgpu.broadcasted_iota(I32, (CHUNK, HALF), 0, layout=wg)
    s.dgp[...] = dgp + jnp.where(row == CHUNK - 1, dglast, 0.0)
    plgpu.commit_smem()
    store(s.dgp, dgp_ref)
    plgpu.wait_smem_to_gmem(0)


def _check(q, k, gam, seg_col, do, vt, dvt, h, dh) -> None:
    """Raise ValueError naming the first argument outside the contract (module docstring)."""
    name = "mosaic_gpu_bwd_dqkw.dqkw"
    B, Tp, H, K = q.shape
    if Tp % CHUNK:
        raise ValueError(f"{name}: Tp={Tp} must be a multiple of {CHUNK}")
    BH, N, D = B * H, Tp // CHUNK, HEAD_DIM
    want = dict(q=((B, Tp, H, D), BF16), k=((B, Tp, H, D), BF16), gam=((B, Tp, H, D), F32),
                seg_col=((B, Tp, 1), I32), do=((B, Tp, H, D), BF16), vt=((BH, Tp, D), BF16),
                dvt=((BH, Tp, D), BF16), h=((BH, N, D, D), BF16), dh=((BH, N, D, D), BF16))
    got = dict(q=q, k=k, gam=gam, seg_col=seg_col, do=do, vt=vt, dvt=dvt, h=h, dh=dh)
    for nm, (shape, dtype) in want.items():
        x = got[nm]
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"{name}: {nm} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                             f"{x.dtype.name}{list(x.shape)}")


def dqkw(q, k, gam, seg_col, do, vt, dvt, h, dh, *, scale: float, interpret=False):
    """Step 6 of :mod:`pallas_kernels.kda.gpu_bwd` (its ``_dqkw_kernel``) at ``K = V = 128``, chunk 64.

    Args (the arrays ``chunk_kda_bwd`` passes its Triton kernel): ``q, k [B, Tp, H, 128]`` bf16,
    ``gam [B, Tp, H, 128]`` f32 (``G``), ``seg_col [B, Tp, 1]`` i32, ``do [B, Tp, H, 128]`` bf16,
    ``vt, dvt [B*H, Tp, 128]`` bf16 (``V~``, ``dV~``), ``h, dh [B*H, N, 128, 128]`` bf16 (``S_in^T`` and
    ``dS_out^T`` per chunk); ``Tp = 64 N``. ``scale``: the query scale. ``interpret``: False/None (compiled for
    sm_90), True or a ``plgpu.InterpretGPUParams`` (the Mosaic GPU interpreter).
    Returns ``(dw f32, dqp bf16, dkp bf16, dgp f32)``, each ``[B*H, Tp, 128]`` (module docstring).
    """
    _check(q, k, gam, seg_col, do, vt, dvt, h, dh)
    B, Tp, H, K = q.shape
    V = do.shape[-1]
    BH, N = B * H, Tp // CHUNK
    interpret = interpret_params(interpret)
    scale = float(scale)
    buf = lambda r, c, dt=BF16: plgpu.SMEM((r, c), dt, transforms=tiled(dt))
    shared = (buf(CHUNK, V), buf(CHUNK, V), buf(CHUNK, V), plgpu.SMEM((CHUNK,), I32), plgpu.SMEM((K,), F32))
    half = lambda: (plgpu.RefUnion((buf(V, HALF), buf(V, HALF), buf(CHUNK, HALF, F32), buf(2 * CHUNK, HALF)),
                                   (buf(CHUNK, HALF, F32), *(buf(CHUNK, HALF) for _ in range(6))),
                                   (buf(CHUNK, HALF, F32), buf(CHUNK, HALF, F32))),
                    buf(CHUNK, CHUNK))  # h, dh, g, qk | dw, shi, slo, phi, plo, dqp, dkp | -, dgp; ones
    bars = (plgpu.Barrier(num_arrivals=5), plgpu.Barrier(num_arrivals=5, num_barriers=2))

    def kda_bwd_dqkw_mosaic_gpu(q_ref, k_ref, g_ref, glast_ref, seg_ref, do_ref, vt_ref, dvt_ref, h_ref, dh_ref,
                                dw_ref, dqp_ref, dkp_ref, dgp_ref, shared_s, halves, bar_refs):
        shared_loaded, loaded = bar_refs
        c, bh, wg = lax.axis_index("c"), lax.axis_index("bh"), lax.axis_index("wg")
        b, hd = lax.div(bh, H), lax.rem(bh, H)
        tok0 = b * Tp + c * CHUNK  # this chunk's first row of the [B * Tp, ...] views
        rows_in = pl.ds(tok0, CHUNK)
        rows_out = pl.ds(bh * Tp + c * CHUNK, CHUNK)  # of the [B * H * Tp, D] views
        state_rows = pl.ds((bh * N + c) * V, V)  # of the [B * H * N * V, K] views
        for j in range(2):

            @pl.when(wg == j)
            def _warpgroup(j=j):
                (inputs, (dw, *terms), (_, dgp)), ones = halves[j]
                s = _Half(*inputs, dw, *terms, dgp, ones)
                cols = pl.ds(HALF * j, HALF)
                if j == 0:
                    do_s, vt_s, dvt_s, seg_s, glast_s = shared_s
                    plgpu.copy_gmem_to_smem(do_ref.at[rows_in, hd], do_s, shared_loaded)
                    plgpu.copy_gmem_to_smem(vt_ref.at[rows_out], vt_s, shared_loaded)
                    plgpu.copy_gmem_to_smem(dvt_ref.at[rows_out], dvt_s, shared_loaded)
                    plgpu.copy_gmem_to_smem(seg_ref.at[rows_in], seg_s, shared_loaded)
                    plgpu.copy_gmem_to_smem(glast_ref.at[(tok0 + CHUNK - 1) * H + hd], glast_s, shared_loaded)
                bar = loaded.at[j]
                plgpu.copy_gmem_to_smem(h_ref.at[state_rows, cols], s.h, bar)
                plgpu.copy_gmem_to_smem(dh_ref.at[state_rows, cols], s.dh, bar)
                plgpu.copy_gmem_to_smem(g_ref.at[rows_in, hd, cols], s.g, bar)
                plgpu.copy_gmem_to_smem(q_ref.at[rows_in, hd, cols], s.qk.at[pl.ds(0, CHUNK)], bar)
                plgpu.copy_gmem_to_smem(k_ref.at[rows_in, hd, cols], s.qk.at[pl.ds(CHUNK, CHUNK)], bar)
                plgpu.barrier_wait(shared_loaded)
                plgpu.barrier_wait(bar)
                _half(j, s, shared_s, scale, (dw_ref, dqp_ref, dkp_ref, dgp_ref), rows_out)

    tok_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    out = lambda dt: jax.ShapeDtypeStruct((BH * Tp, K), dt)
    dw, dqp, dkp, dgp = plgpu.kernel(
        kda_bwd_dqkw_mosaic_gpu,
        out_type=(out(F32), out(BF16), out(BF16), out(F32)),
        scratch_types=(shared, (half(), half()), bars),
        grid=(N, BH),
        grid_names=("c", "bh"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(tok_view(q), tok_view(k), tok_view(gam), gam.reshape(B * Tp * H, K), seg_col.reshape(B * Tp), tok_view(do),
      vt.reshape(BH * Tp, V), dvt.reshape(BH * Tp, V), h.reshape(BH * N * V, K), dh.reshape(BH * N * V, K))
    return tuple(x.reshape(BH, Tp, K) for x in (dw, dqp, dkp, dgp))

