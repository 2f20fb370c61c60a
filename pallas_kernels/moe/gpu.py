"""Grouped matmul kernels for NVIDIA GPUs (Pallas, Triton lowering).

Each program computes one ``[tm, tn]`` output tile of one group. Row tiles are aligned to group starts
(group ``g``'s rows ``[start_g, end_g)`` are cut into ``ceil(size_g / tm)`` tiles), so no tile mixes
groups and every output row is written exactly once with a masked store; the trailing rows past
``sum(group_sizes)`` form a virtual group that stores zeros. The tile table (group, first row) is computed
under ``jit`` with a static upper bound of ``ceil(M / tm) + E`` tiles; programs past the live count exit.

- :func:`gmm`: forward (``rhs [E, K, N]``, or ``[E, N, K]`` with ``transpose_rhs``) with ``custom_vjp``:
  ``dlhs = gmm(dout, rhs, transpose_rhs=True)``, ``drhs = tgmm(lhs, dout)``.
- :func:`tgmm`: one program per (group, K tile, N tile), looping over that group's rows.
- :func:`gmm_mxfp4`: grouped matmul whose weights stay MXFP4 in HBM (HF ``[E, N, K/2]`` codes + ``[E, N, K/32]``
  E8M0 scales) and are decoded in registers; one or two weights (w1/w3 with the SiTU-GLU epilogue). Built for
  decode (few rows per expert: weight-streaming bound), forward only.

Both kernels also read one layer of a stacked ``[L, E, ...]`` weight in place (``layer=`` an i32 scalar, passed
to the kernel as a one-element input; the kernel indexes ``rhs_ref[layer, expert, ...]``), so a layer scan that
hands the kernel the whole stack and its index copies no per-layer weight slice (XLA materialises a
``dynamic_slice`` that feeds a custom call).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.forward_only import forward_only


def make_tile_table(group_sizes: jax.Array, m: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> ``(tile_group [V] i32, tile_row0 [V] i32, ends [E+1] i32, num_tiles [1] i32)``, V = ceil(m/tm) + E."""
    e = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    sizes = jnp.concatenate([gs, jnp.maximum(m - jnp.sum(gs), 0)[None]])
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    starts = ends - sizes
    ntiles = (sizes + tm - 1) // tm
    cum = jnp.cumsum(ntiles)
    num = cum[-1]
    v = -(-m // tm) + e
    i = jnp.minimum(jnp.arange(v, dtype=jnp.int32), jnp.maximum(num - 1, 0))
    # one fused compare-and-count, not searchsorted's default binary-search loop (an XLA while loop of tiny
    # kernels that the host drives iteration by iteration: per layer and decode step)
    gid = jnp.searchsorted(cum, i, side="right", method="compare_all").astype(jnp.int32)
    row0 = (starts[gid] + (i - (cum - ntiles)[gid]) * tm).astype(jnp.int32)
    return gid, row0, ends, num.reshape(1).astype(jnp.int32)


def _tile_rows(gid_ref, row0_ref, ends_ref, t, tm: int):
    """Output tile ``t`` of the tile table: ``(group g, first row r0, row mask [tm] = rows before g's end)``."""
    g = gid_ref[t]
    r0 = row0_ref[t]
    return g, r0, r0 + jnp.arange(tm, dtype=jnp.int32) < ends_ref[g]


def _gmm_kernel(gid_ref, row0_ref, ends_ref, num_ref, layer_ref, lhs_ref, rhs_ref, out_ref,
                tm: int, tk: int, tn: int, k: int, num_groups: int, trans_b: bool, stacked: bool):
    """One ``[tm, tn]`` output tile of the grouped matmul; with ``stacked``, ``rhs_ref [L, E, ...]`` is read at
    layer ``layer_ref[0]``."""
    t = pl.program_id(1)
    j = pl.program_id(0)

    @pl.when(t < num_ref[0])
    def _run():
        g, r0, smask = _tile_rows(gid_ref, row0_ref, ends_ref, t, tm)
        rmask = smask & (g < num_groups)  # the virtual trailing group loads zeros, stores zeros
        n0 = pl.multiple_of(j * tn, tn)
        gw = jnp.minimum(g, num_groups - 1)
        at = (layer_ref[0], gw) if stacked else (gw,)

        def body(kk, acc):
            k0 = pl.multiple_of(kk * tk, tk)
            a = pltriton.load(lhs_ref.at[pl.ds(r0, tm), pl.ds(k0, tk)], mask=rmask[:, None], other=0.0)
            if trans_b:
                b = rhs_ref[(*at, pl.ds(n0, tn), pl.ds(k0, tk))].T
            else:
                b = rhs_ref[(*at, pl.ds(k0, tk), pl.ds(n0, tn))]
            return acc + jnp.dot(a, b.astype(a.dtype), preferred_element_type=jnp.float32)

        val = jax.lax.fori_loop(0, k // tk, body, jnp.zeros((tm, tn), jnp.float32))
        pltriton.store(out_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)], val.astype(out_ref.dtype), mask=smask[:, None])


