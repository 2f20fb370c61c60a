"""Grouped matmul kernels for TPU (Pallas / Mosaic), megablox-style.

Rows of ``lhs [M, K]`` are sorted by group; ``group_sizes [E] i32``. The grid walks a static upper bound
of "visits" (``tiles_m + E``): each visit is one (row tile, group) pair, listed in row order, so a row tile
shared by several groups is visited once per group, consecutively, and its output block stays resident in
VMEM between those visits (masked stores merge the groups). The visit tables (group id and row tile per
visit, group row offsets, number of live visits) are computed under ``jit`` from ``group_sizes`` and passed
as scalar prefetch (SMEM); visits past the live count repeat the last live block indices (no DMA) and do
no work. Rows past ``sum(group_sizes)`` form a virtual group ``E`` that writes zeros.

Kernels
- :func:`gmm`: ``out[rows of g] = lhs[rows of g] @ rhs[g]`` (``rhs [E, K, N]``, or ``[E, N, K]`` with
  ``transpose_rhs``), f32 accumulation in VMEM scratch over the K grid axis.
- :func:`tgmm`: ``out[g] = lhs[rows of g]^T @ dout[rows of g]`` -> ``[E, K, N]`` (weight gradient); every
  group, empty ones included, gets at least one visit so empty groups produce zeros.
- :func:`gmm_mxfp4`: ``rhs`` as MXFP4 in the HF layout (``codes u8 [E, N, K/2]``, ``scales u8 [E, N, K/32]``),
  decoded per tile in VMEM; the K axis is one tile.
- :func:`gmm_glu`: two rhs (w1, w3) with the SiTU-GLU epilogue; writes only ``[M, I]``.

Stacked weights (``layer=`` an i32 scalar; :func:`gmm`, :func:`gmm_glu`, :func:`gmm_mxfp4`, forward only): the
weights are the whole ``[L, E, ...]`` stack of a scanned layer segment and the layer index is one more scalar
prefetch that the weights' index maps read, so a one-token decode step reads the layer's experts in place
instead of a per-layer slice that XLA copies out of the stack.

Every kernel hands XLA a cost estimate (``pl.CostEstimate``: flops and the HBM bytes its blocks move, the
weights of at most ``min(E, rows)`` experts), so XLA's cost analysis of a program counts the kernels' traffic.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.forward_only import forward_only
from pallas_kernels.moe.reference import situ_epilogue

HI = jax.lax.Precision.HIGHEST


class GroupMetadata(NamedTuple):
    """Scalar-prefetch tables. ``starts/ends [E+1] i32`` row ranges (index E = trailing rows),
    ``group_ids/m_tile_ids [V] i32`` per visit, ``num_visits [1] i32`` live visits."""

    starts: jax.Array
    ends: jax.Array
    group_ids: jax.Array
    m_tile_ids: jax.Array
    num_visits: jax.Array


def make_group_metadata(group_sizes: jax.Array, m: int, tm: int, *, visit_empty: bool) -> GroupMetadata:
    """Visit tables for ``m`` rows in tiles of ``tm`` (``m % tm == 0``); jit-friendly (static shapes)."""
    e = group_sizes.shape[0]
    tiles_m = m // tm
    gs = group_sizes.astype(jnp.int32)
    trailing = jnp.maximum(m - jnp.sum(gs), 0)
    sizes = jnp.concatenate([gs, trailing[None]])
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    starts = ends - sizes
    first_tile = jnp.minimum(starts // tm, tiles_m - 1)
    last_tile = jnp.maximum(ends - 1, 0) // tm
    empty_visits = jnp.where(jnp.arange(e + 1) < e, 1 if visit_empty else 0, 0)
    ntiles = jnp.where(sizes > 0, last_tile - first_tile + 1, empty_visits).astype(jnp.int32)
    cum = jnp.cumsum(ntiles)
    visit_start = cum - ntiles
    num = cum[-1]
    v = tiles_m + e
    i = jnp.minimum(jnp.arange(v, dtype=jnp.int32), num - 1)
    gid = jnp.searchsorted(cum, i, side="right").astype(jnp.int32)
    mtile = (first_tile[gid] + i - visit_start[gid]).astype(jnp.int32)
    return GroupMetadata(starts, ends, gid, mtile, num.reshape(1).astype(jnp.int32))


def _interp(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _params(sem: tuple[str, ...]):
    kinds = {"p": pltpu.PARALLEL, "a": pltpu.ARBITRARY}
    return pltpu.CompilerParams(dimension_semantics=tuple(kinds[s] for s in sem), vmem_limit_bytes=64 << 20)


def _pick(dim: int, pref: int, align: int) -> int:
    """Largest tile <= pref dividing dim and a multiple of align; the full dim if none."""
    t = min(pref, dim) // align * align
    while t >= align:
        if dim % t == 0:
            return t
        t -= align
    return dim


def _row_mask(meta_refs, i, g, tm: int, width: int):
    starts_ref, ends_ref, _, mtile_ref, _ = meta_refs
    rows = mtile_ref[i] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, width), 0)
    return (rows >= starts_ref[g]) & (rows < ends_ref[g])


def _store_merged(meta_refs, out_ref, value, i, g, tm: int):
    """Masked store of this visit's rows; the first visit of a row tile zero-fills the other rows."""
    mtile_ref = meta_refs[3]
    mask = _row_mask(meta_refs, i, g, tm, out_ref.shape[-1])
    first = jnp.logical_or(i == 0, mtile_ref[jnp.maximum(i - 1, 0)] != mtile_ref[i])
    prev = jnp.where(first, jnp.zeros(out_ref.shape, out_ref.dtype), out_ref[...])
    out_ref[...] = jnp.where(mask, value.astype(out_ref.dtype), prev)


