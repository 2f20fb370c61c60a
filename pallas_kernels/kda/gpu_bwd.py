"""KDA chunked backward on GPU (Pallas Triton): gradients for q, k, v, g, beta and the initial state.

The math is :mod:`pallas_kernels.kda.tpu_bwd`'s (see its docstring for the per-chunk formulas); here it is
split into lean Triton kernels, none of which holds more than a few ``[C, 64]`` / ``[C, C]`` tiles at once
(so no program's tiles exceed the register file). Inputs
are read and ``dq, dk, dv, dg, dbeta`` written in the caller's ``[B, T, H, D]`` layout (strided tiles);
intermediates are ``[B*H, Tp, D]`` (``Tp`` = T padded to the chunk ``C``; ``N = Tp / C``), the per-chunk results
of steps 1-3 in :class:`pallas_kernels.kda._layout.ChunkResiduals`' layouts. The first grid
axis is the fastest, so a chunk's row-tile / K-block programs run together and share its tiles in L2. ``G``, the
chunk-local cumsum of g, comes first from the forward's kernel (:func:`pallas_kernels.kda.gpu.chunk_cumsum`).
Steps 1-3 recompute the forward's per-chunk results (:class:`pallas_kernels.kda._layout.ChunkResiduals`, in its
layouts) and are skipped when the forward saved them (``residuals``: the Mosaic GPU forward does):

1. ``_a_kernel``, grid ``(C/16, B*H, N)``: rows of ``A_kk`` (strictly lower, same document; fp32, no beta),
   masked ``A_qk``, ``q e^G scale`` and ``e^{G_C - G} k`` per 16-token row tile (the forward's factoring).
2. ``_solve_kernel``, grid ``(B*H, N)``: ``X = (I + diag(beta) A_kk)^-1`` in fp32 (16x16 tiles, doubling
   product on the diagonal, blocked substitution below it).
3. ``_w_kernel``, grid ``(B*H, N)``: ``X' = X diag(beta)``, ``-W = -X' e^G k``, chunk decay ``e^{G_C}``.
4. ``_h_kernel`` (state sweep), grid ``(B*H, V/BV)``: forward recurrence with ``S^T [BV, K]`` (fp32) in
   registers; writes the state entering each chunk ``h [B*H, N, V, K]`` and ``V~ = X' v - W S``
   ``[B*H, Tp, V]``.
5. ``_ds_kernel`` (reverse sweep), grid ``(B*H, V/BV)``: ``dS^T [BV, K]`` from the final-state cotangent
   backwards; per chunk writes the cotangent of the state *leaving* it, ``dh [B*H, N, V, K]``, and
   ``dV~ = A_qk^T dO + kd dS'`` ``[B*H, Tp, V]``; at the end ``dh0``.
6. ``_dqkw_kernel``, grid ``(K/BK, B*H, N)``: the state products ``dO S^T``, ``V~ dS'^T``,
   ``dW = -dV~ S^T`` and ``sum(S * dS')`` (loop over V blocks), giving the e^G / kd / chunk-decay parts of
   dq, dk, dG and ``dW``.
7. ``_wy_dx_kernel`` then ``_wy_dl_kernel``, grid ``(B*H, N)``: through the UT transform: ``dB_v = X^T dV~``
   (-> dv), ``dB_k = X^T dW`` (written out), ``dX = dV~ B_v^T + dW B_k^T`` (through HBM), then
   ``dL = -X^T dX X^T`` (strictly lower, same document), ``dA_kk = diag(beta) dL``, ``dA_qk = dO V~^T``
   (masked), dbeta. For bf16 inputs the products with ``X`` and ``dX`` take one TF32 pass.
8. ``_da_tile_kernel``, grid ``(K/BK * C/16, B*H, N)``: one 16-row tile of one K block per program: the decay
   products differentiated as matmuls on the 16x16 tiles (row part over the column tiles at or before it, at
   the reference point before the tile; column part over the row tiles at or after it, at the tile's last
   token; dynamic loops), summed with the partial dq, dk, dG of steps 6 and 7; writes dq, dk and ``dG``.
9. ``_dg_cumsum_kernel``, grid ``(K/BK, B*H, N)``: ``dg`` = reverse cumsum of ``dG`` inside the chunk.

Precision as the forward: bf16 inputs take bf16 matmul operands with fp32 accumulation for ``A``,
``W``/``U``, the sweeps and the state products; the inverse ``X`` is stored in fp32, and step 7's products with
``X`` and ``dX`` (``X^T dV~``, ``X^T dW``, the ``dX -> dL`` chain) take one TF32 pass (3xTF32 for fp32 inputs;
emulated by rounding, or ``HIGHEST``, in ``interpret`` mode). The decay-product
gradients of step 8 take TF32 operands (one tensor-core pass; emulated by rounding in ``interpret`` mode):
``dG = x dx - y dy`` cancels, and with bf16 operands ``dg`` was 5.6% off the fp32 VJP (T=128, K=64; TF32
0.8%; the TPU backward's bf16 path has the same 5.6%). fp32 inputs: 3xTF32 everywhere. Stored in the
matmul dtype (bf16 for bf16 inputs, as fla stores its states and ``dv``; -3.2 GB of HBM traffic at T=8192,
H=96 vs fp32, dq/dk/dv errors +0.5e-3): ``h``, ``dh``, ``dV~`` and the step-6 partials of dq and dk; ``dW``,
``dB_k``, the ``dG`` partial and ``dA`` stay fp32; ``X'`` is stored in the matmul dtype (it only enters matmul
operands: ``U = X' v``, ``W``). With the Mosaic GPU forward's ``residuals``, ``X`` is that forward's (by doubling
on bf16 operands summed in fp32). Requires the lower-bounded gate ``g >= -5``.

Mosaic GPU steps (``chunk_kda_bwd(mosaic_gpu_steps=...)``, sm_90 or the Mosaic GPU interpreter; bf16, ``K = V =
128``, chunk 64; the same arrays in and out as the Triton kernels they replace, except the intermediates a fused
kernel keeps on chip): ``"sweeps"`` = steps 4-5 (:mod:`.mosaic_gpu_bwd_sweeps`), ``"dqkw"`` = step 6
(:mod:`.mosaic_gpu_bwd_dqkw`), ``"wy"`` = step 7, both kernels in one (:mod:`.mosaic_gpu_bwd_wy`), ``"da"`` =
steps 8-9 in one kernel (``dG`` on chip; :mod:`.mosaic_gpu_bwd_da`). With all four and the forward's
``residuals``, ``G`` is XLA's chunk cumsum and no Triton kernel runs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import _layout, launch
from pallas_kernels.kda import gpu as _fwd

__all__ = ["chunk_kda_bwd", "KERNEL_NAMES", "RECOMPUTE_KERNEL_NAMES", "DEFAULT_WARPS"]

SUB = 16
EXP_CLAMP = 80.0
NT = (((1,), (1,)), ((), ()))
NN = (((1,), (0,)), ((), ()))
TN = (((0,), (0,)), ((), ()))

KERNEL_NAMES = (
    "kda_chunk_cumsum_gpu", "kda_bwd_a_gpu", "kda_bwd_solve_gpu", "kda_bwd_w_gpu", "kda_bwd_h_gpu", "kda_bwd_ds_gpu",
    "kda_bwd_dqkw_gpu", "kda_bwd_wy_dx_gpu", "kda_bwd_wy_dl_gpu", "kda_bwd_da_gpu", "kda_bwd_dg_gpu",
)
"""The kernels one backward launches, in launch order (first the forward's chunk cumsum of ``g``; step 7 is two
kernels: ``wy_dx``, ``wy_dl``; step 8 is ``da`` then the cumsum ``dg``)."""
RECOMPUTE_KERNEL_NAMES = ("kda_bwd_a_gpu", "kda_bwd_solve_gpu", "kda_bwd_w_gpu")
"""Steps 1-3, not launched when the forward's per-chunk results are given (``residuals``)."""
DEFAULT_WARPS = dict.fromkeys(KERNEL_NAMES, 4) | {
    "kda_bwd_solve_gpu": 2, "kda_bwd_wy_dx_gpu": 8, "kda_bwd_dqkw_gpu": 8}