def _gmm_call(lhs, rhs, group_sizes, *, trans_b, out_dtype, tiles, interpret, layer=None):
    """``rhs [E, K, N]`` (``[E, N, K]`` with ``trans_b``), or ``[L, E, ...]`` read at ``layer`` (i32 scalar)."""
    lyr = _layer_index(rhs, layer, 3)
    m, k = lhs.shape
    e = rhs.shape[-3]
    n = rhs.shape[-2] if trans_b else rhs.shape[-1]
    tm, tk, tn, warps, stages = tiles
    gid, row0, ends, num = make_tile_table(group_sizes, m, tm)
    kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, k=k, num_groups=e, trans_b=trans_b,
                               stacked=layer is not None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n // tn, gid.shape[0]),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="moe_gmm_gpu",
    )(gid, row0, ends, num, lyr, lhs, rhs)


def _layer_index(w: jax.Array, layer: jax.Array | None, ndim: int) -> jax.Array:
    """The kernels' layer input ``i32 [1]`` for weight ``w``: 0 for an unstacked ``ndim``-D weight (unused), else
    ``layer`` of the stack ``[L, ...]`` (``ndim + 1`` dims)."""
    if layer is None:
        if w.ndim != ndim:
            raise ValueError(f"gpu: expert weight of shape {w.shape} needs {ndim} dims ({ndim + 1} with layer=)")
        return jnp.zeros((1,), jnp.int32)
    if w.ndim != ndim + 1:
        raise ValueError(f"gpu: with layer=, the expert weight must be stacked [L, ...] with {ndim + 1} dims, "
                         f"got shape {w.shape}")
    # clamped into [0, L) like dynamic_slice (a traced index cannot be checked; the kernel must not read past)
    return jnp.clip(jnp.reshape(layer, (1,)).astype(jnp.int32), 0, w.shape[0] - 1)


def _tgmm_kernel(ends_ref, lhs_ref, dout_ref, out_ref, *, tm: int, tk: int, tn: int):
    kt, j, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    end = ends_ref[g + 1]
    start = ends_ref[g]
    k0 = pl.multiple_of(kt * tk, tk)
    n0 = pl.multiple_of(j * tn, tn)

    def body(it, acc):
        r0 = start + it * tm
        rmask = (r0 + jnp.arange(tm, dtype=jnp.int32)) < end
        a = pltriton.load(lhs_ref.at[pl.ds(r0, tm), pl.ds(k0, tk)], mask=rmask[:, None], other=0.0)
        d = pltriton.load(dout_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)], mask=rmask[:, None], other=0.0)
        return acc + jnp.dot(a.T, d.astype(a.dtype), preferred_element_type=jnp.float32)

    n_iter = ((end - start + tm - 1) // tm).astype(jnp.int32)
    acc = jax.lax.fori_loop(jnp.int32(0), n_iter, body, jnp.zeros((tk, tn), jnp.float32))
    out_ref[g, pl.ds(k0, tk), pl.ds(n0, tn)] = acc.astype(out_ref.dtype)


def _tgmm_call(lhs, dout, group_sizes, *, out_dtype, tiles, interpret):
    m, k = lhs.shape
    n = dout.shape[1]
    e = group_sizes.shape[0]
    tm, tk, tn, warps, stages = tiles
    ends = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, tk=tk, tn=tn),
        out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
        grid=(k // tk, n // tn, e),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="moe_tgmm_gpu",
    )(ends, lhs, dout)


