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
    tiles_of = lambda n: jax.lax.div(n + tm - 1, jnp.int32(tm))  # n >= 0: truncation is floor, no sign fix-ups
    # the groups' running sums as one fused compare-and-sum over [E, E] (a cumsum is a reduce-window plus slices:
    # several kernels per layer and decode step), the trailing group's entries from their last elements
    upto = jnp.arange(e)[None, :] <= jnp.arange(e)[:, None]
    ends_g = jnp.sum(jnp.where(upto, gs[None, :], 0), axis=1)
    cum_g = jnp.sum(jnp.where(upto, tiles_of(gs)[None, :], 0), axis=1)
    trailing = jnp.maximum(m - ends_g[-1], 0)
    sizes = jnp.concatenate([gs, trailing[None]])
    ends = jnp.concatenate([ends_g, (ends_g[-1] + trailing)[None]]).astype(jnp.int32)
    starts = ends - sizes
    ntiles = tiles_of(sizes)
    cum = jnp.concatenate([cum_g, (cum_g[-1] + tiles_of(trailing))[None]])
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
    lyr = layer_index(rhs, layer, 3)
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


def layer_index(w: jax.Array, layer: jax.Array | None, ndim: int) -> jax.Array:
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
# Layout. The kernel loads tiles of the HF codes ``u8 [E, N, K/2]`` and reads each as little-endian ``u16`` words
# (:func:`code_words`, in registers: the byte pairs already share a register, so it compiles to nothing): word j holds
# K elements 4j..4j+3 as its nibbles 0..3 (bits 4c..4c+3 = element 4j + c). The four nibble classes c are decoded
# into four ``[tn, tq]`` tiles, each multiplied with the matching column class of x (:func:`columns_mod4`: x's
# columns reordered c = 0, 1, 2, 3 mod 4), so no tile ever interleaves nibbles. A 16-bit word per decoded 16-bit
# value keeps the decode in the layout of the MMA's A operand: the weights are the A operand, the product is
# ``acc[tn, tm] = W x^T`` (tn the weights' rows, tm the token rows), an mma.sync m16n8k16 for tm = 8 and a wgmma
# (A from registers) for tm >= 16; as the B operand the decoded weights went through shared memory.
#
# bf16 activations on the GPU (inline PTX, two words -> one bf16x2 register per class, 4.5 instructions per two
# elements): ``and`` keeps nibble c of both words, one ``mul.lo`` places its magnitude bits at 6..8 and its sign at
# 15 of each half (the bf16 of E2M1 * 2^-126, +-0.5 a subnormal), ``and`` clears the rest, then one
# ``mul.rn.bf16x2`` by 2^(s - 1 - XSHIFT): the 2^126 of the placement and the scale in one exact multiply; the
# activations carry 2^XSHIFT (``x * 2^XSHIFT``, exact in bf16 for |x| < 2^(128 - XSHIFT)), so the products are
# the exact products. Exact for every E8M0 scale in [EXACT_SCALES[0], EXACT_SCALES[1]]; smaller scales
# (|w| < 6 * 2^(EXACT_SCALES[0] - 127)) round in the bf16 subnormal range; larger scales (and 255, NaN in E8M0)
# decode as +-inf (NaN for code 0): a non-finite output, never a finite wrong one. f32 activations, and the
# interpreter (no inline PTX there), use the f32 decode (:func:`decode_f16`: exact for s in 0..240 on the GPU, 2..240
# on XLA:CPU, which flushes the f32 subnormals of s <= 1), with unscaled activations.
XSHIFT = 16
EXACT_SCALES = (XSHIFT - 5, 128 + XSHIFT)
"""E8M0 scales the bf16 decode gets exactly: every value E2M1 * 2^(s - 127 - XSHIFT) is a bf16 (2^-133, the smallest
subnormal, divides 0.5 * 2^(s - 127 - XSHIFT)), and the factor 2^(s - 1 - XSHIFT) stays below 2^128."""


def columns_mod4(x: jax.Array) -> jax.Array:
    """``[M, K]`` -> ``[M, K]``: columns 0 mod 4, then 1, 2, 3 mod 4 (the nibble classes of the u16 code words)."""
    return jnp.concatenate([x[:, c::4] for c in range(4)], axis=1)