"""Launch widths: 2 warps for the solve, 8 for the step-7 X-product kernel (with 4 it spills registers) and for
dq/dk/dw, 4 elsewhere."""


TF32 = "tf32"  # matmul "dtype": fp32 operands rounded to TF32 (10-bit mantissa), one tensor-core pass


def _round_tf32(x):
    """Round fp32 to the nearest TF32 value (emulation of a TF32 matmul operand in interpret mode)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jax.lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)


def _make_mm(interpret: bool):
    """The forward's matmul (:func:`pallas_kernels.kda.gpu._make_mm`) plus one mode: ``dtype=TF32`` = one TF32
    pass with fp32 accumulation (emulated by rounding the operands in interpret mode)."""
    base = _fwd._make_mm(interpret)
    precise = jax.lax.Precision.HIGHEST

    def mm(a, b, dims, dtype):
        if isinstance(dtype, str) and dtype == TF32:
            if interpret:
                return jax.lax.dot_general(_round_tf32(a), _round_tf32(b), dims, precision=precise,
                                           preferred_element_type=jnp.float32)
            return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                                       precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
                                       preferred_element_type=jnp.float32)
        return base(a, b, dims, dtype)

    return mm


def _g_before_tile(g_ref, a, start, cols=slice(None)):
    """``G`` at the token before 16-row tile ``a`` (rows from ``start = 16 a``) as ``[1, D]``, 0 for tile 0: the
    tile's reference point for the factored decay."""
    return jnp.where(a == 0, 0.0, g_ref[pl.ds(jnp.maximum(start - 1, 0), 1), cols])


# ------------------------------------------------------------------------------------------------------
# 1-3: intra-chunk recomputation (A, X, W, U)
# ------------------------------------------------------------------------------------------------------


def _a_kernel(q_ref, k_ref, g_ref, segc_ref, segr_ref, akk_ref, aqk_ref, qg_ref, kdec_ref,
              *, scale: float, mm_dtype, block_k: int, interpret: bool):
    """Rows ``[16a, 16a + 16)`` of ``A_kk`` (fp32), ``A_qk``, ``q e^G scale``, ``e^{G_C - G} k``.

    ``q_ref [16, K]``: the row tile; ``k_ref, g_ref [C, K]`` (``g_ref`` holds ``G``), ``segc_ref [C, 1]``,
    ``segr_ref [1, C]``: the chunk.
    """
    f32 = jnp.float32
    C, K = k_ref.shape
    mm = _make_mm(interpret)
    a = pl.program_id(0)
    r0 = pl.multiple_of(a * SUB, SUB)
    rows = pl.ds(r0, SUB)
    sc = segc_ref[rows, :]
    seglast = segc_ref[pl.ds(C - 1, 1), :]
    acc_k = jnp.zeros((SUB, C), f32)
    acc_q = jnp.zeros((SUB, C), f32)
    for kb in range(K // block_k):
        cols = pl.ds(kb * block_k, block_k)
        gall = g_ref[:, cols]
        m = _g_before_tile(g_ref, a, r0, cols)
        glast = g_ref[pl.ds(C - 1, 1), cols]
        ga = g_ref[rows, cols]
        left = jnp.exp(ga - m)  # <= 1
        ka = k_ref[rows, cols].astype(f32)
        qa = q_ref[:, cols].astype(f32)
        colf = k_ref[:, cols].astype(f32) * jnp.exp(jnp.minimum(m - gall, EXP_CLAMP))
        acc_k = acc_k + mm(ka * left, colf, NT, mm_dtype)
        acc_q = acc_q + mm(qa * (left * scale), colf, NT, mm_dtype)
        qg_ref[:, cols] = (qa * jnp.where(sc == 0, jnp.exp(ga) * scale, 0.0)).astype(qg_ref.dtype)
        kdec_ref[:, cols] = jnp.where(sc == seglast, ka * jnp.exp(glast - ga), 0.0).astype(kdec_ref.dtype)
    ri = r0 + jax.lax.broadcasted_iota(jnp.int32, (SUB, C), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SUB, C), 1)
    same = sc == segr_ref[...]
    akk_ref[...] = jnp.where(same & (ri > ci), acc_k, 0.0)
    aqk_ref[...] = jnp.where(same & (ri >= ci), acc_q, 0.0).astype(aqk_ref.dtype)


def _solve_kernel(akk_ref, beta_ref, x_ref, *, interpret: bool):
    """``X = (I + diag(beta) A_kk)^-1`` (fp32) for one chunk from 16x16 tiles."""
    C = akk_ref.shape[0]
    nt = C // SUB
    mm = _make_mm(interpret)
    mmp = lambda p_, r_: mm(p_, r_, NN, jnp.float32)
    ds = lambda i: pl.ds(i * SUB, SUB)
    zeros = jnp.zeros((SUB, SUB), jnp.float32)
    x = _layout.blocked_unit_lower_inverse(lambda a, c: beta_ref[ds(a), :] * akk_ref[ds(a), ds(c)], nt, SUB, mmp)
    for a in range(nt):
        for b in range(nt):
            x_ref[ds(a), ds(b)] = x[a][b] if b <= a else zeros


