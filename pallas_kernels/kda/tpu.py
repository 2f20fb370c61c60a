"""KDA Pallas kernels for TPU (Mosaic): chunked forward (training / prefill) and a decode step.

Chunked forward, grid ``(B*H, N)`` with the chunk axis ``"arbitrary"`` (sequential) and the fp32 state
``S^T [V, K]`` living in a VMEM scratch across chunks (it never goes back to HBM between chunks). Per chunk
(``C = 64``, sub-tiles of 16 tokens), with ``G`` the in-chunk cumulative log-decay (``exp(G_i - G_j)`` is
never factored as ``exp(G_i) exp(-G_j)``):

* ``A_kk``, ``A_qk`` are built as matmuls per 16-row tile ``a``: with the reference point ``m_a = G`` at
  the token just before tile ``a`` (0 for the first tile),
  ``A[i, j] = sum_d (x_i e^{G_i - m_a})[d] (k_j e^{m_a - G_j})[d]``. For ``j`` in earlier tiles both
  exponents are ``<= 0``; for ``j`` inside tile ``a`` the second is ``<= 16 * 5 = 80 < 88`` (log of fp32
  max) thanks to the lower-bounded gate ``g >= -5``; columns past tile ``a`` are clamped at 80 before
  ``exp`` and masked afterwards. **The kernels therefore require g >= -5** (K3's ``kda_gate``; fla's
  ``safe_gate=True, lower_bound=-5``); the reference has no such restriction.
* ``(I + diag(beta) A_kk)^-1`` by doubling (``reference.unit_lower_inverse``, 10 matmuls of 64^3).
* ``W = X (beta e^G K)``, ``U = X (beta V)``, ``V~ = U - W S``, ``O = (q e^G) S + A_qk V~``,
  ``S' = diag(e^{G_C}) S + (e^{G_C - G} K)^T V~`` - with the document masks for packed sequences.

Matmul precision: fp32 inputs use ``Precision.HIGHEST`` everywhere; bf16 inputs feed the MXU in bf16 with
fp32 accumulation for the ``A``/``U``/``W``/state products (as fla does), while the decay factors, the
inverse and the state stay fp32.

Decode step, grid ``(B, H / hb)``: one token per sequence; the state pool ``[P, H, K, V] f32`` is indexed
by a scalar-prefetched slot per sequence and updated in place (``input_output_aliases``). Its cost estimate (what
XLA's cost analysis counts for it) is the ``B`` states read and written plus the token's vectors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.forward_only import forward_only
from pallas_kernels.kda import _layout
from pallas_kernels.kda import reference as ref

HIGHEST = jax.lax.Precision.HIGHEST
SUB = 16  # sub-tile (tokens) for the factored decay products
EXP_CLAMP = 80.0  # max exponent that valid in-tile entries can reach with g >= -5 over 16 tokens

NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _mm(a, b, dims, dtype):
    """Matmul with fp32 accumulation; operands cast to ``dtype`` (HIGHEST precision when fp32)."""
    prec = HIGHEST if dtype == jnp.float32 else None
    return jax.lax.dot_general(
        a.astype(dtype), b.astype(dtype), dims, precision=prec, preferred_element_type=jnp.float32
    )


def _chunk_fwd_kernel(
    q_ref, k_ref, v_ref, gam_ref, beta_ref, segc_ref, segr_ref, h0_ref,  # inputs
    o_ref, ht_ref,  # outputs
    s_scr, akk_scr, aqk_scr,  # scratch
    *, scale: float, mm_dtype,
):
    c = pl.program_id(1)
    C, K = k_ref.shape
    f32 = jnp.float32

    @pl.when(c == 0)
    def _():
        s_scr[...] = h0_ref[...]

    st = s_scr[...]  # [V, K] f32 (state transposed)
    k = k_ref[...].astype(f32)
    gam = gam_ref[...]  # [C, K] f32
    segc = segc_ref[...]  # [C, 1] i32
    segr = segr_ref[...]  # [1, C] i32
    beta = beta_ref[...]  # [C, 1] f32

    # --- A_kk (strict) and A_qk (inclusive), 16-row tiles, factored at the token before each tile.
    for a in range(C // SUB):
        rows = pl.ds(a * SUB, SUB)
        ga = gam_ref[rows, :]
        if a == 0:
            m = jnp.zeros((1, K), f32)
        else:
            m = gam_ref[pl.ds(a * SUB - 1, 1), :]
        left = jnp.exp(ga - m)  # <= 1
        right = k * jnp.exp(jnp.minimum(m - gam, EXP_CLAMP))  # [C, K]
        akk_scr[rows, :] = _mm(k_ref[rows, :].astype(f32) * left, right, NT, mm_dtype)
        aqk_scr[rows, :] = _mm(q_ref[rows, :].astype(f32) * (left * scale), right, NT, mm_dtype)

    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    same = segc == segr  # [C, C]
    akk = jnp.where((row > col) & same, akk_scr[...], 0.0)
    aqk = jnp.where((row >= col) & same, aqk_scr[...], 0.0)

    # --- UT transform: X = (I + diag(beta) A_kk)^-1 (fp32), W = X (beta e^G K), U = X (beta V).
    x = ref.unit_lower_inverse(beta * akk, C, lambda a_, b_: _mm(a_, b_, NN, f32))
    carry = segc == 0  # [C, 1]: tokens still in the document that entered with the state
    eg = jnp.where(carry, jnp.exp(gam), 0.0)  # [C, K]
    w = _mm(x, beta * eg * k, NN, f32)  # [C, K]
    u = _mm(x, beta * v_ref[...].astype(f32), NN, mm_dtype)  # [C, V]

    # --- state-dependent part.
    vt = u - _mm(w, st, NT, mm_dtype)  # [C, V] pseudo-values
    o = _mm(q_ref[...].astype(f32) * (eg * scale), st, NT, mm_dtype) + _mm(aqk, vt, NN, mm_dtype)
    o_ref[...] = o.astype(o_ref.dtype)

    glast = gam_ref[pl.ds(C - 1, 1), :]  # [1, K]
    seglast = segc_ref[pl.ds(C - 1, 1), :]  # [1, 1]
    kdec = jnp.where(segc == seglast, k * jnp.exp(glast - gam), 0.0)  # [C, K]
    dlast = jnp.where(seglast == 0, jnp.exp(glast), 0.0)  # [1, K]
    st_new = st * dlast + _mm(vt, kdec, TN, mm_dtype)  # [V, K]
    s_scr[...] = st_new

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        ht_ref[...] = st_new


def chunk_kda_fwd(
    q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, chunk_size: int = 64,
    interpret=False,
):
    """Chunked KDA forward on TPU. Args as :func:`pallas_kernels.kda.reference.chunk_kda` (``g >= -5``).

    Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32)``. ``interpret`` may be ``True``
    or a ``pltpu.InterpretParams`` (runs the kernel on CPU).
    """
    _layout.check_chunk_args(q, k, v, g, beta, initial_state, segment_ids, chunk_size, "tpu.chunk_kda_fwd")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if C & (C - 1):
        raise ValueError(f"tpu.chunk_kda_fwd: chunk_size must be a power of two, got {C}")
    x = _layout.prepare_chunk_inputs(q, k, v, g, beta, initial_state, segment_ids, C)
    BH, Tp = B * H, x.q.shape[1]
    N = Tp // C
    mm_dtype = jnp.float32 if jnp.promote_types(q.dtype, v.dtype) == jnp.float32 else jnp.bfloat16
    if interpret is True:
        interpret = pltpu.InterpretParams()

    tok = lambda d: pl.BlockSpec((None, C, d), lambda bh, c: (bh, c, 0))
    per_b = pl.BlockSpec((None, C, 1), lambda bh, c: (jax.lax.div(bh, H), c, 0))
    per_b_row = pl.BlockSpec((None, None, 1, C), lambda bh, c: (jax.lax.div(bh, H), c, 0, 0))
    state = pl.BlockSpec((None, V, K), lambda bh, c: (bh, 0, 0))
    kernel = functools.partial(_chunk_fwd_kernel, scale=float(scale), mm_dtype=mm_dtype)
    o, ht = pl.pallas_call(
        kernel,
        grid=(BH, N),
        in_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), per_b, per_b_row, state],
        out_specs=[tok(V), state],
        out_shape=[
            jax.ShapeDtypeStruct((BH, Tp, V), v.dtype),
            jax.ShapeDtypeStruct((BH, V, K), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((V, K), jnp.float32),
            pltpu.VMEM((C, C), jnp.float32),
            pltpu.VMEM((C, C), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_fwd",
    )(x.q, x.k, x.v, x.gam, x.beta, x.seg_col, x.seg_row, x.h0t)
    return _layout.finish_chunk_outputs(o, ht, B, T, H)


# ------------------------------------------------------------------------------------------------------
# Decode: one token per sequence, state pool updated in place.
# ------------------------------------------------------------------------------------------------------


def _row_to_col(row, n: int):
    """``[1, n] -> [n, 1]`` without a transpose: mask the broadcast with the identity and reduce lanes."""
    r = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(r == c, row, 0.0), axis=1, keepdims=True)


def decode_update(s, q, k, v, g, beta, scale: float):
    """One token's recurrent KDA update of one head inside a Mosaic TPU kernel (the decode step's arithmetic, shared
    by :func:`decode_step` and the verify kernel, :mod:`pallas_kernels.kda.verify_tpu`).

    ``s [K, V]`` f32 state; ``q, k, g [1, K]``, ``v [1, V]``, ``beta [1, 1]`` (any float dtype, computed in f32).
    Returns ``(o [1, V] f32, s' [K, V] f32)``: ``s' = diag(e^g) s + (beta k)^T (v - k diag(e^g) s)``,
    ``o = scale q s'``.
    """
    f32 = jnp.float32
    K = s.shape[0]
    k = k.astype(f32)
    s = s * _row_to_col(jnp.exp(g.astype(f32)), K)
    pred = jax.lax.dot_general(k, s, NN, precision=HIGHEST, preferred_element_type=f32)  # [1, V]
    s = s + _row_to_col(beta.astype(f32) * k, K) * (v.astype(f32) - pred)
    o = jax.lax.dot_general(q.astype(f32) * scale, s, NN, precision=HIGHEST, preferred_element_type=f32)
    return o, s


def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref, o_ref, pool_out_ref, *, scale):
    del slots_ref  # used by the index maps only
    for h in range(q_ref.shape[0]):
        one = pl.ds(h, 1)
        o, s = decode_update(pool_in_ref[h], q_ref[one, :], k_ref[one, :], v_ref[one, :], g_ref[one, :],
                             beta_ref[one, :], scale)
        o_ref[one, :] = o.astype(o_ref.dtype)
        pool_out_ref[h] = s


def decode_step(q, k, v, g, beta, scale: float, state_pool, state_slots, heads_per_block: int = 8,
                interpret=False):
    """One recurrent KDA step for a batch of sequences, in place on a state pool.

    Args:
      q, k, g: ``[B, H, K]``; v: ``[B, H, V]``; beta: ``[B, H]``.
      state_pool: ``[P, H, K, V] f32``; state_slots: ``[B] i32`` (row of the pool for each sequence; slots
        must be distinct).
    Returns ``(o [B, H, V] in v.dtype, new_pool [P, H, K, V] f32)`` (the pool buffer is aliased: donate it).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    hb = heads_per_block if H % heads_per_block == 0 else H
    if interpret is True:
        interpret = pltpu.InterpretParams()
    hspec = lambda d: pl.BlockSpec((None, hb, d), lambda b, h, slots: (b, h, 0))
    pool_spec = pl.BlockSpec((None, hb, K, V), lambda b, h, slots: (slots[b], h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, H // hb),
        in_specs=[hspec(K), hspec(K), hspec(V), hspec(K), hspec(1), pool_spec],
        out_specs=[hspec(V), pool_spec],
    )
    size = lambda a: a.size * a.dtype.itemsize
    cost = pl.CostEstimate(  # the B sequences' states read and written (not the whole pool), the token's vectors
        flops=6 * B * H * K * V, transcendentals=B * H * K,
        bytes_accessed=2 * B * H * K * V * 4 + sum(size(a) for a in (q, k, v, g, beta, state_slots)) + size(v))
    o, pool = forward_only(pl.pallas_call(
        functools.partial(_decode_kernel, scale=float(scale)),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((B, H, V), v.dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        cost_estimate=cost,
        name="kda_decode",
    ), state_slots.astype(jnp.int32), q, k, v, g, beta[..., None], state_pool.astype(jnp.float32),
        name="kda.tpu.decode_step")
    return o, pool
