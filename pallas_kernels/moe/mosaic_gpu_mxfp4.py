"""Grouped matmul with MXFP4 weights for decode on Pallas Mosaic GPU (sm_90: TMA loads, wgmma): the Mosaic GPU
counterpart of :func:`pallas_kernels.moe.gpu.gmm_mxfp4`, same contract (bf16 activations only).

One CTA (one warpgroup) per ``(64 weight rows, tile of the tile table)``: the tile table is
:func:`pallas_kernels.moe.gpu.make_tile_table`'s (``tm`` token rows of one expert per tile, aligned to the
expert's first row; the trailing rows past ``sum(group_sizes)`` form a virtual expert that stores zeros and reads
no weights). The CTA streams its expert's ``[64, K/2]`` codes and ``[64, K/32]`` scales (HF layout, as stored:
viewed as ``[(L ·) E · N, ...]`` rows, so every copy takes one dynamic row slice) and its ``[tm, K]`` token rows
along K through ``stages`` shared-memory slots, :data:`STEP_BYTES` code bytes (``2 * STEP_BYTES`` K elements)
per row and step, one TMA copy per weight tensor and one per :data:`CHUNK_BYTES` of token columns.

Product: ``acc[64, tm] += W[64, 64] @ x^T[64, tm]`` on wgmma (M = the weight rows, N = the token rows). Per
chunk of :data:`CHUNK_BYTES` code bytes (4 scale groups), the ``[64, 64]`` u8 tile is loaded once in the WGMMA
register layout (2 bytes per thread and 8 columns; a 64-byte swizzle keeps the loads free of bank conflicts) and
decoded twice: its low nibbles (the chunk's even K elements) and its high nibbles (the odd ones) each form a
``[64, 64]`` bf16 operand, multiplied with the matching columns of x, which the wrapper reorders per chunk
(:func:`chunk_halves`: the even columns, then the odd), so no nibbles are interleaved in registers. The scales
enter as a ``[64, 64]`` factor built from four per-row ``[64]`` columns. With the operands in registers, one
chunk's two wgmma groups run while the next chunk decodes, and no more (:func:`_mma_registers`), so ``ptxas`` keeps
the wgmma pipeline (no C7511 serialisation) at the default tiles.

Decode (compiled, bf16; :func:`code_bits`): ``u = zext(byte)``; low nibble ``((u & 0xF) * 0x1040) & 0x81C0``, high
nibble ``((u & 0xF0) * 0x104) & 0x81C0`` put the 3 magnitude bits at bf16 bits 6..8 and the sign at 15 (the bf16
of ``E2M1 * 2^-126``, +-0.5 a subnormal); one bf16 multiply by ``2^(s - 1 - XSHIFT)`` applies the scale, and the
activations carry ``2^XSHIFT`` (the Triton kernel's scheme, :data:`pallas_kernels.moe.gpu.XSHIFT`). Exact for E8M0
scales in :data:`pallas_kernels.moe.gpu.EXACT_SCALES` and ``|x| < 2^(128 - XSHIFT)``; larger scales decode as
+-inf (a non-finite output, never a finite wrong one), smaller ones round in the bf16 subnormal range. By default
(:data:`A_PTX`) both nibbles of a register's two bytes decode in one inline-PTX block (:data:`DECODE_PTX`, 9
instructions per 2 code bytes); :data:`A_JAX` writes the same in JAX integer ops; :data:`A_STAGED` writes the
decoded operands to shared memory for wgmma instead of passing them in registers. The Mosaic GPU interpreter
(XLA:CPU flushes subnormal products) decodes through f16 and f32 instead (:func:`pallas_kernels.moe.gpu.decode_f16`:
exact for scales 2..240) with unscaled activations, and stages the operands (it reads every wgmma operand from
memory).

The output tile is rounded to bf16, stored transposed into shared memory and written to ``out [M, N]`` by TMA in
power-of-two row pieces, so a tile writes only its expert's rows.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith

from pallas_kernels.forward_only import forward_only
from pallas_kernels.kda.mosaic_gpu_common import BF16, F32, TMA_BOX, accumulate, interpret_params
from pallas_kernels.moe import gpu
from pallas_kernels.moe.gpu import XSHIFT, make_tile_table, mxfp4_rows_tile

ROWS = 64
"""Weight rows per CTA (the wgmma M)."""
STEP_BYTES = TMA_BOX
"""Code bytes per weight row and pipeline step (one TMA box): 512 K elements, 16 scale groups."""
GROUP_BYTES = 16
"""Code bytes per E8M0 scale (32 K elements)."""
CHUNK_BYTES = 64
"""Code bytes per row decoded at once (4 scale groups, 128 K elements): a ``[64, 64]`` u8 tile with a 64-byte swizzle
loads without bank conflicts, and its two nibble halves are ``[64, 64]`` bf16 wgmma operands (K = 64)."""
A_JAX, A_PTX, A_STAGED = 0, 1, 2
"""Decode modes (``tiles[2]``, compiled): JAX integer ops with the decoded operand in registers, inline PTX with it in
registers (the default), inline PTX with it written to shared memory for wgmma to read (wgmma with a register operand
gave wrong results in another kernel of this repository on the H200: pallas_kernels/kda, README)."""
SMEM_BUDGET = 113 * 1024
"""Shared memory the default tiles give one CTA's pipeline slots: two CTAs per SM (227 KB on sm_90)."""
K_MULTIPLE = 2 * STEP_BYTES
"""K must be a multiple of this (whole pipeline steps; the scales of a step fill one 16-byte TMA row)."""


