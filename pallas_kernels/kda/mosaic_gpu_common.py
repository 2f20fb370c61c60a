"""Shared pieces of the Mosaic GPU kernels (:mod:`.mosaic_gpu_intra`, :mod:`.mosaic_gpu_state`,
:mod:`.mosaic_gpu_decode`, :mod:`pallas_kernels.paged_latent_attention_mosaic_gpu`): sizes, shared-memory tilings,
row copies within a TMA box and the wgmma helpers that also run in the Mosaic GPU interpreter.

In ``interpret`` mode (CPU, ``plgpu.InterpretGPUParams``) the register operands of wgmma are staged through shared
memory, which the interpreter needs (it reads every wgmma operand from memory): a ``stage`` is a dict
``{width: [64, width] bf16 ref}``, None when compiled for the GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64
SUB = 16
HEAD_DIM = 128
VTILE = 64
"""Columns of V one state warpgroup carries (its transposed state is ``[VTILE, K]`` fp32 in registers)."""

F32, BF16 = jnp.float32, jnp.bfloat16


TMA_BOX = 256
"""Elements one TMA copy moves along a dimension at most."""


def row_pieces(length: int) -> tuple[tuple[int, int], ...]:
    """``(start, size)`` of the copies that move a ``[length]`` row into shared memory: each within
    :data:`TMA_BOX` (a barrier they arrive on takes ``len(row_pieces(length))`` arrivals)."""
    return tuple((k, min(TMA_BOX, length - k)) for k in range(0, length, TMA_BOX))


def copy_row_to_smem(src, row, dst, barrier, pieces: tuple[tuple[int, int], ...]) -> None:
    """Row ``row`` of the 2-D device ref ``src`` into the 1-D shared ref ``dst``, in the copies ``pieces``
    (:func:`row_pieces`), each arriving on ``barrier``."""
    for k, size in pieces:
        plgpu.copy_gmem_to_smem(src.at[row, pl.ds(k, size)], dst.at[pl.ds(k, size)], barrier)


def tiled(dtype=BF16):
    """128-byte swizzled tiles: the layout wgmma and conflict-free register loads / stores need."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


def mma(acc, a, b, stage):
    """``acc += a @ b`` for a register operand ``a`` (bf16 value). In interpret mode ``a`` is staged in ``stage``
    (the interpreter reads every wgmma operand from memory)."""
    if stage is not None:
        st = stage[a.shape[1]]
        st[...] = a
        a = st
    plgpu.wgmma(acc, a, b)


def accumulate(products, inits, interpret: bool):
    """Run ``products(*acc_refs)`` (wgmma into accumulators starting at ``inits``) and return the accumulators.
    The interpreter has no pre-initialised accumulators: there they start at zero and ``inits`` are added."""
    if not interpret:
        return pl.run_state(lambda refs: products(*refs))(tuple(plgpu.ACC.init(x) for x in inits))

    def run(*accs):
        products(*accs)
        return tuple(a[...] for a in accs)

    outs = pl.run_scoped(run, *(plgpu.ACC(x.shape, x.dtype) for x in inits))
    return tuple(x + o for x, o in zip(inits, outs, strict=True))


def load_f32(ref):
    """A shared-memory tile as an f32 value in the WGMMA register layout."""
    return plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA).astype(F32)


def split_bf16(value, hi_ref, lo_ref) -> None:
    """``value`` (f32) stored as ``hi_ref + lo_ref`` (bf16 each; their sum is ``value`` to ~2^-17 relative): an fp32
    operand for bf16 wgmma."""
    hi = value.astype(BF16)
    hi_ref[...] = hi
    lo_ref[...] = (value - hi.astype(F32)).astype(BF16)


def split_terms(a_hi, a_lo, b_hi, b_lo):
    """The operand pairs of ``(a_hi + a_lo) (b_hi + b_lo)`` that matter in fp32 (``lo lo`` is below its rounding)."""
    return ((a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi))


def bcast_cols(vec, rows: int = CHUNK):
    """``[n]`` per-column vector -> ``[rows, n]`` (the same in every row)."""
    return lax.broadcast_in_dim(vec, (rows, vec.shape[0]), [1])


def bcast_rows(vec, n: int):
    """``[64]`` per-token vector -> ``[64, n]``."""
    return lax.broadcast_in_dim(vec, (CHUNK, n), [0])


def shape_reason(*, dtype: str, k: int, v: int | None, chunk_size: int, state_dtype: str | None = None) -> str | None:
    """None when a chunked KDA call fits the one configuration the Mosaic GPU chunk kernels (forward and backward)
    are built for, else why not: bf16 operands (``dtype``: the promoted dtype of ``q, k, v``), ``K = V = 128``
    (``v=None``: a kernel that reads nothing of width V), chunk 64, and the backward's stored states ``h`` / ``dh``
    in bf16 (``state_dtype``, for the kernels that read them)."""
    if dtype != "bfloat16":
        return f"takes bfloat16 q/k/v, got {dtype}"
    if k != HEAD_DIM or v not in (None, HEAD_DIM):
        return f"needs K = V = {HEAD_DIM}, got K={k}" + ("" if v is None else f", V={v}")
    if chunk_size != CHUNK:
        return f"needs chunk_size {CHUNK}, got {chunk_size}"
    if state_dtype not in (None, "bfloat16"):
        return f"reads and writes h / dh in bfloat16, got state_dtype {state_dtype}"
    return None


def interpret_params(interpret):
    """``interpret`` as the kernels take it: None (compiled) or a ``plgpu.InterpretGPUParams``."""
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None
