"""Fused MoE expert FFN first half on Pallas Mosaic GPU (sm_90: TMA loads and stores, wgmma from shared memory):
``h[rows of g] = situ_glu(x[rows of g] @ w1[g], x[rows of g] @ w3[g])`` in one kernel, the gate and up products
kept in fp32 registers and never written to device memory.

Contract (checked by :func:`shape_reason`; :func:`gmm_glu` raises ``ValueError`` with the reason):

* ``x [M, K]`` bf16, rows sorted by expert; ``w1, w3 [E, K, N]`` (cast to bf16); ``group_sizes [E]`` int
  (group ``g`` owns the next ``group_sizes[g]`` rows; ``sum(group_sizes) <= M``, a larger sum is cut at ``M``);
* ``K`` a multiple of ``block_k`` (64) and ``N`` a multiple of ``block_n`` (128 by default);
* output ``[M, N]`` bf16; rows past ``sum(group_sizes)`` are zeros (written by the kernel).

The activation is :func:`pallas_kernels.moe.reference.situ_epilogue` (gate and up rounded to bf16, then fp32
math), so the result matches ``situ_glu(gmm(x, w1), gmm(x, w3))`` of the unfused path.

Design. A row tile is up to ``block_m = 128`` rows of **one** group: an XLA-side tile table
(:func:`tile_table`) lists ``(group, first row, valid rows)`` per tile, one virtual trailing group covering the
rows past ``sum(group_sizes)`` (tiles that store zeros). A persistent grid of
``num_ctas`` CTAs walks the ``(row tile, column tile)`` work items (``plgpu.nd_loop``, a planar snake over column
bands of ``grid_block_n`` tiles so that CTAs running at the same time share weight tiles in L2). Per CTA: three
warpgroups, one issuing TMA loads and two computing (``plgpu.emit_pipeline_warp_specialized``, ``stages`` slots of
``x [128, 64]``, ``w1 [64, block_n]``, ``w3 [64, block_n]``). Compute warpgroup ``w`` owns rows ``64 w ..
64 w + 63`` of the tile and two fp32 accumulators ``[64, block_n]`` (gate and up: 2 x 64 registers per thread at
``block_n = 128``), both wgmma operands in shared memory and the x tile read once for both products. The epilogue
applies SiTU-GLU in registers, writes bf16 to shared memory and stores the tile's valid rows with TMA in
power-of-two row pieces (a static descriptor per piece size, as JAX's ``ragged_dot_mgpu`` does). Row tiles start
on multiples of 8 rows (the swizzled operand layout's tile rows: a TMA box into it starts on one), so a group's
first tile starts up to 7 rows before the group and holds fewer than 128 of its rows; a tile whose 128 rows would
run past ``M`` is loaded from row ``M - 128`` and its valid rows shifted accordingly, so every TMA box lies inside
``x`` (``x`` is padded to a multiple of 8 rows, at least 128, where it is not one).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import interpret_params
from pallas_kernels.moe.reference import grouped_matmul, situ_epilogue

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
WG_ROWS = 64
"""Rows of a tile one compute warpgroup owns (one wgmma M)."""
COMPUTE_WGS = 2
ROW_ALIGN = 8
"""Row tiles are loaded from multiples of this (the 8-row tiling of the swizzled shared-memory layout wgmma reads
needs a TMA box starting on a tile row)."""
DEFAULT_SMS = 132
"""SMs of an H100 SXM / H200: the persistent grid's CTAs."""


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tiling of :func:`gmm_glu`. ``block_m`` is fixed by the two compute warpgroups of 64 rows."""

    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 8
    num_ctas: int = DEFAULT_SMS

    @property
    def block_m(self) -> int:
        return COMPUTE_WGS * WG_ROWS


def blocks_reason(blocks: Blocks) -> str | None:
    """None when ``blocks`` can be compiled (registers, TMA box, shared memory), else why not."""
    if blocks.block_n not in (64, 128, 192):  # two [64, block_n] fp32 accumulators per compute thread
        return f"block_n must be 64, 128 or 192, got {blocks.block_n}"
    if blocks.block_k != 64:
        return f"block_k must be 64 (one 128-byte swizzle row of bf16), got {blocks.block_k}"
    stage_bytes = 2 * (blocks.block_m * blocks.block_k + 2 * blocks.block_k * blocks.block_n)
    out_bytes = 2 * blocks.block_m * blocks.block_n
    if blocks.stages < 2 or blocks.stages * stage_bytes + out_bytes > 227 * 1024:
        return (f"stages={blocks.stages} at block_n={blocks.block_n} needs {blocks.stages * stage_bytes + out_bytes} "
                f"bytes of shared memory (2 <= stages, at most {227 * 1024})")
    return None


def shape_reason(dtype: str, k: int, n: int, blocks: Blocks | None = None) -> str | None:
    """None when ``x [M, K] (dtype) x w [E, K, N]`` fits :func:`gmm_glu` with ``blocks``, else why not."""
    blocks = blocks or default_blocks(n)
    if dtype != "bfloat16":
        return f"takes bfloat16 operands, got {dtype}"
    if k % blocks.block_k:
        return f"needs K a multiple of block_k={blocks.block_k}, got K={k}"
    if n % blocks.block_n:
        return f"needs N a multiple of block_n={blocks.block_n}, got N={n}"
    return blocks_reason(blocks)


def default_blocks(n: int) -> Blocks:
    """128 output columns per tile (64 where N is not a multiple of 128). 192 also compiles (2 stages; 192 of the
    232 registers per compute thread held by the accumulators) but is not the default."""
    return Blocks(block_n=128 if n % 128 == 0 else 64)


def table_size(m: int, e: int, block_m: int) -> int:
    """Entries of :func:`tile_table`: an upper bound on the tiles of ``E + 1`` groups over ``m`` rows (each group's
    tiles start up to ``ROW_ALIGN - 1`` rows before its first row)."""
    return -(-(m + (ROW_ALIGN - 1) * (e + 1)) // block_m) + e + 1


def tile_table(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(group, first row, valid rows)`` per row tile (int32 ``[table_size]`` each; entries past the number of
    tiles unused) and the number of tiles (int32 ``[1]``). Group ``g``'s tiles start at its first row rounded down
    to :data:`ROW_ALIGN` and step by ``block_m``; each holds the group's rows inside its ``block_m``. Group ``E``
    (virtual) holds the rows past ``sum(group_sizes)`` (cut at ``m``)."""
    e = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(I32)), m)
    ends = jnp.concatenate([ends, jnp.full((1,), m, I32)])
    starts = jnp.concatenate([jnp.zeros((1,), I32), ends[:-1]])
    base = starts - starts % ROW_ALIGN
    ntiles = jnp.where(ends > starts, (ends - base + block_m - 1) // block_m, 0)
    cum = jnp.cumsum(ntiles)
    item = jnp.arange(table_size(m, e, block_m), dtype=I32)
    group = jnp.minimum(jnp.searchsorted(cum, item, side="right", method="compare_all"), e).astype(I32)
    tile0 = base[group] + (item - (cum - ntiles)[group]) * block_m
    row0 = jnp.maximum(tile0, starts[group])
    rows = jnp.clip(jnp.minimum(ends[group], tile0 + block_m) - row0, 0, block_m)
    return group, row0.astype(I32), rows.astype(I32), cum[-1:].astype(I32)


def _store_piece(o_smem, o_gmem, smem_row, gmem_row, size: int, cols, when) -> None:
    @pl.when(when)
    def _():
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(smem_row, size)], o_gmem.at[pl.ds(gmem_row, size), cols])