DEFAULT_TILES = (128, 64, 256, 8, 3)  # tm, tk, tn, num_warps, num_stages (benchmarks/moe.py sweeps others)
DECODE_TILES = (16, 64, 64, 4, 3)
""":func:`gmm`'s tiles for at most ``tm = 16`` rows (a decode step of a few tokens): no group can span two row
tiles (each expert's weight is read once), and N cut into 64-wide tiles gives a few live experts enough
programs to stream their weights over most of the GPU (256-wide: 12 programs per expert for N = 3,072)."""
MXFP4_TILES = (16, 128, 64, 4, 4)  # tm, tkh (packed bytes of K per step), tn, num_warps, num_stages
TGMM_TILES = (64, 128, 128, 8, 3)


def _shrink(tile: int, dim: int) -> int:
    """The largest power-of-two tile <= ``tile`` dividing ``dim`` (down to 16), or ``dim`` when it is smaller."""
    if dim <= tile:
        return dim
    t = tile
    while t > 16 and dim % t:
        t //= 2
    return t


def _fit(tiles, k, n):
    tm, tk, tn, w, s = tiles
    return tm, _shrink(tk, k), _shrink(tn, n), w, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_vjp(lhs, rhs, group_sizes, tiles, out_dtype, interpret):
    return _gmm_call(lhs, rhs, group_sizes, trans_b=False, out_dtype=out_dtype, tiles=tiles, interpret=interpret)


def _gmm_fwd(lhs, rhs, group_sizes, tiles, out_dtype, interpret):
    return _gmm_vjp(lhs, rhs, group_sizes, tiles, out_dtype, interpret), (lhs, rhs, group_sizes)


def _gmm_bwd(tiles, out_dtype, interpret, res, dout):
    lhs, rhs, group_sizes = res
    k, n = rhs.shape[1], rhs.shape[2]
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm_call(dout, rhs, group_sizes, trans_b=True, out_dtype=lhs.dtype,
                     tiles=_fit(tiles, n, k), interpret=interpret)
    drhs = _tgmm_call(lhs, dout, group_sizes, out_dtype=rhs.dtype, tiles=_fit(TGMM_TILES, k, n),
                      interpret=interpret)
    return dlhs, drhs, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    tiles: tuple[int, int, int, int, int] | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Grouped matmul ``lhs [M, K] x rhs [E, K, N] -> [M, N]`` (ragged_dot semantics), differentiable.

    K and N must be multiples of the K/N tiles (64/128 by default, or smaller than one tile and a power
    of two). ``tiles = (tm, tk, tn, num_warps, num_stages)``.
    ``layer`` (i32 scalar): ``rhs`` is a stack ``[L, E, K, N]`` read in place at that layer (clamped into
    ``[0, L)``); that form is forward only (decode).
    """
    k, n = rhs.shape[-2], rhs.shape[-1]
    m = lhs.shape[0]
    tiles = _fit(tiles or (DECODE_TILES if m <= DECODE_TILES[0] else DEFAULT_TILES), k, n)
    if k % tiles[1] or n % tiles[2]:
        raise ValueError(f"gpu.gmm: K={k}, N={n} must be multiples of the tiles (tk={tiles[1]}, tn={tiles[2]})")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    # The interpreter clamps out-of-range slices instead of masking them: give it tm spare rows.
    x = jnp.pad(lhs, ((0, tiles[0]), (0, 0))) if interpret else lhs
    if layer is not None:
        call = functools.partial(_gmm_call, trans_b=False, out_dtype=out_dtype, tiles=tiles, interpret=interpret)
        out = forward_only(lambda a, w, gs, lyr: call(a, w, gs, layer=lyr), x, rhs.astype(lhs.dtype),
                           group_sizes.astype(jnp.int32), layer, name="moe.gpu.gmm(layer=)")
        return out[:m]
    out = _gmm_vjp(x, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), tiles, out_dtype, interpret)
    return out[:m]


def tgmm(lhs, dout, group_sizes, *, tiles=None, out_dtype=jnp.float32, interpret=False) -> jax.Array:
    """Per-group ``lhs[rows of g]^T @ dout[rows of g]`` -> ``[E, K, N]`` (zeros for empty groups)."""
    tiles = _fit(tiles or TGMM_TILES, lhs.shape[1], dout.shape[1])
    if interpret:
        lhs, dout = (jnp.pad(a, ((0, tiles[0]), (0, 0))) for a in (lhs, dout))
    return _tgmm_call(lhs, dout.astype(lhs.dtype), group_sizes.astype(jnp.int32), out_dtype=out_dtype,
                      tiles=tiles, interpret=interpret)


# ------------------------------------------------------------------------------------------- MXFP4 gmm
def even_odd_columns(x: jax.Array) -> jax.Array:
    """``[M, K]`` -> ``[M, K]``: even columns, then odd ones (the low / high nibble order of packed codes)."""
    return jnp.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)


def _scale_factor(scales: jax.Array) -> jax.Array:
    """E8M0 ``i32 [...]`` -> ``f32 2^(s - 127) * 2^14`` (the 2^14 undoes the f16 placement in :func:`_decode`).

    Exact for s in 0..240; 255 (NaN in E8M0) gives NaN; s > 240 (|w| >= 2^114, absent from real weights)
    overflows to inf where the reference is finite.
    """
    f = jax.lax.bitcast_convert_type(scales << 23, jnp.float32) * jnp.float32(16384.0)
    f = jnp.where(scales == 0, jnp.float32(2.0**-113), f)
    return jnp.where(scales == 255, jnp.float32(jnp.nan), f)


def _decode(codes: jax.Array, factor: jax.Array, dtype) -> jax.Array:
    """4-bit E2M1 codes (low 4 bits of ``i32 [tn, tkh]``; higher bits ignored) x ``factor f32 [tn, tkh]``.

    The 3 magnitude bits go to f16 bits 9..11 (exponent low bits + top mantissa bit) and the sign to bit 15:
    the f16 value is ``E2M1 * 2^-14`` exactly, subnormals (+-0.5) included, so no select is needed.
    """
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    v = jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(jnp.float32)
    return (v * factor).astype(dtype)


# MXFP4 decode. bf16 activations on the GPU: inline PTX (prmt / shl / lop3 / mul.rn.bf16x2, 2 elements per
# instruction): per half-word the magnitude bits go to 6..8 and the sign to 15 (the bf16 of E2M1 * 2^-126, +-0.5 a
# subnormal), then x 2^126 and x 2^(s-127); exact for every E8M0 scale (0 -> 2^-127 as a bf16 subnormal, 255 -> NaN).
# Static cost 6.0 SASS instructions per decoded element (Triton 3.9, sm_90); on the H200 it streamed w1 fastest of
# five decodes measured side by side (benchmarks/RESULTS.md). f32 activations, and the interpreter (no inline PTX
# there), use the f32 decode (:func:`_decode`: exact for s in 0..240 on the GPU, 2..240 on XLA:CPU, which flushes the
# f32 subnormals of s <= 1). Scales are broadcast from [tn, tkh/16] to [tn, tkh] with broadcast_to + reshape, which
# Triton lowers to a register layout (no smem).
_BF16_NAN = 0x7FC0


def _broadcast_groups(v: jax.Array, tkh: int) -> jax.Array:
    """``[tn, tkh/16]`` (one value per 32 elements = 16 packed bytes) -> ``[tn, tkh]``."""
    tn, ts = v.shape
    return jnp.broadcast_to(v[:, :, None], (tn, ts, 16)).reshape(tn, tkh)


def _bf16_from_bits(bits: jax.Array) -> jax.Array:
    """``i32`` holding bf16 bits in the low 16 -> bf16."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)


