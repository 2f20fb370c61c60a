"""KDA Pallas kernels for GPU (Triton lowering): chunked forward and a decode step.

Chunked forward, grid ``(B*H, V / BV)``: each program owns one (sequence, head) and a ``BV``-wide slice of
the value dimension, keeps its fp32 state slice ``S^T [BV, K]`` in registers and walks the chunks with a
``fori_loop`` (the state never goes to HBM between chunks). Triton has no value slicing or concatenation,
so everything inside a chunk is done on 16-token tiles loaded straight from the refs:

* ``A_kk[a, b]``, ``A_qk[a, b]`` (``b <= a``) are 16x16 matmuls of decay-factored tiles, reference point
  ``m_a = G`` at the token before tile ``a`` (exponents ``<= 0`` off the diagonal, ``<= 80`` on it, which
  needs ``g >= -5``; see :mod:`pallas_kernels.kda.tpu`);
* the unit-lower-triangular solve is blocked forward substitution over the 4 tiles, each 16x16 diagonal
  block inverted by the Neumann product (all matmuls);
* ``V~_b = U_b - W_b S``, ``O_a = (q_a e^{G_a}) S + sum_{b<=a} A_qk[a, b] V~_b``,
  ``S' = diag(e^{G_C}) S + sum_b (e^{G_C - G_b} K_b)^T V~_b``, with document masks for packed sequences.

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


def chunk_kda_fwd(
    q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, chunk_size: int = 64,
    interpret: bool = False, block_v: int | None = None, num_warps: int = 4, num_stages: int = 1,
):
    """Chunked KDA forward on GPU (Triton). Args as the reference ``chunk_kda`` (``g >= -5``).

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
    o, pool = pl.pallas_call(
        functools.partial(_decode_kernel, scale=float(scale), block_v=BV),
        grid=(B, H, V // BV),
        out_shape=[jax.ShapeDtypeStruct((B, H, 1, V), v.dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={6: 1},
        compiler_params=None if interpret else _compiler_params(num_warps, 1),
        interpret=bool(interpret),
        name="kda_decode_gpu",
    )(state_slots.astype(jnp.int32), q[..., None], k[..., None], v[:, :, None, :], g[..., None],
      beta[:, :, None, None], state_pool.astype(jnp.float32))
    return o[:, :, 0, :], pool
