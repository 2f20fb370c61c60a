"""KDA chunk forward, part 1 of 2 on Mosaic GPU (sm_90): everything of a chunk that does not depend on the carried
state, one CTA (one warpgroup) per ``(chunk, sequence * H + head)``, all chunks in parallel. Every copy between
device and shared memory has one integer index: the token tensors are read and written as ``[B * Tp, H, D]``
views (rows ``b * Tp + 64 c``), ``beta`` as ``[B * H, Tp]``, ``decay`` as ``[B * H * Tp / 64, 128]``.

Per chunk of 64 tokens (TMA loads of ``q, k, g, beta``; every product on wgmma with **both operands in shared
memory** (bf16, fp32 accumulation): wgmma reading its A operand from registers gave wrong results on the H200 at
some shapes (1x64x2, 1x128x1, 4x64x8, ...: ``benchmarks/kda_mosaic_probe.py defect``)):

* ``G`` = the chunk-local cumulative sums of ``g``, one product ``S g`` with the ``[64, 64]`` 0 / 1 selector ``S``
  (``S[i, t] = [t <= i]``); ``g`` is split into two bf16 terms, ``g_hi + g_lo``, so each sum is exact to ~2^-17
  relative. Every other decay exponent is a difference of ``G`` and one of its rows (``m_b`` = ``G`` at the token
  before 16-token tile ``b``, 0 for tile 0; ``G_C`` = its last row), taken in registers. The rows are read back
  through shared memory (``G`` stored once, four rows copied to a small buffer and loaded where used), not by
  reductions over the rows of a register value: those cross warps and cost more than the rest of the kernel.
* The 16-token tiles of ``A_kk`` and ``A_qk`` with factored decay (the K3 gate bound ``g >= -5``): column tile
  ``b`` takes the reference point ``m_b``; rows ``k_i e^{min(G_i - m_b, 0)}`` (exact for the rows ``i >= 16 b``
  that the causal mask keeps, where ``G_i <= m_b``) meet columns ``k_j e^{m_b - G_j}`` (exponent ``<= 80``) in
  ``[64, 64] x [64, 16]`` products over the two halves of K; the row operands are staged through two pairs of
  shared-memory buffers in turn (the pair written two steps back is free once at most two wgmma are in flight).
* ``X = (I + diag(beta) A_kk)^-1`` by doubling (:func:`pallas_kernels.kda.reference.unit_lower_inverse`: five
  levels ``X <- X - X (N_s X)`` of two ``64 x 64 x 64`` products each, bf16 operands, fp32 sums; every
  intermediate a block of the exact inverse, so aligned keys stay exact where a Neumann product's powers of ``N``
  would not), then ``X' = X diag(beta)`` (in registers) and ``-W = -X' (e^G k)``.

Outputs (bf16 unless said): ``qg = q e^G scale``, ``kd = e^{G_C - G} k``, ``wn = -W`` (each ``[B, Tp, H, 128]``),
``x = X'`` and ``aqk`` = the causal ``A_qk`` (each ``[B, Tp, H, 64]``: row ``t`` holds token ``t``'s row of its
chunk), ``decay = e^{G_C}`` ``[B, H, Tp / 64, 128]`` fp32.
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

from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, HEAD_DIM, SUB, bcast_cols, tiled

HALF = HEAD_DIM // 2
HALVES = (slice(0, HALF), slice(HALF, HEAD_DIM))
TILES = CHUNK // SUB
TAP_WIDTHS = {
    **{f"p_cum{h}": HALF for h in range(2)},
    **{f"p_col{h}": HALF for h in range(2)}, "w_col": HEAD_DIM,
    **{f"{name}{b}_{h}": HALF for b in range(TILES) for h in range(2) for name in ("p_row", "e")},
    "akk": CHUNK, "aqk": CHUNK, "n": CHUNK,
    **{f"p_last{h}": HALF for h in range(2)}, "w_eg": HEAD_DIM,
    "x_inv": CHUNK, "xb": CHUNK, "wn": HEAD_DIM,
}
"""Intermediates of one chunk that ``intra_chunks(..., taps=names)`` also writes (name -> columns; 64 rows each,
fp32), in the order the kernel forms them. ``h``: the half of K; ``b``: the column tile. ``p_cum`` = ``G``;
``p_col`` = ``m_{tile(i)} - G_i``; ``p_row`` = ``G - m_b`` (tile ``b``); ``e`` = ``exp(min(p_row, 0))``;
``p_last`` = ``G_C - G``; ``w_col``: ``s.w`` after its first write (``k e^{p_col}``); ``akk``, ``aqk``: the tile
products before masking; ``n`` = ``N``; ``w_eg``: ``s.w = e^G k``; ``x_inv`` = ``X`` (fp32); ``xb`` = ``X'``;
``wn`` = ``-W``."""
Tap = Callable[[str, jax.Array], None] | None
"""None (production: nothing extra is traced) or ``tap(name, value)`` that records a ``[64, TAP_WIDTHS[name]]``
register value."""
RESIDUALS = ("akk", "x_inv")
"""What ``intra_chunks(..., residuals=True)`` also writes for the backward (``[64, 64]`` f32 per chunk, from
registers): ``akk`` = ``A_kk`` masked strictly lower (one document), no beta; ``x_inv`` = ``X``."""


@dataclasses.dataclass(frozen=True)
class _Smem:
    """Shared memory of one CTA. ``ghi`` / ``glo`` (``g`` split) alias the four staging buffers ``st`` (A operands
    of the tile products and of the inverse's levels), first written after ``G`` is formed. ``g`` (the loaded
    log-decay) aliases ``gs`` (``G``, untiled, written after ``g`` was split and read once to fill ``rows``) and
    ``w`` and ``x`` (first written after that). ``aqk``: the ``"cum"`` selector ->
    the causal ``A_qk``; ``w``: the column operand of ``A`` -> ``e^G k`` -> ``-W``; ``x``: the inverse's levels ->
    ``X'``; ``q``: ``q`` -> ``qg``; ``k``: ``k`` -> ``kd``."""

    q: object  # [64, 128] bf16
    k: object  # [64, 128] bf16
    aqk: object  # [64, 64] bf16
    beta: object  # [64] f32
    decay: object  # [128] f32
    ghi: object  # [64, 128] bf16
    glo: object  # [64, 128] bf16: g - ghi
    st: tuple  # 4 x [64, 64] bf16 (alias ghi, glo)
    g: object  # [64, 128] f32
    gs: object  # [64, 128] f32 untiled (aliases g)
    rows: object  # [4 * 128] f32: G at tokens 15, 31, 47, 63
    w: object  # [64, 128] bf16 (aliases g)
    x: object  # [64, 64] bf16 (aliases g)
    seg: object = None  # [64] f32, packed sequences only: document starts in the chunk up to each token
    last: object = None  # [64] f32, packed sequences only: 1 where the token is in the chunk's last document


