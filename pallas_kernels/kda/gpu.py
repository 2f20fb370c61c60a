"""KDA Pallas kernels for GPU (Triton lowering): chunked forward and a decode step.

Chunked forward (``chunk_kda_fwd``), two kernels, the split fla also uses:

1. ``_intra_kernel``, grid ``(B*H, N)``, fully parallel: everything of a chunk that does not depend on the
   carried state. Triton has no value slicing or concatenation, so it works on 16-token tiles loaded
   straight from the refs: ``A_kk[a, b]``, ``A_qk[a, b]`` (``b <= a``) are 16x16 matmuls of decay-factored
   tiles, reference point ``m_a = G`` at the token before tile ``a`` (exponents ``<= 0`` off the diagonal,
   ``<= 80`` on it, which needs ``g >= -5``; see :mod:`pallas_kernels.kda.tpu`); the inverse
   ``X = (I + diag(beta) A_kk)^-1`` is built tile by tile (diagonal tiles by the Neumann product, the
   rest by blocked substitution, all matmuls); it writes ``W = X (beta e^G K)``, ``U = X (beta V)``, the
   masked ``A_qk``, ``q e^G``, ``e^{G_C - G} K`` and the chunk decay.
2. ``_state_kernel``, grid ``(B*H, V / BV)``: carries the fp32 state slice ``S^T [BV, K]`` in registers
   through the chunks (``fori_loop``; never to HBM in between): ``V~ = U - W S``,
   ``O = (q e^G) S + A_qk V~``, ``S' = diag(e^{G_C}) S + (e^{G_C - G} K)^T V~``.

``chunk_kda_fwd_fused`` does both in one kernel per (sequence, head, V block); it is correct but slow
(measured, see benchmarks/RESULTS.md) and kept for comparison.

Precision: the decay/solve matmuls use 3xTF32 (``DotAlgorithmPreset.TF32_TF32_F32_X3``, ~fp32); with bf16
inputs the ``A``/state/output matmuls take bf16 operands with fp32 accumulation (as fla does); with fp32
inputs every matmul is 3xTF32. In ``interpret`` mode (CPU) fp32 ``HIGHEST`` replaces 3xTF32.

Decode step, grid ``(B, H, V / BV)``: one token per sequence, state pool row ``state_slots[b]`` read and
written in place (``input_output_aliases``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.forward_only import forward_only
from pallas_kernels.kda import _layout

SUB = 16
EXP_CLAMP = 80.0
NT = (((1,), (1,)), ((), ()))
NN = (((1,), (0,)), ((), ()))
TN = (((0,), (0,)), ((), ()))


def _compiler_params(num_warps: int, num_stages: int):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _make_mm(interpret: bool):
    precise = jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3

    def mm(a, b, dims, dtype):
        if dtype == jnp.float32:
            return jax.lax.dot_general(
                a.astype(jnp.float32), b.astype(jnp.float32), dims, precision=precise,
                preferred_element_type=jnp.float32,
            )
        return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=jnp.float32)

    return mm


def _chunk_fwd_kernel(
    q_ref, k_ref, v_ref, gam_ref, beta_ref, segc_ref, segr_ref, h0_ref, o_ref, ht_ref,
    *, scale: float, chunk: int, n_chunks: int, mm_dtype, interpret: bool,
):
    f32 = jnp.float32
    C = chunk
    nt = C // SUB
    K = k_ref.shape[-1]
    mm = _make_mm(interpret)
    mmp = lambda a, b, dims: mm(a, b, dims, f32)
    ri = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)

    def body(c, st):  # st: [BV, K] f32 (state slice, transposed)
        base = c * C
        rows = [pl.ds(base + a * SUB, SUB) for a in range(nt)]
        kt = [k_ref[r, :].astype(f32) for r in rows]
        gt = [gam_ref[r, :] for r in rows]
        bt = [beta_ref[r, :] for r in rows]  # [16, 1]
        sc = [segc_ref[r, :] for r in rows]  # [16, 1]
        sr = [segr_ref[c, :, pl.ds(a * SUB, SUB)] for a in range(nt)]  # [1, 16]
        eg = [jnp.where(sc[a] == 0, jnp.exp(gt[a]), 0.0) for a in range(nt)]
        glast = gam_ref[pl.ds(base + C - 1, 1), :]  # [1, K]
        seglast = segc_ref[pl.ds(base + C - 1, 1), :]  # [1, 1]

        akk = [[None] * nt for _ in range(nt)]
        aqk = [[None] * nt for _ in range(nt)]
        for a in range(nt):
            m = jnp.zeros((1, K), f32) if a == 0 else gam_ref[pl.ds(base + a * SUB - 1, 1), :]
            left = jnp.exp(gt[a] - m)
            rowk = kt[a] * left
            rowq = q_ref[rows[a], :].astype(f32) * (left * scale)
            for b in range(a + 1):
                colf = kt[b] * jnp.exp(jnp.minimum(m - gt[b], EXP_CLAMP))
                same = sc[a] == sr[b]
                mk = same & (ri > ci) if a == b else same
                mq = same & (ri >= ci) if a == b else same
                akk[a][b] = jnp.where(mk, mm(rowk, colf, NT, mm_dtype), 0.0)
                aqk[a][b] = jnp.where(mq, mm(rowq, colf, NT, mm_dtype), 0.0)

        w, u = [], []
        for a in range(nt):
            rw = bt[a] * eg[a] * kt[a]
            ru = bt[a] * v_ref[rows[a], :].astype(f32)
            for b in range(a):
                nab = bt[a] * akk[a][b]
                rw = rw - mmp(nab, w[b], NN)
                ru = ru - mmp(nab, u[b], NN)
            dinv = _layout.neumann_inverse(bt[a] * akk[a][a], SUB, lambda x, y: mmp(x, y, NN))
            w.append(mmp(dinv, rw, NN))
            u.append(mmp(dinv, ru, NN))

        vt = [u[b] - mm(w[b], st, NT, mm_dtype) for b in range(nt)]  # [16, BV]
        for a in range(nt):
            qg = q_ref[rows[a], :].astype(f32) * (eg[a] * scale)
            o = mm(qg, st, NT, mm_dtype)
            for b in range(a + 1):
                o = o + mm(aqk[a][b], vt[b], NN, mm_dtype)
            o_ref[rows[a], :] = o.astype(o_ref.dtype)

        st_new = st * jnp.where(seglast == 0, jnp.exp(glast), 0.0)
        for b in range(nt):
            kdec = jnp.where(sc[b] == seglast, kt[b] * jnp.exp(glast - gt[b]), 0.0)
            st_new = st_new + mm(vt[b], kdec, TN, mm_dtype)
        return st_new

    st = jax.lax.fori_loop(0, n_chunks, body, h0_ref[...])
    ht_ref[...] = st


def chunk_kda_fwd_fused(
    q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, chunk_size: int = 64,
    interpret: bool = False, block_v: int | None = None, num_warps: int = 4, num_stages: int = 1,
):
    """Chunked KDA forward on GPU, one fused Triton kernel per (sequence, head, V block).

    Kept for comparison: measured 35 ms at B=1, T=8192, H=96 on an H200 (spills; the intra-chunk work
    is serialised with the state). Args as the reference ``chunk_kda`` (``g >= -5``).

    Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32)``. ``K``, ``V`` and ``block_v``
    must be powers of two >= 16.
    """
    _layout.check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size, "gpu.chunk_kda_fwd")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    BV = block_v or min(V, 64)
    for nm, d in (("K", K), ("V", V), ("block_v", BV), ("chunk_size", C)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"gpu.chunk_kda_fwd: {nm} must be a power of two >= 16, got {d}")
    if V % BV:
        raise ValueError(f"gpu.chunk_kda_fwd: block_v={BV} must divide V={V}")
    x = _layout.prepare_chunk_inputs(q, k, v, g, beta, initial_state, segment_ids, C)
    BH, Tp = B * H, x.q.shape[1]
    N = Tp // C
    mm_dtype = jnp.float32 if jnp.promote_types(q.dtype, v.dtype) == jnp.float32 else jnp.bfloat16
    seq = lambda d: pl.BlockSpec((None, Tp, d), lambda bh, j: (bh, 0, 0))
    seq_v = pl.BlockSpec((None, Tp, BV), lambda bh, j: (bh, 0, j))
    per_b = pl.BlockSpec((None, Tp, 1), lambda bh, j: (jax.lax.div(bh, H), 0, 0))
    per_b_row = pl.BlockSpec((None, N, 1, C), lambda bh, j: (jax.lax.div(bh, H), 0, 0, 0))
    state = pl.BlockSpec((None, BV, K), lambda bh, j: (bh, j, 0))
    kernel = functools.partial(
        _chunk_fwd_kernel, scale=float(scale), chunk=C, n_chunks=N, mm_dtype=mm_dtype, interpret=bool(interpret)
    )
    o, ht = pl.pallas_call(
        kernel,
        grid=(BH, V // BV),
        in_specs=[seq(K), seq(K), seq_v, seq(K), seq(1), per_b, per_b_row, state],
        out_specs=[seq_v, state],
        out_shape=[
            jax.ShapeDtypeStruct((BH, Tp, V), v.dtype),
            jax.ShapeDtypeStruct((BH, V, K), jnp.float32),
        ],
        compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
        interpret=bool(interpret),
        name="kda_chunk_fwd_gpu",
    )(x.q, x.k, x.v, x.gam, x.beta, x.seg_col, x.seg_row, x.h0t)
    return _layout.finish_chunk_outputs(o, ht, B, T, H)


# ------------------------------------------------------------------------------------------------------
# Two-phase forward (default): a fully parallel intra-chunk kernel, then a thin sequential state pass.
# ------------------------------------------------------------------------------------------------------


def _intra_kernel(
    q_ref, k_ref, v_ref, gam_ref, beta_ref, segc_ref, segr_ref,  # inputs, one chunk
    w_ref, u_ref, aqk_ref, qg_ref, kdec_ref, dl_ref,  # outputs, one chunk
    *, scale: float, mm_dtype, interpret: bool,
):
    """Everything of a chunk that does not depend on the carried state (grid ``(B*H, N)``, parallel)."""
    f32 = jnp.float32
    C, K = k_ref.shape
    nt = C // SUB
    mm = _make_mm(interpret)
    mmp = lambda a, b, dims: mm(a, b, dims, f32)
    ri = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    rows = [pl.ds(a * SUB, SUB) for a in range(nt)]
    kt = [k_ref[r, :].astype(f32) for r in rows]
    gt = [gam_ref[r, :] for r in rows]
    bt = [beta_ref[r, :] for r in rows]
    sc = [segc_ref[r, :] for r in rows]
    sr = [segr_ref[:, r] for r in rows]
    eg = [jnp.where(sc[a] == 0, jnp.exp(gt[a]), 0.0) for a in range(nt)]
    glast = gam_ref[pl.ds(C - 1, 1), :]
    seglast = segc_ref[pl.ds(C - 1, 1), :]

    akk = [[None] * nt for _ in range(nt)]
    zeros = jnp.zeros((SUB, SUB), f32)
    for a in range(nt):
        m = jnp.zeros((1, K), f32) if a == 0 else gam_ref[pl.ds(a * SUB - 1, 1), :]
        left = jnp.exp(gt[a] - m)
        rowk = kt[a] * left
        qa = q_ref[rows[a], :].astype(f32)
        rowq = qa * (left * scale)
        for b in range(nt):
            if b > a:
                aqk_ref[rows[a], rows[b]] = zeros.astype(aqk_ref.dtype)
                continue
            colf = kt[b] * jnp.exp(jnp.minimum(m - gt[b], EXP_CLAMP))
            same = sc[a] == sr[b]
            mk = same & (ri > ci) if a == b else same
            mq = same & (ri >= ci) if a == b else same
            akk[a][b] = jnp.where(mk, mm(rowk, colf, NT, mm_dtype), 0.0)
            aqk_ref[rows[a], rows[b]] = jnp.where(mq, mm(rowq, colf, NT, mm_dtype), 0.0).astype(aqk_ref.dtype)
        qg_ref[rows[a], :] = (qa * (eg[a] * scale)).astype(qg_ref.dtype)
        kdec = jnp.where(sc[a] == seglast, kt[a] * jnp.exp(glast - gt[a]), 0.0)
        kdec_ref[rows[a], :] = kdec.astype(kdec_ref.dtype)
    dl_ref[...] = jnp.where(seglast == 0, jnp.exp(glast), 0.0)

    # X = (I + diag(beta) A_kk)^-1 as 16x16 tiles: X_aa = D_a^-1, X_ab = -D_a^-1 sum_{b<=c<a} N_ac X_cb.
    x = [[None] * nt for _ in range(nt)]
    for a in range(nt):
        dinv = _layout.neumann_inverse(bt[a] * akk[a][a], SUB, lambda p_, r_: mmp(p_, r_, NN))
        x[a][a] = dinv
        for b in range(a):
            acc = mmp(bt[a] * akk[a][b], x[b][b], NN)
            for c in range(b + 1, a):
                acc = acc + mmp(bt[a] * akk[a][c], x[c][b], NN)
            x[a][b] = -mmp(dinv, acc, NN)
    rk = [bt[b] * eg[b] * kt[b] for b in range(nt)]
    rv = [bt[b] * v_ref[rows[b], :].astype(f32) for b in range(nt)]
    for a in range(nt):
        w = mmp(x[a][0], rk[0], NN)
        u = mmp(x[a][0], rv[0], NN)
        for b in range(1, a + 1):
            w = w + mmp(x[a][b], rk[b], NN)
            u = u + mmp(x[a][b], rv[b], NN)
        w_ref[rows[a], :] = w.astype(w_ref.dtype)
        u_ref[rows[a], :] = u.astype(u_ref.dtype)


def _state_kernel(w_ref, u_ref, aqk_ref, qg_ref, kdec_ref, dl_ref, h0_ref, o_ref, ht_ref,
                  *, chunk: int, n_chunks: int, mm_dtype, interpret: bool):
    """Sequential pass over chunks (grid ``(B*H, V / BV)``), state slice ``S^T [BV, K]`` in registers."""
    mm = _make_mm(interpret)
    C = chunk

    def body(c, st):
        rows = pl.ds(c * C, C)
        vt = u_ref[rows, :].astype(jnp.float32) - mm(w_ref[rows, :], st, NT, mm_dtype)  # [C, BV]
        o = mm(qg_ref[rows, :], st, NT, mm_dtype) + mm(aqk_ref[rows, :], vt, NN, mm_dtype)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return st * dl_ref[c] + mm(vt, kdec_ref[rows, :], TN, mm_dtype)

    ht_ref[...] = jax.lax.fori_loop(0, n_chunks, body, h0_ref[...])


def chunk_kda_fwd(
    q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, chunk_size: int = 64,
    interpret: bool = False, block_v: int | None = None, num_warps: int = 4, num_stages: int = 2,
    intra_num_warps: int = 8,
):
    """Chunked KDA forward on GPU, two Triton kernels. Args as the reference ``chunk_kda`` (``g >= -5``).

    Phase 1 (grid ``(B*H, N)``, parallel) writes per chunk ``W``, ``U``, the masked ``A_qk``,
    ``q e^G``, ``e^{G_C - G} K`` (in the matmul dtype: bf16 for bf16 inputs) and the chunk decay; phase 2
    (grid ``(B*H, V / BV)``) carries the fp32 state through the chunks with four small matmuls each.
    Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32)``.
    """
    _layout.check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size, "gpu.chunk_kda_fwd")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    BV = block_v or min(V, 64)
    for nm, d in (("K", K), ("V", V), ("block_v", BV), ("chunk_size", C)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"gpu.chunk_kda_fwd: {nm} must be a power of two >= 16, got {d}")
    if V % BV:
        raise ValueError(f"gpu.chunk_kda_fwd: block_v={BV} must divide V={V}")
    x = _layout.prepare_chunk_inputs(q, k, v, g, beta, initial_state, segment_ids, C)
    BH, Tp = B * H, x.q.shape[1]
    N = Tp // C
    mm_dtype = jnp.float32 if jnp.promote_types(q.dtype, v.dtype) == jnp.float32 else jnp.bfloat16
    interp = bool(interpret)

    tok = lambda d: pl.BlockSpec((None, C, d), lambda bh, c: (bh, c, 0))
    per_b = pl.BlockSpec((None, C, 1), lambda bh, c: (jax.lax.div(bh, H), c, 0))
    per_b_row = pl.BlockSpec((None, None, 1, C), lambda bh, c: (jax.lax.div(bh, H), c, 0, 0))
    dl_spec = pl.BlockSpec((None, None, 1, K), lambda bh, c: (bh, c, 0, 0))
    w, u, aqk, qg, kdec, dl = pl.pallas_call(
        functools.partial(_intra_kernel, scale=float(scale), mm_dtype=mm_dtype, interpret=interp),
        grid=(BH, N),
        in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), per_b, per_b_row],
        out_specs=[tok(K), tok(V), tok(C), tok(K), tok(K), dl_spec],
        out_shape=[
            jax.ShapeDtypeStruct((BH, Tp, K), mm_dtype),
            jax.ShapeDtypeStruct((BH, Tp, V), mm_dtype),
            jax.ShapeDtypeStruct((BH, Tp, C), mm_dtype),
            jax.ShapeDtypeStruct((BH, Tp, K), mm_dtype),
            jax.ShapeDtypeStruct((BH, Tp, K), mm_dtype),
            jax.ShapeDtypeStruct((BH, N, 1, K), jnp.float32),
        ],
        compiler_params=None if interp else _compiler_params(intra_num_warps, 1),
        interpret=interp,
        name="kda_chunk_intra_gpu",
    )(x.q, x.k, x.v, x.gam, x.beta, x.seg_col, x.seg_row)

    seq = lambda d: pl.BlockSpec((None, Tp, d), lambda bh, j: (bh, 0, 0))
    seq_v = pl.BlockSpec((None, Tp, BV), lambda bh, j: (bh, 0, j))
    state = pl.BlockSpec((None, BV, K), lambda bh, j: (bh, j, 0))
    dl_all = pl.BlockSpec((None, N, 1, K), lambda bh, j: (bh, 0, 0, 0))
    o, ht = pl.pallas_call(
        functools.partial(_state_kernel, chunk=C, n_chunks=N, mm_dtype=mm_dtype, interpret=interp),
        grid=(BH, V // BV),
        in_specs=[seq(K), seq_v, seq(C), seq(K), seq(K), dl_all, state],
        out_specs=[seq_v, state],
        out_shape=[
            jax.ShapeDtypeStruct((BH, Tp, V), v.dtype),
            jax.ShapeDtypeStruct((BH, V, K), jnp.float32),
        ],
        compiler_params=None if interp else _compiler_params(num_warps, num_stages),
        interpret=interp,
        name="kda_chunk_state_gpu",
    )(w, u, aqk, qg, kdec, dl, x.h0t)
    return _layout.finish_chunk_outputs(o, ht, B, T, H)


# ------------------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------------------


def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, o_ref, pool_out_ref,
                   *, scale: float, block_v: int):
    b = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    f32 = jnp.float32
    slot = slots_ref[b]
    vs = pl.ds(j * block_v, block_v)
    s = pool_in_ref[slot, h, :, vs]  # [K, BV]
    qc = q_ref[b, h, :, :].astype(f32)  # [K, 1]
    kc = k_ref[b, h, :, :].astype(f32)
    gc = g_ref[b, h, :, :].astype(f32)
    vr = v_ref[b, h, :, vs].astype(f32)  # [1, BV]
    bb = beta_ref[b, h, :, :].astype(f32)  # [1, 1]
    s = s * jnp.exp(gc)
    pred = jnp.sum(kc * s, axis=0, keepdims=True)  # [1, BV]
    s = s + (bb * kc) * (vr - pred)
    o = jnp.sum((qc * scale) * s, axis=0, keepdims=True)
    o_ref[b, h, :, vs] = o.astype(o_ref.dtype)
    pool_out_ref[slot, h, :, vs] = s


def decode_step(q, k, v, g, beta, scale: float, state_pool, state_slots, block_v: int = 32,
                interpret: bool = False, num_warps: int = 4):
    """One recurrent KDA step in place on a state pool (see :func:`pallas_kernels.kda.tpu.decode_step`).

    ``q, k, g [B, H, K]``, ``v [B, H, V]``, ``beta [B, H]``, ``state_pool [P, H, K, V] f32``,
    ``state_slots [B] i32``. Returns ``(o [B, H, V], new_pool)``.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    BV = min(block_v, V)
    o, pool = forward_only(pl.pallas_call(
        functools.partial(_decode_kernel, scale=float(scale), block_v=BV),
        grid=(B, H, V // BV),
        out_shape=[jax.ShapeDtypeStruct((B, H, 1, V), v.dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={6: 1},
        compiler_params=None if interpret else _compiler_params(num_warps, 1),
        interpret=bool(interpret),
        name="kda_decode_gpu",
    ), state_slots.astype(jnp.int32), q[..., None], k[..., None], v[:, :, None, :], g[..., None],
        beta[:, :, None, None], state_pool.astype(jnp.float32), name="kda.gpu.decode_step")
    return o[:, :, 0, :], pool
