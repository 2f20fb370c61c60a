"""Grouped matmul kernels for NVIDIA GPUs (Pallas, Triton lowering).

Each program computes one ``[tm, tn]`` output tile of one group. Row tiles are aligned to group starts
(group ``g``'s rows ``[start_g, end_g)`` are cut into ``ceil(size_g / tm)`` tiles), so no tile mixes
groups and every output row is written exactly once with a masked store; the trailing rows past
``sum(group_sizes)`` form a virtual group that stores zeros. The tile table (group, first row) is computed
under ``jit`` with a static upper bound of ``ceil(M / tm) + E`` tiles; programs past the live count exit.

- :func:`gmm`: forward (``rhs [E, K, N]``, or ``[E, N, K]`` with ``transpose_rhs``) with ``custom_vjp``:
  ``dlhs = gmm(dout, rhs, transpose_rhs=True)``, ``drhs = tgmm(lhs, dout)``.
- :func:`tgmm`: one program per (group, K tile, N tile), looping over that group's rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


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
    gid = jnp.searchsorted(cum, i, side="right").astype(jnp.int32)
    row0 = (starts[gid] + (i - (cum - ntiles)[gid]) * tm).astype(jnp.int32)
    return gid, row0, ends, num.reshape(1).astype(jnp.int32)


def _gmm_kernel(gid_ref, row0_ref, ends_ref, num_ref, lhs_ref, rhs_ref, out_ref, *,
                tm: int, tk: int, tn: int, k: int, num_groups: int, trans_b: bool):
    t = pl.program_id(1)
    j = pl.program_id(0)

    @pl.when(t < num_ref[0])
    def _run():
        g = gid_ref[t]
        r0 = row0_ref[t]
        end = ends_ref[g]
        rows = r0 + jnp.arange(tm, dtype=jnp.int32)
        rmask = (rows < end) & (g < num_groups)  # the virtual trailing group loads zeros, stores zeros
        n0 = pl.multiple_of(j * tn, tn)
        gw = jnp.minimum(g, num_groups - 1)
        smask = rows < end

        def body(kk, acc):
            k0 = pl.multiple_of(kk * tk, tk)
            a = pltriton.load(lhs_ref.at[pl.ds(r0, tm), pl.ds(k0, tk)], mask=rmask[:, None], other=0.0)
            if trans_b:
                b = rhs_ref[gw, pl.ds(n0, tn), pl.ds(k0, tk)].T
            else:
                b = rhs_ref[gw, pl.ds(k0, tk), pl.ds(n0, tn)]
            return acc + jnp.dot(a, b.astype(a.dtype), preferred_element_type=jnp.float32)

        acc = jnp.zeros((tm, tn), jnp.float32)
        acc = jax.lax.fori_loop(0, k // tk, body, acc)
        pltriton.store(out_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)], acc.astype(out_ref.dtype), mask=smask[:, None])


def _gmm_call(lhs, rhs, group_sizes, *, trans_b, out_dtype, tiles, interpret):
    m, k = lhs.shape
    e = rhs.shape[0]
    n = rhs.shape[1] if trans_b else rhs.shape[2]
    tm, tk, tn, warps, stages = tiles
    gid, row0, ends, num = make_tile_table(group_sizes, m, tm)
    kernel = functools.partial(_gmm_kernel, tm=tm, tk=tk, tn=tn, k=k, num_groups=e, trans_b=trans_b)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n // tn, gid.shape[0]),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="moe_gmm_gpu",
    )(gid, row0, ends, num, lhs, rhs)


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


DEFAULT_TILES = (128, 64, 128, 8, 4)  # tm, tk, tn, num_warps, num_stages
TGMM_TILES = (64, 128, 128, 8, 3)


def _fit(tiles, k, n):
    tm, tk, tn, w, s = tiles
    return tm, min(tk, k), min(tn, n), w, s


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
) -> jax.Array:
    """Grouped matmul ``lhs [M, K] x rhs [E, K, N] -> [M, N]`` (ragged_dot semantics), differentiable.

    K and N must be multiples of the K/N tiles (64/128 by default, or smaller than one tile and a power
    of two). ``tiles = (tm, tk, tn, num_warps, num_stages)``.
    """
    k, n = rhs.shape[1], rhs.shape[2]
    tiles = _fit(tiles or DEFAULT_TILES, k, n)
    if k % tiles[1] or n % tiles[2]:
        raise ValueError(f"gpu.gmm: K={k}, N={n} must be multiples of the tiles (tk={tiles[1]}, tn={tiles[2]})")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    m = lhs.shape[0]
    # The interpreter clamps out-of-range slices instead of masking them: give it tm spare rows.
    x = jnp.pad(lhs, ((0, tiles[0]), (0, 0))) if interpret else lhs
    out = _gmm_vjp(x, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), tiles, out_dtype, interpret)
    return out[:m]


def tgmm(lhs, dout, group_sizes, *, tiles=None, out_dtype=jnp.float32, interpret=False) -> jax.Array:
    """Per-group ``lhs[rows of g]^T @ dout[rows of g]`` -> ``[E, K, N]`` (zeros for empty groups)."""
    tiles = _fit(tiles or TGMM_TILES, lhs.shape[1], dout.shape[1])
    if interpret:
        lhs, dout = (jnp.pad(a, ((0, tiles[0]), (0, 0))) for a in (lhs, dout))
    return _tgmm_call(lhs, dout.astype(lhs.dtype), group_sizes.astype(jnp.int32), out_dtype=out_dtype,
                      tiles=tiles, interpret=interpret)