def _dot(a, b, trans_b: bool):
    prec = HI if a.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------- gmm
def _gmm_kernel(*refs, num_groups: int, tm: int, nk: int, trans_b: bool, n_rhs: int, epilogue, n_prefetch: int):
    meta_refs = refs[:5]
    lhs_ref = refs[n_prefetch]
    rhs_refs = refs[n_prefetch + 1:n_prefetch + 1 + n_rhs]
    out_ref = refs[n_prefetch + 1 + n_rhs]
    acc_refs = refs[n_prefetch + 2 + n_rhs:]
    i, k = pl.program_id(1), pl.program_id(2)
    g = meta_refs[2][i]
    live = i < meta_refs[4][0]

    @pl.when(k == 0)
    def _zero():
        for acc in acc_refs:
            acc[...] = jnp.zeros(acc.shape, acc.dtype)

    @pl.when(live & (g < num_groups))
    def _acc():
        x = lhs_ref[...]
        for rhs_ref, acc in zip(rhs_refs, acc_refs, strict=True):
            acc[...] += _dot(x, rhs_ref[0].astype(x.dtype), trans_b)

    @pl.when(live & (k == nk - 1))
    def _out():
        vals = [acc[...] for acc in acc_refs]
        val = epilogue(*vals) if epilogue is not None else vals[0]
        _store_merged(meta_refs, out_ref, val, i, g, tm)


def _layer_prefetch(arrays: list[jax.Array], layer: jax.Array | None, ndim: int, name: str) -> list[jax.Array]:
    """The scalar-prefetch operand ``[i32 [1]]`` of a kernel reading stacked weights ``[L, ...]`` (``ndim + 1``
    dims) at ``layer`` (clamped into ``[0, L)``, as ``dynamic_slice`` clamps), or ``[]`` for unstacked weights
    (``ndim`` dims)."""
    want = ndim if layer is None else ndim + 1
    for a in arrays:
        if a.ndim != want:
            raise ValueError(f"{name}: expert weight of shape {a.shape} must have {want} dims "
                             f"({'stacked [L, ...] with layer=' if layer is not None else 'no layer='})")
    if layer is None:
        return []
    return [jnp.clip(jnp.reshape(layer, (1,)).astype(jnp.int32), 0, arrays[0].shape[0] - 1)]