def code_words(codes: jax.Array) -> jax.Array:
    """MXFP4 codes ``u8 [..., K/2]`` -> little-endian ``u16 [..., K/4]`` words (byte 2j low, 2j + 1 high); used
    inside the kernel on a loaded tile (XLA would copy the whole weight for a bitcast of this kind)."""
    lo, hi = jnp.split(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2), 2, axis=-1)
    return lo[..., 0].astype(jnp.uint16) | (hi[..., 0].astype(jnp.uint16) << 8)


def scale_factor_f16(scales: jax.Array) -> jax.Array:
    """E8M0 ``i32 [...]`` -> ``f32 2^(s - 127) * 2^14`` (the 2^14 undoes the f16 placement in :func:`decode_f16`).

    Exact for s in 0..240; 255 (NaN in E8M0) gives NaN; s > 240 (|w| >= 2^114, absent from real weights)
    overflows to inf where the reference is finite.
    """
    f = jax.lax.bitcast_convert_type(scales << 23, jnp.float32) * jnp.float32(16384.0)
    f = jnp.where(scales == 0, jnp.float32(2.0**-113), f)
    return jnp.where(scales == 255, jnp.float32(jnp.nan), f)


def decode_f16(codes: jax.Array, factor: jax.Array, dtype) -> jax.Array:
    """4-bit E2M1 codes (low 4 bits of ``i32 [tn, tq]``; higher bits ignored) x ``factor f32 [tn, tq]``.

    The 3 magnitude bits go to f16 bits 9..11 (exponent low bits + top mantissa bit) and the sign to bit 15:
    the f16 value is ``E2M1 * 2^-14`` exactly, subnormals (+-0.5) included, so no select is needed.
    """
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    v = jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(jnp.float32)
    return (v * factor).astype(dtype)


def _broadcast_groups(v: jax.Array, tq: int) -> jax.Array:
    """``[tn, tq/8]`` (one value per 32 K elements = 8 code words) -> ``[tn, tq]``: a register layout, no smem."""
    tn, ts = v.shape
    return jnp.broadcast_to(v[:, :, None], (tn, ts, 8)).reshape(tn, tq)


def scale_bits_bf16(s: jax.Array) -> jax.Array:
    """E8M0 ``i32`` -> bf16 bits (``i32``) of ``2^(s - 1 - XSHIFT)``, saturated to +inf above EXACT_SCALES[1]."""
    return (jnp.minimum(s, EXACT_SCALES[1] + 1) + (126 - XSHIFT)) << 7


def _mxfp4_asm(cls: int) -> str:
    """Inline PTX for nibble class ``cls`` of two code words: ``$1`` = words w0 (bits 0..15) and w1 (16..31), ``$2``
    = bf16x2 ``2^(s - 1 - XSHIFT)``; ``$0`` = bf16x2 (w0's nibble, w1's nibble) * 2^-XSHIFT, exact (see above)."""
    lines = ["{", ".reg .b32 u;"]
    src = "$1"
    if cls >= 2:  # nibbles 2, 3: the high byte of each half moved down
        lines.append("shr.b32 u, $1, 8;")
        src = "u"
    mask, mult = ("0x00F000F0", "0x104") if cls % 2 else ("0x000F000F", "0x1040")  # shifts 2 + 8, or 6 + 12
    lines += [f"and.b32 u, {src}, {mask};", f"mul.lo.u32 u, u, {mult};", "and.b32 u, u, 0x81C081C0;",
              "mul.rn.bf16x2 $0, u, $2;"]
    return "\n".join([*lines, "}"])


def _decode_tile(words: jax.Array, scales_u8: jax.Array, dtype, interpret: bool) -> list[jax.Array]:
    """The four nibble classes, each ``[tn, tq]`` in ``dtype``, of a ``u16 [tn, tq]`` code-word tile and its
    ``u8 [tn, tq/8]`` scales: times 2^-XSHIFT with bf16 on the GPU (inline PTX), exact values otherwise."""
    tq = words.shape[1]
    s = scales_u8.astype(jnp.int32) & 0xFF
    if jnp.dtype(dtype) == jnp.bfloat16 and not interpret:
        sf = jax.lax.bitcast_convert_type(_broadcast_groups(scale_bits_bf16(s), tq).astype(jnp.int16), jnp.bfloat16)
        out = jax.ShapeDtypeStruct(words.shape, jnp.bfloat16)
        # one result per asm block: this JAX's Pallas lowering of elementwise_inline_asm returns a single value
        return [pltriton.elementwise_inline_asm(_mxfp4_asm(c), args=[words, sf], constraints="=r,r,r", pack=2,
                                                result_shape_dtypes=[out])[0] for c in range(4)]
    w = words.astype(jnp.int32)
    f = _broadcast_groups(scale_factor_f16(s), tq)
    return [decode_f16(w >> (4 * c), f, dtype) for c in range(4)]


