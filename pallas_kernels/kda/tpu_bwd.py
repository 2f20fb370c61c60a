"""KDA chunked backward on TPU (Mosaic): gradients for q, k, v, g, beta and the initial state.

Two ``pallas_call`` s, both on the grid ``(B*H, N)`` with the chunk axis ``"arbitrary"`` (sequential):

1. **State sweep** (:func:`chunk_states`, forward order): the forward's state recurrence again, writing the
   state *entering* each chunk, ``h [B*H, N, V, K] f32`` (transposed, V-first, like the forward kernel's
   scratch). Nothing but the inputs is saved by the forward (``custom_vjp`` residuals = inputs), so the
   backward pays one extra state sweep (no ``A_qk``, no output) instead of holding per-chunk states for every
   layer between forward and backward. ``h`` is fp32 (exact recomputation; the fp32 gradient test needs it)
   and transient: ``4 N K V`` bytes per (sequence, head), i.e. at K3's ``H = 96, K = V = 128``:
   403 MB for ``T = 4096`` and 805 MB for ``T = 8192`` (per layer, freed after its backward; bf16 would halve
   it at the cost of an O(1e-3) state error).
2. **Reverse sweep** (:func:`chunk_kda_bwd`, chunks in reverse through the index maps): ``dS^T [V, K] f32``
   lives in a VMEM scratch across chunks (initialised from the final-state cotangent); per chunk the kernel
   recomputes the intra-chunk quantities from q, k, v, g, beta of that chunk (``A_kk``, ``A_qk`` by the
   forward's 16-token factored tiles, ``X = (I + diag(beta) A_kk)^-1`` by doubling, ``W``, ``U``,
   ``V~ = U - W S``) and emits ``dq, dk, dv, dg, dbeta`` for the chunk and, at the last step, ``dh0``.

Per chunk, with ``qs = scale q``, ``e = carry * e^G``, ``B_k = beta e k``, ``B_v = beta v``,
``kd = lastdoc * k e^{G_C - G}``, ``d = [no reset in chunk] e^{G_C}`` (forward: ``V~ = X B_v - X B_k S``,
``O = (qs e) S + A_qk V~``, ``S' = diag(d) S + kd^T V~``) and incoming ``dO``, ``dS'``::

    dV~  = A_qk^T dO + kd dS'               dS  = (qs e)^T dO + diag(d) dS' - W^T dV~
    dW   = -dV~ S^T    dB_v = X^T dV~       dB_k = X^T dW    dX = dV~ B_v^T + dW B_k^T
    dL   = -X^T dX X^T (strictly lower, same document),  dA_kk = diag(beta) dL,  dA_qk = dO V~^T (masked)

and the decay products are differentiated as matmuls: for ``A[i, j] = sum_d x_i y_j e^{G_i - G_j}``,
``dx_i = sum_j dA[i, j] y_j e^{G_i - G_j}`` (row part: the forward's tiling, reference point = ``G`` just
before the 16-row tile) and ``dy_j = sum_i dA[i, j] x_i e^{G_i - G_j}`` (column part: the same on ``dA^T``
with the reference point = ``G`` at the tile's last token, so ``e^{m - G_j} <= 1`` and
``e^{G_i - m} <= e^{75}`` for the unmasked ``i >= j``; masked entries are clamped at 80 before ``exp``);
``dG`` collects ``x dx - y dy`` plus the ``e``, ``kd``, ``d`` terms, and ``dg = reverse-cumsum(dG)`` inside
the chunk as one matmul with an upper-triangular ones matrix. ``dA^T`` s are computed directly as matmuls
(``V~ dO^T``, ``-X dX^T X``) so nothing is transposed in-kernel. Like the forward kernel this requires the
lower-bounded gate ``g >= -5``; segment ids and ``T`` not a multiple of the chunk work as in the forward.

Matmul precision: fp32 inputs use ``Precision.HIGHEST`` everywhere. bf16 inputs feed the MXU in bf16 (fp32
accumulation) for the decay products, ``U`` and the state-sized products, as the forward does; the
inverse ``X``, ``W`` and the whole ``dX -> dL`` chain and the reverse cumsum stay fp32.

VMEM (K = V = 128, C = 64, bf16; :func:`pallas_kernels.kda._aot.bwd_vmem_estimate`): reverse-sweep kernel
1.33 MB (double-buffered blocks 0.97 MB + scratch 0.36 MB), state sweep 0.63 MB - far below the 16 MiB
scoped default. HBM: XLA's temp for the whole backward at B=1, T=8192, H=96 is 3.85 GB (``h`` 0.81 GB, the
heads-first input/cotangent copies and the gradients before the transpose back), AOT-compiled for v5p/v6e.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import _layout
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.tpu import EXP_CLAMP, NN, NT, SUB, TN, _mm

__all__ = ["chunk_states", "chunk_kda_bwd"]


def _masks(segc, segr, C: int):
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    same = segc == segr
    return row, col, same


def _decay_tiles(x_ref, k_ref, gam_ref, out_scr, x_scale: float, mm_dtype) -> None:
    """``out[i, j] = x_scale * sum_d x_i k_j e^{G_i - G_j}`` for all (i, j) (unmasked; caller masks
    ``j <= i``), as 16-row tiles factored at ``G`` of the token before the tile (the forward's scheme)."""
    C, K = k_ref.shape
    f32 = jnp.float32
    k = k_ref[...].astype(f32)
    gam = gam_ref[...]
    for a in range(C // SUB):
        rows = pl.ds(a * SUB, SUB)
        m = jnp.zeros((1, K), f32) if a == 0 else gam_ref[pl.ds(a * SUB - 1, 1), :]
        left = jnp.exp(gam_ref[rows, :] - m) * x_scale
        right = k * jnp.exp(jnp.minimum(m - gam, EXP_CLAMP))
        out_scr[rows, :] = _mm(x_ref[rows, :].astype(f32) * left, right, NT, mm_dtype)


def _ut(k, v, gam, beta, segc, akk, mm_dtype):
    """UT transform of one chunk: ``X``, ``e`` (carry * e^G), ``B_k``, ``B_v``, ``W``, ``U``."""
    C = k.shape[0]
    x = ref.unit_lower_inverse(beta * akk, C, lambda a_, b_: _mm(a_, b_, NN, jnp.float32))
    eg = jnp.where(segc == 0, jnp.exp(gam), 0.0)
    bk = beta * eg * k
    bv = beta * v
    w = _mm(x, bk, NN, jnp.float32)
    u = _mm(x, bv, NN, mm_dtype)
    return x, eg, bk, bv, w, u


def _states_kernel(k_ref, v_ref, gam_ref, beta_ref, segc_ref, segr_ref, h0_ref, h_ref, s_scr, akk_scr, *,
                   mm_dtype):
    c = pl.program_id(1)
    C, K = k_ref.shape
    f32 = jnp.float32

    @pl.when(c == 0)
    def _():
        s_scr[...] = h0_ref[...]

    st = s_scr[...]  # [V, K] f32: S^T entering this chunk
    h_ref[...] = st
    k = k_ref[...].astype(f32)
    gam = gam_ref[...]
    segc = segc_ref[...]
    _decay_tiles(k_ref, k_ref, gam_ref, akk_scr, 1.0, mm_dtype)
    row, col, same = _masks(segc, segr_ref[...], C)
    akk = jnp.where((row > col) & same, akk_scr[...], 0.0)
    _, _, _, _, w, u = _ut(k, v_ref[...].astype(f32), gam, beta_ref[...], segc, akk, mm_dtype)
    vt = u - _mm(w, st, NT, mm_dtype)
    glast = gam_ref[pl.ds(C - 1, 1), :]
    seglast = segc_ref[pl.ds(C - 1, 1), :]
    kdec = jnp.where(segc == seglast, k * jnp.exp(glast - gam), 0.0)
    dl = jnp.where(seglast == 0, jnp.exp(glast), 0.0)
    s_scr[...] = st * dl + _mm(vt, kdec, TN, mm_dtype)


def _mm_dtype(q, v):
    return jnp.float32 if jnp.promote_types(q.dtype, v.dtype) == jnp.float32 else jnp.bfloat16


def _interp(interpret):
    return pltpu.InterpretParams() if interpret is True else interpret


def _states_call(x: _layout.ChunkInputs, C: int, mm_dtype, interpret) -> jax.Array:
    BH, Tp, K = x.k.shape
    V = x.v.shape[-1]
    N = Tp // C
    H = BH // x.seg_col.shape[0]
    tok = lambda d: pl.BlockSpec((None, C, d), lambda bh, c: (bh, c, 0))
    return pl.pallas_call(
        functools.partial(_states_kernel, mm_dtype=mm_dtype),
        grid=(BH, N),
        in_specs=[
            tok(K), tok(V), tok(K), tok(1),
            pl.BlockSpec((None, C, 1), lambda bh, c: (jax.lax.div(bh, H), c, 0)),
            pl.BlockSpec((None, None, 1, C), lambda bh, c: (jax.lax.div(bh, H), c, 0, 0)),
            pl.BlockSpec((None, V, K), lambda bh, c: (bh, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, V, K), lambda bh, c: (bh, c, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((BH, N, V, K), jnp.float32),
        scratch_shapes=[pltpu.VMEM((V, K), jnp.float32), pltpu.VMEM((C, C), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interp(interpret),
        name="kda_chunk_states",
    )(x.k, x.v, x.gam, x.beta, x.seg_col, x.seg_row, x.h0t)


def chunk_states(k, v, g, beta, initial_state=None, segment_ids=None, chunk_size: int = 64, interpret=False):
    """States entering each chunk, ``[B, H, N, K, V] f32`` (``N = ceil(T / chunk_size)``; ``g >= -5``).

    Same recurrence as the forward kernel (chunk ``n``'s entry is the state after chunks ``< n``). Used by
    :func:`chunk_kda_bwd`; exposed for tests and for sequence-parallel state passing.
    """
    q = jnp.zeros_like(k)
    _layout.check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size, "tpu_bwd.chunk_states")
    B, T, H, K = k.shape
    x = _layout.prepare_chunk_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    h = _states_call(x, chunk_size, _mm_dtype(k, v), interpret)
    BH, N, V, _ = h.shape
    return jnp.swapaxes(h.reshape(B, H, N, V, K), -1, -2)


def _bwd_kernel(
    q_ref, k_ref, v_ref, gam_ref, beta_ref, betar_ref, segc_ref, segr_ref, h_ref, do_ref, dht_ref,  # inputs
    dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref,  # outputs
    ds_scr, akk_scr, aqk_scr, daqk_scr, dakk_scr, daqkt_scr, dakkt_scr, rq_scr, dka_scr, dga_scr,  # scratch
    *, scale: float, mm_dtype,
):
    c = pl.program_id(1)
    C, K = k_ref.shape
    f32 = jnp.float32
    hi = f32  # the dX -> dL chain and the reverse cumsum stay fp32

    @pl.when(c == 0)
    def _():
        ds_scr[...] = dht_ref[...]

    dst = ds_scr[...]  # [V, K]: dLoss / dS_out^T
    st = h_ref[...]  # [V, K]: S_in^T
    k = k_ref[...].astype(f32)
    v = v_ref[...].astype(f32)
    qs = q_ref[...].astype(f32) * scale
    gam = gam_ref[...]
    beta = beta_ref[...]  # [C, 1]
    betar = betar_ref[...]  # [1, C]
    segc = segc_ref[...]
    do = do_ref[...].astype(f32)

    # --- recompute the chunk's forward quantities.
    _decay_tiles(k_ref, k_ref, gam_ref, akk_scr, 1.0, mm_dtype)
    _decay_tiles(q_ref, k_ref, gam_ref, aqk_scr, scale, mm_dtype)
    row, col, same = _masks(segc, segr_ref[...], C)
    strict_lo, incl_lo = (row > col) & same, (row >= col) & same
    strict_up, incl_up = (col > row) & same, (col >= row) & same
    akk = jnp.where(strict_lo, akk_scr[...], 0.0)
    aqk = jnp.where(incl_lo, aqk_scr[...], 0.0)
    x, eg, bk, bv, w, u = _ut(k, v, gam, beta, segc, akk, mm_dtype)
    vt = u - _mm(w, st, NT, mm_dtype)  # [C, V]
    glast = gam_ref[pl.ds(C - 1, 1), :]  # [1, K]
    seglast = segc_ref[pl.ds(C - 1, 1), :]  # [1, 1]
    ekl = jnp.where(segc == seglast, jnp.exp(glast - gam), 0.0)  # [C, K]
    kdec = k * ekl
    dl = jnp.where(seglast == 0, jnp.exp(glast), 0.0)  # [1, K]
    qe = qs * eg

    # --- state-level gradients; carry dS to the previous chunk.
    dvt = _mm(aqk, do, TN, mm_dtype) + _mm(kdec, dst, NT, mm_dtype)  # [C, V]
    dqe = _mm(do, st, NN, mm_dtype)  # [C, K]
    dkdec = _mm(vt, dst, NN, mm_dtype)  # [C, K]
    dw = -_mm(dvt, st, NN, mm_dtype)  # [C, K]
    ddl = jnp.sum(st * dst, axis=0, keepdims=True)  # [1, K]
    ds_new = _mm(do, qe, TN, mm_dtype) + dst * dl - _mm(dvt, w, TN, mm_dtype)  # [V, K]
    ds_scr[...] = ds_new

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        dh0_ref[...] = ds_new

    # --- through the UT transform (fp32).
    dbv = _mm(x, dvt, TN, hi)  # X^T dU   [C, V]
    dbk = _mm(x, dw, TN, hi)  # X^T dW   [C, K]
    dx = _mm(dvt, bv, NT, hi) + _mm(dw, bk, NT, hi)  # [C, C]
    dxt = _mm(bv, dvt, NT, hi) + _mm(bk, dw, NT, hi)  # dX^T
    dlo = jnp.where(strict_lo, -_mm(_mm(x, dx, TN, hi), x, NT, hi), 0.0)  # dL = -X^T dX X^T
    dlot = jnp.where(strict_up, -_mm(_mm(x, dxt, NN, hi), x, NN, hi), 0.0)  # dL^T = -X dX^T X
    dakk_scr[...] = beta * dlo
    dakkt_scr[...] = dlot * betar
    daqk_scr[...] = jnp.where(incl_lo, _mm(do, vt, NT, mm_dtype), 0.0)
    daqkt_scr[...] = jnp.where(incl_up, _mm(vt, do, NT, mm_dtype), 0.0)
    dbeta = (jnp.sum(dlo * akk, axis=1, keepdims=True) + jnp.sum(dbk * eg * k, axis=1, keepdims=True)
             + jnp.sum(dbv * v, axis=1, keepdims=True))

    # --- decay products: row parts (d of the left operand) and column parts (d of the right operand).
    for a in range(C // SUB):
        rows = pl.ds(a * SUB, SUB)
        ga = gam_ref[rows, :]
        m = jnp.zeros((1, K), f32) if a == 0 else gam_ref[pl.ds(a * SUB - 1, 1), :]
        left = jnp.exp(ga - m)  # <= 1
        right = k * jnp.exp(jnp.minimum(m - gam, EXP_CLAMP))
        rq = left * _mm(daqk_scr[rows, :], right, NN, mm_dtype)  # d(qs) from A_qk
        rk = left * _mm(dakk_scr[rows, :], right, NN, mm_dtype)  # d(k_i) from A_kk
        mb = gam_ref[pl.ds(a * SUB + SUB - 1, 1), :]  # G at the tile's last token
        back = jnp.exp(mb - ga)  # <= 1
        up = jnp.exp(jnp.minimum(gam - mb, EXP_CLAMP))
        cq = back * _mm(daqkt_scr[rows, :], qs * up, NN, mm_dtype)  # d(k_j) from A_qk
        ck = back * _mm(dakkt_scr[rows, :], k * up, NN, mm_dtype)  # d(k_j) from A_kk
        qa = q_ref[rows, :].astype(f32) * scale
        ka = k_ref[rows, :].astype(f32)
        rq_scr[rows, :] = rq
        dka_scr[rows, :] = rk + cq + ck
        dga_scr[rows, :] = qa * rq + ka * (rk - cq - ck)

    dqs = dqe * eg + rq_scr[...]
    dk = dka_scr[...] + dbk * beta * eg + dkdec * ekl
    dgam = dga_scr[...] + dqe * qe + dbk * bk - dkdec * kdec
    dglast = jnp.sum(dkdec * kdec, axis=0, keepdims=True) + ddl * dl  # [1, K]
    rowk = jax.lax.broadcasted_iota(jnp.int32, (C, K), 0)
    dgam = dgam + jnp.where(rowk == C - 1, dglast, 0.0)
    upper = jnp.where(col >= row, 1.0, 0.0).astype(f32)  # dg_s = sum_{i >= s} dG_i
    dq_ref[...] = (dqs * scale).astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = (beta * dbv).astype(dv_ref.dtype)
    dg_ref[...] = _mm(upper, dgam, NN, hi).astype(dg_ref.dtype)
    dbeta_ref[...] = dbeta


def chunk_kda_bwd(
    q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, do=None, dht=None,
    chunk_size: int = 64, interpret=False,
):
    """Gradients of :func:`pallas_kernels.kda.tpu.chunk_kda_fwd` (``g >= -5``).

    Args: forward inputs as :func:`pallas_kernels.kda.reference.chunk_kda` (``q, k, g [B, T, H, K]``,
    ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state [B, H, K, V] f32`` or None, ``segment_ids [B, T]``
    or None), ``do [B, T, H, V]`` (output cotangent) and ``dht [B, H, K, V]`` (final-state cotangent; None =
    zeros). Returns ``(dq, dk, dv, dg, dbeta, dh0)`` in the dtypes of ``q, k, v, g, beta`` and fp32 for
    ``dh0 [B, H, K, V]``. ``interpret``: ``True`` or a ``pltpu.InterpretParams`` runs on CPU.
    """
    _layout.check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size, "tpu_bwd.chunk_kda_bwd")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if C & (C - 1):
        raise ValueError(f"tpu_bwd.chunk_kda_bwd: chunk_size must be a power of two, got {C}")
    if do is None or do.shape != v.shape:
        raise ValueError(f"tpu_bwd.chunk_kda_bwd: do must be [B, T, H, V]={v.shape}, got "
                         f"{None if do is None else do.shape}")
    if dht is not None and dht.shape != (B, H, K, V):
        raise ValueError(f"tpu_bwd.chunk_kda_bwd: dht must be [B, H, K, V]={(B, H, K, V)}, got {dht.shape}")
    mm_dtype = _mm_dtype(q, v)
    x = _layout.prepare_chunk_inputs(q, k, v, g, beta, initial_state, segment_ids, C)
    BH, Tp = B * H, x.q.shape[1]
    N = Tp // C
    h = _states_call(x, C, mm_dtype, interpret)  # [BH, N, V, K] f32

    dop = jnp.swapaxes(jnp.pad(do, [(0, 0), (0, Tp - T), (0, 0), (0, 0)]), 1, 2).reshape(BH, Tp, V)
    if dht is None:
        dhtt = jnp.zeros((BH, V, K), jnp.float32)
    else:
        dhtt = jnp.swapaxes(dht.astype(jnp.float32), -1, -2).reshape(BH, V, K)
    beta_row = x.beta.reshape(BH, N, 1, C)

    rev = lambda c: N - 1 - c
    tok = lambda d: pl.BlockSpec((None, C, d), lambda bh, c: (bh, rev(c), 0))
    per_b = pl.BlockSpec((None, C, 1), lambda bh, c: (jax.lax.div(bh, H), rev(c), 0))
    per_b_row = pl.BlockSpec((None, None, 1, C), lambda bh, c: (jax.lax.div(bh, H), rev(c), 0, 0))
    beta_row_spec = pl.BlockSpec((None, None, 1, C), lambda bh, c: (bh, rev(c), 0, 0))
    h_spec = pl.BlockSpec((None, None, V, K), lambda bh, c: (bh, rev(c), 0, 0))
    state = pl.BlockSpec((None, V, K), lambda bh, c: (bh, 0, 0))
    f32 = jnp.float32
    cc = lambda: pltpu.VMEM((C, C), f32)
    ck = lambda: pltpu.VMEM((C, K), f32)
    dq, dk, dv, dg, dbeta, dh0t = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=float(scale), mm_dtype=mm_dtype),
        grid=(BH, N),
        in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), beta_row_spec, per_b, per_b_row, h_spec, tok(V), state],
        out_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), state],
        out_shape=[
            jax.ShapeDtypeStruct((BH, Tp, K), q.dtype),
            jax.ShapeDtypeStruct((BH, Tp, K), k.dtype),
            jax.ShapeDtypeStruct((BH, Tp, V), v.dtype),
            jax.ShapeDtypeStruct((BH, Tp, K), g.dtype),
            jax.ShapeDtypeStruct((BH, Tp, 1), f32),
            jax.ShapeDtypeStruct((BH, V, K), f32),
        ],
        scratch_shapes=[pltpu.VMEM((V, K), f32), cc(), cc(), cc(), cc(), cc(), cc(), ck(), ck(), ck()],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interp(interpret),
        name="kda_chunk_bwd",
    )(x.q, x.k, x.v, x.gam, x.beta, beta_row, x.seg_col, x.seg_row, h, dop, dhtt)

    def back(y, dtype):  # [BH, Tp, D] -> [B, T, H, D]
        return jnp.swapaxes(y.reshape(B, H, Tp, y.shape[-1]), 1, 2)[:, :T].astype(dtype)

    dh0 = jnp.swapaxes(dh0t.reshape(B, H, V, K), -1, -2)
    return (back(dq, q.dtype), back(dk, k.dtype), back(dv, v.dtype), back(dg, g.dtype),
            back(dbeta, beta.dtype)[..., 0], dh0)