def _weight_block(block: tuple[int, ...], index_map, stacked: bool) -> pl.BlockSpec:
    """BlockSpec of a per-expert weight block; stacked weights get a leading squeezed layer dim read at the
    prefetched layer (the last scalar-prefetch operand)."""
    if not stacked:
        return pl.BlockSpec(block, index_map)
    return pl.BlockSpec((None, *block), lambda *a: (a[-1][0], *index_map(*a[:-1])))


def _gmm_cost(rows: int, kdim: int, n: int, tn: int, lhs_itemsize: int, out_itemsize: int, groups: int,
              expert_bytes: int, n_rhs: int, epilogue: bool) -> pl.CostEstimate:
    """Cost estimate of one grouped matmul call (``n_rhs`` products ``[rows, kdim] x [kdim, n]``): the lhs swept
    once per column tile of width ``tn``, the output written once, and ``groups`` experts' weights
    (``expert_bytes`` each, all rhs together) read once. With ``groups = min(E, rows)`` the weights are an upper
    bound for any routing (an expert with no rows is not read)."""
    return pl.CostEstimate(
        flops=2 * rows * kdim * n * n_rhs,
        transcendentals=rows * n if epilogue else 0,
        bytes_accessed=(n // tn) * rows * kdim * lhs_itemsize + rows * n * out_itemsize + groups * expert_bytes,
    )


def _gmm_call(lhs, rhs_list, group_sizes, *, tiles, trans_b, out_dtype, interpret, epilogue=None, layer=None,
              rows=None):
    """``rhs [E, K, N]`` (``[E, N, K]`` with ``trans_b``), or stacks ``[L, E, ...]`` read in place at ``layer``.
    ``rows``: the real rows of ``lhs`` before padding (for the cost estimate)."""
    m, kdim = lhs.shape
    lyr = _layer_prefetch(rhs_list, layer, 3, "tpu.gmm")
    e = rhs_list[0].shape[-3]
    n = rhs_list[0].shape[-2] if trans_b else rhs_list[0].shape[-1]
    tm, tk, tn = tiles
    meta = make_group_metadata(group_sizes, m, tm, visit_empty=False)
    v = meta.group_ids.shape[0]
    nk = kdim // tk

    def lhs_map(j, i, k, st, en, gid, mt, nv, *_):
        return mt[i], k

    def rhs_map(j, i, k, st, en, gid, mt, nv):
        g = jnp.minimum(gid[i], e - 1)
        return (g, j, k) if trans_b else (g, k, j)

    def out_map(j, i, k, st, en, gid, mt, nv, *_):
        return mt[i], j

    rhs_block = (1, tn, tk) if trans_b else (1, tk, tn)
    n_rhs = len(rhs_list)
    kernel = functools.partial(
        _gmm_kernel, num_groups=e, tm=tm, nk=nk, trans_b=trans_b, n_rhs=n_rhs, epilogue=epilogue,
        n_prefetch=5 + len(lyr),
    )
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5 + len(lyr),
        grid=(n // tn, v, nk),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map)] + [_weight_block(rhs_block, rhs_map, bool(lyr))] * n_rhs,
        out_specs=pl.BlockSpec((tm, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32) for _ in range(n_rhs)],
    )
    itemsize = jnp.dtype(rhs_list[0].dtype).itemsize
    cost = _gmm_cost(m, kdim, n, tn, jnp.dtype(lhs.dtype).itemsize, jnp.dtype(out_dtype).itemsize,
                     min(e, rows or m), n_rhs * kdim * n * itemsize, n_rhs, epilogue is not None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=spec,
        compiler_params=_params(("p", "a", "a")),
        interpret=_interp(interpret),
        cost_estimate=cost,
        name="moe_gmm",
    )(*meta, *lyr, lhs, *rhs_list)


# ---------------------------------------------------------------------------------------------- tgmm
def _tgmm_kernel(*refs, num_groups: int, tm: int):
    meta_refs = refs[:5]
    lhs_ref, dout_ref, out_ref, acc_ref = refs[5:]
    gid_ref, nv_ref = meta_refs[2], meta_refs[4]
    i = pl.program_id(2)
    g = gid_ref[i]
    num = nv_ref[0]
    live = (i < num) & (g < num_groups)
    first = (i == 0) | (gid_ref[jnp.maximum(i - 1, 0)] != g)
    last = (i == num - 1) | (gid_ref[jnp.minimum(i + 1, gid_ref.shape[0] - 1)] != g)

    @pl.when(live & first)
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(live)
    def _acc():
        x = lhs_ref[...]
        d = dout_ref[...]
        mask = _row_mask(meta_refs, i, g, tm, 1)
        x = jnp.where(mask, x, jnp.zeros_like(x))
        prec = HI if x.dtype == jnp.float32 else None
        acc_ref[...] += jax.lax.dot_general(
            x, d.astype(x.dtype), (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
        )

    @pl.when(live & last)
    def _out():
        out_ref[0] = acc_ref[...].astype(out_ref.dtype)


def _tgmm_call(lhs, dout, group_sizes, *, tiles, out_dtype, interpret):
    m, kdim = lhs.shape
    n = dout.shape[1]
    e = group_sizes.shape[0]
    tm, tk, tn = tiles
    meta = make_group_metadata(group_sizes, m, tm, visit_empty=True)
    v = meta.group_ids.shape[0]

    def lhs_map(kk, j, i, st, en, gid, mt, nv):
        return mt[i], kk

    def dout_map(kk, j, i, st, en, gid, mt, nv):
        return mt[i], j

    def out_map(kk, j, i, st, en, gid, mt, nv):
        return jnp.minimum(gid[i], e - 1), kk, j

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(kdim // tk, n // tn, v),
        in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), dout_map)],
        out_specs=pl.BlockSpec((1, tk, tn), out_map),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    )
    itemsize = jnp.dtype(lhs.dtype).itemsize
    cost = pl.CostEstimate(  # lhs swept once per column tile, dout once per row tile of the output, out written
        flops=2 * m * kdim * n, transcendentals=0,
        bytes_accessed=(n // tn) * m * kdim * itemsize + (kdim // tk) * m * n * itemsize
        + e * kdim * n * jnp.dtype(out_dtype).itemsize)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, num_groups=e, tm=tm),
        out_shape=jax.ShapeDtypeStruct((e, kdim, n), out_dtype),
        grid_spec=spec,
        compiler_params=_params(("p", "p", "a")),
        interpret=_interp(interpret),
        cost_estimate=cost,
        name="moe_tgmm",
    )(*meta, lhs, dout)


