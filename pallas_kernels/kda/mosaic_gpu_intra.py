"""KDA chunk forward, part 1 of 2 on Mosaic GPU (sm_90): everything of a chunk that does not depend on the carried
state, one CTA (one warpgroup) per ``(chunk, sequence * H + head)``, all chunks in parallel. Every copy between
device and shared memory has one integer index: the token tensors are read and written as ``[B * Tp, H, D]``
views (rows ``b * Tp + 64 c``), ``beta`` as ``[B * H, Tp]``, ``decay`` as ``[B * H * Tp / 64, 128]``.

Per chunk of 64 tokens (TMA loads of ``q, k, g, beta``; every product on wgmma, bf16 operands, fp32 accumulation):

* Every decay exponent is a difference of chunk-local cumulative sums of ``g``, computed as one product ``S g``
  with a ``[64, 64]`` selector ``S`` of 0 / +-1 (:func:`_selector`) on wgmma; ``g`` is split into two bf16 terms,
  ``g_hi + g_lo``, so each sum is exact to ~2^-17 relative; no per-tile reference vectors are kept in registers.
* The 16-token tiles of ``A_kk`` and ``A_qk`` with factored decay (the K3 gate bound ``g >= -5``): column tile
  ``b`` takes the reference point ``m_b = G`` at the token before the tile; rows ``k_i e^{min(G_i - m_b, 0)}``
  (exact for the rows ``i >= 16 b`` that the causal mask keeps, where ``G_i <= m_b``) meet columns ``k_j e^{m_b - G_j}``
  (exponent ``<= 80``) in ``[64, 64] x [64, 16]`` products over the two halves of K.
* ``X = (I + diag(beta) A_kk)^-1`` by the Neumann product ``(I - N)(I + N^2)(I + N^4)...(I + N^32)`` (the running
  product in fp32), then ``X' = X diag(beta)`` (a product with the bf16 diagonal) and ``-W = -X' (e^G k)``.

Outputs (bf16 unless said): ``qg = q e^G scale``, ``kd = e^{G_C - G} k``, ``wn = -W`` (each ``[B, Tp, H, 128]``),
``x = X'`` and ``aqk`` = the causal ``A_qk`` (each ``[B, Tp, H, 64]``: row ``t`` holds token ``t``'s row of its
chunk), ``decay = e^{G_C}`` ``[B, H, Tp / 64, 128]`` fp32 (``G_C`` = the chunk's last ``G``).
:mod:`.mosaic_gpu_state` carries the state from these and ``v`` (``U = X' v`` is formed there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, HEAD_DIM, SUB, mma, tiled

NEUMANN_STEPS = 5
"""``(I + N)^-1 = (I - N)(I + N^2)...(I + N^32)`` for a strictly lower ``64 x 64`` N: five multiply steps."""
HALF = HEAD_DIM // 2
HALVES = (slice(0, HALF), slice(HALF, HEAD_DIM))
TILES = CHUNK // SUB
TAP_WIDTHS = {
    **{f"p_col{h}": HALF for h in range(2)}, "w_col": HEAD_DIM,
    **{f"{name}{b}_{h}": HALF for b in range(TILES) for h in range(2) for name in ("p_row", "e")},
    "akk": CHUNK, "aqk": CHUNK, "n": CHUNK, "g_full": HEAD_DIM,
    **{f"{name}{h}": HALF for h in range(2) for name in ("p_cum", "p_last")}, "w_eg": HEAD_DIM,
    "x_inv": CHUNK, "xb": CHUNK, "wn": HEAD_DIM,
}
"""Intermediates of one chunk that ``intra_chunks(..., taps=names)`` also writes (name -> columns; 64 rows each,
fp32), in the order the kernel forms them. ``h``: the half of K; ``b``: the column tile. ``p_col``, ``p_row``,
``p_cum``, ``p_last``: the prefix products with the ``"col"``, ``"row"`` (tile ``b``), ``"cum"``, ``"last"``
selectors; ``e`` = ``exp(min(p_row, 0))``; ``w_col``: ``s.w`` after its first write (``k e^{p_col}``); ``akk``,
``aqk``: the tile products before masking; ``n`` = ``N``; ``g_full``: the ``"cum"`` prefix over all of K; ``w_eg``:
``s.w = e^G k``; ``x_inv`` = ``X`` (fp32); ``xb`` = ``X'``; ``wn`` = ``-W``."""
Tap = Callable[[str, jax.Array], None] | None
"""None (production: nothing extra is traced) or ``tap(name, value)`` that records a ``[64, TAP_WIDTHS[name]]``
register value."""