def chunk_halves(x: jax.Array) -> jax.Array:
    """``[M, K]`` -> ``[M, K]``: within each chunk of ``2 * CHUNK_BYTES`` columns, the even columns, then the odd
    ones (the low and the high nibbles of the chunk's code bytes)."""
    m, k = x.shape
    return x.reshape(m, k // (2 * CHUNK_BYTES), CHUNK_BYTES, 2).swapaxes(-1, -2).reshape(m, k)


def _slot_bytes(n_rhs: int, tm: int) -> int:
    """Shared memory of one pipeline slot: each weight's codes and scales, the token rows."""
    return n_rhs * ROWS * (STEP_BYTES + STEP_BYTES // GROUP_BYTES) + tm * 2 * K_MULTIPLE


def mxfp4_tiles(m: int, e: int, n_rhs: int = 1) -> tuple[int, int, int]:
    """``(tm, stages, mode)`` of :func:`gmm_mxfp4` for ``m`` rows over ``e`` experts and ``n_rhs`` weights: tm as
    the Triton kernel's, as many slots (2..4) as fit :data:`SMEM_BUDGET`, the inline-PTX decode (:data:`A_PTX`)."""
    tm = mxfp4_rows_tile(m, e)
    return tm, max(2, min(4, SMEM_BUDGET // _slot_bytes(n_rhs, tm))), A_PTX


def code_bits(u: jax.Array, high: bool) -> jax.Array:
    """``u16`` code bytes -> ``u16`` bf16 bits of ``E2M1 * 2^-126`` of their low (or high) nibbles: the magnitude at
    bits 6..8, the sign at 15 (one ``and``, one multiply placing both, one ``and``)."""
    if high:
        return ((u & 0xF0) * 0x104) & 0x81C0
    return ((u & 0xF) * 0x1040) & 0x81C0


def _decode_compiled(u: jax.Array, high: bool, factor: jax.Array) -> jax.Array:
    """bf16 ``E2M1 * 2^(s - 127 - XSHIFT)`` of the low (or high) nibbles of ``u16`` code bytes; ``factor`` bf16
    ``2^(s - 1 - XSHIFT)``."""
    return lax.bitcast_convert_type(code_bits(u, high), BF16) * factor


DECODE_PTX = "\n".join([
    "{", ".reg .b32 u, t;",
    "prmt.b32 u, $2, 0, 0x4140;",  # bytes b0, b1 of the 16-bit pair -> bits 0..7 and 16..23
    "and.b32 t, u, 0x000F000F;", "mul.lo.u32 t, t, 0x1040;", "and.b32 t, t, 0x81C081C0;",  # low nibbles: << 6, << 12
    "mul.rn.bf16x2 $0, t, $3;",
    "and.b32 t, u, 0x00F000F0;", "mul.lo.u32 t, t, 0x104;", "and.b32 t, t, 0x81C081C0;",  # high nibbles: << 2, << 8
    "mul.rn.bf16x2 $1, t, $3;", "}"])
"""Inline PTX decoding the two code bytes of one register (``$2``, zero-extended) with its bf16x2 factors ``$3``
into the bf16x2 low-nibble (``$0``) and high-nibble (``$1``) values: :func:`code_bits` and the bf16 multiply of
:func:`_decode_compiled` on both bytes at once, 9 instructions per 2 code bytes."""


def _decode_ptx(codes: jax.Array, factor: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`_decode_compiled` of both nibbles in inline PTX (:data:`DECODE_PTX`), register by register: ``codes
    u8 [64, C]`` and ``factor bf16 [64, C]`` in the WGMMA layout (2 elements per register) -> two bf16 ``[64, C]``."""
    out = plgpu.ShapeDtypeStruct(codes.shape, BF16, plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA), return_type=(out, out))
    def decode(_, codes_fa, factor_fa):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        lo = np.empty_like(codes_fa.registers)
        hi = np.empty_like(codes_fa.registers)
        for idx, reg in np.ndenumerate(codes_fa.registers):
            pair = arith.extui(i32, mgpu_utils.bitcast(reg, i16))
            f = mgpu_utils.bitcast(factor_fa.registers[idx], i32)
            lo_i, hi_i = mgpu_utils.inline_ptx(DECODE_PTX, pair, f, result_types=(i32, i32))
            lo[idx], hi[idx] = mgpu_utils.bitcast(lo_i, bf16x2), mgpu_utils.bitcast(hi_i, bf16x2)
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=codes_fa.layout, _is_signed=None) for r in (lo, hi))

    return decode(codes, factor)


def _scale_operand(columns: list[jax.Array], interpret: bool) -> jax.Array:
    """The per-row scales ``u8 [64]`` of a chunk's groups -> ``[64, CHUNK_BYTES]`` factors, each repeated over its
    group's 16 code bytes: bf16 ``2^(s - 1 - XSHIFT)`` compiled, f32 ``2^(s - 127) * 2^14``
    (:func:`pallas_kernels.moe.gpu.scale_factor_f16`) in the interpreter."""
    pieces = []
    for s_u8 in columns:
        s = s_u8.astype(jnp.int32)
        if interpret:
            f = gpu.scale_factor_f16(s)
        else:
            f = lax.bitcast_convert_type(gpu.scale_bits_bf16(s).astype(jnp.int16), BF16)
        pieces.append(lax.broadcast_in_dim(f, (ROWS, GROUP_BYTES), [0]))
    return jnp.concatenate(pieces, axis=1)


def _decode_chunk(codes: jax.Array, factor: jax.Array, interpret: bool, ptx: bool) -> tuple[jax.Array, jax.Array]:
    """``u8 [64, CHUNK_BYTES]`` code bytes -> the bf16 ``[64, CHUNK_BYTES]`` low- and high-nibble operands: the f32
    decode in the interpreter; compiled, the bf16 decode in inline PTX (``ptx``) or in JAX integer ops."""
    if interpret:
        c = codes.astype(jnp.int32)
        return gpu.decode_f16(c, factor, BF16), gpu.decode_f16(c >> 4, factor, BF16)
    if ptx:
        return _decode_ptx(codes, factor)
    u = codes.astype(jnp.uint16)
    return _decode_compiled(u, False, factor), _decode_compiled(u, True, factor)


def _check_weights(x: jax.Array, weights, epilogue, layer) -> tuple[int, int, int]:
    """``(E, N, K)`` of the weights after checking them against ``x`` (same checks as ``gpu.gmm_mxfp4``)."""
    if not 1 <= len(weights) <= 2 or (len(weights) == 2) != (epilogue is not None):
        raise ValueError("mosaic_gpu_mxfp4.gmm_mxfp4: pass one weight, or two weights with an epilogue")
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise TypeError(f"mosaic_gpu_mxfp4.gmm_mxfp4: x must be bf16 [M, K], got {x.dtype} {x.shape}")
    m, k = x.shape
    codes0 = weights[0][0]
    ndim = 3 if layer is None else 4
    lead, (e, n, kh) = codes0.shape[:-3], codes0.shape[-3:]
    for codes, scales in weights:
        if codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
            raise TypeError(f"mosaic_gpu_mxfp4.gmm_mxfp4: codes/scales must be u8, got {codes.dtype}/{scales.dtype}")
        if codes.ndim != ndim or codes.shape != (*lead, e, n, kh) or scales.shape != (*lead, e, n, k // 32):
            lead_dims = "L, " if layer is not None else ""
            raise ValueError(f"mosaic_gpu_mxfp4.gmm_mxfp4: x [M, K={k}] needs codes [{lead_dims}E, N, {k // 2}] and "
                             f"scales [{lead_dims}E, N, {k // 32}], got {codes.shape} / {scales.shape} "
                             f"(first codes {codes0.shape})")
    if 2 * kh != k or k % K_MULTIPLE or n % ROWS:
        raise ValueError(f"mosaic_gpu_mxfp4.gmm_mxfp4: x has K={k}, codes {codes0.shape} imply K={2 * kh}, N={n}: "
                         f"K must match and be a multiple of {K_MULTIPLE}, N a multiple of {ROWS}")
    return e, n, k


def _weight_rows(w: jax.Array) -> jax.Array:
    """``[(L,) E, N, C]`` -> ``[(L ·) E · N, C]`` (a view: every copy then takes one dynamic row slice)."""
    return w.reshape(-1, w.shape[-1])


def _store_rows(o_s, out_ref, r0, rows, n0, tm: int) -> None:
    """Rows ``[0, rows)`` of the staged tile ``o_s [tm, 64]`` to ``out[r0 + .., n0 : n0 + 64]``: one TMA copy per
    set bit of ``rows``. A copy's shared-memory start must be static (the tile is swizzled), so each piece is
    enumerated over its possible starts (the higher bits of ``rows``): about ``tm`` guarded copies in all."""
    size = tm
    while size:
        for start in range(0, tm - size + 1, 2 * size):
            @pl.when(((rows & size) != 0) & ((rows & -(2 * size)) == start))
            def _piece(start=start, size=size):
                plgpu.copy_smem_to_gmem(o_s.at[pl.ds(start, size)],
                                        out_ref.at[pl.ds(r0 + start, size), pl.ds(n0, ROWS)])

        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _stage_transposed(o_s, val: jax.Array) -> None:
    """``val f32 [64, tm]`` (WGMMA layout) -> ``o_s [tm, 64]`` bf16, visible to the TMA."""
    o_s.T[...] = plgpu.layout_cast(val.astype(BF16), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()


def _mma_staged(acc, a_vals: tuple[jax.Array, jax.Array], b_refs, a_s, q: int) -> None:
    """``acc += lo @ b_lo + hi @ b_hi`` with the decoded operands written to the shared buffers ``a_s [2, 64, C]``
    (one of two such pairs, alternating by chunk ``q``) for wgmma to read: before the writes, at most the previous
    chunk's two wgmma groups may still be reading (the pair of chunk ``q - 2`` is free)."""
    if q >= 2:
        plgpu.wgmma_wait(2)
    for i, a in enumerate(a_vals):
        a_s.at[i][...] = a
    plgpu.commit_smem()
    for i, b in enumerate(b_refs):
        plgpu.wgmma(acc, a_s.at[i], b)


def _mma_registers(acc, a_vals: tuple[jax.Array, jax.Array], b_refs, last: bool) -> None:
    """``acc += lo @ b_lo + hi @ b_hi`` with the decoded operands in registers, then (except after a step's ``last``
    chunk: the step's closing wait covers it) a wait until only these two wgmma groups may be in flight: the previous
    chunk's operand registers are then dead, so the next chunk decodes into them while these products run.
    Without the wait every chunk's operands stay live until the step's end (32 registers per chunk, 8 chunks per
    step in the fused call): ptxas, short of registers, serialised every wgmma instead (C7511)."""
    for a, b in zip(a_vals, b_refs, strict=True):
        plgpu.wgmma(acc, a, b)
    if not last:
        plgpu.wgmma_wait(2)


def _build(m: int, n: int, k: int, e: int, n_rhs: int, tiles: tuple[int, int, int], epilogue, interpret: bool,
           stacked: bool) -> Callable:
    """The ``plgpu.kernel`` call ``f(gid, row0, ends, num, layer, x, *codes_scales) -> out [M, N]``."""
    tm, stages, mode = tiles
    staged = interpret or mode == A_STAGED
    n_steps = k // K_MULTIPLE
    groups = STEP_BYTES // GROUP_BYTES
    chunks = STEP_BYTES // CHUNK_BYTES
    per_chunk = CHUNK_BYTES // GROUP_BYTES
    x_sw = (plgpu.TilingTransform((8, CHUNK_BYTES)), plgpu.SwizzleTransform(2 * CHUNK_BYTES))  # bf16 operand tiles
    codes_sw = (plgpu.TilingTransform((8, CHUNK_BYTES)), plgpu.SwizzleTransform(CHUNK_BYTES))
    scratch = [
        plgpu.SMEM((stages, n_rhs, ROWS, STEP_BYTES), jnp.uint8, transforms=codes_sw),
        plgpu.SMEM((stages, n_rhs, ROWS, groups), jnp.uint8),
        plgpu.SMEM((stages, chunks, tm, 2 * CHUNK_BYTES), BF16, transforms=x_sw),
        plgpu.SMEM((tm, ROWS), BF16, transforms=(plgpu.SwizzleTransform(128),)),  # 128-byte rows
    ]
    if staged:  # decoded operands in shared memory: two chunks' (low, high) pairs
        scratch.append(plgpu.SMEM((2, 2, ROWS, CHUNK_BYTES), BF16, transforms=x_sw))
    bars = plgpu.Barrier(num_arrivals=2 * n_rhs + chunks, num_barriers=stages)

    def mxfp4_gmm_mosaic_gpu(gid_ref, row0_ref, ends_ref, num_ref, layer_ref, x_ref, *refs):
        w_refs, out_ref = refs[:2 * n_rhs], refs[2 * n_rhs]
        (codes_s, scales_s, x_s, o_s, *a_s), loaded = refs[2 * n_rhs + 1:]
        j, t = lax.axis_index("n"), lax.axis_index("t")
        n0 = j * ROWS
        g = gid_ref[t]
        r0 = row0_ref[t]
        rows = jnp.minimum(ends_ref[jnp.minimum(g, e)] - r0, tm)
        live = t < num_ref[0]
        lyr = layer_ref[0] if stacked else 0
        wrow = (lyr * e + jnp.minimum(g, e - 1)) * n + n0

        def issue(step, slot):
            for r in range(n_rhs):
                codes, scales = w_refs[2 * r], w_refs[2 * r + 1]
                plgpu.copy_gmem_to_smem(codes.at[pl.ds(wrow, ROWS), pl.ds(step * STEP_BYTES, STEP_BYTES)],
                                        codes_s.at[slot, r], loaded.at[slot])
                plgpu.copy_gmem_to_smem(scales.at[pl.ds(wrow, ROWS), pl.ds(step * groups, groups)],
                                        scales_s.at[slot, r], loaded.at[slot])
            for ch in range(chunks):
                cols = pl.ds(step * K_MULTIPLE + ch * 2 * CHUNK_BYTES, 2 * CHUNK_BYTES)
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(r0, tm), cols], x_s.at[slot, ch], loaded.at[slot])

        def products(slot, accs):
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            for r in range(n_rhs):
                for ch in range(chunks):
                    scales = [plgpu.load(scales_s.at[slot, r, :, ch * per_chunk + i], layout=row_layout)
                              for i in range(per_chunk)]
                    codes = plgpu.load(codes_s.at[slot, r, :, pl.ds(ch * CHUNK_BYTES, CHUNK_BYTES)],
                                       layout=plgpu.Layout.WGMMA)
                    lo, hi = _decode_chunk(codes, _scale_operand(scales, interpret), interpret, mode != A_JAX)
                    xc = x_s.at[slot, ch]
                    b_ops = (xc.at[:, pl.ds(0, CHUNK_BYTES)].T, xc.at[:, pl.ds(CHUNK_BYTES, CHUNK_BYTES)].T)
                    if staged:
                        _mma_staged(accs[r], (lo, hi), b_ops, a_s[0].at[(r * chunks + ch) % 2], r * chunks + ch)
                    else:
                        _mma_registers(accs[r], (lo, hi), b_ops, last=r * chunks + ch == n_rhs * chunks - 1)

        def step(i, accs):
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(loaded.at[slot])
            accs = accumulate(lambda *a: products(slot, a), accs, interpret)
            plgpu.commit_smem()  # every thread's reads of the slot before the TMA refills it

            @pl.when(i + stages < n_steps)
            def _refill():
                issue(i + stages, slot)

            return accs

        @pl.when(live & (g < e))
        def _expert_tile():
            for s in range(min(stages, n_steps)):
                issue(s, s)
            zero = plgpu.layout_cast(jnp.zeros((ROWS, tm), F32), plgpu.Layout.WGMMA)
            accs = lax.fori_loop(0, n_steps, step, (zero,) * n_rhs)
            _stage_transposed(o_s, epilogue(*accs) if epilogue is not None else accs[0])
            _store_rows(o_s, out_ref, r0, rows, n0, tm)

        @pl.when(live & (g >= e))
        def _trailing_rows():
            _stage_transposed(o_s, plgpu.layout_cast(jnp.zeros((ROWS, tm), F32), plgpu.Layout.WGMMA))
            _store_rows(o_s, out_ref, r0, rows, n0, tm)

    return plgpu.kernel(
        mxfp4_gmm_mosaic_gpu,
        out_type=jax.ShapeDtypeStruct((m, n), BF16),
        scratch_types=(tuple(scratch), bars),
        grid=(n // ROWS, -(-m // tm) + e),
        grid_names=("n", "t"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params(interpret),
    )


def gmm_mxfp4(
    x: jax.Array,
    weights: list[tuple[jax.Array, jax.Array]],
    group_sizes: jax.Array,
    *,
    epilogue: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    out_dtype=None,
    tiles: tuple[int, int] | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Grouped matmul with MXFP4 weights decoded in registers: ``x[rows of g] @ W[g]^T`` for HF ``W [E, N, K]``.

    Args:
      x: ``[M, K]`` bf16 activations sorted by expert (natural column order).
      weights: one ``(codes u8 [E, N, K/2], scales u8 [E, N, K/32])`` pair (HF layout, as stored), or two with
        ``epilogue(acc1, acc2) -> f32`` (elementwise on the f32 accumulators).
      group_sizes: ``[E] i32``; experts with no rows are not read.
      out_dtype: output dtype (default bf16).
      tiles: ``(tm, stages[, mode])`` (default :func:`mxfp4_tiles`): token rows per tile (8, 16 or 32), pipeline
        slots, the compiled decode mode (:data:`A_JAX`, :data:`A_PTX` (default), :data:`A_STAGED`).
      interpret: run in the Mosaic GPU interpreter (CPU).
      layer: i32 scalar: every codes/scales array is a stack ``[L, E, ...]`` read in place at that layer
        (clamped into ``[0, L)``).
    Returns:
      ``[M, N]`` in ``out_dtype``; rows past ``sum(group_sizes)`` are 0. Forward only. K a multiple of 512, N of 64.
      The kernel stores bf16: an f32 ``out_dtype`` is the f32 accumulator rounded to bf16, widened.
      Exact products (f32 accumulation) for E8M0 scales in ``gpu.EXACT_SCALES`` (interpreter: 2..240) and
      ``|x| < 2^(128 - XSHIFT)`` (see the module docstring).
    """
    e, n, k = _check_weights(x, weights, epilogue, layer)
    m = x.shape[0]
    tiles = tuple(tiles) + (1,) * (3 - len(tiles)) if tiles else mxfp4_tiles(m, e, len(weights))
    tm, stages, mode = tiles
    if len(tiles) != 3 or tm not in (8, 16, 32) or stages < 1 or mode not in (A_JAX, A_PTX, A_STAGED):
        raise ValueError(f"mosaic_gpu_mxfp4.gmm_mxfp4: tiles=(tm, stages[, mode]) needs tm in (8, 16, 32), "
                         f"stages >= 1, mode in (0, 1, 2), got {tiles}")
    lyr = gpu.layer_index(weights[0][0], layer, 3)
    xe = chunk_halves(x)
    if not interpret:  # the compiled decode's weights carry 2^-XSHIFT
        xe = xe * jnp.asarray(2.0**XSHIFT, xe.dtype)
    # a tile's rows past M read zeros (the interpreter clamps slices); the TMA's 8-row tiling needs whole row tiles
    xe = jnp.pad(xe, ((0, -(-(m + tm) // 8) * 8 - m), (0, 0)))
    gid, row0, ends, num = make_tile_table(group_sizes.astype(jnp.int32), m, tm)
    call = _build(m, n, k, e, len(weights), tiles, epilogue, bool(interpret), layer is not None)
    arrays = [_weight_rows(a) for w in weights for a in w]
    out = forward_only(call, gid, row0, ends, num, lyr, xe, *arrays, name="moe.mosaic_gpu_mxfp4.gmm_mxfp4")
    return out.astype(out_dtype or x.dtype)