# ------------------------------------------------------------------------------------ public (bf16/f32)
def default_tiles(m: int, k: int, n: int, dtype, tiles=None) -> tuple[int, int, int]:
    """(tm, tk, tn): TPU-legal (rows multiple of 8, 16 for bf16; K/N multiples of 128 or the full dim)."""
    if tiles is not None:
        return tiles
    sub = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    return _pick(m, 512, sub), _pick(k, 512, 128), _pick(n, 512, 128)


def _pad_rows(x: jax.Array, tm: int) -> jax.Array:
    pad = (-x.shape[0]) % tm
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm_vjp(lhs, rhs, group_sizes, tiles, out_dtype, interpret, rows):
    return _gmm_call(lhs, [rhs], group_sizes, tiles=tiles, trans_b=False, out_dtype=out_dtype, interpret=interpret,
                     rows=rows)


def _gmm_fwd(lhs, rhs, group_sizes, tiles, out_dtype, interpret, rows):
    return _gmm_vjp(lhs, rhs, group_sizes, tiles, out_dtype, interpret, rows), (lhs, rhs, group_sizes)


def _gmm_bwd(tiles, out_dtype, interpret, rows, res, dout):
    lhs, rhs, group_sizes = res
    tm, tk, tn = tiles
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm_call(dout, [rhs], group_sizes, tiles=(tm, tn, tk), trans_b=True, out_dtype=lhs.dtype,
                     interpret=interpret, rows=rows)
    drhs = _tgmm_call(lhs, dout, group_sizes, tiles=tiles, out_dtype=rhs.dtype, interpret=interpret)
    return dlhs, drhs, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    tiles: tuple[int, int, int] | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Grouped matmul ``lhs [M, K] x rhs [E, K, N] -> [M, N]`` (ragged_dot semantics), differentiable.

    ``rhs`` is cast to ``lhs.dtype``; K and N must be multiples of 128 (or fit one tile); M is padded to
    the row tile. Backward: ``dlhs = gmm(dout, rhs^T)``, ``drhs = tgmm(lhs, dout)``.
    ``layer`` (i32 scalar): ``rhs`` is a stack ``[L, E, K, N]`` read in place at that layer (clamped into
    ``[0, L)``; no copy of the layer's slice when ``rhs`` already has ``lhs.dtype``); that form is forward only.
    """
    m, k = lhs.shape
    tiles = default_tiles(m, k, rhs.shape[-1], lhs.dtype, tiles)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    x = _pad_rows(lhs, tiles[0])
    if layer is not None:
        call = functools.partial(_gmm_call, tiles=tiles, trans_b=False, out_dtype=out_dtype, interpret=interpret,
                                 rows=m)
        out = forward_only(lambda a, w, gs, lyr: call(a, [w], gs, layer=lyr), x, rhs.astype(lhs.dtype),
                           group_sizes.astype(jnp.int32), layer, name="moe.tpu.gmm(layer=)")
        return out[:m]
    out = _gmm_vjp(x, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), tiles, out_dtype, interpret, m)
    return out[:m]


def tgmm(lhs, dout, group_sizes, *, tiles=None, out_dtype=jnp.float32, interpret=False) -> jax.Array:
    """Per-group ``lhs[rows of g]^T @ dout[rows of g]`` -> ``[E, K, N]`` (zeros for empty groups)."""
    m, k = lhs.shape
    tiles = default_tiles(m, k, dout.shape[1], lhs.dtype, tiles)
    x, d = _pad_rows(lhs, tiles[0]), _pad_rows(dout.astype(lhs.dtype), tiles[0])
    return _tgmm_call(x, d, group_sizes.astype(jnp.int32), tiles=tiles, out_dtype=out_dtype, interpret=interpret)


# ------------------------------------------------------------------------------------- fused w1/w3 GLU
def gmm_glu(
    x: jax.Array,
    w1: jax.Array,
    w3: jax.Array,
    group_sizes: jax.Array,
    *,
    beta1: float = 4.0,
    beta2: float = 25.0,
    tiles: tuple[int, int, int] | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """``SiTU-GLU(x @ w1[g], x @ w3[g])`` per group in one kernel -> ``[M, I]`` in ``x.dtype`` (forward only).

    Gate/up products are rounded to ``x.dtype`` before the f32 epilogue, as in the reference.
    ``layer`` (i32 scalar): ``w1``/``w3`` are stacks ``[L, E, K, I]`` read in place at that layer (see :func:`gmm`).
    """
    m, k = x.shape
    tiles = default_tiles(m, k, w1.shape[-1], x.dtype, tiles)
    xp = _pad_rows(x, tiles[0])
    call = functools.partial(_gmm_call, tiles=tiles, trans_b=False, out_dtype=x.dtype, interpret=interpret,
                             epilogue=situ_epilogue(beta1, beta2, x.dtype), rows=m)
    args = (xp, w1.astype(x.dtype), w3.astype(x.dtype), group_sizes.astype(jnp.int32))
    if layer is None:
        return call(args[0], list(args[1:3]), args[3])[:m]
    out = forward_only(lambda a, u, v, gs, lyr: call(a, [u, v], gs, layer=lyr), *args, layer,
                       name="moe.tpu.gmm_glu(layer=)")
    return out[:m]


# ------------------------------------------------------------------------------------------- MXFP4 gmm
def even_odd_columns(x: jax.Array) -> jax.Array:
    """``[M, K]`` -> ``[M, K]`` with even columns first, then odd (the nibble order of the packed codes)."""
    return jnp.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)


def _e2m1(nibbles: jax.Array) -> jax.Array:
    """E2M1 codes ``i32 [...]`` (0..15) -> their values ``f32 [...]``, built as f32 bit patterns (exact)."""
    mag = nibbles & 7
    e = mag >> 1
    mbit = mag & 1
    normal = ((e + 126) << 23) | (mbit << 22)
    sub = jnp.where(mbit == 1, jnp.int32(126 << 23), jnp.int32(0))
    bits = jnp.where(e > 0, normal, sub) | ((nibbles & 8) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _byte_scales(scales_t: jax.Array, kh: int) -> jax.Array:
    """E8M0 exponents ``i32 [K/32, tn]`` (one column per weight row) -> ``f32 [tn, kh]``: the scale
    ``2^(s - 127)`` of packed byte ``j`` of row ``n`` is exponent ``j // 16`` of that row.

    The exponents move onto the lanes by a matmul with a 0/1 spreading matrix: exponents 0..255 and 0/1 are exact
    in bf16 and each output is one product, so the f32 result is exact. Exponents 1..254 as E8M0 defines them
    (0 gives 0, not 2^-127)."""
    nb = scales_t.shape[0]
    blk = jax.lax.broadcasted_iota(jnp.int32, (nb, kh), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (nb, kh), 1)
    spread = jnp.where((col >> 4) == blk, 1.0, 0.0).astype(jnp.bfloat16)
    exps = jax.lax.dot_general(scales_t.astype(jnp.float32).astype(jnp.bfloat16), spread, (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
    return jax.lax.bitcast_convert_type(exps.astype(jnp.int32) << 23, jnp.float32)


def _gmm_mxfp4_kernel(*refs, num_groups: int, tm: int, kh: int, epilogue, n_rhs: int, n_prefetch: int):
    meta_refs = refs[:5]
    lhs_ref = refs[n_prefetch]
    w_refs = refs[n_prefetch + 1:n_prefetch + 1 + 2 * n_rhs]
    out_ref = refs[n_prefetch + 1 + 2 * n_rhs]
    i = pl.program_id(1)
    g = meta_refs[2][i]
    live = i < meta_refs[4][0]

    @pl.when(live)
    def _run():
        x = lhs_ref[...]
        x_even, x_odd = x[:, :kh], x[:, kh:]
        vals = []
        for r in range(n_rhs):
            codes = w_refs[2 * r][...].astype(jnp.int32)  # [tn, kh]: row n of HF W [N, K], two elements a byte
            scale = _byte_scales(w_refs[2 * r + 1][...].astype(jnp.int32), kh)  # [tn, kh]
            lo = (_e2m1(codes & 0xF) * scale).astype(x.dtype)  # elements 2j
            hi = (_e2m1(codes >> 4) * scale).astype(x.dtype)  # elements 2j + 1
            acc = _dot(x_even, lo, True) + _dot(x_odd, hi, True)
            vals.append(jnp.where(g < num_groups, acc, 0.0))
        val = epilogue(*vals) if epilogue is not None else vals[0]
        _store_merged(meta_refs, out_ref, val, i, g, tm)


def gmm_mxfp4(
    x: jax.Array,
    weights: list[tuple[jax.Array, jax.Array]],
    group_sizes: jax.Array,
    *,
    epilogue=None,
    out_dtype=None,
    tm: int | None = None,
    tn: int | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Grouped matmul with MXFP4 rhs decoded in VMEM: ``x [M, K] @ W[g]^T`` for HF ``W [E, N, K]``.

    Args:
      x: ``[M, K]`` bf16/f32 activations sorted by expert (natural column order; permuted here to even|odd).
      weights: ``(codes u8 [E, N, K/2], scales u8 [E, N, K/32])`` pairs in the HF layout, as stored (1, or 2 with
        ``epilogue(acc1, acc2) -> f32``). The kernel reads the codes as they are and the scales as
        ``[E, K/32, N]`` (``swapaxes``): XLA:TPU's default layout of a u8 array whose last dim is under 128 (K/32
        for K < 4096, e.g. K3's 3584 and 3072) already stores it that way, so neither is copied.
      layer: i32 scalar: every codes/scales array is a stack ``[L, E, ...]`` read in place at that layer (clamped
        into ``[0, L)``): no copy of the layer's slice.
    Returns ``[M, N]`` in ``out_dtype`` (default ``x.dtype``); rows past ``sum(group_sizes)`` are 0. Forward only.
    The cost estimate given to XLA counts ``min(E, M)`` experts' weights: what the kernel reads at most.
    """
    if not 1 <= len(weights) <= 2 or (len(weights) == 2) != (epilogue is not None):
        raise ValueError("tpu.gmm_mxfp4: pass one weight, or two weights with an epilogue")
    m, k = x.shape
    codes0 = weights[0][0]
    lyr = _layer_prefetch([a for w in weights for a in w], layer, 3, "tpu.gmm_mxfp4")
    lead, (e, n, kh) = codes0.shape[:-3], codes0.shape[-3:]
    for codes, scales in weights:
        if codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
            raise TypeError(f"tpu.gmm_mxfp4: codes/scales must be u8, got {codes.dtype}/{scales.dtype}")
        if codes.shape != (*lead, e, n, k // 2) or scales.shape != (*lead, e, n, k // 32) or k % 32:
            raise ValueError(f"tpu.gmm_mxfp4: x [M, K={k}] needs codes [(L,) E, N, {k // 2}] and scales "
                             f"[(L,) E, N, {k // 32}] (K % 32 == 0), got {codes.shape} / {scales.shape} "
                             f"(first codes {codes0.shape})")
    sub = 16 if x.dtype == jnp.bfloat16 else 8
    tm = tm or _pick(m, 256, sub)
    tn = tn or _pick(n, 256, 128)
    xp = _pad_rows(even_odd_columns(x), tm)
    mp = xp.shape[0]
    meta = make_group_metadata(group_sizes.astype(jnp.int32), mp, tm, visit_empty=False)
    v = meta.group_ids.shape[0]

    def lhs_map(j, i, st, en, gid, mt, nv, *_):
        return mt[i], 0

    def codes_map(j, i, st, en, gid, mt, nv):
        return jnp.minimum(gid[i], e - 1), j, 0

    def scales_map(j, i, st, en, gid, mt, nv):
        return jnp.minimum(gid[i], e - 1), 0, j

    def out_map(j, i, st, en, gid, mt, nv, *_):
        return mt[i], j

    w_specs, args = [], []
    for codes, scales in weights:
        w_specs += [_weight_block((None, tn, kh), codes_map, bool(lyr)),
                    _weight_block((None, k // 32, tn), scales_map, bool(lyr))]
        args += [codes, jnp.swapaxes(scales, -1, -2)]
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5 + len(lyr),
        grid=(n // tn, v),
        in_specs=[pl.BlockSpec((tm, k), lhs_map)] + w_specs,
        out_specs=pl.BlockSpec((tm, tn), out_map),
    )
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    cost = _gmm_cost(mp, k, n, tn, jnp.dtype(x.dtype).itemsize, out_dtype.itemsize, min(e, m),
                     len(weights) * (n * kh + n * (k // 32)), len(weights), epilogue is not None)
    kernel = functools.partial(_gmm_mxfp4_kernel, num_groups=e, tm=tm, kh=kh, epilogue=epilogue,
                               n_rhs=len(weights), n_prefetch=5 + len(lyr))
    out = forward_only(pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid_spec=spec,
        compiler_params=_params(("p", "a")),
        interpret=_interp(interpret),
        cost_estimate=cost,
        name="moe_gmm_mxfp4",
    ), *meta, *lyr, xp, *args, name="moe.tpu.gmm_mxfp4")
    return out[:m]