@dataclasses.dataclass(frozen=True)
class _Smem:
    """Shared memory of one CTA. ``g`` (the loaded log-decay) aliases ``w`` and ``x``, which are first written
    after ``g`` was split into ``ghi + glo``. ``w``: the column operand of ``A`` -> ``e^G k`` -> ``-W``; ``x``: the
    Neumann powers -> ``diag(beta)`` -> ``X'``; ``q``: ``q`` -> ``qg``; ``k``: ``k`` -> ``kd``."""

    q: object  # [64, 128] bf16
    k: object  # [64, 128] bf16
    ghi: object  # [64, 128] bf16
    glo: object  # [64, 128] bf16: g - ghi
    aqk: object  # [64, 64] bf16
    beta: object  # [64] f32
    decay: object  # [128] f32
    g: object  # [64, 128] f32 (aliased)
    w: object  # [64, 128] bf16 (aliases g)
    x: object  # [64, 64] bf16 (aliases g)


def _emit(tap: Tap, name: str, value) -> None:
    if tap is not None:
        tap(name, value)


def _read(acc):
    """The value of a wgmma accumulator (waits for every wgmma in flight)."""
    return acc[...]


def _iota(dim: int):
    return plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), dim, layout=plgpu.Layout.WGMMA)


def _ones(cond):
    return jnp.where(cond, 1.0, 0.0)


