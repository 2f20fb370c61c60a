"""KDA chunk forward, part 1 of 2 on Mosaic GPU (sm_90): everything of a chunk that does not depend on the carried
state, one CTA (one warpgroup) per ``(chunk, head, sequence)``, all chunks in parallel.

Per chunk of 64 tokens (TMA loads of ``q, k, g, beta``; every product on wgmma, bf16 operands, fp32 accumulation):

* ``G = L g``: the chunk-local cumulative log-decay as a product with the lower-triangular ones matrix; ``g`` is
  split into two bf16 terms, ``g_hi + g_lo``, so ``G`` is exact to ~2^-17 relative.
* The 16-token tiles of ``A_kk`` and ``A_qk`` with factored decay (the K3 gate bound ``g >= -5``): column tile
  ``b`` takes the reference point ``m_b = G`` at the token before the tile, rows ``k_i e^{G_i - m_b}`` (exponent
  ``<= 0``) meet columns ``k_j e^{m_b - G_j}`` (exponent ``<= 80``) in one ``[64, 128] x [128, 16]`` product each.
  The row operand is ``k e^{G - M}`` (``M`` = the row's own tile reference) times ``e^{m_a - m_b} <= 1``.
* ``X = (I + diag(beta) A_kk)^-1`` by the Neumann product ``(I - N)(I + N^2)(I + N^4)...(I + N^32)`` (the running
  product in fp32), then ``X' = X diag(beta)`` and ``-W = -X' (e^G k)``.

Outputs (bf16 unless said): ``qg = q e^G scale``, ``kd = e^{G_C - G} k``, ``wn = -W`` (each ``[B, Tp, H, 128]``),
``x = X'`` and ``aqk`` = the causal ``A_qk`` (each ``[B, Tp, H, 64]``: row ``t`` holds token ``t``'s row of its
chunk), ``decay = e^{G_C}`` ``[B, H, Tp / 64, 128]`` fp32 (``G_C`` = the chunk's last ``G``). With ``U = X' v``,
:mod:`.mosaic_gpu_state` runs ``V~ = U + W S``-style recurrences from these (``v`` itself is read there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, HEAD_DIM, SUB, bcast_cols, bcast_rows, mma, tiled

NEUMANN_STEPS = 5
"""``(I + N)^-1 = (I - N)(I + N^2)...(I + N^32)`` for a strictly lower ``64 x 64`` N: five multiply steps."""
HALF = HEAD_DIM // 2


@dataclasses.dataclass(frozen=True)
class _Smem:
    """Shared memory of one CTA. Reuse, in order: ``w``: ``g_hi`` -> column operand of ``A`` -> ``e^G k`` -> ``-W``;
    ``x``, ``aqk``: the two column halves of ``g_lo``, then ``x``: the Neumann powers -> ``X'``, ``aqk``: masked
    ``A_qk``; ``g``: ``g`` -> ``G``; ``q``: ``q`` -> ``qg``; ``k``: ``k`` -> ``kd``."""

    q: object  # [64, 128] bf16
    k: object  # [64, 128] bf16
    w: object  # [64, 128] bf16
    x: object  # [64, 64] bf16
    aqk: object  # [64, 64] bf16
    g: object  # [64, 128] f32
    beta: object  # [64] f32
    decay: object  # [128] f32


def _cumulative_gate(s: _Smem, stage):
    """``G = L (g_hi + g_lo)`` into ``s.g``; returns ``G`` ``[64, 128]`` f32 (WGMMA layout)."""
    wg = plgpu.Layout.WGMMA
    r64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wg)
    c64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wg)
    ones_lower = jnp.where(c64 <= r64, 1.0, 0.0).astype(BF16)
    halves = (slice(0, HALF), slice(HALF, HEAD_DIM))
    for i, lo_ref in enumerate((s.x, s.aqk)):
        gi = plgpu.layout_cast(s.g[:, halves[i]], wg)
        hi = gi.astype(BF16)
        s.w[:, halves[i]] = hi
        lo_ref[...] = (gi - hi.astype(F32)).astype(BF16)
    plgpu.commit_smem()

    def cumsum(acc):
        for i, lo_ref in enumerate((s.x, s.aqk)):
            mma(acc.at[:, halves[i]], ones_lower, s.w.at[:, halves[i]], stage)
            mma(acc.at[:, halves[i]], ones_lower, lo_ref, stage)
        return acc[...]

    gc = pl.run_scoped(cumsum, plgpu.ACC((CHUNK, HEAD_DIM), F32))
    s.g[...] = gc
    return gc


def _decayed_products(s: _Smem, gc, stage, scale: float):
    """The causal 16-token tiles of ``A_kk`` and ``A_qk`` (``[64, 64]`` f32 each) and ``G_C`` (``[128]``)."""
    wg = plgpu.Layout.WGMMA
    tile = plgpu.broadcasted_iota(jnp.int32, (CHUNK, HEAD_DIM), 0, layout=wg) // SUB
    g_rows = plgpu.broadcasted_iota(jnp.int32, (CHUNK, HEAD_DIM), 0, layout=wg)
    row_of = lambda i: jnp.sum(jnp.where(g_rows == i, gc, 0.0), axis=0)  # G[i] as a [128] vector
    m = [None] + [row_of(SUB * a - 1) for a in range(1, CHUNK // SUB)]
    g_last = row_of(CHUNK - 1)
    m_row = jnp.zeros((CHUNK, HEAD_DIM), F32)
    for a in range(1, CHUNK // SUB):
        m_row = jnp.where(tile == a, bcast_cols(m[a]), m_row)
    kf = plgpu.layout_cast(s.k[...], wg).astype(F32)
    qf = plgpu.layout_cast(s.q[...], wg).astype(F32)
    s.w[...] = (kf * jnp.exp(m_row - gc)).astype(BF16)  # column operand of A
    base = jnp.exp(gc - m_row)
    k_rows = (kf * base).astype(BF16)
    q_rows = (qf * (base * scale)).astype(BF16)
    plgpu.commit_smem()

    def tile_factor(b):
        """Rows of tile ``a``: ``e^{m_a - m_b}`` for ``a > b``, 1 for ``a = b``, 0 above (masked anyway)."""
        f = jnp.where(tile == b, 1.0, 0.0)
        for a in range(b + 1, CHUNK // SUB):
            ratio = jnp.exp(m[a]) if b == 0 else jnp.exp(m[a] - m[b])
            f = jnp.where(tile == a, bcast_cols(ratio), f)
        return f.astype(BF16)

    def products(rows16):
        def run(acc):
            for b in range(CHUNK // SUB):
                cols = s.w.at[SUB * b:SUB * (b + 1)].T
                mma(acc.at[:, SUB * b:SUB * (b + 1)], rows16 * tile_factor(b), cols, stage)
            return acc[...]

        return pl.run_scoped(run, plgpu.ACC((CHUNK, CHUNK), F32))

    return products(k_rows), products(q_rows), g_last


def _neumann_step(x16, p16, p_ref, stage, *, last: bool):
    """``(x P, P P)`` with ``P`` in ``p_ref`` (and as ``p16``); the last step skips the square."""

    def run(acc_x, acc_p):
        mma(acc_x, x16, p_ref, stage)
        if not last:
            mma(acc_p, p16, p_ref, stage)
        return acc_x[...], acc_p[...]

    return run


def _inverse(n, xs, stage):
    """``(I + n)^-1`` for strictly lower ``n`` ``[64, 64]`` f32 (``xs``: a ``[64, 64]`` bf16 scratch)."""
    wg = plgpu.Layout.WGMMA
    r64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wg)
    c64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wg)
    x = jnp.where(r64 == c64, 1.0, 0.0) - n
    n16 = n.astype(BF16)
    xs[...] = n16
    plgpu.commit_smem()

    def square(acc):
        mma(acc, n16, xs, stage)
        return acc[...]

    p = pl.run_scoped(square, plgpu.ACC((CHUNK, CHUNK), F32))
    for step in range(NEUMANN_STEPS):
        p16 = p.astype(BF16)
        xs[...] = p16
        plgpu.commit_smem()
        dx, p = pl.run_scoped(
            _neumann_step(x.astype(BF16), p16, xs, stage, last=step == NEUMANN_STEPS - 1),
            plgpu.ACC((CHUNK, CHUNK), F32), plgpu.ACC((CHUNK, CHUNK), F32))
        x = x + dx
    return x


def _chunk(s: _Smem, stage, scale: float):
    """One chunk, in place in ``s`` (module docstring; :class:`_Smem` for what each buffer ends as)."""
    wg = plgpu.Layout.WGMMA
    r64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wg)
    c64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wg)
    gc = _cumulative_gate(s, stage)
    akk, aqk, g_last = _decayed_products(s, gc, stage, scale)
    s.decay[...] = jnp.exp(g_last)
    beta_row = plgpu.layout_cast(s.beta[...], wg.reduce(1))
    n = jnp.where(r64 > c64, akk * bcast_rows(beta_row, CHUNK), 0.0)
    s.aqk[...] = jnp.where(r64 >= c64, aqk, 0.0).astype(BF16)

    gc = plgpu.layout_cast(s.g[...], wg)
    e_g = jnp.exp(gc)
    kf = plgpu.layout_cast(s.k[...], wg).astype(F32)
    s.k[...] = (kf * jnp.exp(bcast_cols(g_last) - gc)).astype(BF16)
    s.w[...] = (kf * e_g).astype(BF16)
    qf = plgpu.layout_cast(s.q[...], wg).astype(F32)
    s.q[...] = (qf * (e_g * scale)).astype(BF16)
    plgpu.commit_smem()

    x = _inverse(n, s.x, stage)
    beta_col = plgpu.layout_cast(s.beta[...], wg.reduce(0))
    x16 = (x * bcast_cols(beta_col)).astype(BF16)  # X' = X diag(beta)
    s.x[...] = x16

    def solve_w(acc):
        mma(acc, x16, s.w, stage)
        return acc[...]

    wm = pl.run_scoped(solve_w, plgpu.ACC((CHUNK, HEAD_DIM), F32))
    s.w[...] = (-wm).astype(BF16)
    plgpu.commit_smem()


def intra_chunks(q, k, g, beta_t, *, scale: float, interpret=None):
    """Part 1 (module docstring). ``q, k [B, Tp, H, 128]`` bf16, ``g [B, Tp, H, 128]`` f32 (``Tp`` a multiple of
    64), ``beta_t [B, H, Tp]`` f32. Returns ``(qg, kd, wn, x, aqk, decay)``. ``interpret``: None or a
    ``plgpu.InterpretGPUParams``."""
    B, Tp, H, K = q.shape
    n_chunks = Tp // CHUNK
    smem = _Smem(
        q=plgpu.SMEM((CHUNK, K), BF16, transforms=tiled()),
        k=plgpu.SMEM((CHUNK, K), BF16, transforms=tiled()),
        w=plgpu.SMEM((CHUNK, K), BF16, transforms=tiled()),
        x=plgpu.SMEM((CHUNK, CHUNK), BF16, transforms=tiled()),
        aqk=plgpu.SMEM((CHUNK, CHUNK), BF16, transforms=tiled()),
        g=plgpu.SMEM((CHUNK, K), F32, transforms=tiled(F32)),
        beta=plgpu.SMEM((CHUNK,), F32),
        decay=plgpu.SMEM((K,), F32),
    )
    stages = ()
    if interpret is not None:
        stages = (plgpu.SMEM((CHUNK, CHUNK), BF16, transforms=tiled()),
                  plgpu.SMEM((CHUNK, K), BF16, transforms=tiled()))

    def kda_chunk_intra_mosaic_gpu(q_ref, k_ref, g_ref, beta_ref, qg_ref, kd_ref, wn_ref, x_ref, aqk_ref,
                                   decay_ref, s_refs, loaded, stage_refs):
        s = _Smem(*s_refs)
        c, h, b = lax.axis_index("c"), lax.axis_index("h"), lax.axis_index("b")
        rows = pl.ds(c * CHUNK, CHUNK)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], s.q, loaded)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], s.k, loaded)
        plgpu.copy_gmem_to_smem(g_ref.at[b, rows, h], s.g, loaded)
        plgpu.copy_gmem_to_smem(beta_ref.at[b, h, rows], s.beta, loaded)
        plgpu.barrier_wait(loaded)
        stage = None if interpret is None else {CHUNK: stage_refs[0], HEAD_DIM: stage_refs[1]}
        _chunk(s, stage, scale)
        for src, dst in ((s.q, qg_ref), (s.k, kd_ref), (s.w, wn_ref), (s.x, x_ref), (s.aqk, aqk_ref)):
            plgpu.copy_smem_to_gmem(src, dst.at[b, rows, h])
        plgpu.copy_smem_to_gmem(s.decay, decay_ref.at[b, h, c])
        plgpu.wait_smem_to_gmem(0)

    tok = lambda d: jax.ShapeDtypeStruct((B, Tp, H, d), BF16)
    return plgpu.kernel(
        kda_chunk_intra_mosaic_gpu,
        out_type=(tok(K), tok(K), tok(K), tok(CHUNK), tok(CHUNK), jax.ShapeDtypeStruct((B, H, n_chunks, K), F32)),
        scratch_types=(tuple(getattr(smem, f.name) for f in dataclasses.fields(smem)), plgpu.Barrier(num_arrivals=4),
                       stages),
        grid=(n_chunks, H, B),
        grid_names=("c", "h", "b"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(q, k, g, beta_t)


def intra_chunks_reference(q, k, g, beta_t, *, scale: float):
    """Plain-JAX fp32 (``precision=HIGHEST``) reference of :func:`intra_chunks`: the same six outputs in the same
    dtypes and layouts, exact (pairwise decay ``e^{G_i - G_j}`` per key, a direct triangular solve; memory
    ``O(T C K)``: small shapes only)."""
    B, Tp, H, K = q.shape
    n = Tp // CHUNK
    hp = jax.lax.Precision.HIGHEST
    split = lambda x: jnp.moveaxis(x.astype(F32).reshape(B, n, CHUNK, H, -1), 3, 1)  # [B, H, n, C, D]
    qc, kc, gc = split(q), split(k), jnp.cumsum(split(g), axis=3)
    beta = beta_t.astype(F32).reshape(B, H, n, CHUNK)
    g_last = gc[..., -1:, :]
    causal = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    diff = jnp.where(causal[:, :, None], gc[..., :, None, :] - gc[..., None, :, :], -jnp.inf)  # [.., i, j, K]
    pair = lambda a: jnp.einsum("...id,...jd,...ijd->...ij", a, kc, jnp.exp(diff), precision=hp)
    akk = jnp.where(jnp.eye(CHUNK, dtype=bool), 0.0, pair(kc))
    aqk = scale * pair(qc)
    eye = jnp.eye(CHUNK, dtype=F32)
    x = jax.scipy.linalg.solve_triangular(eye + beta[..., :, None] * akk, jnp.broadcast_to(eye, akk.shape),
                                          lower=True) * beta[..., None, :]
    wn = -jnp.einsum("...ij,...jd->...id", x, kc * jnp.exp(gc), precision=hp)
    merge = lambda t: jnp.moveaxis(t, 1, 3).reshape(B, Tp, H, -1).astype(BF16)
    return (merge(qc * jnp.exp(gc) * scale), merge(kc * jnp.exp(g_last - gc)), merge(wn), merge(x), merge(aqk),
            jnp.exp(g_last[..., 0, :]))