def _scale_bf16_bits(s: jax.Array) -> jax.Array:
    """E8M0 ``i32`` -> bf16 bits (``i32``) of ``2^(s - 127)``: 0 -> 2^-127 (bf16 subnormal 0x0040), 255 -> NaN."""
    bits = jnp.where(s == 0, 0x0040, s << 7)
    return jnp.where(s == 255, _BF16_NAN, bits)


def _mxfp4_asm(high: bool) -> str:
    """Inline PTX for one nibble of 4 packed bytes: ``$2`` = bytes b0..b3 (b0 lowest), ``$3``/``$4`` = bf16x2 scales
    of elements (0, 1) / (2, 3); ``$0``/``$1`` = bf16x2 values of the low (or high) nibbles of bytes (0, 1) / (2, 3).

    prmt spreads bytes (0, 1), then (2, 3), into the two 16-bit halves; per half the magnitude bits go to 6..8 and
    the sign to 15 (the bf16 of E2M1 * 2^-126, +-0.5 a subnormal), then x 2^126 and x the scale, two elements per
    ``mul.rn.bf16x2`` (sm_90). Four integer ops + two multiplies per two elements.
    """
    mag, sign = (2, 8) if high else (6, 12)
    lines = ["{", ".reg .b32 t, u, v, c;", "mov.b32 c, 0x7E807E80;"]
    for out, sel, scale in (("$0", "0x4140", "$3"), ("$1", "0x4342", "$4")):
        lines += [f"prmt.b32 t, $2, 0, {sel};",
                  f"shl.b32 u, t, {mag};", "and.b32 u, u, 0x01C001C0;",
                  f"shl.b32 v, t, {sign};", "lop3.b32 u, v, 0x80008000, u, 0xEA;",
                  "mul.rn.bf16x2 u, u, c;", f"mul.rn.bf16x2 {out}, u, {scale};"]
    return "\n".join([*lines, "}"])


