"""Shared-memory budget of the KDA Triton launches: pick ``num_stages`` that fit the target GPU.

The three sequential sweeps (forward state kernel, backward state sweep and reverse sweep) loop over chunks in a
``fori_loop`` whose loads Triton software-pipelines through shared memory: each stage holds one chunk's tiles.
A launch needs, conservatively (an upper bound of what Triton allocates),

    num_stages * (bytes of one iteration's loaded tiles) + BV * K * 4   (the fp32 state slice, staged for dots)

Tile bytes use each operand's storage dtype: the matmul dtype (bf16 for bf16 inputs, fp32 for fp32 inputs) for
``W, U, X', A_qk, q e^G, e^{G_C - G} k``, ``v.dtype`` for ``dO`` and ``v``, fp32 for the chunk decay. With fp32
inputs the default 3-stage forward at K = V = 128 would need 427,520 B (Triton asked for 327,680 B on an H200, whose
limit per block is 232,448 B); :func:`fit_num_stages` lowers the stage count until the estimate fits, and
:func:`chunk_launch_reason` says when not even one stage fits (the ``triton`` backend's ``supports`` reason).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

H200_SHARED_MEMORY = 232_448
"""Opt-in shared memory per thread block on sm_90 (H100/H200), bytes."""

SHARED_MEMORY_BY_CC = {(9, 0): 232_448, (8, 9): 101_376, (8, 7): 166_912, (8, 6): 101_376, (8, 0): 166_912,
                       (7, 5): 65_536, (7, 0): 98_304}
"""Opt-in shared memory per block by compute capability (CUDA programming guide, table of technical limits)."""

SWEEPS = ("kda_chunk_state_gpu", "kda_bwd_h_gpu", "kda_bwd_ds_gpu")
DEFAULT_STAGES = {"kda_chunk_state_gpu": 3, "kda_bwd_h_gpu": 2, "kda_bwd_ds_gpu": 2}
"""Stages asked for when they fit (the forward's 3 stages were the H200 sweep's fastest for bf16)."""


def shared_memory_limit(compute_capability: str | float | tuple[int, int] | None) -> int:
    """Shared memory per block for a compute capability (``"9.0"``, ``9.0``, ``(9, 0)``); None = the H200's.
    Unknown capabilities take the entry of the closest lower one."""
    if compute_capability is None:
        return H200_SHARED_MEMORY
    if isinstance(compute_capability, tuple):
        cc = compute_capability
    else:
        major, _, minor = str(compute_capability).partition(".")
        cc = (int(major), int(minor or 0))
    lower = [k for k in SHARED_MEMORY_BY_CC if k <= cc]
    return SHARED_MEMORY_BY_CC[max(lower)] if lower else min(SHARED_MEMORY_BY_CC.values())


def device_shared_memory() -> int:
    """Shared memory per block of the first visible GPU; the H200's when none is visible (interpret mode,
    lowering on a CPU host)."""
    import jax  # noqa: PLC0415

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return H200_SHARED_MEMORY
    return shared_memory_limit(getattr(gpus[0], "compute_capability", None))


def _mm_itemsize(q_dtype, v_dtype) -> int:
    return 4 if jnp.promote_types(q_dtype, v_dtype) == jnp.float32 else 2


def stage_bytes(kernel: str, *, chunk: int, k: int, block_v: int, q_dtype, v_dtype) -> int:
    """Bytes of one pipeline stage (one chunk's loaded tiles) of sweep ``kernel`` (:data:`SWEEPS`)."""
    c, bv = chunk, block_v
    mm = _mm_itemsize(q_dtype, v_dtype)
    decay = 4 * k
    if kernel == "kda_chunk_state_gpu":  # W, q e^G, kd [C, K]; U [C, BV]; A_qk [C, C]
        return (3 * c * k + c * bv + c * c) * mm + decay
    if kernel == "kda_bwd_h_gpu":  # W, kd [C, K]; X' [C, C]; v [C, BV] in v.dtype
        return (2 * c * k + c * c) * mm + c * bv * jnp.dtype(v_dtype).itemsize + decay
    if kernel == "kda_bwd_ds_gpu":  # A_qk [C, C]; q e^G, kd, W [C, K]; dO [C, BV] in v.dtype
        return (c * c + 3 * c * k) * mm + c * bv * jnp.dtype(v_dtype).itemsize + decay
    raise ValueError(f"unknown Triton sweep {kernel!r}, expected one of {SWEEPS}")


def shared_memory_bytes(kernel: str, num_stages: int, *, chunk: int, k: int, block_v: int, q_dtype,
                        v_dtype) -> int:
    """Conservative shared-memory need of one launch of ``kernel`` with ``num_stages`` (module docstring)."""
    per = stage_bytes(kernel, chunk=chunk, k=k, block_v=block_v, q_dtype=q_dtype, v_dtype=v_dtype)
    return max(1, num_stages) * per + block_v * k * 4


def fit_num_stages(kernel: str, requested: int | None, *, chunk: int, k: int, block_v: int, q_dtype, v_dtype,
                   limit: int | None = None) -> int:
    """``requested`` stages (checked) or, for None, the most stages up to :data:`DEFAULT_STAGES` that fit
    ``limit`` (default: :func:`device_shared_memory`). Raises ValueError naming the bytes when nothing fits."""
    limit = device_shared_memory() if limit is None else limit
    need = lambda s: shared_memory_bytes(kernel, s, chunk=chunk, k=k, block_v=block_v, q_dtype=q_dtype,
                                         v_dtype=v_dtype)
    if requested is not None:
        if need(requested) > limit:
            raise ValueError(f"{kernel}: num_stages={requested} needs ~{need(requested):,} B of shared memory "
                             f"(chunk {chunk}, K {k}, block_v {block_v}, {jnp.dtype(q_dtype).name}), the GPU "
                             f"has {limit:,} B; use fewer stages or num_stages=None")
        return requested
    for s in range(DEFAULT_STAGES[kernel], 0, -1):
        if need(s) <= limit:
            return s
    raise ValueError(f"{kernel}: even one stage needs ~{need(1):,} B of shared memory (chunk {chunk}, K {k}, "
                     f"block_v {block_v}, {jnp.dtype(q_dtype).name}), the GPU has {limit:,} B")


@dataclasses.dataclass(frozen=True)
class ChunkLaunch:
    """Stages and shared-memory estimate per sweep for one chunked call (forward + backward)."""

    stages: dict[str, int]
    bytes: dict[str, int]
    limit: int


def chunk_launch(*, chunk: int, k: int, v: int, q_dtype, v_dtype, block_v: int | None = None,
                 limit: int | None = None) -> ChunkLaunch:
    """The default launch (``block_v = min(V, 64)``, stages fitted) of every sweep; raises if one cannot fit."""
    bv = block_v or min(v, 64)
    limit = device_shared_memory() if limit is None else limit
    kw = dict(chunk=chunk, k=k, block_v=bv, q_dtype=q_dtype, v_dtype=v_dtype)
    stages = {n: fit_num_stages(n, None, limit=limit, **kw) for n in SWEEPS}
    return ChunkLaunch(stages, {n: shared_memory_bytes(n, s, **kw) for n, s in stages.items()}, limit)


def chunk_launch_reason(*, chunk: int, k: int, v: int, q_dtype, v_dtype, limit: int | None = None) -> str | None:
    """None when every sweep of the chunked kernels fits in shared memory with one stage or more, else why."""
    try:
        chunk_launch(chunk=chunk, k=k, v=v, q_dtype=q_dtype, v_dtype=v_dtype, limit=limit)
    except ValueError as e:
        return f"shared memory: {e}"
    return None