def _w_kernel(x_ref, k_ref, g_ref, betar_ref, segc_ref, wn_ref, xb_ref, dl_ref,
              *, block: int, mm_dtype, interpret: bool):
    """``X' = X diag(beta)`` (stored in the matmul dtype), ``-W = -X' (e^G k)`` (``e^G`` only for the document
    entering the chunk), ``e^{G_C}`` (0 if a document starts inside the chunk). ``betar_ref [1, C]``: beta as a
    row."""
    f32 = jnp.float32
    C, K = k_ref.shape
    mm = _make_mm(interpret)
    xb = x_ref[...] * betar_ref[...]
    xb_ref[...] = xb.astype(xb_ref.dtype)
    first = segc_ref[...] == 0
    reset = segc_ref[pl.ds(C - 1, 1), :] != 0
    bk = min(block, K)
    for kb in range(K // bk):
        cols = pl.ds(kb * bk, bk)
        egk = jnp.where(first, jnp.exp(g_ref[:, cols]), 0.0) * k_ref[:, cols].astype(f32)
        wn_ref[:, cols] = (-mm(xb, egk, NN, mm_dtype)).astype(wn_ref.dtype)
        dl_ref[:, cols] = jnp.where(reset, 0.0, jnp.exp(g_ref[pl.ds(C - 1, 1), cols]))


# ------------------------------------------------------------------------------------------------------
# 4-5: the two sequential sweeps over chunks (state slices in registers)
# ------------------------------------------------------------------------------------------------------


def _h_kernel(wn_ref, xb_ref, v_ref, kdec_ref, dl_ref, h0_ref, h_ref, vt_ref, *, chunk: int, n_chunks: int,
              mm_dtype, interpret: bool):
    """Forward order: ``h[c] = S_in^T [BV, K]``, ``V~ = X' v - W S_in`` (``U = X' v`` formed here; ``wn = -W``),
    ``S_out = diag(dl) S_in + kd^T V~``."""
    mm = _make_mm(interpret)
    C = chunk

    def body(c, st):
        rows = pl.ds(c * C, C)
        h_ref[c] = st.astype(h_ref.dtype)
        vt = (mm(xb_ref[rows, :], v_ref[rows, :], NN, mm_dtype)
              + mm(wn_ref[rows, :], st, NT, mm_dtype))  # [C, BV]
        vt_ref[rows, :] = vt.astype(vt_ref.dtype)
        return st * dl_ref[c] + mm(vt, kdec_ref[rows, :], TN, mm_dtype)

    jax.lax.fori_loop(0, n_chunks, body, h0_ref[...])


def _ds_kernel(aqk_ref, qg_ref, kdec_ref, wn_ref, dl_ref, do_ref, dht_ref, dh_ref, dvt_ref, dh0_ref,
               *, chunk: int, n_chunks: int, mm_dtype, interpret: bool):
    """Reverse order, ``dS'^T [BV, K]`` = cotangent of the state leaving chunk c: ``dh[c] = dS'^T``,
    ``dV~ = A_qk^T dO + kd dS'``, ``dS = (q e^G)^T dO + diag(dl) dS' - W^T dV~`` (``wn = -W``)."""
    mm = _make_mm(interpret)
    C = chunk

    def body(i, dst):
        c = n_chunks - 1 - i
        rows = pl.ds(c * C, C)
        dh_ref[c] = dst.astype(dh_ref.dtype)
        do = do_ref[rows, :]
        dvt = mm(aqk_ref[rows, :], do, TN, mm_dtype) + mm(kdec_ref[rows, :], dst, NT, mm_dtype)  # [C, BV]
        dvt_ref[rows, :] = dvt.astype(dvt_ref.dtype)
        return (dst * dl_ref[c] + mm(do, qg_ref[rows, :], TN, mm_dtype)
                + mm(dvt, wn_ref[rows, :], TN, mm_dtype))

    dh0_ref[...] = jax.lax.fori_loop(0, n_chunks, body, dht_ref[...])


# ------------------------------------------------------------------------------------------------------
# 6-8: per-chunk gradients (fully parallel)
# ------------------------------------------------------------------------------------------------------


def _dqkw_kernel(q_ref, k_ref, g_ref, segc_ref, do_ref, vt_ref, dvt_ref, h_ref, dh_ref,
                 dw_ref, dqp_ref, dkp_ref, dgp_ref, *, scale: float, block_v: int, mm_dtype, interpret: bool):
    """K-block ``[C, BK]`` of ``dW = -dV~ S^T`` and of the partial dq (wrt ``q scale``), dk, dG from the
    ``q e^G`` / ``kd`` / chunk-decay terms. ``h_ref, dh_ref [V, BK]``: ``S_in^T``, ``dS_out^T``."""
    f32 = jnp.float32
    C, BK = k_ref.shape
    V = do_ref.shape[-1]
    mm = _make_mm(interpret)
    dqe = jnp.zeros((C, BK), f32)
    dkd = jnp.zeros((C, BK), f32)
    dw = jnp.zeros((C, BK), f32)
    ddl = jnp.zeros((1, BK), f32)
    for vb in range(V // block_v):
        vs = pl.ds(vb * block_v, block_v)
        st = h_ref[vs, :].astype(f32)
        dst = dh_ref[vs, :].astype(f32)
        dqe = dqe + mm(do_ref[:, vs], st, NN, mm_dtype)
        dkd = dkd + mm(vt_ref[:, vs], dst, NN, mm_dtype)
        dw = dw - mm(dvt_ref[:, vs], st, NN, mm_dtype)
        ddl = ddl + jnp.sum(st * dst, axis=0, keepdims=True)
    gam = g_ref[...]
    segc = segc_ref[...]
    seglast = segc_ref[pl.ds(C - 1, 1), :]
    glast = g_ref[pl.ds(C - 1, 1), :]
    eg = jnp.where(segc == 0, jnp.exp(gam), 0.0)
    ekl = jnp.where(segc == seglast, jnp.exp(glast - gam), 0.0)
    kdec = k_ref[...].astype(f32) * ekl
    dl = jnp.where(seglast == 0, jnp.exp(glast), 0.0)
    dw_ref[...] = dw
    dqp_ref[...] = (dqe * eg).astype(dqp_ref.dtype)
    dkp_ref[...] = (dkd * ekl).astype(dkp_ref.dtype)
    dglast = jnp.sum(dkd * kdec, axis=0, keepdims=True) + ddl * dl
    rowk = jax.lax.broadcasted_iota(jnp.int32, (C, BK), 0)
    qe = q_ref[...].astype(f32) * (eg * scale)
    dgp_ref[...] = dqe * qe - dkd * kdec + jnp.where(rowk == C - 1, dglast, 0.0)


def _dx_and_db(x_of, beta, first, k_ref, v_ref, g_ref, dvt_ref, dw_ref, dv_ref, dbk_ref, *, block: int, mm,
               x_dtype):
    """Step 7's V / K-block loops: ``dB_v = X^T dV~`` (written as ``dv = beta dB_v``), ``dB_k = X^T dW`` (written),
    and their sums ``dX = dV~ B_v^T + dW B_k^T [C, C]`` and the ``dB`` part of dbeta ``[C, 1]`` (both fp32,
    returned). ``x_of()`` gives ``X`` (a held value, or a fresh ref read per product for short live ranges);
    ``first [C, 1]``: tokens of the document that entered the chunk."""
    f32 = jnp.float32
    C, K = k_ref.shape
    V = v_ref.shape[-1]
    dx = jnp.zeros((C, C), f32)
    dbeta = jnp.zeros((C, 1), f32)
    bv_ = min(block, V)
    for vb in range(V // bv_):
        vs = pl.ds(vb * bv_, bv_)
        dvt = dvt_ref[:, vs].astype(f32)
        vv = v_ref[:, vs].astype(f32)
        dx = dx + mm(dvt, beta * vv, NT, x_dtype)
        dbv = mm(x_of(), dvt, TN, x_dtype)
        dv_ref[:, vs] = (beta * dbv).astype(dv_ref.dtype)
        dbeta = dbeta + jnp.sum(dbv * vv, axis=1, keepdims=True)
    bk_ = min(block, K)
    for kb in range(K // bk_):
        cols = pl.ds(kb * bk_, bk_)
        dwb = dw_ref[:, cols]
        egk = jnp.where(first, jnp.exp(g_ref[:, cols]), 0.0) * k_ref[:, cols].astype(f32)
        dx = dx + mm(dwb, beta * egk, NT, x_dtype)
        dbk = mm(x_of(), dwb, TN, x_dtype)
        dbk_ref[:, cols] = dbk
        dbeta = dbeta + jnp.sum(dbk * egk, axis=1, keepdims=True)
    return dx, dbeta


def _wy_dx_kernel(x_ref, k_ref, v_ref, g_ref, beta_ref, segc_ref, dvt_ref, dw_ref,
                  dv_ref, dbk_ref, dx_ref, dbp_ref, *, block: int, interpret: bool, x_dtype=jnp.float32):
    """Step 7, part 1: ``dB_v = X^T dV~`` (-> dv), ``dB_k = X^T dW``, the V / K-block
    sums ``dX [C, C]`` (fp32, written out) and the ``dB`` part of dbeta. ``X`` is re-read from its ref at each
    product (short live ranges; only the ``dX`` accumulator spans the loops)."""
    mm = _make_mm(interpret)
    dx, dbeta = _dx_and_db(lambda: x_ref[...], beta_ref[...], segc_ref[...] == 0, k_ref, v_ref, g_ref, dvt_ref,
                           dw_ref, dv_ref, dbk_ref, block=block, mm=mm, x_dtype=x_dtype)
    dx_ref[...] = dx
    dbp_ref[...] = dbeta


def _wy_dl_kernel(x_ref, akk_ref, beta_ref, segc_ref, segr_ref, dx_ref, dbp_ref, do_ref, vt_ref,
                  dakk_ref, daqk_ref, dbeta_ref, *, block: int, mm_dtype, interpret: bool, x_dtype=jnp.float32):
    """Step 7, part 2: ``dL = -X^T dX X^T`` (strictly lower, same document),
    ``dA_kk = diag(beta) dL``, dbeta, then ``dA_qk = dO V~^T`` (masked) over V blocks."""
    f32 = jnp.float32
    C = x_ref.shape[0]
    V = do_ref.shape[-1]
    mm = _make_mm(interpret)
    xm = x_ref[...]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    same = segc_ref[...] == segr_ref[...]
    dlo = jnp.where(same & (row > col), -mm(mm(xm, dx_ref[...], TN, x_dtype), xm, NT, x_dtype), 0.0)
    dakk_ref[...] = beta_ref[...] * dlo
    dbeta_ref[...] = dbp_ref[...] + jnp.sum(dlo * akk_ref[...], axis=1, keepdims=True)
    daqk = jnp.zeros((C, C), f32)
    bv_ = min(block, V)
    for vb in range(V // bv_):
        vs = pl.ds(vb * bv_, bv_)
        daqk = daqk + mm(do_ref[:, vs], vt_ref[:, vs], NT, mm_dtype)
    daqk_ref[...] = jnp.where(same & (row >= col), daqk, 0.0)


def _tile_terms(rows, ga, rq, rk, cq, ck, scale: float, q_ref, k_ref, beta_ref, segc_ref, dbk_ref, dqp_ref,
                dkp_ref, dgp_ref):
    """``dq, dk`` (fp32) and ``dG`` (before the reverse cumsum) of one 16-row tile of the decay kernels: the
    row/column decay-product parts ``rq, rk, cq, ck [16, BK] f32`` plus step 6's partials and the
    ``B_k = beta e^G k`` terms (``d B_k / d k``). ``rows`` index the chunk-blocked refs."""
    f32 = jnp.float32
    qa = q_ref[rows, :].astype(f32) * scale
    ka = k_ref[rows, :].astype(f32)
    beg = beta_ref[rows, :] * jnp.where(segc_ref[rows, :] == 0, jnp.exp(ga), 0.0)
    dbk = dbk_ref[rows, :]
    dq = (dqp_ref[rows, :].astype(f32) + rq) * scale
    dk = dkp_ref[rows, :].astype(f32) + dbk * beg + rk + cq + ck
    dgt = dgp_ref[rows, :] + dbk * beg * ka + qa * rq + ka * (rk - cq - ck)
    return dq, dk, dgt


def _da_tile_kernel(q_ref, k_ref, g_ref, beta_ref, segc_ref, dakk_ref, daqk_ref, dqp_ref, dkp_ref, dgp_ref,
                    dbk_ref, dq_ref, dk_ref, dgt_ref, *, scale: float, mm_dtype, interpret: bool):
    """One 16-row tile ``a`` (grid axis 0 mod ``C / 16``) of one K block of the decay-product gradients
    (``dA_kk``, ``dA_qk`` are lower triangular, so only 16x16 sub-tiles on or below the diagonal enter): the
    row part sums over the column tiles ``b <= a`` at the reference point before the tile, the column part
    over the row tiles ``b >= a`` at the tile's last token (exponents ``<= 0``, or at most 80 on the diagonal
    tile, clamped there). Inputs are chunk blocks ``[C, BK]`` / ``[C, C]``; outputs the tile's
    ``dq, dk [16, BK]`` and ``dG [16, BK] f32`` before the in-chunk reverse cumsum (:func:`_dg_cumsum_kernel`)."""
    f32 = jnp.float32
    C, BK = k_ref.shape
    nt = C // SUB
    mm = _make_mm(interpret)
    a = jax.lax.rem(pl.program_id(0), nt)
    start = pl.multiple_of(a * SUB, SUB)
    rows = pl.ds(start, SUB)
    tile = lambda b: pl.ds(pl.multiple_of(b * SUB, SUB), SUB)
    ga = g_ref[rows, :]
    m = _g_before_tile(g_ref, a, start)
    zero = jnp.zeros((SUB, BK), f32)

    def row_part(b, acc):
        right = k_ref[tile(b), :].astype(f32) * jnp.exp(jnp.minimum(m - g_ref[tile(b), :], EXP_CLAMP))
        return (acc[0] + mm(daqk_ref[rows, tile(b)], right, NN, mm_dtype),
                acc[1] + mm(dakk_ref[rows, tile(b)], right, NN, mm_dtype))

    rq, rk = jax.lax.fori_loop(0, a + 1, row_part, (zero, zero))
    left = jnp.exp(ga - m)
    mb = g_ref[pl.ds(start + SUB - 1, 1), :]  # G at the tile's last token

    def col_part(b, acc):
        up = jnp.exp(jnp.minimum(g_ref[tile(b), :] - mb, EXP_CLAMP))
        return (acc[0] + mm(daqk_ref[tile(b), rows], (q_ref[tile(b), :].astype(f32) * scale) * up, TN, mm_dtype),
                acc[1] + mm(dakk_ref[tile(b), rows], k_ref[tile(b), :].astype(f32) * up, TN, mm_dtype))

    cq, ck = jax.lax.fori_loop(a, nt, col_part, (zero, zero))
    back = jnp.exp(mb - ga)
    dq, dk, dgt = _tile_terms(rows, ga, left * rq, left * rk, back * cq, back * ck, scale, q_ref, k_ref, beta_ref,
                              segc_ref, dbk_ref, dqp_ref, dkp_ref, dgp_ref)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dgt_ref[...] = dgt


def _dg_cumsum_kernel(dgt_ref, dg_ref):
    """``dg`` = reverse cumsum of ``dG [C, BK] f32`` inside one chunk."""
    x = dgt_ref[...]
    dg_ref[...] = (jnp.sum(x, axis=0, keepdims=True) - jnp.cumsum(x, axis=0) + x).astype(dg_ref.dtype)


# ------------------------------------------------------------------------------------------------------
# Wrapper
# ------------------------------------------------------------------------------------------------------


class _Inputs(NamedTuple):
    q: jax.Array  # [B, Tp, H, K]
    k: jax.Array  # [B, Tp, H, K]
    v: jax.Array  # [B, Tp, H, V]
    gam: jax.Array  # [B, Tp, H, K] f32: chunk-local cumsum of g
    beta: jax.Array  # [B, Tp, H, 1] f32
    seg_col: jax.Array  # [B, Tp, 1] i32
    seg_row: jax.Array  # [B, N, 1, C] i32
    h0t: jax.Array  # [B*H, V, K] f32
    do: jax.Array  # [B, Tp, H, V]
    dhtt: jax.Array  # [B*H, V, K] f32


def _prepare(q, k, v, g, beta, initial_state, segment_ids, do, dht, C: int, interpret: bool,
             cumsum_warps: int | None) -> _Inputs:
    """The forward's inputs (:func:`pallas_kernels.kda.gpu._prepare`, ``G`` from the forward's cumsum kernel
    :func:`pallas_kernels.kda.gpu.chunk_cumsum`, or from XLA with ``cumsum_warps=None``), plus the padded output
    cotangent and the transposed final-state cotangent."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    fwd = _fwd._prepare(q, k, v, g, beta, initial_state, segment_ids, C)
    if cumsum_warps is None:
        gam = jnp.cumsum(fwd.gam.reshape(B, -1, C, H, K), axis=2).reshape(fwd.gam.shape)
    else:
        gam = _fwd.chunk_cumsum(fwd.gam, C, interpret=interpret, num_warps=cumsum_warps)
    fwd = fwd._replace(gam=gam)
    pad = fwd.q.shape[1] - T
    do_p = do if pad == 0 else jnp.pad(do, [(0, 0), (0, pad), (0, 0), (0, 0)])
    dhtt = (jnp.zeros((B * H, V, K), jnp.float32) if dht is None
            else jnp.swapaxes(dht.astype(jnp.float32), -1, -2).reshape(B * H, V, K))
    return _Inputs(*fwd, do_p, dhtt)


def _chunk_specs(C: int, H: int):
    """``(bi, hi, tok, tok_in, segc)`` for the per-chunk kernels (grid ``(B*H, N)``): the sequence and head of a
    ``bh`` index, chunk ``c``'s ``[C, d]`` block of a ``[B*H, Tp, d]`` (``tok``) or ``[B, Tp, H, d]`` (``tok_in``)
    array, and its ``[C, 1]`` block of the document starts ``[B, Tp, 1]``."""
    bi = lambda bh: jax.lax.div(bh, H)
    hi = lambda bh: jax.lax.rem(bh, H)
    tok = lambda d: pl.BlockSpec((None, C, d), lambda bh, c: (bh, c, 0))
    tok_in = lambda d: pl.BlockSpec((None, C, None, d), lambda bh, c: (bi(bh), c, hi(bh), 0))
    segc = pl.BlockSpec((None, C, 1), lambda bh, c: (bi(bh), c, 0))
    return bi, hi, tok, tok_in, segc


def _recompute(x: _Inputs, scale: float, C: int, mm_dtype, a_block_k: int, block_k: int, call,
               interpret: bool) -> _layout.ChunkResiduals:
    """Steps 1-3: the forward's per-chunk results from the inputs (``call`` launches one kernel)."""
    f32 = jnp.float32
    B, Tp, H, K = x.q.shape
    BH, N, nt = B * H, Tp // C, C // SUB
    bi, hi, tok, tok_in, segc = _chunk_specs(C, H)
    sds = jax.ShapeDtypeStruct
    # 1. A rows per 16-token tile.
    row_in = lambda d: pl.BlockSpec((None, SUB, None, d), lambda a, bh, c: (bi(bh), c * nt + a, hi(bh), 0))
    chunk_in = lambda d: pl.BlockSpec((None, C, None, d), lambda a, bh, c: (bi(bh), c, hi(bh), 0))
    row_out = lambda d: pl.BlockSpec((None, SUB, d), lambda a, bh, c: (bh, c * nt + a, 0))
    akk, aqk, qg, kd = call(
        functools.partial(_a_kernel, scale=scale, mm_dtype=mm_dtype, block_k=a_block_k, interpret=interpret),
        "kda_bwd_a_gpu", (nt, BH, N),
        [row_in(K), chunk_in(K), chunk_in(K), pl.BlockSpec((None, C, 1), lambda a, bh, c: (bi(bh), c, 0)),
         pl.BlockSpec((None, None, 1, C), lambda a, bh, c: (bi(bh), c, 0, 0))],
        [row_out(C), row_in(C), row_in(K), row_in(K)],
        [sds((BH, Tp, C), f32), sds((B, Tp, H, C), mm_dtype), sds((B, Tp, H, K), mm_dtype),
         sds((B, Tp, H, K), mm_dtype)],
    )(x.q, x.k, x.gam, x.seg_col, x.seg_row)
    # 2-3. X, then X', -W and the chunk decay.
    per_chunk = lambda d: pl.BlockSpec((None, None, 1, d), lambda bh, c: (bh, c, 0, 0))
    xm = call(functools.partial(_solve_kernel, interpret=interpret), "kda_bwd_solve_gpu", (BH, N),
              [tok(C), tok_in(1)], tok(C), sds((BH, Tp, C), f32))(akk, x.beta)
    beta_row = jnp.swapaxes(x.beta[..., 0], 1, 2).reshape(BH, N, 1, C)
    wn, xb, dl = call(
        functools.partial(_w_kernel, block=block_k, mm_dtype=mm_dtype, interpret=interpret), "kda_bwd_w_gpu",
        (BH, N), [tok(C), tok_in(K), tok_in(K), per_chunk(C), segc],
        [tok_in(K), tok_in(C), per_chunk(K)],
        [sds((B, Tp, H, K), mm_dtype), sds((B, Tp, H, C), mm_dtype), sds((BH, N, 1, K), f32)],
    )(xm, x.k, x.gam, beta_row, x.seg_col)
    return _layout.ChunkResiduals(qg, kd, wn, xb, aqk, dl.reshape(B, H, N, K), xm, akk)


def _check_residuals(r: _layout.ChunkResiduals, B: int, Tp: int, H: int, K: int, C: int, mm_dtype,
                     name: str) -> None:
    """Raise ValueError naming the first field of ``r`` whose shape or dtype is not the layout's."""
    mm = jnp.dtype(mm_dtype)
    want = dict(qg=((B, Tp, H, K), mm), kd=((B, Tp, H, K), mm), wn=((B, Tp, H, K), mm), xb=((B, Tp, H, C), mm),
                aqk=((B, Tp, H, C), mm), decay=((B, H, Tp // C, K), jnp.float32),
                x_inv=((B * H, Tp, C), jnp.float32), akk=((B * H, Tp, C), jnp.float32))
    for field, (shape, dtype) in want.items():
        got = getattr(r, field)
        if got.shape != shape or got.dtype != dtype:
            raise ValueError(f"{name}: residuals.{field} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                             f"{got.dtype.name}{list(got.shape)}")


def _pow2(name: str, d: int) -> None:
    if d < 16 or d & (d - 1):
        raise ValueError(f"gpu_bwd.chunk_kda_bwd: {name} must be a power of two >= 16, got {d}")


MOSAIC_GPU_STEPS = ("sweeps", "dqkw", "wy", "da")
"""Steps :func:`chunk_kda_bwd` can run as Mosaic GPU kernels (module docstring)."""
KERNEL_BACKWARD_MOSAIC_GPU_STEPS = ("sweeps", "dqkw", "wy")
"""The steps the ``mosaic_gpu`` backend's kernel backward (``chunk_kda(backward="kernel")``) runs on Mosaic GPU: each
is faster on the H200 than its Triton kernel, ``da``'s is not (benchmarks/RESULTS.md); all of
:data:`MOSAIC_GPU_STEPS` is the Triton-free backward (``backward="mosaic_gpu"``, and ``"auto"`` once JAX no longer
ships Triton)."""


def _mosaic_gpu_steps(steps, dtype: str, k: int, v: int, chunk: int, state_dtype: str, g_dtype: str,
                      name: str) -> dict:
    """``{step: its Mosaic GPU module}`` for the named steps, after checking each can take the call (``ValueError``
    with the reason otherwise)."""
    from pallas_kernels.kda import (  # noqa: PLC0415
        mosaic_gpu_bwd_da,
        mosaic_gpu_bwd_dqkw,
        mosaic_gpu_bwd_sweeps,
        mosaic_gpu_bwd_wy,
    )

    unknown = sorted(set(steps) - set(MOSAIC_GPU_STEPS))
    if unknown:
        raise ValueError(f"{name}: mosaic_gpu_steps must be among {MOSAIC_GPU_STEPS}, got {unknown}")
    common = dict(dtype=dtype, k=k, chunk_size=chunk)
    checks = {  # step: (module, the facts its check reads)
        "sweeps": (mosaic_gpu_bwd_sweeps, dict(common, v=v, state_dtype=state_dtype)),
        "dqkw": (mosaic_gpu_bwd_dqkw, dict(common, v=v, state_dtype=state_dtype)),
        "wy": (mosaic_gpu_bwd_wy, dict(common, v=v)),
        "da": (mosaic_gpu_bwd_da, dict(common, g_dtype=g_dtype)),
    }
    out = {}
    for step in steps:
        mod, facts = checks[step]
        reason = mod.supports_reason(**facts)
        if reason is not None:
            raise ValueError(f"{name}: the Mosaic GPU kernel of step {step!r} cannot take this call: {reason}")
        out[step] = mod
    return out


def chunk_kda_bwd(
    q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, do=None, dht=None,
    chunk_size: int = 64, interpret: bool = False, block_v: int | None = None, block_k: int | None = None,
    num_warps: dict | None = None, num_stages: int | None = None, state_dtype=None, da_block_k: int = 32,
    a_block_k: int = 64, residuals: _layout.ChunkResiduals | None = None, mosaic_gpu_steps: tuple[str, ...] = (),
):
    """Gradients of :func:`pallas_kernels.kda.gpu.chunk_kda_fwd` (``g >= -5``), eleven Triton kernels.

    Args: forward inputs as :func:`pallas_kernels.kda.reference.chunk_kda` (``q, k, g [B, T, H, K]``,
    ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state [B, H, K, V]`` or None, ``segment_ids [B, T]``
    or None), ``do [B, T, H, V]`` (output cotangent), ``dht [B, H, K, V]`` (final-state cotangent; None =
    zeros). ``block_v``: V slice of the two sweeps (grid axis; default ``min(V, 64)``); ``block_k``: K block
    of the per-chunk gradient kernels (grid axis), their V loop block and the W kernel's K loop (default 128 for
    16-bit inputs, 64 for fp32, whose 128-wide tiles pass the H200's 227 KiB of shared memory per block);
    ``a_block_k``: the A kernel's K loop block;
    ``num_warps``: per-kernel override ``{kernel name: warps}`` (names in :data:`KERNEL_NAMES`; default
    :data:`DEFAULT_WARPS`); ``state_dtype``: storage of the per-chunk states
    ``h`` and state cotangents ``dh`` (default: the matmul dtype, bf16 for bf16 inputs - they only enter
    bf16 matmuls there - else fp32). ``interpret``: generic Pallas interpreter.
    ``da_block_k``: steps 8-9's K block (grid axis). ``residuals``: the forward's per-chunk results
    (:class:`pallas_kernels.kda._layout.ChunkResiduals`, e.g. from the Mosaic GPU forward): steps 1-3 are then
    skipped (their kernels, :data:`RECOMPUTE_KERNEL_NAMES`, not launched). ``num_stages``: the sweeps' pipeline
    stages, None = the most (up to 2) whose shared-memory estimate fits the GPU
    (:func:`pallas_kernels.kda.launch.fit_num_stages`). ``mosaic_gpu_steps``: the steps run as Mosaic GPU kernels
    instead (names in :data:`MOSAIC_GPU_STEPS`, module docstring; sm_90, or the Mosaic GPU interpreter with
    ``interpret``); a step whose kernel cannot take the call raises ``ValueError`` with the reason.
    Returns ``(dq, dk, dv, dg, dbeta)`` in the dtypes of ``q, k, v, g, beta`` and ``dh0 [B, H, K, V] f32``.
    """
    name = "gpu_bwd.chunk_kda_bwd"
    _layout.check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size, name)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if do is None or do.shape != v.shape:
        raise ValueError(f"{name}: do must be [B, T, H, V]={v.shape}, got {None if do is None else do.shape}")
    if dht is not None and dht.shape != (B, H, K, V):
        raise ValueError(f"{name}: dht must be [B, H, K, V]={(B, H, K, V)}, got {dht.shape}")
    BV = block_v or min(V, 64)
    block_k = block_k or (128 if jnp.dtype(q.dtype).itemsize <= 2 else 64)
    BK = min(block_k, K)
    BL = min(block_k, V)  # V loop block of the per-chunk kernels
    BKD = min(da_block_k, K)
    BKA = min(a_block_k, K)
    for nm, d in (("K", K), ("V", V), ("block_v", BV), ("block_k", BK), ("da_block_k", BKD), ("a_block_k", BKA),
                  ("chunk_size", C)):
        _pow2(nm, d)
    if V % BV or K % BK or V % BL or K % BKD or K % BKA:
        raise ValueError(f"{name}: block_v={BV} must divide V={V}, block_k={block_k} K={K} and V, and "
                         f"da_block_k={BKD} and a_block_k={BKA} K")
    mm_dtype = jnp.float32 if jnp.promote_types(q.dtype, v.dtype) == jnp.float32 else jnp.bfloat16
    st_dtype = jnp.dtype(state_dtype or mm_dtype)
    da_dtype = jnp.float32 if mm_dtype == jnp.float32 else TF32
    wy_dtype = TF32 if mm_dtype != jnp.float32 else jnp.float32  # step 7's X / dX products: one TF32 pass
    mgpu = _mosaic_gpu_steps(mosaic_gpu_steps, jnp.promote_types(q.dtype, v.dtype).name, K, V, C, st_dtype.name,
                             jnp.dtype(g.dtype).name, name)
    nt = C // SUB
    f32 = jnp.float32
    interp = bool(interpret)
    fit = dict(chunk=C, k=K, block_v=BV, q_dtype=q.dtype, v_dtype=v.dtype)
    stages = {n: 1 if interp else launch.fit_num_stages(n, num_stages, **fit)
              for n in ("kda_bwd_h_gpu", "kda_bwd_ds_gpu")}
    warps = dict(num_warps or {})
    unknown = set(warps) - set(DEFAULT_WARPS)
    if unknown:
        raise ValueError(f"{name}: num_warps keys must be in {tuple(DEFAULT_WARPS)}, got {sorted(unknown)}")
    # with every kernel step on Mosaic GPU and the forward's per-chunk results, no Triton kernel runs: G from XLA
    no_triton = residuals is not None and set(mgpu) == set(MOSAIC_GPU_STEPS)
    x = _prepare(q, k, v, g, beta, initial_state, segment_ids, do.astype(v.dtype), dht, C, bool(interpret),
                 None if no_triton else warps.get("kda_chunk_cumsum_gpu", DEFAULT_WARPS["kda_chunk_cumsum_gpu"]))
    BH, Tp = B * H, x.q.shape[1]
    N = Tp // C
    if residuals is not None:
        _check_residuals(residuals, B, Tp, H, K, C, mm_dtype, name)

    def call(kernel, kname, grid, in_specs, out_specs, out_shape, stages=1, **kw):
        if interp:
            params = None
        else:
            from jax.experimental.pallas import triton as pltriton

            params = pltriton.CompilerParams(num_warps=warps.get(kname, DEFAULT_WARPS[kname]), num_stages=stages)
        return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                              compiler_params=params, interpret=interp, name=kname, **kw)

    bi, hi, tok, tok_in, segc_spec = _chunk_specs(C, H)
    sds = jax.ShapeDtypeStruct
    segr_spec = pl.BlockSpec((None, None, 1, C), lambda bh, c: (bi(bh), c, 0, 0))
    r = _recompute(x, float(scale), C, mm_dtype, BKA, BK, call, interp) if residuals is None else residuals
    dl = r.decay.reshape(BH, N, 1, K)
    xm, akk = r.x_inv.reshape(BH, Tp, C), r.akk.reshape(BH, Tp, C)

    # 4-5. Sweeps over chunks, grid (B*H, V / BV).
    seq = lambda d: pl.BlockSpec((None, Tp, None, d), lambda bh, j: (bi(bh), 0, hi(bh), 0))
    seq_v = pl.BlockSpec((None, Tp, BV), lambda bh, j: (bh, 0, j))
    seq_in_v = pl.BlockSpec((None, Tp, None, BV), lambda bh, j: (bi(bh), 0, hi(bh), j))
    dl_spec = pl.BlockSpec((None, N, 1, K), lambda bh, j: (bh, 0, 0, 0))
    state = pl.BlockSpec((None, BV, K), lambda bh, j: (bh, j, 0))
    states = pl.BlockSpec((None, N, BV, K), lambda bh, j: (bh, 0, j, 0))
    sweep = dict(chunk=C, n_chunks=N, mm_dtype=mm_dtype, interpret=interp)
    if "sweeps" in mgpu:
        h, vt = mgpu["sweeps"].h_sweep(r.wn, r.xb, x.v, r.kd, dl, x.h0t, interpret=interp)
        dh, dvt, dh0t = mgpu["sweeps"].ds_sweep(r.aqk, r.qg, r.kd, r.wn, dl, x.do, x.dhtt, interpret=interp)
    else:
        h, vt = call(
            functools.partial(_h_kernel, **sweep), "kda_bwd_h_gpu", (BH, V // BV),
            [seq(K), seq(C), seq_in_v, seq(K), dl_spec, state], [states, seq_v],
            [sds((BH, N, V, K), st_dtype), sds((BH, Tp, V), mm_dtype)], stages=stages["kda_bwd_h_gpu"],
        )(r.wn, r.xb, x.v, r.kd, dl, x.h0t)
        dh, dvt, dh0t = call(
            functools.partial(_ds_kernel, **sweep), "kda_bwd_ds_gpu", (BH, V // BV),
            [seq(C), seq(K), seq(K), seq(K), dl_spec, seq_in_v, state], [states, seq_v, state],
            [sds((BH, N, V, K), st_dtype), sds((BH, Tp, V), mm_dtype), sds((BH, V, K), f32)],
            stages=stages["kda_bwd_ds_gpu"],
        )(r.aqk, r.qg, r.kd, r.wn, dl, x.do, x.dhtt)

    # 6. State products per K block.
    kin = lambda: pl.BlockSpec((None, C, None, BK), lambda kb, bh, c: (bi(bh), c, hi(bh), kb))
    kout = lambda: pl.BlockSpec((None, C, BK), lambda kb, bh, c: (bh, c, kb))
    st_spec = pl.BlockSpec((None, None, V, BK), lambda kb, bh, c: (bh, c, 0, kb))
    tok3 = lambda d: pl.BlockSpec((None, C, d), lambda kb, bh, c: (bh, c, 0))
    if "dqkw" in mgpu:
        dw, dqp, dkp, dgp = mgpu["dqkw"].dqkw(x.q, x.k, x.gam, x.seg_col, x.do, vt, dvt, h, dh, scale=float(scale),
                                              interpret=interp)
    else:
        dw, dqp, dkp, dgp = call(
            functools.partial(_dqkw_kernel, scale=float(scale), block_v=BL, mm_dtype=mm_dtype, interpret=interp),
            "kda_bwd_dqkw_gpu", (K // BK, BH, N),
            [kin(), kin(), kin(), pl.BlockSpec((None, C, 1), lambda kb, bh, c: (bi(bh), c, 0)),
             pl.BlockSpec((None, C, None, V), lambda kb, bh, c: (bi(bh), c, hi(bh), 0)), tok3(V), tok3(V),
             st_spec, st_spec],
            [kout(), kout(), kout(), kout()],
            [sds((BH, Tp, K), f32), sds((BH, Tp, K), mm_dtype), sds((BH, Tp, K), mm_dtype), sds((BH, Tp, K), f32)],
        )(x.q, x.k, x.gam, x.seg_col, x.do, vt, dvt, h, dh)

    # 7. Through the UT transform: X-products and dX, then the dL chain and dA_qk.
    if "wy" in mgpu:
        dv, dbk, dakk, daqk, dbeta = mgpu["wy"].wy_backward(xm, akk, x.k, x.v, x.gam, x.beta, x.seg_col, x.do, vt,
                                                            dvt, dw, interpret=interp or None)
    else:
        dv, dbk, dxm, dbp = call(
            functools.partial(_wy_dx_kernel, block=BL, interpret=interp, x_dtype=wy_dtype), "kda_bwd_wy_dx_gpu",
            (BH, N), [tok(C), tok_in(K), tok_in(V), tok_in(K), tok_in(1), segc_spec, tok(V), tok(K)],
            [tok_in(V), tok(K), tok(C), tok(1)],
            [sds((B, Tp, H, V), v.dtype), sds((BH, Tp, K), f32), sds((BH, Tp, C), f32), sds((BH, Tp, 1), f32)],
        )(xm, x.k, x.v, x.gam, x.beta, x.seg_col, dvt, dw)
        dakk, daqk, dbeta = call(
            functools.partial(_wy_dl_kernel, block=BL, mm_dtype=mm_dtype, interpret=interp, x_dtype=wy_dtype),
            "kda_bwd_wy_dl_gpu", (BH, N),
            [tok(C), tok(C), tok_in(1), segc_spec, segr_spec, tok(C), tok(1), tok_in(V), tok(V)],
            [tok(C), tok(C), tok_in(1)],
            [sds((BH, Tp, C), f32), sds((BH, Tp, C), f32), sds((B, Tp, H, 1), f32)],
        )(xm, akk, x.beta, x.seg_col, x.seg_row, dxm, dbp, x.do, vt)

    # 8. Decay products per (K block, 16-row tile), then the in-chunk reverse cumsum of dG. Grid axis 0 =
    # K block * (C / 16) + row tile: a chunk's tiles and K blocks run side by side.
    kb_of = lambda i: i // nt
    tile_of = lambda i: i % nt
    t_in = lambda d, kb: pl.BlockSpec((None, C, None, d), lambda i, bh, c: (bi(bh), c, hi(bh), kb(i)))
    t_tok = lambda: pl.BlockSpec((None, C, C), lambda i, bh, c: (bh, c, 0))
    t_part = lambda: pl.BlockSpec((None, C, BKD), lambda i, bh, c: (bh, c, kb_of(i)))
    t_out = lambda: pl.BlockSpec((None, SUB, None, BKD),
                                 lambda i, bh, c: (bi(bh), c * nt + tile_of(i), hi(bh), kb_of(i)))
    if "da" in mgpu:  # both steps in one kernel: dG stays on chip
        dq, dk, dg = mgpu["da"].da_backward(x.q, x.k, x.gam, x.beta, x.seg_col, dakk, daqk, dqp, dkp, dgp, dbk,
                                            scale=float(scale), g_dtype=g.dtype, interpret=interp)
    else:
        dq, dk, dgt = call(
            functools.partial(_da_tile_kernel, scale=float(scale), mm_dtype=da_dtype, interpret=interp),
            "kda_bwd_da_gpu", (K // BKD * nt, BH, N),
            [t_in(BKD, kb_of), t_in(BKD, kb_of), t_in(BKD, kb_of), t_in(1, lambda i: 0),
             pl.BlockSpec((None, C, 1), lambda i, bh, c: (bi(bh), c, 0)), t_tok(), t_tok(), t_part(), t_part(),
             t_part(), t_part()],
            [t_out(), t_out(), pl.BlockSpec((None, SUB, BKD), lambda i, bh, c: (bh, c * nt + tile_of(i), kb_of(i)))],
            [sds((B, Tp, H, K), q.dtype), sds((B, Tp, H, K), k.dtype), sds((BH, Tp, K), f32)],
        )(x.q, x.k, x.gam, x.beta, x.seg_col, dakk, daqk, dqp, dkp, dgp, dbk)
        dg = call(_dg_cumsum_kernel, "kda_bwd_dg_gpu", (K // BKD, BH, N),
                  [pl.BlockSpec((None, C, BKD), lambda kb, bh, c: (bh, c, kb))],
                  pl.BlockSpec((None, C, None, BKD), lambda kb, bh, c: (bi(bh), c, hi(bh), kb)),
                  sds((B, Tp, H, K), g.dtype))(dgt)

    cut = (lambda y: y) if Tp == T else (lambda y: y[:, :T])
    dh0 = jnp.swapaxes(dh0t.reshape(B, H, V, K), -1, -2)
    return (cut(dq), cut(dk), cut(dv), cut(dg), cut(dbeta)[..., 0].astype(beta.dtype), dh0)
