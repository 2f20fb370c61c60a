"""KDA Pallas kernels for GPU (Triton lowering): chunked forward and a decode step.

Chunked forward (``chunk_kda_fwd``): four lean kernels, the split flash-linear-attention also uses. Triton has
no value slicing or concatenation, so every sub-block is loaded from a ref (``pl.ds``). q, k, v, g, beta are read
and o written in the caller's ``[B, T, H, D]`` layout (strided tiles, no transposes; T is padded only when it
is not a multiple of the chunk). ``G``, the chunk-local cumsum of g, comes from a small scan kernel
(``_cumsum_kernel``, grid ``(B*H, N)``, memory-bound) ahead of them:

1. ``_a_kernel``, grid ``(C/16, B*H, N)``: one program per 16-token row tile ``a`` of a chunk. With the
   reference point ``m_a = G`` at the token before the tile (0 for ``a = 0``) the rows
   ``k_a e^{G_a - m_a}``, ``q_a e^{G_a - m_a} scale`` (exponents ``<= 0``) meet the columns of the whole
   chunk ``k e^{min(m_a - G, 80)}`` (``<= 80`` inside the tile, which needs ``g >= -5``; later tokens are
   clamped and masked) in ONE ``[16, K] x [K, C]`` matmul each (K in ``block_k`` slices): the rows of
   ``N = diag(beta) A_kk`` (strictly lower, same segment; fp32) and of the masked ``A_qk`` (incl. diagonal),
   plus the rows of ``q e^G scale`` and ``e^{G_C - G} k``. The tile index is the fastest grid axis, so a
   chunk's programs run together and share its k / g tiles in L2.
2. ``_solve_kernel``, grid ``(B*H, N)``: ``X = (I + N)^-1`` from the 16x16 tiles of ``N``: diagonal tiles by
   doubling, the rest by blocked substitution, all matmuls (exact fp32 FMA products); writes
   ``X [C, C]``.
3. ``_wu_kernel``, grid ``(B*H, N)``: ``W = X (beta e^G k)``, ``U = X (beta v)`` as ``[C, C] x [C, 64]``
   matmuls, and the chunk decay ``e^{G_C}``.
4. ``_state_kernel``, grid ``(B*H, V / BV)``: carries the fp32 state slice ``S^T [BV, K]`` in registers
   through the chunks (``fori_loop``; never to HBM in between): ``V~ = U - W S``,
   ``O = (q e^G) S + A_qk V~``, ``S' = diag(e^{G_C}) S + (e^{G_C - G} K)^T V~``.

Precision: decay factors, ``N`` and the inverse are fp32 (inverse products exact fp32, the rest 3xTF32,
``DotAlgorithmPreset.TF32_TF32_F32_X3``, ~fp32). With bf16 inputs the ``A``, ``W``/``U`` and state matmuls
take bf16 operands with fp32 accumulation and ``X`` is stored in bf16 (as fla does); with fp32 inputs
everything is fp32 / 3xTF32. In ``interpret`` mode (CPU) fp32 ``HIGHEST`` replaces 3xTF32.

Decode step, a flat grid of ``B * H * V / BV`` programs (:func:`flat_slice_ids`): one token per sequence, state
pool row ``state_slots[b]`` read and written in place (``input_output_aliases``). The same update with the layer's
short conv, gate and beta in front of it: :mod:`.gpu_decode_fused`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.forward_only import forward_only
from pallas_kernels.kda import _layout, launch

SUB = 16
EXP_CLAMP = 80.0
LOG2E = 1.4426950408889634
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


def _exp(x):
    """``e^x`` as ``2^(x log2 e)``: on the GPU one ``ex2.approx.ftz`` (results below ~1e-38 flush to 0) instead
    of libdevice's accurate ``expf`` (~5 FMAs more), relative error ~1e-6 for ``|x| <= 80``. The A kernel
    takes ~1.5k instead of ~2.5k instructions per thread (Triton 3.9, sm_90, 4 warps)."""
    return jnp.exp2(x * LOG2E)


def _decay_tiles(g_ref, cols):
    """``(G [C, BK], select)`` for the columns ``cols`` of a chunk: ``G`` the chunk-local cumulative log-decay
    (the ref holds it), ``select(i)`` its row ``i`` as ``[1, BK]`` (0 for ``i = -1``)."""
    gall = g_ref[:, cols]

    def select(i):
        return jnp.where(i < 0, 0.0, g_ref[pl.ds(jnp.maximum(i, 0), 1), cols])

    return gall, select


def _cumsum_kernel(g_ref, gam_ref, *, block: int):
    """``G = cumsum(g)`` over the tokens of one chunk (``[C, K]`` f32), ``block`` columns at a time."""
    K = g_ref.shape[-1]
    for kb in range(K // block):
        cols = pl.ds(kb * block, block)
        gam_ref[:, cols] = jnp.cumsum(g_ref[:, cols], axis=0)


def chunk_cumsum(g, chunk: int, block: int = 64, interpret: bool = False, num_warps: int = 4) -> jax.Array:
    """``G``: the cumulative sums of ``g [B, Tp, H, K] f32`` over the tokens of each chunk of ``chunk`` tokens
    (``Tp`` a multiple of ``chunk``), one program per ``(sequence * head, chunk)``, ``block`` columns at a time;
    ``[B, Tp, H, K] f32``. The forward and the backward (:mod:`.gpu_bwd`) both take ``G`` from here."""
    B, Tp, H, K = g.shape
    tok = pl.BlockSpec((None, chunk, None, K), lambda bh, c: (jax.lax.div(bh, H), c, jax.lax.rem(bh, H), 0))
    return pl.pallas_call(
        functools.partial(_cumsum_kernel, block=min(block, K)),
        grid=(B * H, Tp // chunk),
        in_specs=[tok],
        out_specs=tok,
        out_shape=jax.ShapeDtypeStruct(g.shape, jnp.float32),
        compiler_params=None if interpret else _compiler_params(num_warps, 1),
        interpret=bool(interpret),
        name="kda_chunk_cumsum_gpu",
    )(g)


def _a_kernel(
    q_ref, k_ref, g_ref, beta_ref, segc_ref, segr_ref,  # q, beta: this row tile; k, g, seg: the chunk
    nkk_ref, aqk_ref, qg_ref, kdec_ref,  # outputs: this row tile
    *, scale: float, mm_dtype, block_k: int, interpret: bool,
):
    """Rows ``[16a, 16a + 16)`` of ``N = diag(beta) A_kk``, masked ``A_qk``, ``q e^G scale``, ``e^{G_C-G} k``.

    Grid ``(C/16, B*H, N)``. ``k_ref [C, K]``, ``g_ref [C, K]`` (the chunk-local cumulative log-decay
    ``G``), ``segc_ref [C, 1]``, ``segr_ref [1, C]`` hold the chunk; ``q_ref [16, K]``,
    ``beta_ref [16, 1]`` the row tile.
    """
    f32 = jnp.float32
    C, K = k_ref.shape
    mm = _make_mm(interpret)
    a = pl.program_id(0)
    r0 = pl.multiple_of(a * SUB, SUB)
    rows = pl.ds(r0, SUB)
    last = pl.ds(C - 1, 1)
    sc = segc_ref[rows, :]  # [16, 1]
    seglast = segc_ref[last, :]  # [1, 1]
    acc_k = jnp.zeros((SUB, C), f32)
    acc_q = jnp.zeros((SUB, C), f32)
    for kb in range(K // block_k):
        cols = pl.ds(kb * block_k, block_k)
        gall, select = _decay_tiles(g_ref, cols)
        m = select(r0 - 1)  # [1, BK]: G at the token before the tile (0 for a = 0)
        glast = select(C - 1)
        ga = g_ref[rows, cols]  # [16, BK]
        left = _exp(ga - m)  # <= 1
        ka = k_ref[rows, cols].astype(f32)
        qa = q_ref[:, cols].astype(f32)
        colf = k_ref[:, cols].astype(f32) * _exp(jnp.minimum(m - gall, EXP_CLAMP))  # [C, BK]
        acc_k = acc_k + mm(ka * left, colf, NT, mm_dtype)
        acc_q = acc_q + mm(qa * (left * scale), colf, NT, mm_dtype)
        qg_ref[:, cols] = (qa * jnp.where(sc == 0, _exp(ga) * scale, 0.0)).astype(qg_ref.dtype)
        kdec_ref[:, cols] = jnp.where(sc == seglast, ka * _exp(glast - ga), 0.0).astype(kdec_ref.dtype)
    ri = r0 + jax.lax.broadcasted_iota(jnp.int32, (SUB, C), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SUB, C), 1)
    same = sc == segr_ref[...]  # [16, C]
    nkk_ref[...] = jnp.where(same & (ri > ci), beta_ref[...] * acc_k, 0.0)
    aqk_ref[...] = jnp.where(same & (ri >= ci), acc_q, 0.0).astype(aqk_ref.dtype)


def _solve_kernel(n_ref, x_ref, *, interpret: bool):
    """``X = (I + N)^-1`` for one chunk (grid ``(B*H, N)``), ``N [C, C]`` strictly lower, as 16x16 tiles:
    ``X_aa = D_a^-1`` (by doubling), ``X_ab = -D_a^-1 sum_{b <= c < a} N_ac X_cb``."""
    C = n_ref.shape[0]
    nt = C // SUB
    # Exact fp32 products ("ieee": FMAs, no tensor cores): for 16x16 tiles a quarter of the instructions of
    # 3xTF32 (Triton 3.9 for sm_90: ~2.5k vs ~9k PTX instructions per thread at 4 warps, no spills).
    prec = jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.F32_F32_F32
    mmp = lambda p_, r_: jax.lax.dot_general(p_, r_, NN, precision=prec, preferred_element_type=jnp.float32)
    ds = lambda i: pl.ds(i * SUB, SUB)
    zeros = jnp.zeros((SUB, SUB), x_ref.dtype)
    x = _layout.blocked_unit_lower_inverse(lambda a, c: n_ref[ds(a), ds(c)], nt, SUB, mmp)
    for a in range(nt):
        for b in range(nt):
            x_ref[ds(a), ds(b)] = x[a][b].astype(x_ref.dtype) if b <= a else zeros


def _wu_kernel(x_ref, k_ref, v_ref, g_ref, beta_ref, segc_ref, w_ref, u_ref, dl_ref,
               *, block: int, interpret: bool):
    """``W = X (beta e^G k)`` (``e^G`` only for the segment entering the chunk), ``U = X (beta v)`` and the
    chunk decay ``e^{G_C}`` (0 if a document starts inside the chunk); grid ``(B*H, N)``. ``g_ref`` holds ``G``.
    The matmuls take ``X``'s dtype as operand dtype (bf16, or fp32 = 3xTF32)."""
    f32 = jnp.float32
    C, K = k_ref.shape
    V = v_ref.shape[-1]
    mm = _make_mm(interpret)
    xdt = x_ref.dtype
    xm = x_ref[...]
    beta = beta_ref[...]  # [C, 1]
    first = segc_ref[...] == 0  # [C, 1]
    reset = segc_ref[pl.ds(C - 1, 1), :] != 0  # [1, 1]
    bk = min(block, K)
    for kb in range(K // bk):
        cols = pl.ds(kb * bk, bk)
        gall, select = _decay_tiles(g_ref, cols)
        rk = jnp.where(first, beta * _exp(gall), 0.0) * k_ref[:, cols].astype(f32)
        w_ref[:, cols] = mm(xm, rk, NN, xdt).astype(w_ref.dtype)
        dl_ref[:, cols] = jnp.where(reset, 0.0, _exp(select(C - 1)))
    for vb in range(V // min(block, V)):
        cols = pl.ds(vb * min(block, V), min(block, V))
        u_ref[:, cols] = mm(xm, beta * v_ref[:, cols].astype(f32), NN, xdt).astype(u_ref.dtype)


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


def _pow2(name: str, d: int) -> None:
    if d < 16 or d & (d - 1):
        raise ValueError(f"gpu.chunk_kda_fwd: {name} must be a power of two >= 16, got {d}")


class _Inputs(NamedTuple):
    """Kernel inputs; the big ones stay in the caller's ``[B, T, H, D]`` layout (no transposes)."""

    q: jax.Array  # [B, Tp, H, K], caller dtype
    k: jax.Array  # [B, Tp, H, K]
    v: jax.Array  # [B, Tp, H, V]
    gam: jax.Array  # [B, Tp, H, K] f32: log-decay g (padded); :func:`chunk_cumsum` makes it G
    beta: jax.Array  # [B, Tp, H, 1] f32
    seg_col: jax.Array  # [B, Tp, 1] i32: document starts inside the chunk up to token i
    seg_row: jax.Array  # [B, N, 1, C] i32: the same, row layout
    h0t: jax.Array  # [B*H, V, K] f32: initial state, transposed


def _prepare(q, k, v, g, beta, initial_state, segment_ids, C: int) -> _Inputs:
    """Pad T to a multiple of ``C`` (only when needed: padding tokens have ``g = 0``, ``beta = 0``, zero
    q/k/v, so they neither decay nor write the state); ``gam`` is still the per-token log decay."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = -(-T // C)
    Tp = N * C
    pad = Tp - T
    padt = lambda x: x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    gam = padt(g.astype(jnp.float32))
    seg = _layout.chunk_document_starts(segment_ids, B, T, C)
    if initial_state is None:
        h0t = jnp.zeros((B * H, V, K), jnp.float32)
    else:
        h0t = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2).reshape(B * H, V, K)
    return _Inputs(padt(q), padt(k), padt(v), gam, padt(beta.astype(jnp.float32))[..., None],
                   seg.reshape(B, Tp, 1), seg.reshape(B, N, 1, C), h0t)


def chunk_kda_fwd(
    q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, chunk_size: int = 64,
    interpret: bool = False, block_v: int | None = None, num_warps: int = 4, num_stages: int | None = None,
    a_num_warps: int = 4, solve_num_warps: int = 4, wu_num_warps: int = 4, block_k: int = 64, x_dtype=None,
):
    """Chunked KDA forward on GPU, four Triton kernels. Args as the reference ``chunk_kda`` (``g >= -5``).

    ``num_warps``/``num_stages``/``block_v``: the state kernel (grid ``(B*H, V / block_v)``); ``num_stages=None``
    takes the most stages (up to 3) whose shared-memory estimate fits the GPU
    (:func:`pallas_kernels.kda.launch.fit_num_stages`: 3 for bf16, 1 for fp32 at K = V = 128 on an H200);
    ``a_num_warps``, ``solve_num_warps``, ``wu_num_warps``: the A, solve and W/U kernels; ``block_k``: the
    K slice of the A kernel and the column block of the W/U kernel; ``x_dtype``: storage and matmul dtype of
    ``X = (I + diag(beta) A_kk)^-1`` (default: the matmul dtype, bf16 for bf16 inputs, else fp32).
    The kernels read q, k, v, beta and the cumulative decay in the ``[B, T, H, D]`` layout and write ``o`` in
    it (strided tiles, no transposes); intermediates are ``[B*H, Tp, D]``.
    Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32)``.
    """
    _layout.check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size, "gpu.chunk_kda_fwd")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    BV = block_v or min(V, 64)
    BK = min(block_k, K)
    for nm, d in (("K", K), ("V", V), ("block_v", BV), ("block_k", BK), ("chunk_size", C)):
        _pow2(nm, d)
    if V % BV:
        raise ValueError(f"gpu.chunk_kda_fwd: block_v={BV} must divide V={V}")
    x = _prepare(q, k, v, g, beta, initial_state, segment_ids, C)
    BH, Tp = B * H, x.q.shape[1]
    N = Tp // C
    nt = C // SUB
    mm_dtype = jnp.float32 if jnp.promote_types(q.dtype, v.dtype) == jnp.float32 else jnp.bfloat16
    x_dtype = jnp.dtype(x_dtype or mm_dtype)
    interp = bool(interpret)
    if not interp:
        num_stages = launch.fit_num_stages("kda_chunk_state_gpu", num_stages, chunk=C, k=K, block_v=BV,
                                           q_dtype=q.dtype, v_dtype=v.dtype)
    params = lambda nw, ns=1: None if interp else _compiler_params(nw, ns)
    bi = lambda bh: jax.lax.div(bh, H)  # batch index of a (sequence, head) program
    hi = lambda bh: jax.lax.rem(bh, H)  # head index

    tok_in = lambda d: pl.BlockSpec((None, C, None, d), lambda bh, c: (bi(bh), c, hi(bh), 0))
    x = x._replace(gam=chunk_cumsum(x.gam, C, block=BK, interpret=interp))

    # 1. A: one program per (16-row tile, sequence/head, chunk); the row tile is the fastest grid axis so the
    #    programs of one chunk run together and share its k / decay tiles in L2.
    row_in = lambda d: pl.BlockSpec((None, SUB, None, d), lambda a, bh, c: (bi(bh), c * nt + a, hi(bh), 0))
    chunk_in = lambda d: pl.BlockSpec((None, C, None, d), lambda a, bh, c: (bi(bh), c, hi(bh), 0))
    row_out = lambda d: pl.BlockSpec((None, SUB, d), lambda a, bh, c: (bh, c * nt + a, 0))
    nkk, aqk, qg, kdec = pl.pallas_call(
        functools.partial(_a_kernel, scale=float(scale), mm_dtype=mm_dtype, block_k=BK, interpret=interp),
        grid=(nt, BH, N),
        in_specs=[
            row_in(K), chunk_in(K), chunk_in(K), row_in(1),
            pl.BlockSpec((None, C, 1), lambda a, bh, c: (bi(bh), c, 0)),
            pl.BlockSpec((None, None, 1, C), lambda a, bh, c: (bi(bh), c, 0, 0)),
        ],
        out_specs=[row_out(C), row_out(C), row_out(K), row_out(K)],
        out_shape=[
            jax.ShapeDtypeStruct((BH, Tp, C), jnp.float32),
            jax.ShapeDtypeStruct((BH, Tp, C), mm_dtype),
            jax.ShapeDtypeStruct((BH, Tp, K), mm_dtype),
            jax.ShapeDtypeStruct((BH, Tp, K), mm_dtype),
        ],
        compiler_params=params(a_num_warps),
        interpret=interp,
        name="kda_chunk_a_gpu",
    )(x.q, x.k, x.gam, x.beta, x.seg_col, x.seg_row)

    # 2. X = (I + N)^-1 per chunk.
    tok = lambda d: pl.BlockSpec((None, C, d), lambda bh, c: (bh, c, 0))
    xm = pl.pallas_call(
        functools.partial(_solve_kernel, interpret=interp),
        grid=(BH, N),
        in_specs=[tok(C)],
        out_specs=tok(C),
        out_shape=jax.ShapeDtypeStruct((BH, Tp, C), x_dtype),
        compiler_params=params(solve_num_warps),
        interpret=interp,
        name="kda_chunk_solve_gpu",
    )(nkk)

    # 3. W, U and the chunk decay.
    w, u, dl = pl.pallas_call(
        functools.partial(_wu_kernel, block=BK, interpret=interp),
        grid=(BH, N),
        in_specs=[tok(C), tok_in(K), tok_in(V), tok_in(K), tok_in(1),
                  pl.BlockSpec((None, C, 1), lambda bh, c: (bi(bh), c, 0))],
        out_specs=[tok(K), tok(V), pl.BlockSpec((None, None, 1, K), lambda bh, c: (bh, c, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((BH, Tp, K), mm_dtype),
            jax.ShapeDtypeStruct((BH, Tp, V), mm_dtype),
            jax.ShapeDtypeStruct((BH, N, 1, K), jnp.float32),
        ],
        compiler_params=params(wu_num_warps),
        interpret=interp,
        name="kda_chunk_wu_gpu",
    )(xm, x.k, x.v, x.gam, x.beta, x.seg_col)

    # 4. Sequential state pass; o written straight into [B, Tp, H, V].
    seq = lambda d: pl.BlockSpec((None, Tp, d), lambda bh, j: (bh, 0, 0))
    seq_v = pl.BlockSpec((None, Tp, BV), lambda bh, j: (bh, 0, j))
    state = pl.BlockSpec((None, BV, K), lambda bh, j: (bh, j, 0))
    o, ht = pl.pallas_call(
        functools.partial(_state_kernel, chunk=C, n_chunks=N, mm_dtype=mm_dtype, interpret=interp),
        grid=(BH, V // BV),
        in_specs=[seq(K), seq_v, seq(C), seq(K), seq(K),
                  pl.BlockSpec((None, N, 1, K), lambda bh, j: (bh, 0, 0, 0)), state],
        out_specs=[pl.BlockSpec((None, Tp, None, BV), lambda bh, j: (bi(bh), 0, hi(bh), j)), state],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype),
            jax.ShapeDtypeStruct((BH, V, K), jnp.float32),
        ],
        compiler_params=params(num_warps, num_stages),
        interpret=interp,
        name="kda_chunk_state_gpu",
    )(w, u, aqk, qg, kdec, dl, x.h0t)
    o = o if Tp == T else o[:, :T]
    return o, jnp.swapaxes(ht.reshape(B, H, V, K), -1, -2)


# ------------------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------------------


def flat_slice_ids(n_v: int, heads: int):
    """``(row, head, V slice)`` of this program on the decode / verify kernels' flat grid of
    ``rows * heads * n_v`` programs: the V slices of one state fastest, then heads, then rows, so the programs that
    read one state run side by side."""
    pid = pl.program_id(0)
    return pid // (n_v * heads), (pid // n_v) % heads, pid % n_v


def decode_update(s, q, k, g, v, beta, scale: float):
    """One recurrent KDA step on a state slice inside a Triton kernel body (the decode and verify kernels' math).

    ``s [K, BV]`` f32 state slice; ``q, k, g [K, 1]`` f32 (``g`` the log-decay); ``v [1, BV]`` f32; ``beta`` f32,
    ``[1, 1]`` or a scalar. Returns ``(o [1, BV] f32, new state [K, BV] f32)``: decay, delta-rule write, read.
    """
    s = s * jnp.exp(g)
    pred = jnp.sum(k * s, axis=0, keepdims=True)  # [1, BV]
    s = s + (beta * k) * (v - pred)
    return jnp.sum((q * scale) * s, axis=0, keepdims=True), s


def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, o_ref, pool_out_ref,
                   *, scale: float, block_v: int, heads: int):
    b, h, j = flat_slice_ids(v_ref.shape[-1] // block_v, heads)
    f32 = jnp.float32
    slot = slots_ref[b]
    vs = pl.ds(j * block_v, block_v)
    s = pool_in_ref[slot, h, :, vs]  # [K, BV]
    qc = q_ref[b, h, :, :].astype(f32)  # [K, 1]
    kc = k_ref[b, h, :, :].astype(f32)
    gc = g_ref[b, h, :, :].astype(f32)
    vr = v_ref[b, h, :, vs].astype(f32)  # [1, BV]
    bb = beta_ref[b, h, :, :].astype(f32)  # [1, 1]
    o, s = decode_update(s, qc, kc, gc, vr, bb, scale)
    o_ref[b, h, :, vs] = o.astype(o_ref.dtype)
    pool_out_ref[slot, h, :, vs] = s


def decode_step(q, k, v, g, beta, scale: float, state_pool, state_slots, block_v: int = 64,
                interpret: bool = False, num_warps: int = 8):
    """One recurrent KDA step in place on a state pool (see :func:`pallas_kernels.kda.tpu.decode_step`).

    ``block_v`` / ``num_warps``: V slice per program and its warps; default 64 and 8 warps
    (``benchmarks/kda.py --decode-configs`` sweeps others).

    ``q, k, g [B, H, K]``, ``v [B, H, V]``, ``beta [B, H]``, ``state_pool [P, H, K, V] f32``,
    ``state_slots [B] i32``. Returns ``(o [B, H, V], new_pool)``.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    BV = min(block_v, V)
    o, pool = forward_only(pl.pallas_call(
        functools.partial(_decode_kernel, scale=float(scale), block_v=BV, heads=H),
        grid=(B * H * (V // BV),),
        out_shape=[jax.ShapeDtypeStruct((B, H, 1, V), v.dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={6: 1},
        compiler_params=None if interpret else _compiler_params(num_warps, 1),
        interpret=bool(interpret),
        name="kda_decode_gpu",
    ), state_slots.astype(jnp.int32), q[..., None], k[..., None], v[:, :, None, :], g[..., None],
        beta[:, :, None, None], state_pool.astype(jnp.float32), name="kda.gpu.decode_step")
    return o[:, :, 0, :], pool