def _decode_asm(codes_u8: jax.Array, s: jax.Array, tkh: int):
    """``(lo, hi)`` bf16 ``[tn, tkh]`` from the ``u8`` tile via :func:`_mxfp4_asm`."""
    sf = _bf16_from_bits(_broadcast_groups(_scale_bf16_bits(s), tkh))
    out = jax.ShapeDtypeStruct(codes_u8.shape, jnp.bfloat16)
    # One result per asm block: this JAX's Pallas lowering of elementwise_inline_asm returns a single value.
    return tuple(pltriton.elementwise_inline_asm(_mxfp4_asm(high), args=[codes_u8, sf], constraints="=r,=r,r,r,r",
                                                 pack=4, result_shape_dtypes=[out])[0]
                 for high in (False, True))


def _decode_tile(codes_u8: jax.Array, scales_u8: jax.Array, dtype, interpret: bool):
    """``(lo, hi)`` in ``dtype`` ``[tn, tkh]`` (even / odd K columns) of one packed tile (see the comment above)."""
    tkh = codes_u8.shape[1]
    s = scales_u8.astype(jnp.int32) & 0xFF
    if jnp.dtype(dtype) == jnp.bfloat16 and not interpret:
        return _decode_asm(codes_u8, s, tkh)
    codes = codes_u8.astype(jnp.int32)
    f = _broadcast_groups(_scale_factor(s), tkh)
    return _decode(codes, f, dtype), _decode(codes >> 4, f, dtype)


