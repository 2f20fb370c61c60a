"""KDA chunk backward on Mosaic GPU (sm_90): each chunk's state-independent forward recomputed and differentiated,
one CTA (one warpgroup) per ``(chunk, sequence * H + head)``, all chunks in parallel. From the cotangents of the
per-chunk tensors (:mod:`.mosaic_gpu_bwd_chunk`) to ``dq, dk, dg, dbeta``.

Recomputed as :mod:`.mosaic_gpu_intra` does (its helpers): ``G`` (exact sums of ``g`` through the split ``ghi +
glo``), ``A_kk`` (factored decay on 16-token tiles; ``w = k e^{m - G}`` its column operand), ``X`` (Neumann product),
``X' = X diag(beta)``, ``Ek = k e^G``. Then, with ``D*`` the cotangents of ``qg, kd, wn, x, aqk, decay``:

1. (all of K) ``dX' = tril(Dx - Dwn Ek^T)``; ``dbeta += colsum(X * dX')``; ``dX = dX' diag(beta)``;
   ``dL = -strict(X^T dX X^T)``; ``dbeta += rowsum(dL * A_kk)``; ``dA_kk = diag(beta) dL``.
2. (per half of K) the decay products differentiated on the tiles. Column tile ``b`` with reference point ``m_b``
   (``G`` before the tile): rows ``R_x = sum_b e^{G - m_b} (dA_x[:, b] w_b)`` (``x`` = ``k`` with ``dA_kk``,
   ``q scale`` with ``dA_qk``; as ``[64, 64] x [64, 64]`` products with the other tiles' columns of ``dA_x``
   zeroed: wgmma contracts at least 64), columns ``C = e^{m - G} sum_b rows_b(dA_kk^T (k e^{G - m_b}) + dA_qk^T
   (q scale e^{G - m_b}))``; ``dEk = -X'^T Dwn``. Then ``dq = Dqg e^G scale + scale R_q``, ``dk = Dkd e^{G_C - G}
   + dEk e^G + R_k + C``, ``dG = Dqg qg - Dkd kd + dEk Ek + k R_k + q scale R_q - k C``, ``dG_C = colsum(Dkd kd)
   + Ddecay e^{G_C}`` and ``dg = suffix-sum(dG) + dG_C`` (a product with a ``[64, 64]`` 0/1 selector, ``dG`` split
   in two bf16 terms).

Precision: the diagonal of ``dA_qk`` is taken out of the products and applied in fp32 (its two sides of ``dG``
cancel exactly); each side of ``dG`` from the decay products is formed with the same bf16-rounded factors
(``x e^{G - m_b}`` and ``w``), so a pair's two terms, which cancel in the suffix sums, cancel to fp32 accumulation
error (with plain bf16 operands ``dg`` was 4% off the fp32 VJP at ``T = 128``, with the diagonal alone 0.8%).

Every product on wgmma (bf16 operands, fp32 accumulation). Every copy between device and shared memory has one
integer index: token tensors as ``[B * Tp, H, D]`` views, ``beta`` and ``dbeta`` as ``[B * H, Tp]``, ``Ddecay`` as
``[B * H * n_chunks, 128]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import mosaic_gpu_intra as intra
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, HEAD_DIM, SUB, bcast_cols, bcast_rows, mma, tiled

HALF = HEAD_DIM // 2
HALVES = intra.HALVES
TILES = CHUNK // SUB


@dataclasses.dataclass(frozen=True)
class _Smem:
    """Shared memory of one CTA (aliases: ``g`` -> ``st_dq`` / ``st_dk`` (f32 scratch: ``A_kk`` / ``X`` in phase 1,
    ``dq`` / ``R_k`` in phase 2); ``xf`` (X) and ``dx`` -> ``st_dg`` (``dG``, then ``dg``); ``ek`` -> ``xe_k`` /
    ``xe_q`` (the tiles' row operands, then the bf16 ``dk`` / ``dq``); ``dakk_t`` first holds ``Dx``; ``ghi`` /
    ``glo`` halves -> ``dG``'s two terms)."""

    q: object  # [64, 128] bf16
    k: object  # [64, 128] bf16
    ghi: object  # [64, 128] bf16
    glo: object  # [64, 128] bf16
    w: object  # [64, 128] bf16: k e^{m - G}
    xp: object  # [64, 64] bf16: X', first the Neumann scratch
    dakk_t: object  # [64, 64] bf16: Dx, then dA_kk^T
    daqk_t: object  # [64, 64] bf16: dA_qk^T
    dqg: object  # [64, 128] bf16
    dkd: object  # [64, 128] bf16
    dwn: object  # [64, 128] bf16
    beta: object  # [64] f32
    ddecay: object  # [128] f32
    dbeta_row: object  # [64] f32
    dbeta_col: object  # [64] f32
    daqk_diag: object  # [64] f32: the diagonal of dA_qk (taken out of daqk_t)
    g: object  # [64, 128] f32 (aliased)
    st_dq: object  # [64, 64] f32 scratch (aliases g)
    st_dk: object  # [64, 64] f32 scratch (aliases g)
    xf: object  # [64, 64] bf16: X (aliased)
    dx: object  # [64, 64] bf16: dX (aliased)
    st_dg: object  # [64, 64] f32 (aliases xf, dx)
    ek: object  # [64, 128] bf16: e^G k (aliased)
    xe_k: object  # [64, 64] bf16 (aliases ek)
    xe_q: object  # [64, 64] bf16 (aliases ek)


def _iota(dim: int, width: int = CHUNK):
    return plgpu.broadcasted_iota(jnp.int32, (CHUNK, width), dim, layout=plgpu.Layout.WGMMA)


def _suffix():
    """``[64, 64]`` bf16 ``U[t, i] = 1 if i >= t``: ``U dG`` = the suffix sums of ``dG``."""
    return jnp.where(_iota(1) >= _iota(0), 1.0, 0.0).astype(BF16)


def _run(products, *shapes):
    """Accumulators of ``shapes`` (zero), ``products(*accs)``, their values."""

    def run(*accs):
        products(*accs)
        return tuple(a[...] for a in accs)

    return pl.run_scoped(run, *(plgpu.ACC(s, F32) for s in shapes))


def _wy_cotangents(s: _Smem, stage):
    """Phase 1 (module docstring): writes ``dA_kk^T`` and both ``dbeta`` parts to shared memory. ``A_kk`` and ``X``
    wait in the (then unused) ``dq`` / ``dk`` staging buffers instead of registers."""
    wg = plgpu.Layout.WGMMA
    r64, c64 = _iota(0), _iota(1)
    staged = lambda ref: plgpu.layout_cast(ref[...], wg)
    intra._split_gate(s)  # the last read of s.g, which st_dq / st_dk alias
    akk, _ = intra._decayed_products(s, stage, 1.0, with_qk=False)  # writes s.w
    s.st_dq[...] = akk
    beta_row = lambda: bcast_rows(plgpu.layout_cast(s.beta[...], wg.reduce(1)), CHUNK)
    beta_col = lambda: bcast_cols(plgpu.layout_cast(s.beta[...], wg.reduce(0)), CHUNK)
    x = intra._inverse(jnp.where(r64 > c64, akk * beta_row(), 0.0), s.xp, stage)
    s.st_dk[...] = x
    s.xf[...] = x.astype(BF16)
    s.xp[...] = (x * beta_col()).astype(BF16)
    sel_cum = intra._selector("cum")
    for cols in HALVES:
        s.ek[:, cols] = (intra._load(s.k, cols) * jnp.exp(intra._prefix(s, sel_cum, cols, stage))).astype(BF16)
    plgpu.commit_smem()
    dx_in = plgpu.layout_cast(s.dakk_t[...], wg).astype(F32)
    (dwe,) = _run(lambda acc: plgpu.wgmma(acc, s.dwn, s.ek.T), (CHUNK, CHUNK))
    dxp = jnp.where(r64 >= c64, dx_in - dwe, 0.0)
    s.dbeta_col[...] = jnp.sum(staged(s.st_dk) * dxp, axis=0)
    s.dx[...] = (dxp * beta_col()).astype(BF16)
    plgpu.commit_smem()
    (t1,) = _run(lambda acc: plgpu.wgmma(acc, s.xf.T, s.dx), (CHUNK, CHUNK))
    (t2,) = _run(lambda acc: mma(acc, t1.astype(BF16), s.xf.T, stage), (CHUNK, CHUNK))
    dl = jnp.where(r64 > c64, -t2, 0.0)
    s.dbeta_row[...] = jnp.sum(dl * staged(s.st_dq), axis=1)
    s.dakk_t.T[...] = (dl * beta_row()).astype(BF16)
    daqk_t = plgpu.layout_cast(s.daqk_t[...], wg).astype(F32)
    s.daqk_diag[...] = jnp.sum(jnp.where(r64 == c64, daqk_t, 0.0), axis=1)
    s.daqk_t[...] = jnp.where(r64 == c64, 0.0, daqk_t).astype(BF16)
    plgpu.commit_smem()


def _side(s: _Smem, cols: slice, stage, side: str, scale: float, acc_c):
    """One side of the decay products' VJP on the tiles of the half ``cols`` (module docstring, phase 2): ``side``
    ``"k"`` (``dA_kk`` with ``k``) or ``"q"`` (``dA_qk`` with ``q scale``). Returns ``(R, the side's decay-product
    terms of dG)`` (``[64, 64]`` f32) and adds the side's rows of ``C`` (before ``e^{m - G}``) to ``acc_c``. Only
    the two running sums are live across the tiles; ``dA`` and the row operand are reloaded from shared memory."""
    wg = plgpu.Layout.WGMMA
    r64, c64 = _iota(0), _iota(1)
    a_t, x_s, row = (s.dakk_t, s.xe_k, s.k) if side == "k" else (s.daqk_t, s.xe_q, s.q)
    w_h = s.w.at[:, cols]
    r = dgr = None
    add = lambda acc, x: x if acc is None else acc + x
    for b in range(TILES):
        e_b = jnp.exp(jnp.minimum(intra._prefix(s, intra._selector("row", b), cols, stage), 0.0))
        da = plgpu.layout_cast(a_t.T[...], wg)
        da = jnp.where((c64 >= SUB * b) & (c64 < SUB * (b + 1)), da, jnp.zeros_like(da))  # wgmma contracts >= 64
        (acc,) = _run(lambda acc, da=da: mma(acc, da, w_h, stage), (CHUNK, HALF))
        xf = intra._load(row, cols)
        x16 = ((xf * scale if side == "q" else xf) * e_b).astype(BF16)
        r = add(r, e_b * acc)
        dgr = add(dgr, x16.astype(F32) * acc)
        plgpu.wgmma_wait(0)  # the previous tile's product has read x_s
        x_s[...] = x16
        plgpu.commit_smem()
        da_t = plgpu.layout_cast(a_t[...], wg)
        mma(acc_c, jnp.where((r64 >= SUB * b) & (r64 < SUB * (b + 1)), da_t, jnp.zeros_like(da_t)), x_s, stage)
    return r, dgr


def _half(s: _Smem, h: int, stage, scale: float):
    """Phase 2 for the half ``h`` of K: ``dq, dk`` (``[64, 64]`` bf16) into ``s.xe_q, s.xe_k``, ``dg`` (f32) into
    ``s.st_dg`` (the previous half's copies out of them must have read them). The ``q`` side first (folded into
    ``dq`` at once), then the ``k`` side; ``C`` accumulates over both in one wgmma accumulator; partial sums wait in
    the staging buffers, so that few ``[64, 64]`` f32 values are live at a time (255 registers a thread)."""
    cols = HALVES[h]
    wg = plgpu.Layout.WGMMA
    r64 = _iota(0)
    load = lambda ref: intra._load(ref, cols)
    diag = lambda: bcast_rows(plgpu.layout_cast(s.daqk_diag[...], wg.reduce(1)), HALF)
    e_g = lambda: jnp.exp(intra._prefix(s, intra._selector("cum"), cols, stage))

    def sides(acc_c):
        r_q, dg_q = _side(s, cols, stage, "q", scale, acc_c)
        eg = e_g()
        dqg = load(s.dqg)
        s.st_dq[...] = (dqg * eg + r_q + diag() * load(s.k)) * scale
        s.st_dg[...] = dg_q + dqg * (load(s.q) * scale) * eg
        r_k, dg_k = _side(s, cols, stage, "k", scale, acc_c)
        s.st_dk[...] = r_k
        return dg_k, acc_c[...]

    dg_k, c_raw = pl.run_scoped(sides, plgpu.ACC((CHUNK, HALF), F32))
    staged = lambda ref: plgpu.layout_cast(ref[...], wg)
    s.xe_q[...] = staged(s.st_dq).astype(BF16)
    (dek,) = _run(lambda acc: plgpu.wgmma(acc, s.xp.T, s.dwn.at[:, cols]), (CHUNK, HALF))
    dek = -dek
    eg = e_g()
    kf = load(s.k)
    s.st_dg[...] = staged(s.st_dg) + dg_k + dek * kf * eg  # dG so far (in order: few values live at a time)
    dk = staged(s.st_dk) + dek * eg + diag() * (load(s.q) * scale)
    eg_last = jnp.sum(jnp.where(r64 == CHUNK - 1, eg, 0.0), axis=0)  # e^{G_C}
    kdf = jnp.exp(intra._prefix(s, intra._selector("last"), cols, stage))
    dkd = load(s.dkd)
    dkd_kd = dkd * (kf * kdf)
    dk = dk + dkd * kdf
    dgc = jnp.sum(dkd_kd, axis=0) + plgpu.layout_cast(s.ddecay[cols], wg.reduce(0)) * eg_last
    dG = staged(s.st_dg) - dkd_kd
    dk = dk + c_raw * jnp.exp(intra._prefix(s, intra._selector("col"), cols, stage))
    s.xe_k[...] = dk.astype(BF16)
    # The decay products' two sides of dG with the same rounded factors (x e_b and w = k e^{m - G} as the bf16
    # operands), so that each pair's terms, which cancel in the suffix sums, cancel to fp32 accumulation error.
    dG = dG - load(s.w) * c_raw
    hi = dG.astype(BF16)
    s.ghi[:, cols] = hi
    s.glo[:, cols] = (dG - hi.astype(F32)).astype(BF16)
    plgpu.commit_smem()
    suffix = _suffix()
    (dg,) = _run(lambda acc: (mma(acc, suffix, s.ghi.at[:, cols], stage), mma(acc, suffix, s.glo.at[:, cols], stage)),
                 (CHUNK, HALF))
    s.st_dg[...] = dg + bcast_cols(dgc)


def chunk_intra_grads(q, k, g, beta_t, dqg, dkd, dwn, dx, daqk_t, ddecay, *, scale: float, interpret=None):
    """Phase 1 and 2 (module docstring). ``q, k [B, Tp, H, 128]`` bf16, ``g [B, Tp, H, 128]`` f32, ``beta_t [B, H,
    Tp]`` f32; the cotangents ``dqg, dkd, dwn [B, Tp, H, 128]`` and ``dx, daqk_t [B, Tp, H, 64]`` bf16 (``daqk_t``
    transposed per chunk: row ``t`` holds column ``t`` of the chunk's ``dA_qk``), ``ddecay [B, H, n, 128]`` f32.
    Returns ``(dq, dk [B, Tp, H, 128] bf16, dg [B, Tp, H, 128] f32, dbeta [B, H, Tp] f32)``. ``interpret``: None or a
    ``plgpu.InterpretGPUParams``."""
    B, Tp, H, K = q.shape
    n_chunks = Tp // CHUNK
    buf = lambda d, dt=BF16: plgpu.SMEM((CHUNK, d), dt, transforms=tiled(dt))
    vec = lambda n: plgpu.SMEM((n,), F32)
    fixed = (buf(K), buf(K), buf(K), buf(K), buf(K), buf(CHUNK), buf(CHUNK), buf(CHUNK), buf(K), buf(K), buf(K),
             vec(CHUNK), vec(K), vec(CHUNK), vec(CHUNK), vec(CHUNK))
    smem = (fixed, plgpu.RefUnion((buf(K, F32),), (buf(HALF, F32), buf(HALF, F32))),
            plgpu.RefUnion((buf(CHUNK), buf(CHUNK)), (buf(HALF, F32),)),
            plgpu.RefUnion((buf(K),), (buf(HALF), buf(HALF))))
    stages = ()
    if interpret is not None:
        stages = (buf(CHUNK), buf(K))
    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])

    def kda_chunk_intra_bwd_mosaic_gpu(q_ref, k_ref, g_ref, beta_ref, dqg_ref, dkd_ref, dwn_ref, dx_ref, daqk_ref,
                                       ddecay_ref, dq_ref, dk_ref, dg_ref, dbr_ref, dbc_ref, smem_refs, loaded,
                                       stage_refs):
        fixed_refs, ((g_s,), (st_dq, st_dk)), ((xf, dx_s), (st_dg,)), ((ek,), (xe_k, xe_q)) = smem_refs
        s = _Smem(*fixed_refs, g=g_s, st_dq=st_dq, st_dk=st_dk, xf=xf, dx=dx_s, st_dg=st_dg, ek=ek, xe_k=xe_k,
                  xe_q=xe_q)
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        h = lax.rem(bh, H)
        rows = pl.ds(lax.div(bh, H) * Tp + c * CHUNK, CHUNK)
        for src, dst in ((q_ref, s.q), (k_ref, s.k), (g_ref, s.g), (dqg_ref, s.dqg), (dkd_ref, s.dkd),
                         (dwn_ref, s.dwn), (dx_ref, s.dakk_t), (daqk_ref, s.daqk_t)):
            plgpu.copy_gmem_to_smem(src.at[rows, h], dst, loaded)
        plgpu.copy_gmem_to_smem(beta_ref.at[bh, pl.ds(c * CHUNK, CHUNK)], s.beta, loaded)
        plgpu.copy_gmem_to_smem(ddecay_ref.at[bh * n_chunks + c], s.ddecay, loaded)
        plgpu.barrier_wait(loaded)
        stage = None if interpret is None else {CHUNK: stage_refs[0], HEAD_DIM: stage_refs[1]}
        _wy_cotangents(s, stage)
        plgpu.copy_smem_to_gmem(s.dbeta_row, dbr_ref.at[bh, pl.ds(c * CHUNK, CHUNK)])
        plgpu.copy_smem_to_gmem(s.dbeta_col, dbc_ref.at[bh, pl.ds(c * CHUNK, CHUNK)])
        for half in range(2):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging buffers are free
            _half(s, half, stage, scale)
            plgpu.commit_smem()
            out_cols = pl.ds(half * HALF, HALF)
            for st, dst in ((s.xe_q, dq_ref), (s.xe_k, dk_ref), (s.st_dg, dg_ref)):
                plgpu.copy_smem_to_gmem(st, dst.at[rows, h, out_cols])
        plgpu.wait_smem_to_gmem(0)

    tok = lambda d, dt: jax.ShapeDtypeStruct((B * Tp, H, d), dt)
    vec_out = jax.ShapeDtypeStruct((B * H, Tp), F32)
    dq, dk, dg, dbr, dbc = plgpu.kernel(
        kda_chunk_intra_bwd_mosaic_gpu,
        out_type=(tok(K, BF16), tok(K, BF16), tok(K, F32), vec_out, vec_out),
        scratch_types=(smem, plgpu.Barrier(num_arrivals=10), stages),
        grid=(n_chunks, B * H),
        grid_names=("c", "bh"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*(rows_view(x) for x in (q, k, g)), beta_t.reshape(B * H, Tp),
      *(rows_view(x) for x in (dqg, dkd, dwn, dx, daqk_t)), ddecay.reshape(B * H * n_chunks, K))
    shape = lambda t: t.reshape(B, Tp, H, K)
    return shape(dq), shape(dk), shape(dg), (dbr + dbc).reshape(B, H, Tp)


HP = lax.Precision.HIGHEST


def _ein(eq: str, *xs):
    return jnp.einsum(eq, *xs, precision=HP, preferred_element_type=F32)


def _chunks(x, n: int):
    """``[B, Tp, H, D]`` -> ``[B, H, n, 64, D]``."""
    B, _, H, D = x.shape
    return jnp.moveaxis(x.reshape(B, n, CHUNK, H, D), 3, 1)


def _tokens(x):
    """``[B, H, n, 64, D]`` -> ``[B, n * 64, H, D]``."""
    B, H, n, C, D = x.shape
    return jnp.moveaxis(x, 1, 3).reshape(B, n * C, H, D)


def intra_f32(q, k, g, beta, *, scale: float):
    """The per-chunk tensors of :mod:`.mosaic_gpu_intra` in fp32 (``precision=HIGHEST``), differentiable, memory
    ``O(T K)`` (the decay products on 16-token tiles, :func:`.reference._decay_products`). ``q, k, g [B, Tp, H,
    128]`` f32 (``Tp`` a multiple of 64), ``beta [B, Tp, H]`` f32. Returns ``(qg, kd, wn, x, aqk)`` as ``[B, H, n,
    64, D]`` and ``decay [B, H, n, 128]``."""
    n = q.shape[1] // CHUNK
    qc, kc = _chunks(q, n), _chunks(k, n)
    G = jnp.cumsum(_chunks(g, n), axis=-2)
    bc = _chunks(beta[..., None], n)[..., 0]  # [B, H, n, C]
    g_last = G[..., -1:, :]
    both = ref._decay_products(jnp.stack([kc, qc * scale], axis=-3), kc, G, SUB, strict=False)
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool), -1)
    akk = jnp.where(lower, both[..., 0, :, :], 0.0)
    aqk = both[..., 1, :, :]
    x = ref._unit_lower_inverse(bc[..., :, None] * akk) * bc[..., None, :]
    wn = -_ein("...ij,...jd->...id", x, kc * jnp.exp(G))
    return qc * jnp.exp(G) * scale, kc * jnp.exp(g_last - G), wn, x, aqk, jnp.exp(g_last[..., 0, :])


def chunk_intra_grads_reference(q, k, g, beta_t, dqg, dkd, dwn, dx, daqk_t, ddecay, *, scale: float):
    """Plain-JAX fp32 reference of :func:`chunk_intra_grads` (same arguments and outputs): the VJP of
    :func:`intra_f32` at the given cotangents."""
    f = lambda t: t.astype(F32)
    Tp = q.shape[1]
    n = Tp // CHUNK
    B, H = beta_t.shape[:2]
    daqk = jnp.swapaxes(daqk_t.reshape(B, n, CHUNK, H, CHUNK), 2, 4).reshape(B, Tp, H, CHUNK)
    _, vjp = jax.vjp(lambda *a: intra_f32(*a, scale=scale), f(q), f(k), f(g), jnp.swapaxes(f(beta_t), 1, 2))
    dq, dk, dg, dbeta = vjp((*(_chunks(f(t), n) for t in (dqg, dkd, dwn, dx, daqk)), f(ddecay)))
    return dq, dk, dg, jnp.swapaxes(dbeta, 1, 2)