def _emit(tap: Tap, name: str, value) -> None:
    if tap is not None:
        tap(name, value)


def _mma(acc, a_ref, b_ref) -> None:
    """``acc += a @ b``, both operands in shared memory (committed). The one wgmma call of this kernel."""
    plgpu.wgmma(acc, a_ref, b_ref)


def _iota(dim: int):
    return plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), dim, layout=plgpu.Layout.WGMMA)


def _ones(cond):
    return jnp.where(cond, 1.0, 0.0)


def _load(ref, cols):
    return plgpu.layout_cast(ref[:, cols], plgpu.Layout.WGMMA).astype(F32)


def _products(a_ref, b_refs, width: int):
    """``sum_i a @ b_i`` (``[64, width]`` f32) for shared-memory operands."""

    def run(acc):
        for b_ref in b_refs:
            _mma(acc, a_ref, b_ref)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC((CHUNK, width), F32))


def _split_gate(s: _Smem) -> None:
    """``g`` -> ``ghi + glo`` (bf16 each, ``g`` to ~2^-17 relative); the ``"cum"`` selector into ``s.aqk``."""
    wg = plgpu.Layout.WGMMA
    for cols in HALVES:
        gi = plgpu.layout_cast(s.g[:, cols], wg)
        hi = gi.astype(BF16)
        s.ghi[:, cols] = hi
        s.glo[:, cols] = (gi - hi.astype(F32)).astype(BF16)
    s.aqk[...] = _ones(_iota(1) <= _iota(0)).astype(BF16)
    plgpu.commit_smem()