def _gmm_mxfp4_kernel(gid_ref, row0_ref, ends_ref, num_ref, layer_ref, x_ref, *refs,
                      tm: int, tq: int, tn: int, kq: int, num_groups: int, n_rhs: int, epilogue, interpret: bool,
                      stacked: bool):
    """``refs = (codes_1, scales_1[, codes_2, scales_2], out)``, with ``stacked`` weights ``[L, E, ...]`` read at
    layer ``layer_ref[0]``; x is in :func:`columns_mod4` order (times 2^XSHIFT on the bf16 PTX path)."""
    w_refs, out_ref = refs[:2 * n_rhs], refs[2 * n_rhs]
    t = pl.program_id(1)
    j = pl.program_id(0)

    @pl.when(t < num_ref[0])
    def _run():
        g, r0, smask = _tile_rows(gid_ref, row0_ref, ends_ref, t, tm)
        n0 = pl.multiple_of(j * tn, tn)
        gw = jnp.minimum(g, num_groups - 1)
        at = (layer_ref[0], gw) if stacked else (gw,)
        ts = tq // 8  # scales per K step (one per 32 elements = 8 code words)
        dims = (((1,), (1,)), ((), ()))  # W [tn, tq] . x [tm, tq] -> [tn, tm]

        def body(kk, accs):
            k0 = pl.multiple_of(kk * tq, tq)
            xs = [pltriton.load(x_ref.at[pl.ds(r0, tm), pl.ds(c * kq + k0, tq)], mask=smask[:, None], other=0.0)
                  for c in range(4)]
            out = []
            for r in range(n_rhs):
                words = code_words(w_refs[2 * r][(*at, pl.ds(n0, tn), pl.ds(2 * k0, 2 * tq))])
                sc = w_refs[2 * r + 1][(*at, pl.ds(n0, tn), pl.ds(kk * ts, ts))]
                acc = accs[r]
                for wc, xc in zip(_decode_tile(words, sc, xs[0].dtype, interpret), xs, strict=True):
                    acc = acc + jax.lax.dot_general(wc, xc, dims, preferred_element_type=jnp.float32)
                out.append(acc)
            return tuple(out)

        dst = out_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)]

        # A static trip count (a traced one lowers to an scf.for whose bounds Triton rejects, seen on the
        # H200); the virtual trailing group (rows past sum(group_sizes)) streams no weights and stores zeros.
        @pl.when(g < num_groups)
        def _real_group():
            accs = tuple(jnp.zeros((tn, tm), jnp.float32) for _ in range(n_rhs))
            accs = jax.lax.fori_loop(0, kq // tq, body, accs)
            val = epilogue(*accs) if epilogue is not None else accs[0]
            pltriton.store(dst, val.T.astype(out_ref.dtype), mask=smask[:, None])

        @pl.when(g >= num_groups)
        def _virtual_group():
            pltriton.store(dst, jnp.zeros((tm, tn), out_ref.dtype), mask=smask[:, None])


MXFP4_TILES = {8: (128, 64, 4, 3), 16: (64, 64, 4, 3)}
""":func:`gmm_mxfp4`'s tiles ``(tq, tn, num_warps, num_stages)`` by token rows per tile (8, or 16 and more); tq
counts u16 code words (4 K elements each) per K step. An 8-row product is an mma.sync m16n8k16 (A = the decoded
weights in registers); 16+ rows make Triton take wgmma, whose register operand stays live for the whole K step,
so the step is halved there (128 words with 16 rows took ~195 registers and streamed slower, benchmarks/RESULTS.md).
Shared memory, not registers, bounds the programs per SM at 3 stages (the fused w1/w3 kernel at 32 rows: 84 KB, two
per SM), yet 2 stages (four per SM) and, for the fused kernel at 8 rows, the 64-word step streamed slower inside the
decode step (benchmarks/RESULTS.md): the decode's integer work, rather than the loads in flight, looks the bound.
"""


def mxfp4_rows_tile(m: int, e: int) -> int:
    """Token rows per tile for ``m`` rows over ``e`` experts: twice the mean rows per expert as a power of two in
    [8, 32], so that most experts' rows fit one tile (each extra tile decodes and streams the expert's weights
    again). 32 at most: a 64-row tile takes 113 KB of shared memory (one program per SM)."""
    want = 2 * -(-m // max(e, 1))
    return int(min(32, max(8, 1 << (want - 1).bit_length())))


def mxfp4_tiles(m: int, e: int) -> tuple[int, int, int, int, int]:
    """``(tm, tq, tn, num_warps, num_stages)`` of :func:`gmm_mxfp4` for ``m`` rows over ``e`` experts."""
    tm = mxfp4_rows_tile(m, e)
    return (tm, *MXFP4_TILES[min(tm, 16)])


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
        checkpoint: no transpose, no dequantized copy), or two with ``epilogue(acc1, acc2) -> f32`` (elementwise).
      group_sizes: ``[E] i32``; experts with no rows are not read.
      tiles: ``(tm, tq, tn, num_warps, num_stages)`` (default :func:`mxfp4_tiles`); tm a power of two >= 8; tq
        counts u16 code words (4 K elements) per step, a multiple of 8 (16 or more when compiled).
      layer: i32 scalar: every codes/scales array is a stack ``[L, E, ...]`` read in place at that layer
        (clamped into ``[0, L)``).
    Returns:
      ``[M, N]`` in ``out_dtype`` (default ``x.dtype``); rows past ``sum(group_sizes)`` are 0. Forward only.
      With bf16 ``x`` compiled for the GPU, exact products for E8M0 scales in ``EXACT_SCALES`` and ``|x| <
      2^(128 - XSHIFT)`` (see the comment above :data:`XSHIFT`).
    """
    if not 1 <= len(weights) <= 2 or (len(weights) == 2) != (epilogue is not None):
        raise ValueError("gpu.gmm_mxfp4: pass one weight, or two weights with an epilogue")
    m, k = x.shape
    codes0, _ = weights[0]
    lyr = [layer_index(a, layer, 3) for w in weights for a in w][0]  # checks every array's rank
    lead, (e, n, kh) = codes0.shape[:-3], codes0.shape[-3:]
    for codes, scales in weights:
        if codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
            raise TypeError(f"gpu.gmm_mxfp4: codes/scales must be u8, got {codes.dtype}/{scales.dtype}")
        if codes.shape != (*lead, e, n, kh) or scales.shape != (*lead, e, n, k // 32):
            raise ValueError(f"gpu.gmm_mxfp4: x [M, K={k}] needs codes [(L,) E, N, {k // 2}] and scales "
                             f"[(L,) E, N, {k // 32}], got {codes.shape} / {scales.shape} (first codes {codes0.shape})")
    if 2 * kh != k or k % 32:
        raise ValueError(f"gpu.gmm_mxfp4: x has K={k} but codes {codes0.shape} imply K={2 * kh} (K % 32 == 0)")
    tm, tq, tn, warps, stages = tiles or mxfp4_tiles(m, e)
    kq = k // 4
    tq, tn = min(tq, kq), min(tn, n)
    if kq % tq or tq % 8 or n % tn:
        raise ValueError(f"gpu.gmm_mxfp4: K/4={kq}, N={n} must be multiples of tq={tq} (a multiple of 8), tn={tn}")
    xe = columns_mod4(x)
    if x.dtype == jnp.bfloat16 and not interpret:  # the PTX decode's weights carry 2^-XSHIFT
        xe = xe * jnp.asarray(2.0**XSHIFT, xe.dtype)
    # The interpreter clamps out-of-range slices instead of masking them: give it tm spare rows.
    xe = jnp.pad(xe, ((0, tm), (0, 0))) if interpret else xe
    gid, row0, ends, num = make_tile_table(group_sizes.astype(jnp.int32), m, tm)
    kernel = functools.partial(_gmm_mxfp4_kernel, tm=tm, tq=tq, tn=tn, kq=kq, num_groups=e,
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