def _store_rows(o_smem, o_gmem, smem_row, gmem_row, count, cols, limit: int) -> None:
    """TMA-store rows ``smem_row .. smem_row + count - 1`` of ``o_smem`` to ``o_gmem`` rows from ``gmem_row``
    (``count`` dynamic, ``0 <= count <= limit``): one copy per set bit of ``count``, largest first (TMA boxes
    have static sizes)."""
    size = 1 << (limit.bit_length() - 1)
    while size >= 1:
        _store_piece(o_smem, o_gmem, smem_row, gmem_row, size, cols, count & size != 0)
        smem_row = smem_row + (count & size)
        gmem_row = gmem_row + (count & size)
        size //= 2


def _kernel(group_ref, row0_ref, rows_ref, num_ref, x_gmem, w1_gmem, w3_gmem, o_gmem, *, blocks: Blocks,
            epilogue, num_groups: int):
    m, k = x_gmem.shape
    n = o_gmem.shape[1]
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    grid_n = n // bn
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def pipeline(body, compute_context):
        spec = lambda shape, index: plgpu.BlockSpec(shape, index, transforms=tiled, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // bk,), memory_registers=40, wg_axis="wg", num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=blocks.stages, compute_context=compute_context,
            in_specs=[spec((bm, bk), lambda kk: (0, kk)), spec((bk, bn), lambda kk: (kk, 0)),
                      spec((bk, bn), lambda kk: (kk, 0))])

    ignore = lambda *_, **__: None

    @functools.partial(pl.run_scoped,
                       allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w1_gmem.at[0], w3_gmem.at[0]),
                       o_smem=plgpu.SMEM((COMPUTE_WGS, WG_ROWS, bn), BF16), collective_axes="wg")
    def _scope(allocs, o_smem):
        wg = lax.axis_index("wg")
        num = num_ref[0]

        @plgpu.nd_loop((num * grid_n,), collective_axes="sm")
        def _items(info: plgpu.NDLoopInfo):
            t, j = plgpu.planar_snake(info.index[0], (num, grid_n), 1, blocks.grid_block_n)
            g, row0, rows = group_ref[t], row0_ref[t], rows_ref[t]
            # rows load0 .. load0 + 127 are loaded: from the tile's 8-row boundary, kept inside x (m % 8 == 0)
            load0 = pl.multiple_of(jnp.minimum(row0 - row0 % ROW_ALIGN, m - bm), ROW_ALIGN)
            cols = pl.ds(j * bn, bn)
            wg_rows = pl.ds(pl.multiple_of(wg * WG_ROWS, WG_ROWS), WG_ROWS)

            def store(h):
                """This warpgroup's valid rows of the tile (rows ``row0 - load0 ..`` of the loaded 128)."""
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have read o_smem
                o_smem[wg] = h
                plgpu.commit_smem()
                first, last = row0 - load0 - wg * WG_ROWS, row0 - load0 + rows - wg * WG_ROWS
                lo, hi = jnp.clip(first, 0, WG_ROWS), jnp.clip(last, 0, WG_ROWS)
                _store_rows(o_smem.at[wg], o_gmem, lo, load0 + wg * WG_ROWS + lo, hi - lo, cols, WG_ROWS)

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, gate=plgpu.ACC((WG_ROWS, bn), F32),
                                   up=plgpu.ACC((WG_ROWS, bn), F32))
                def _acc(gate, up):
                    eval_pipeline((gate, up))
                    store(epilogue(gate[...], up[...]).astype(BF16))

            def mma(_, x_smem, w1_smem, w3_smem, carry):
                gate, up = carry
                xs = x_smem.at[wg_rows]
                plgpu.wgmma(gate, xs, w1_smem)
                plgpu.wgmma(up, xs, w3_smem)
                plgpu.wgmma_wait(0)
                return carry

            @pl.when(g < num_groups)
            def _products():
                gw = jnp.minimum(g, num_groups - 1)
                pipeline(mma, compute_context)(x_gmem.at[pl.ds(load0, bm)], w1_gmem.at[gw, :, cols],
                                               w3_gmem.at[gw, :, cols], allocations=allocs)

            @pl.when((g >= num_groups) & (wg < COMPUTE_WGS))
            def _zeros():
                store(jnp.zeros((WG_ROWS, bn), BF16))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check(x, w1, w3, group_sizes, blocks: Blocks) -> None:
    m, k = x.shape
    for name, w in (("w1", w1), ("w3", w3)):
        if w.ndim != 3 or w.shape[1] != k or w.shape != w1.shape:
            raise ValueError(f"mosaic_gpu_glu.gmm_glu: {name} must be [E, K={k}, N] like w1 {w1.shape}, got {w.shape}")
    if group_sizes.shape != (w1.shape[0],):
        raise ValueError(f"mosaic_gpu_glu.gmm_glu: group_sizes must be [E={w1.shape[0]}], got {group_sizes.shape}")
    reason = shape_reason(jnp.dtype(x.dtype).name, k, w1.shape[2], blocks)
    if reason is not None:
        raise ValueError(f"mosaic_gpu_glu.gmm_glu: x {x.shape} {x.dtype}, w1/w3 {w1.shape}: {reason}")