def _store_with_conflicts(ref, value) -> None:
    """``ref[...] = value`` into an untiled ref from the WGMMA layout (bank conflicts allowed: no conflict-free
    pattern exists there). jax 0.12 needs ``plgpu.store(..., optimized=False)`` for that; 0.11 has no
    ``plgpu.store`` and stores untiled refs that way already."""
    store = getattr(plgpu, "store", None)
    if store is None:
        ref[...] = value
    else:
        store(ref, value, optimized=False)


def _cumsums(s: _Smem, tap: Tap):
    """``G``: per half of K, ``[64, 64]`` f32; its rows at the last token of each tile into ``s.rows``."""
    G = [_products(s.aqk, (s.ghi.at[:, cols], s.glo.at[:, cols]), HALF) for cols in HALVES]
    for h, cols in enumerate(HALVES):
        _emit(tap, f"p_cum{h}", G[h])
        _store_with_conflicts(s.gs.at[:, cols], G[h])
    plgpu.commit_smem()
    for b in range(TILES):
        s.rows.at[pl.ds(b * HEAD_DIM, HEAD_DIM)][...] = s.gs[SUB * (b + 1) - 1]
    plgpu.commit_smem()  # every thread's reads of gs are done before w / x (aliasing it) are written
    return G


def _tile_row(s: _Smem, b: int, h: int):
    """``G`` at the last token of tile ``b``, half ``h`` of K: a per-column ``[64]`` vector."""
    return plgpu.layout_cast(s.rows[pl.ds(b * HEAD_DIM + h * HALF, HALF)], plgpu.Layout.WGMMA.reduce(0))


def _m(s: _Smem, b: int, h: int):
    """``m_b`` (``G`` at the token before tile ``b``) for half ``h``; None for tile 0, where it is 0."""
    return None if b == 0 else _tile_row(s, b - 1, h)


def _column_operand(s: _Smem, G, tap: Tap) -> None:
    """``s.w <- k e^{m_{tile(i)} - G_i}``: the column operand of every ``A`` tile (committed for wgmma)."""
    tile = lax.div(_iota(0), SUB)
    for h, cols in enumerate(HALVES):
        start = sum(jnp.where(tile == b, bcast_cols(_m(s, b, h)), 0.0) for b in range(1, TILES))
        p_col = start - G[h]
        _emit(tap, f"p_col{h}", p_col)
        s.w[:, cols] = (_load(s.k, cols) * jnp.exp(p_col)).astype(BF16)
    plgpu.commit_smem()
    if tap is not None:
        tap("w_col", _load(s.w, slice(0, HEAD_DIM)))


