"""Grouped matmul on Pallas Mosaic GPU (sm_90: wgmma from shared memory, TMA loads and stores, a persistent grid
of one program per SM), through the kernels JAX ships in ``jax.experimental.pallas.ops.gpu``:

- forward ``lhs [M, K] x rhs [E, K, N]`` and ``dlhs = dout x rhs[g]^T``: ``ragged_dot_mgpu.ragged_dot``
  (``transpose_rhs=True`` for the latter, no transposed copy of the weights);
- ``drhs[g] = lhs[rows of g]^T x dout[rows of g]``: ``transposed_ragged_dot_mgpu.transposed_ragged_dot``.

Contract (checked by :func:`shape_reason`, which ``ops.EXPERT_FFN`` uses to pass this backend over):
bf16 operands; K and N multiples of 128; an sm_90+ GPU. The kernels write the operand dtype: a requested f32
output is the bf16-rounded f32 accumulator, widened. Rows past ``sum(group_sizes)`` are zeroed here (the
forward kernel does not write them). JAX's kernels take no interpret flag: CPU tests lower them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

ALIGN = 128
"""K and N must be multiples of this (the output / 64-deep contraction blocks below)."""

GMM_BLOCKS_WIDE = {"block_m": 128, "block_n": 192, "block_k": 64, "max_concurrent_steps": 5, "grid_block_n": 8}
"""Forward / ``dlhs`` blocks when N is a multiple of 192 (the fastest of the benchmark's block sweep)."""
GMM_BLOCKS = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 6, "grid_block_n": 4}
"""Forward / ``dlhs`` blocks otherwise."""
TGMM_BLOCKS = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}
"""``drhs`` blocks."""
DTYPES = ("bfloat16",)


def shape_reason(dtype: str, k: int, n: int) -> str | None:
    """None when ``[M, K] x [E, K, N]`` in ``dtype`` fits these kernels, else why not."""
    if dtype not in DTYPES:
        return f"takes {DTYPES} operands, got {dtype}"
    if k % ALIGN or n % ALIGN:
        return f"needs K and N multiples of {ALIGN}, got K={k}, N={n}"
    return None


def _zero_trailing_rows(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def _fwd_product(lhs, rhs, group_sizes, transpose_rhs: bool):
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    blocks = GMM_BLOCKS_WIDE if n % GMM_BLOCKS_WIDE["block_n"] == 0 else GMM_BLOCKS
    out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, transpose_rhs=transpose_rhs, **blocks)
    return _zero_trailing_rows(out, group_sizes)


@jax.custom_vjp
def _gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return _fwd_product(lhs, rhs, group_sizes, False)


def _gmm_fwd(lhs, rhs, group_sizes):
    return _gmm(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_bwd(res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = _fwd_product(dout, rhs, group_sizes, True)
    drhs = transposed_ragged_dot_mgpu.transposed_ragged_dot(lhs, dout, group_sizes=group_sizes, **TGMM_BLOCKS)
    return dlhs, drhs.astype(rhs.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None) -> jax.Array:
    """Grouped matmul ``lhs [M, K] x rhs [E, K, N] -> [M, N]`` (``jax.lax.ragged_dot`` semantics), differentiable
    w.r.t. ``lhs`` and ``rhs``; bf16 operands (``rhs`` is cast to ``lhs.dtype``), f32 accumulation, the result
    rounded to bf16 and returned in ``preferred_element_type`` (default bf16)."""
    m, k = lhs.shape
    e, k2, n = rhs.shape
    reason = shape_reason(jnp.dtype(lhs.dtype).name, k, n)
    if reason is not None or k2 != k or group_sizes.shape != (e,):
        raise ValueError(f"mosaic_gpu.gmm: lhs {lhs.shape} {lhs.dtype}, rhs {rhs.shape}, group_sizes "
                         f"{group_sizes.shape}: {reason or 'inconsistent shapes'}")
    out = _gmm(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))
    return out.astype(preferred_element_type or lhs.dtype)


def arch_reason(compute_capability: float | None) -> str | None:
    """None when the target GPU has wgmma (compute capability >= 9.0), else why this backend cannot run."""
    if compute_capability is None:
        return "needs compute capability >= 9.0 (wgmma); the target GPU's is unknown"
    if compute_capability < 9.0:
        return f"needs compute capability >= 9.0 (wgmma), the target GPU has {compute_capability}"
    return None