def _gmm_mxfp4_kernel(gid_ref, row0_ref, ends_ref, num_ref, layer_ref, x_ref, *refs,
                      tm: int, tkh: int, tn: int, kh: int, num_groups: int, n_rhs: int, epilogue, interpret: bool,
                      stacked: bool):
    """``refs = (codes_1, scales_1[, codes_2, scales_2], out)``, with ``stacked`` weights ``[L, E, ...]`` read at
    layer ``layer_ref[0]``; x is in even|odd column order."""
    w_refs, out_ref = refs[:2 * n_rhs], refs[2 * n_rhs]
    t = pl.program_id(1)
    j = pl.program_id(0)

    @pl.when(t < num_ref[0])
    def _run():
        g, r0, smask = _tile_rows(gid_ref, row0_ref, ends_ref, t, tm)
        n0 = pl.multiple_of(j * tn, tn)
        gw = jnp.minimum(g, num_groups - 1)
        at = (layer_ref[0], gw) if stacked else (gw,)
        ts = tkh // 16  # scales per K step (one per 32 elements = 16 packed bytes)

        def body(kk, accs):
            k0 = pl.multiple_of(kk * tkh, tkh)
            a_lo = pltriton.load(x_ref.at[pl.ds(r0, tm), pl.ds(k0, tkh)], mask=smask[:, None], other=0.0)
            a_hi = pltriton.load(x_ref.at[pl.ds(r0, tm), pl.ds(kh + k0, tkh)], mask=smask[:, None], other=0.0)
            out = []
            for r in range(n_rhs):
                codes = w_refs[2 * r][(*at, pl.ds(n0, tn), pl.ds(k0, tkh))]
                sc = w_refs[2 * r + 1][(*at, pl.ds(n0, tn), pl.ds(kk * ts, ts))]
                lo, hi = _decode_tile(codes, sc, a_lo.dtype, interpret)  # even / odd K columns
                acc = accs[r] + jax.lax.dot_general(a_lo, lo, (((1,), (1,)), ((), ())),
                                                    preferred_element_type=jnp.float32)
                acc = acc + jax.lax.dot_general(a_hi, hi, (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.float32)
                out.append(acc)
            return tuple(out)

        dst = out_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)]

        # A static trip count (a traced one lowers to an scf.for whose bounds Triton rejects, seen on the
        # H200); the virtual trailing group (rows past sum(group_sizes)) streams no weights and stores zeros.
        @pl.when(g < num_groups)
        def _real_group():
            accs = tuple(jnp.zeros((tm, tn), jnp.float32) for _ in range(n_rhs))
            accs = jax.lax.fori_loop(0, kh // tkh, body, accs)
            val = epilogue(*accs) if epilogue is not None else accs[0]
            pltriton.store(dst, val.astype(out_ref.dtype), mask=smask[:, None])

        @pl.when(g >= num_groups)
        def _virtual_group():
            pltriton.store(dst, jnp.zeros((tm, tn), out_ref.dtype), mask=smask[:, None])


def gmm_mxfp4(
    x: jax.Array,
    weights: list[tuple[jax.Array, jax.Array]],
    group_sizes: jax.Array,
    *,
    epilogue=None,
    out_dtype=None,
    tiles: tuple[int, int, int, int, int] | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Grouped matmul with MXFP4 weights decoded in registers: ``x[rows of g] @ W[g]^T`` for HF ``W [E, N, K]``.

    Args:
      x: ``[M, K]`` bf16/f32 activations sorted by expert (natural column order).
      weights: one ``(codes u8 [E, N, K/2], scales u8 [E, N, K/32])`` pair (HF layout, as stored in the
        checkpoint: no transpose, no dequantized copy), or two with ``epilogue(acc1, acc2) -> f32``.
      group_sizes: ``[E] i32``; experts with no rows are not read.
      tiles: ``(tm, tkh, tn, num_warps, num_stages)``; tkh counts packed bytes (K/2) per step, a multiple of 16.
      layer: i32 scalar: every codes/scales array is a stack ``[L, E, ...]`` read in place at that layer
        (clamped into ``[0, L)``).
    Returns:
      ``[M, N]`` in ``out_dtype`` (default ``x.dtype``); rows past ``sum(group_sizes)`` are 0. Forward only.
    """
    if not 1 <= len(weights) <= 2 or (len(weights) == 2) != (epilogue is not None):
        raise ValueError("gpu.gmm_mxfp4: pass one weight, or two weights with an epilogue")
    m, k = x.shape
    codes0, _ = weights[0]
    lyr = [_layer_index(a, layer, 3) for w in weights for a in w][0]  # checks every array's rank
    lead, (e, n, kh) = codes0.shape[:-3], codes0.shape[-3:]
    for codes, scales in weights:
        if codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
            raise TypeError(f"gpu.gmm_mxfp4: codes/scales must be u8, got {codes.dtype}/{scales.dtype}")
        if codes.shape != (*lead, e, n, kh) or scales.shape != (*lead, e, n, k // 32):
            raise ValueError(f"gpu.gmm_mxfp4: x [M, K={k}] needs codes [(L,) E, N, {k // 2}] and scales "
                             f"[(L,) E, N, {k // 32}], got {codes.shape} / {scales.shape} (first codes {codes0.shape})")
    if 2 * kh != k or k % 32:
        raise ValueError(f"gpu.gmm_mxfp4: x has K={k} but codes {codes0.shape} imply K={2 * kh} (K % 32 == 0)")
    tm, tkh, tn, warps, stages = tiles or MXFP4_TILES
    tkh, tn = min(tkh, kh), min(tn, n)
    if kh % tkh or tkh % 16 or n % tn:
        raise ValueError(f"gpu.gmm_mxfp4: K/2={kh}, N={n} must be multiples of tkh={tkh} (a multiple of 16), "
                         f"tn={tn}")
    xe = even_odd_columns(x)
    # The interpreter clamps out-of-range slices instead of masking them: give it tm spare rows.
    xe = jnp.pad(xe, ((0, tm), (0, 0))) if interpret else xe
    gid, row0, ends, num = make_tile_table(group_sizes.astype(jnp.int32), m, tm)
    kernel = functools.partial(_gmm_mxfp4_kernel, tm=tm, tkh=tkh, tn=tn, kh=kh, num_groups=e,
                               n_rhs=len(weights), epilogue=epilogue, interpret=interpret, stacked=layer is not None)
    out = forward_only(pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((xe.shape[0], n), jnp.dtype(out_dtype or x.dtype)),
        grid=(n // tn, gid.shape[0]),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="moe_gmm_mxfp4_gpu",
    ), gid, row0, ends, num, lyr, xe, *[a for w in weights for a in w], name="moe.gpu.gmm_mxfp4")
    return out[:m]