def _decayed_products(s: _Smem, G, scale: float, tap: Tap):
    """The 16-token tiles of ``A_kk`` and ``A_qk`` (``[64, 64]`` f32 each, entries above the diagonal tile
    undefined): column tile ``b`` = ``(k e^{G - m_b}) (k e^{m_b - G})^T`` over the tile's columns. The row
    operands go through the staging pairs ``st[0:2]``, ``st[2:4]`` in turn."""

    def run(acc_kk, acc_qk):
        step = 0
        for b in range(TILES):
            out = slice(SUB * b, SUB * (b + 1))
            for h, cols in enumerate(HALVES):
                p_row = G[h] if b == 0 else G[h] - bcast_cols(_m(s, b, h))
                e = jnp.exp(jnp.minimum(p_row, 0.0))  # rows above tile b: masked later
                _emit(tap, f"p_row{b}_{h}", p_row)
                _emit(tap, f"e{b}_{h}", e)
                a_kk, a_qk = s.st[2 * (step % 2)], s.st[2 * (step % 2) + 1]
                if step >= 2:
                    plgpu.wgmma_wait(2)  # the two wgmma that read this pair (two steps back) are done
                a_kk[...] = (_load(s.k, cols) * e).astype(BF16)
                a_qk[...] = (_load(s.q, cols) * (e * scale)).astype(BF16)
                plgpu.commit_smem()
                col_op = s.w.at[out, cols].T
                _mma(acc_kk.at[:, out], a_kk, col_op)
                _mma(acc_qk.at[:, out], a_qk, col_op)
                step += 1
        return acc_kk[...], acc_qk[...]

    return pl.run_scoped(run, plgpu.ACC((CHUNK, CHUNK), F32), plgpu.ACC((CHUNK, CHUNK), F32))


def _inverse(n, xs, st, ys):
    """``(I + n)^-1`` for strictly lower ``n`` ``[64, 64]`` f32 by doubling (module docstring): ``X_1 = I - n_1``,
    then ``X <- X - X (n_s X)`` for ``s = 2 .. 32``, ``n_s`` the lower-left ``s x s`` blocks of ``n``'s ``2s``
    diagonal blocks. The products' operands are staged as bf16 in ``[64, 64]`` buffers: ``st`` ``n_s``, ``xs``
    ``X``, ``ys`` ``n_s X``."""
    r, c = _iota(0), _iota(1)
    lower_left = lambda s: (lax.div(r, s) == lax.div(c, s) + 1) & (lax.rem(lax.div(r, s), 2) == 1)
    x = _ones(r == c) - jnp.where(lower_left(1), n, 0.0)
    s = 2
    while s < CHUNK:
        st[...] = jnp.where(lower_left(s), n, 0.0).astype(BF16)
        xs[...] = x.astype(BF16)
        plgpu.commit_smem()
        ys[...] = _products(st, (xs,), CHUNK).astype(BF16)
        plgpu.commit_smem()
        x = x - _products(xs, (ys,), CHUNK)
        s *= 2
    return x


def _chunk(s: _Smem, scale: float, tap: Tap = None, save: Tap = None):
    """One chunk, in place in ``s`` (module docstring; :class:`_Smem` for what each buffer ends as); ``tap``: see
    :data:`Tap`. Packed sequences (``s.seg`` set): ``A_kk`` / ``A_qk`` keep the entries of one document, ``e^G k``
    (so ``W``) and ``qg`` the rows of the document that entered the chunk (the carried state is its), ``kd`` the
    rows of the chunk's last document (the state leaving it is that document's). ``save``: None, or a writer like
    ``tap`` that takes the :data:`RESIDUALS`."""
    wg = plgpu.Layout.WGMMA
    r64, c64 = _iota(0), _iota(1)
    packed = s.seg is not None
    # packed masks are formed where used (from shared memory), not held in registers across the kernel
    per_token = lambda ref, n: lax.broadcast_in_dim(plgpu.layout_cast(ref[...], wg.reduce(1)), (CHUNK, n), [0])
    _split_gate(s)
    G = _cumsums(s, tap)
    _column_operand(s, G, tap)
    akk, aqk = _decayed_products(s, G, scale, tap)
    _emit(tap, "akk", akk)
    _emit(tap, "aqk", aqk)
    beta_row = plgpu.layout_cast(s.beta[...], wg.reduce(1))
    causal_kk, causal_qk = r64 > c64, r64 >= c64
    if packed:  # one document
        same = per_token(s.seg, CHUNK) == bcast_cols(plgpu.layout_cast(s.seg[...], wg.reduce(0)))
        causal_kk, causal_qk = causal_kk & same, causal_qk & same
    akk = jnp.where(causal_kk, akk, 0.0)
    _emit(save, "akk", akk)
    n = akk * lax.broadcast_in_dim(beta_row, (CHUNK, CHUNK), [0])
    _emit(tap, "n", n)
    s.aqk[...] = jnp.where(causal_qk, aqk, 0.0).astype(BF16)
    for h, cols in enumerate(HALVES):
        g_last = _tile_row(s, TILES - 1, h)
        s.decay.at[cols][...] = jnp.exp(g_last)
        e_g = jnp.exp(G[h])
        if packed:  # W and qg: the document entering the chunk only
            e_g = jnp.where(per_token(s.seg, HALF) == 0.0, e_g, 0.0)
        kf = _load(s.k, cols)
        s.w[:, cols] = (kf * e_g).astype(BF16)
        p_last = bcast_cols(g_last) - G[h]
        _emit(tap, f"p_last{h}", p_last)
        kd = kf * jnp.exp(p_last)
        s.k[:, cols] = (kd * per_token(s.last, HALF) if packed else kd).astype(BF16)
        s.q[:, cols] = (_load(s.q, cols) * (e_g * scale)).astype(BF16)
    plgpu.commit_smem()
    if tap is not None:
        tap("w_eg", _load(s.w, slice(0, HEAD_DIM)))

    x_inv = _inverse(n, s.x, s.st[0], s.st[1])
    _emit(tap, "x_inv", x_inv)
    _emit(save, "x_inv", x_inv)
    beta_col = bcast_cols(plgpu.layout_cast(s.beta[...], wg.reduce(0)))
    xb = x_inv * beta_col  # X' = X diag(beta)
    _emit(tap, "xb", xb)
    s.x[...] = xb.astype(BF16)
    plgpu.commit_smem()
    wn = -_products(s.x, (s.w,), HEAD_DIM)
    _emit(tap, "wn", wn)
    s.w[...] = wn.astype(BF16)
    plgpu.commit_smem()


