"""Lowering of Mosaic GPU kernels for sm_90 on a host without a GPU, with the integer indices of every copy between
device and shared memory recorded (imports only JAX: also run under the H200's jax 0.11.2, which has no pytest)."""

from __future__ import annotations

import jax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import launch_context


def lower_for_sm90(fn, *args) -> tuple[str, list[int]]:
    """``(StableHLO text of jit(fn) lowered for CUDA, integer indices of each async copy's device-memory slice)``;
    ``args``: arrays or ``jax.ShapeDtypeStruct``."""
    int_indices = []
    copy = launch_context.LaunchContext.async_copy

    def counting(self, *, gmem_slice=(), **kw):
        index = gmem_slice if isinstance(gmem_slice, tuple) else (gmem_slice,)
        int_indices.append(sum(not isinstance(i, slice | mgpu.DynamicSlice) for i in index))
        return copy(self, gmem_slice=gmem_slice, **kw)

    launch_context.LaunchContext.async_copy = counting
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        launch_context.LaunchContext.async_copy = copy
    return text, int_indices


def lower_sweep(v_split: int, reverse: bool) -> tuple[int, bool, list[int]]:
    """``(mosaic_gpu custom calls, wgmma present, integer indices of every copy)`` of a KDA backward sweep
    (:mod:`pallas_kernels.kda.mosaic_gpu_bwd_state`: ``state_grad_pass`` when ``reverse``, else ``state_sweep``) at
    two sequences of three heads, 256 tokens."""
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.kda.mosaic_gpu_bwd_state import state_grad_pass, state_sweep  # noqa: PLC0415

    B, Tp, H = 2, 256, 3
    s = jax.ShapeDtypeStruct
    tok = lambda d: s((B, Tp, H, d), jnp.bfloat16)
    decay, end = s((B, H, Tp // 64, 128), jnp.float32), s((B, H, 128, 128), jnp.float32)
    if reverse:  # qg, kd, wn, aqk, decay, do, dht_t
        fn, args = state_grad_pass, (tok(128), tok(128), tok(128), tok(64), decay, tok(128), end)
    else:  # kd, wn, x, v, decay, h0_t
        fn, args = state_sweep, (tok(128), tok(128), tok(64), tok(128), decay, end)
    text, ints = lower_for_sm90(lambda *a: fn(*a, v_split=v_split), *args)
    return text.count("custom_call @mosaic_gpu"), "wgmma.mma_async" in text, ints