def gmm_glu(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array, *, beta1: float = 4.0,
            beta2: float = 25.0, interpret=False, blocks: Blocks | None = None) -> jax.Array:
    """``situ_glu(x @ w1[g], x @ w3[g])`` per group -> ``[M, N]`` bf16 (module docstring for the contract);
    forward only. ``interpret``: run on the Mosaic GPU interpreter (True or a ``plgpu.InterpretGPUParams``)."""
    blocks = blocks or default_blocks(w1.shape[-1])
    _check(x, w1, w3, group_sizes, blocks)
    m0 = x.shape[0]
    m = max(blocks.block_m, -(-m0 // ROW_ALIGN) * ROW_ALIGN)
    if m != m0:  # a copy of x: only where M < 128 or M % 8 != 0
        x = jnp.pad(x, ((0, m - m0), (0, 0)))
    n, e = w1.shape[2], w1.shape[0]
    table = tile_table(group_sizes, m, blocks.block_m)
    body = functools.partial(_kernel, blocks=blocks, epilogue=situ_epilogue(float(beta1), float(beta2), BF16),
                             num_groups=e)
    out = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m, n), BF16), grid=(blocks.num_ctas,), grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
    )(*table, x, w1.astype(BF16), w3.astype(BF16))
    return out[:m0]


def gmm_glu_reference(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array, *, beta1: float = 4.0,
                      beta2: float = 25.0) -> jax.Array:
    """fp32 reference of :func:`gmm_glu`: ``situ_epilogue`` of the fp32 (``HIGHEST``) grouped gate and up products
    (:func:`pallas_kernels.moe.reference.grouped_matmul`; zeros past ``sum(group_sizes)``), in bf16."""
    f32 = lambda a: a.astype(F32)
    gate, up = (grouped_matmul(f32(x), f32(w), group_sizes.astype(I32)) for w in (w1, w3))
    return situ_epilogue(float(beta1), float(beta2), BF16)(gate, up).astype(BF16)