def intra_chunks(q, k, g, beta_t, *, scale: float, seg=None, interpret=None, residuals: bool = False,
                 taps: tuple[str, ...] | None = None):
    """Part 1 (module docstring). ``q, k [B, Tp, H, 128]`` bf16, ``g [B, Tp, H, 128]`` f32 (``Tp`` a multiple of
    64), ``beta_t [B, H, Tp]`` f32; packed sequences: ``seg [B, Tp]`` int, the document starts inside each chunk up
    to each token (0 for the document that entered the chunk; :func:`chunk_segments`), None otherwise. Returns
    ``(qg, kd, wn, x, aqk, decay)`` (``decay`` 0 for a chunk where a document starts); with ``residuals`` also
    ``{name: [B * H * Tp / 64, 64, 64] f32}`` for the :data:`RESIDUALS` (the backward's). ``interpret``: None or a
    ``plgpu.InterpretGPUParams``. ``taps`` (a debugging aid; None in production, where nothing extra is traced):
    names from :data:`TAP_WIDTHS`; then a last result ``{name: [B, H, Tp / 64, 64, width] f32}`` holds those
    intermediates of every chunk, written from registers straight to device memory."""
    B, Tp, H, K = q.shape
    n_chunks = Tp // CHUNK
    taps = tuple(taps) if taps is not None else None
    unknown = sorted(set(taps or ()) - set(TAP_WIDTHS))
    if unknown:
        raise ValueError(f"intra_chunks: unknown taps {unknown}; expected names from TAP_WIDTHS {list(TAP_WIDTHS)}")
    saved = RESIDUALS if residuals else ()
    buf = lambda d, dt=BF16: plgpu.SMEM((CHUNK, d), dt, transforms=tiled(dt))
    smem = (
        (buf(K), buf(K), buf(CHUNK), plgpu.SMEM((CHUNK,), F32), plgpu.SMEM((K,), F32)),
        plgpu.RefUnion((buf(K), buf(K)), tuple(buf(CHUNK) for _ in range(4))),
        plgpu.RefUnion((buf(K, F32),), (plgpu.SMEM((CHUNK, K), F32),), (buf(K), buf(CHUNK))),
        plgpu.SMEM((TILES * K,), F32),
    )
    packed = seg is not None
    if packed:
        smem += ((plgpu.SMEM((CHUNK,), F32), plgpu.SMEM((CHUNK,), F32)),)
    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    extra = (*saved, *(taps or ()))
    n_outs = 6 + len(extra)

    def writer(out_refs, index):
        def write(name, value):
            if name in out_refs:
                out_refs[name].at[index][...] = value.astype(F32)

        return write

    def kda_chunk_intra_mosaic_gpu(q_ref, k_ref, g_ref, beta_ref, *refs):
        seg_refs, refs = (refs[:2], refs[2:]) if packed else ((), refs)
        qg_ref, kd_ref, wn_ref, x_ref, aqk_ref, decay_ref = refs[:6]
        save_refs = dict(zip(saved, refs[6:6 + len(saved)], strict=True))
        tap_refs = dict(zip(taps or (), refs[6 + len(saved):n_outs], strict=True))
        smem_refs, loaded = refs[n_outs:]
        fixed, ((ghi, glo), st), ((g,), (gs,), (w, x)), rows, *seg_smem = smem_refs
        s = _Smem(*fixed, ghi=ghi, glo=glo, st=tuple(st), g=g, gs=gs, rows=rows, w=w, x=x,
                  **(dict(zip(("seg", "last"), seg_smem[0], strict=True)) if packed else {}))
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        h = lax.rem(bh, H)
        rows = pl.ds(lax.div(bh, H) * Tp + c * CHUNK, CHUNK)  # this chunk's rows of the [B * Tp, H, D] views
        plgpu.copy_gmem_to_smem(q_ref.at[rows, h], s.q, loaded)
        plgpu.copy_gmem_to_smem(k_ref.at[rows, h], s.k, loaded)
        plgpu.copy_gmem_to_smem(g_ref.at[rows, h], s.g, loaded)
        plgpu.copy_gmem_to_smem(beta_ref.at[bh, pl.ds(c * CHUNK, CHUNK)], s.beta, loaded)
        if packed:  # the [B * Tp] token vectors, this chunk's rows
            for src, dst in zip(seg_refs, (s.seg, s.last), strict=True):
                plgpu.copy_gmem_to_smem(src.at[rows], dst, loaded)
        plgpu.barrier_wait(loaded)
        chunk_index = bh * n_chunks + c
        _chunk(s, scale, writer(tap_refs, chunk_index) if taps is not None else None,
               writer(save_refs, chunk_index) if residuals else None)
        for src, dst in ((s.q, qg_ref), (s.k, kd_ref), (s.w, wn_ref), (s.x, x_ref), (s.aqk, aqk_ref)):
            plgpu.copy_smem_to_gmem(src, dst.at[rows, h])
        plgpu.copy_smem_to_gmem(s.decay, decay_ref.at[chunk_index])
        plgpu.wait_smem_to_gmem(0)

    tok = lambda d: jax.ShapeDtypeStruct((B * Tp, H, d), BF16)
    per_chunk = lambda width: jax.ShapeDtypeStruct((B * H * n_chunks, CHUNK, width), F32)
    extra_types = (*(per_chunk(CHUNK) for _ in saved), *(per_chunk(TAP_WIDTHS[t]) for t in taps or ()))
    outs = plgpu.kernel(
        kda_chunk_intra_mosaic_gpu,
        out_type=(tok(K), tok(K), tok(K), tok(CHUNK), tok(CHUNK), jax.ShapeDtypeStruct((B * H * n_chunks, K), F32),
                  *extra_types),
        scratch_types=(smem, plgpu.Barrier(num_arrivals=6 if packed else 4)),
        grid=(n_chunks, B * H),
        grid_names=("c", "bh"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*(rows_view(x) for x in (q, k, g)), beta_t.reshape(B * H, Tp),
      *(() if not packed else (x.reshape(B * Tp) for x in chunk_segments(seg))))
    decay = outs[5].reshape(B, H, n_chunks, K)
    if packed:  # a document starting inside the chunk: the state entering it does not reach its end
        decay = jnp.where((seg.reshape(B, 1, n_chunks, CHUNK)[..., -1:] == 0), decay, 0.0)
    results = (*(x.reshape(B, Tp, H, -1) for x in outs[:5]), decay)
    if residuals:
        results = (*results, dict(zip(saved, outs[6:6 + len(saved)], strict=True)))
    if taps is None:
        return results
    tapped = outs[6 + len(saved):]
    return (*results, {t: o.reshape(B, H, n_chunks, CHUNK, -1) for t, o in zip(taps, tapped, strict=True)})


def chunk_segments(seg):
    """``(seg, last)`` as the kernel reads them, ``[B, Tp]`` f32 each: ``seg`` (document starts inside the chunk
    up to each token, as given) and ``last`` (1 where the token is in its chunk's last document)."""
    B, Tp = seg.shape
    chunks = seg.astype(F32).reshape(B, Tp // CHUNK, CHUNK)
    return chunks.reshape(B, Tp), (chunks == chunks[..., -1:]).astype(F32).reshape(B, Tp)


def intra_chunks_reference(q, k, g, beta_t, *, scale: float, seg=None, residuals: bool = False):
    """Plain-JAX fp32 (``precision=HIGHEST``) reference of :func:`intra_chunks`: the same six outputs (and with
    ``residuals`` the same dict) in the same dtypes and layouts, exact (pairwise decay ``e^{G_i - G_j}`` per key, a
    direct triangular solve; memory ``O(T C K)``: small shapes only); ``seg`` as there."""
    B, Tp, H, K = q.shape
    n = Tp // CHUNK
    hp = jax.lax.Precision.HIGHEST
    split = lambda x: jnp.moveaxis(x.astype(F32).reshape(B, n, CHUNK, H, -1), 3, 1)  # [B, H, n, C, D]
    qc, kc, gc = split(q), split(k), jnp.cumsum(split(g), axis=3)
    beta = beta_t.astype(F32).reshape(B, H, n, CHUNK)
    g_last = gc[..., -1:, :]
    causal = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    first = last = jnp.ones((1, 1, n, CHUNK, 1), F32)
    if seg is not None:
        sc = seg.reshape(B, 1, n, CHUNK)
        causal = causal & (sc[..., :, None] == sc[..., None, :])  # [B, 1, n, i, j]: one document
        first, last = (sc == 0)[..., None].astype(F32), (sc == sc[..., -1:])[..., None].astype(F32)
    diff = jnp.where(causal[..., None], gc[..., :, None, :] - gc[..., None, :, :], -jnp.inf)  # [.., i, j, K]
    pair = lambda a: jnp.einsum("...id,...jd,...ijd->...ij", a, kc, jnp.exp(diff), precision=hp)
    akk = jnp.where(jnp.eye(CHUNK, dtype=bool), 0.0, pair(kc))
    aqk = scale * pair(qc)
    eye = jnp.eye(CHUNK, dtype=F32)
    x_inv = jax.scipy.linalg.solve_triangular(eye + beta[..., :, None] * akk, jnp.broadcast_to(eye, akk.shape),
                                              lower=True)
    x = x_inv * beta[..., None, :]
    wn = -jnp.einsum("...ij,...jd->...id", x, kc * jnp.exp(gc) * first, precision=hp)
    merge = lambda t: jnp.moveaxis(t, 1, 3).reshape(B, Tp, H, -1).astype(BF16)
    decay = jnp.exp(g_last[..., 0, :]) * first[..., -1, :]  # 0 where a document starts in the chunk
    out = (merge(qc * jnp.exp(gc) * scale * first), merge(kc * jnp.exp(g_last - gc) * last), merge(wn), merge(x),
           merge(aqk), decay)
    if not residuals:
        return out
    per_chunk = lambda t: t.reshape(B * H * n, CHUNK, CHUNK)
    return (*out, {"akk": per_chunk(akk), "x_inv": per_chunk(x_inv)})
