"""Shared pieces of the Mosaic GPU KDA kernels (:mod:`.mosaic_gpu_intra`, :mod:`.mosaic_gpu_state`): sizes,
shared-memory tilings and the wgmma helpers that also run in the Mosaic GPU interpreter.

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


def bcast_cols(vec, rows: int = CHUNK):
    """``[n]`` per-column vector -> ``[rows, n]`` (the same in every row)."""
    return lax.broadcast_in_dim(vec, (rows, vec.shape[0]), [1])


def bcast_rows(vec, n: int):
    """``[64]`` per-token vector -> ``[64, n]``."""
    return lax.broadcast_in_dim(vec, (CHUNK, n), [0])


def interpret_params(interpret):
    """``interpret`` as the kernels take it: None (compiled) or a ``plgpu.InterpretGPUParams``."""
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None