def _selector(kind: str, b: int = 0):
    """A ``[64, 64]`` bf16 matrix of 0 / +-1 whose product with ``g`` gives a difference of cumulative sums
    (rows ``i``, summed tokens ``t``): ``"col"``: ``m_{tile(i)} - G_i`` (``m_a`` = ``G`` at the token before tile
    ``a``); ``"row"``: ``G_i - m_b``; ``"cum"``: ``G_i``; ``"last"``: ``G_C - G_i``."""
    r, t = _iota(0), _iota(1)
    cum = _ones(t <= r)
    sel = {"col": lambda: _ones(t < SUB * (r // SUB)) - cum, "row": lambda: cum - _ones(t < SUB * b),
           "cum": lambda: cum, "last": lambda: 1.0 - cum}[kind]()
    return sel.astype(BF16)


def _prefix(s: _Smem, sel16, cols: slice, stage):
    """``sel @ (ghi + glo)`` over the columns ``cols``: exact fp32 sums of ``g`` (``[64, width]``)."""
    width = cols.stop - cols.start

    def run(acc):
        mma(acc, sel16, s.ghi.at[:, cols], stage)
        mma(acc, sel16, s.glo.at[:, cols], stage)
        return _read(acc)

    return pl.run_scoped(run, plgpu.ACC((CHUNK, width), F32))


def _split_gate(s: _Smem):
    """``g`` -> ``ghi + glo`` (bf16 each, ``g`` to ~2^-17 relative)."""
    wg = plgpu.Layout.WGMMA
    for cols in HALVES:
        gi = plgpu.layout_cast(s.g[:, cols], wg)
        hi = gi.astype(BF16)
        s.ghi[:, cols] = hi
        s.glo[:, cols] = (gi - hi.astype(F32)).astype(BF16)
    plgpu.commit_smem()


def _load(ref, cols):
    return plgpu.layout_cast(ref[:, cols], plgpu.Layout.WGMMA).astype(F32)


def _column_operand(s: _Smem, stage, tap: Tap = None) -> None:
    """``s.w <- k e^{m_{tile(i)} - G_i}``: the column operand of every ``A`` tile (committed for wgmma)."""
    sel_col = _selector("col")
    for h, cols in enumerate(HALVES):
        kf = _load(s.k, cols)
        p_col = _prefix(s, sel_col, cols, stage)
        _emit(tap, f"p_col{h}", p_col)
        s.w[:, cols] = (kf * jnp.exp(p_col)).astype(BF16)
    plgpu.commit_smem()
    if tap is not None:
        tap("w_col", _load(s.w, slice(0, HEAD_DIM)))


def _decayed_products(s: _Smem, stage, scale: float, tap: Tap = None):
    """The 16-token tiles of ``A_kk`` and ``A_qk`` (``[64, 64]`` f32 each, entries above the diagonal tile
    undefined): column tile ``b`` = ``(k e^{G - m_b}) (k e^{m_b - G})^T`` over the tile's columns."""
    _column_operand(s, stage, tap)

    def run(acc_kk, acc_qk):
        for b in range(TILES):
            sel = _selector("row", b)
            out = slice(SUB * b, SUB * (b + 1))
            for h, cols in enumerate(HALVES):
                p_row = _prefix(s, sel, cols, stage)
                e = jnp.exp(jnp.minimum(p_row, 0.0))  # rows above tile b: masked later
                _emit(tap, f"p_row{b}_{h}", p_row)
                _emit(tap, f"e{b}_{h}", e)
                col_op = s.w.at[out, cols].T
                mma(acc_kk.at[:, out], (_load(s.k, cols) * e).astype(BF16), col_op, stage)
                mma(acc_qk.at[:, out], (_load(s.q, cols) * (e * scale)).astype(BF16), col_op, stage)
        return _read(acc_kk), _read(acc_qk)

    return pl.run_scoped(run, plgpu.ACC((CHUNK, CHUNK), F32), plgpu.ACC((CHUNK, CHUNK), F32))


def _neumann_step(x16, p16, p_ref, stage, *, last: bool):
    """``(x P, P P)`` with ``P`` in ``p_ref`` (and as ``p16``); the last step skips the square."""

    def run(acc_x, acc_p):
        mma(acc_x, x16, p_ref, stage)
        if not last:
            mma(acc_p, p16, p_ref, stage)
        return _read(acc_x), _read(acc_p)

    return run


def _inverse(n, xs, stage):
    """``(I + n)^-1`` for strictly lower ``n`` ``[64, 64]`` f32 (``xs``: a ``[64, 64]`` bf16 scratch)."""
    x = _ones(_iota(0) == _iota(1)) - n
    n16 = n.astype(BF16)
    xs[...] = n16
    plgpu.commit_smem()

    def square(acc):
        mma(acc, n16, xs, stage)
        return _read(acc)

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


def _product(a16, b_ref, stage, width: int):
    def run(acc):
        mma(acc, a16, b_ref, stage)
        return _read(acc)

    return pl.run_scoped(run, plgpu.ACC((CHUNK, width), F32))


def _chunk(s: _Smem, stage, scale: float, tap: Tap = None):
    """One chunk, in place in ``s`` (module docstring; :class:`_Smem` for what each buffer ends as); ``tap``: see
    :data:`Tap`."""
    wg = plgpu.Layout.WGMMA
    r64, c64 = _iota(0), _iota(1)
    _split_gate(s)
    akk, aqk = _decayed_products(s, stage, scale, tap)
    _emit(tap, "akk", akk)
    _emit(tap, "aqk", aqk)
    beta_row = plgpu.layout_cast(s.beta[...], wg.reduce(1))
    n = jnp.where(r64 > c64, akk * lax.broadcast_in_dim(beta_row, (CHUNK, CHUNK), [0]), 0.0)
    _emit(tap, "n", n)
    s.aqk[...] = jnp.where(r64 >= c64, aqk, 0.0).astype(BF16)

    g_full = _prefix(s, _selector("cum"), slice(0, HEAD_DIM), stage)
    _emit(tap, "g_full", g_full)
    g_last = jnp.sum(jnp.where(plgpu.broadcasted_iota(jnp.int32, (CHUNK, HEAD_DIM), 0, layout=wg) == CHUNK - 1,
                               g_full, 0.0), axis=0)
    s.decay[...] = jnp.exp(g_last)
    sel_cum, sel_last = _selector("cum"), _selector("last")
    for h, cols in enumerate(HALVES):
        p_cum = _prefix(s, sel_cum, cols, stage)
        _emit(tap, f"p_cum{h}", p_cum)
        e_g = jnp.exp(p_cum)
        kf = _load(s.k, cols)
        s.w[:, cols] = (kf * e_g).astype(BF16)
        p_last = _prefix(s, sel_last, cols, stage)
        _emit(tap, f"p_last{h}", p_last)
        s.k[:, cols] = (kf * jnp.exp(p_last)).astype(BF16)
        s.q[:, cols] = (_load(s.q, cols) * (e_g * scale)).astype(BF16)
    plgpu.commit_smem()
    if tap is not None:
        tap("w_eg", _load(s.w, slice(0, HEAD_DIM)))

    x_inv = _inverse(n, s.x, stage)
    _emit(tap, "x_inv", x_inv)
    x16 = x_inv.astype(BF16)
    s.x[...] = jnp.where(r64 == c64, lax.broadcast_in_dim(beta_row, (CHUNK, CHUNK), [0]), 0.0).astype(BF16)
    plgpu.commit_smem()
    xb16 = _product(x16, s.x, stage, CHUNK).astype(BF16)  # X' = X diag(beta)
    if tap is not None:
        tap("xb", xb16.astype(F32))
    s.x[...] = xb16
    wn = -_product(xb16, s.w, stage, HEAD_DIM)
    _emit(tap, "wn", wn)
    s.w[...] = wn.astype(BF16)
    plgpu.commit_smem()


def intra_chunks(q, k, g, beta_t, *, scale: float, interpret=None, taps: tuple[str, ...] | None = None):
    """Part 1 (module docstring). ``q, k [B, Tp, H, 128]`` bf16, ``g [B, Tp, H, 128]`` f32 (``Tp`` a multiple of
    64), ``beta_t [B, H, Tp]`` f32. Returns ``(qg, kd, wn, x, aqk, decay)``. ``interpret``: None or a
    ``plgpu.InterpretGPUParams``. ``taps`` (a debugging aid; None in production, where nothing extra is traced):
    names from :data:`TAP_WIDTHS`; then a seventh result ``{name: [B, H, Tp / 64, 64, width] f32}`` holds those
    intermediates of every chunk, written from registers straight to device memory."""
    B, Tp, H, K = q.shape
    n_chunks = Tp // CHUNK
    taps = tuple(taps) if taps is not None else None
    unknown = sorted(set(taps or ()) - set(TAP_WIDTHS))
    if unknown:
        raise ValueError(f"intra_chunks: unknown taps {unknown}; expected names from TAP_WIDTHS {list(TAP_WIDTHS)}")
    buf = lambda d, dt=BF16: plgpu.SMEM((CHUNK, d), dt, transforms=tiled(dt))
    smem = (
        (buf(K), buf(K), buf(K), buf(K), buf(CHUNK), plgpu.SMEM((CHUNK,), F32), plgpu.SMEM((K,), F32)),
        plgpu.RefUnion((buf(K, F32),), (buf(K), buf(CHUNK))),
    )
    stages = ()
    if interpret is not None:
        stages = (buf(CHUNK), buf(K))
    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    n_outs = 6 + len(taps or ())

    def kda_chunk_intra_mosaic_gpu(q_ref, k_ref, g_ref, beta_ref, *refs):
        qg_ref, kd_ref, wn_ref, x_ref, aqk_ref, decay_ref = refs[:6]
        tap_refs = dict(zip(taps or (), refs[6:n_outs], strict=True))
        smem_refs, loaded, stage_refs = refs[n_outs:]
        fixed, ((g,), (w, x)) = smem_refs
        s = _Smem(*fixed, g=g, w=w, x=x)
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        h = lax.rem(bh, H)
        rows = pl.ds(lax.div(bh, H) * Tp + c * CHUNK, CHUNK)  # this chunk's rows of the [B * Tp, H, D] views
        plgpu.copy_gmem_to_smem(q_ref.at[rows, h], s.q, loaded)
        plgpu.copy_gmem_to_smem(k_ref.at[rows, h], s.k, loaded)
        plgpu.copy_gmem_to_smem(g_ref.at[rows, h], s.g, loaded)
        plgpu.copy_gmem_to_smem(beta_ref.at[bh, pl.ds(c * CHUNK, CHUNK)], s.beta, loaded)
        plgpu.barrier_wait(loaded)
        stage = None if interpret is None else {CHUNK: stage_refs[0], HEAD_DIM: stage_refs[1]}
        tap = None
        if taps is not None:
            def tap(name, value):
                if name in tap_refs:
                    tap_refs[name].at[bh * n_chunks + c][...] = value.astype(F32)
        _chunk(s, stage, scale, tap)
        for src, dst in ((s.q, qg_ref), (s.k, kd_ref), (s.w, wn_ref), (s.x, x_ref), (s.aqk, aqk_ref)):
            plgpu.copy_smem_to_gmem(src, dst.at[rows, h])
        plgpu.copy_smem_to_gmem(s.decay, decay_ref.at[bh * n_chunks + c])
        plgpu.wait_smem_to_gmem(0)

    tok = lambda d: jax.ShapeDtypeStruct((B * Tp, H, d), BF16)
    tap_types = tuple(jax.ShapeDtypeStruct((B * H * n_chunks, CHUNK, TAP_WIDTHS[t]), F32) for t in taps or ())
    outs = plgpu.kernel(
        kda_chunk_intra_mosaic_gpu,
        out_type=(tok(K), tok(K), tok(K), tok(CHUNK), tok(CHUNK), jax.ShapeDtypeStruct((B * H * n_chunks, K), F32),
                  *tap_types),
        scratch_types=(smem, plgpu.Barrier(num_arrivals=4), stages),
        grid=(n_chunks, B * H),
        grid_names=("c", "bh"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*(rows_view(x) for x in (q, k, g)), beta_t.reshape(B * H, Tp))
    results = (*(x.reshape(B, Tp, H, -1) for x in outs[:5]), outs[5].reshape(B, H, n_chunks, K))
    if taps is None:
        return results
    return (*results, {t: o.reshape(B, H, n_chunks, CHUNK, -1) for t, o in zip(taps, outs[6:], strict=True)})


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
