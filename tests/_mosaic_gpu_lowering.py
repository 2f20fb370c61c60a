"""Lowering of Mosaic GPU kernels for sm_90 on a host without a GPU, with the integer indices of every copy between
device and shared memory recorded (imports only JAX: also run under the H200's jax 0.11.2, which has no pytest)."""

from __future__ import annotations

import os
import subprocess
import textwrap

import jax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import launch_context

JAX_0112_PYTHON = os.environ.get("K3_JAX_0112_PYTHON", "/work/venv-0112/bin/python")
"""A Python with jax 0.11.2 (the H200's JAX) for the second lowering tests; they skip where it is absent."""


CUDA_AOT_PYTHON = os.environ.get("K3_CUDA_AOT_PYTHON", "/work/venv-cuda/bin/python")
"""A Python with JAX's CUDA plugin of the H200's JAX and this project's dependencies, for the tests that compile for
sm_90a on this host (``benchmarks/gpu_aot.py``); they skip where it is absent (CI installs no CUDA plugin)."""


def cuda_aot_missing_reason() -> str | None:
    """None when :data:`CUDA_AOT_PYTHON` imports JAX's CUDA plugin, else why not (the tests' skip reason)."""
    if not os.path.exists(CUDA_AOT_PYTHON):
        return f"no Python with JAX's CUDA plugin at {CUDA_AOT_PYTHON} (set K3_CUDA_AOT_PYTHON)"
    probe = subprocess.run([CUDA_AOT_PYTHON, "-c", "import jax_plugins.xla_cuda13"], capture_output=True, text=True,
                           timeout=120)
    return None if probe.returncode == 0 else f"{CUDA_AOT_PYTHON} has no CUDA plugin: {probe.stderr.strip()[-200:]}"


def run_under_jax_0112(body: str) -> subprocess.CompletedProcess:
    """Run ``body`` (Python source; it may import ``tests._mosaic_gpu_lowering``) under :data:`JAX_0112_PYTHON` on
    CPU after asserting that Python's JAX is 0.11.2; it prints ``ok 0.11.2`` when ``body`` finishes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (f"import sys, jax\nsys.path.insert(0, {root!r})\n"
              f"assert jax.__version__ == '0.11.2', jax.__version__\n"
              f"{textwrap.dedent(body)}\nprint('ok', jax.__version__)\n")
    return subprocess.run([JAX_0112_PYTHON, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


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


def lower_decode(block_v: int, batch: int = 2, heads: int = 3, num_ctas: int | None = None
                 ) -> tuple[int, bool, list[int]]:
    """``(mosaic_gpu custom calls, pool aliased, integer indices of every copy)`` of the KDA decode step
    (:func:`pallas_kernels.kda.mosaic_gpu_decode.decode_step`) lowered for sm_90 at ``batch`` sequences of ``heads``
    heads on a pool of ``batch + 3`` rows over ``num_ctas`` CTAs."""
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.kda import mosaic_gpu_decode  # noqa: PLC0415

    s = jax.ShapeDtypeStruct
    vec = s((batch, heads, 128), jnp.bfloat16)
    args = (vec, vec, vec, s((batch, heads, 128), jnp.float32), s((batch, heads), jnp.float32),
            s((batch + 3, heads, 128, 128), jnp.float32), s((batch,), jnp.int32))
    text, ints = lower_for_sm90(
        lambda q, k, v, g, b, p, sl: mosaic_gpu_decode.decode_step(q, k, v, g, b, 0.1, p, sl, block_v=block_v,
                                                                   num_ctas=num_ctas), *args)
    return text.count("custom_call @mosaic_gpu"), "output_operand_alias" in text, ints


def lower_paged_attention(t: int = 1, batch: int = 2, max_pages: int = 8, splits: int | None = None
                          ) -> tuple[int, list[int]]:
    """``(mosaic_gpu custom calls, integer indices of every copy)`` of the Mosaic GPU paged MLA decode attention
    (:func:`pallas_kernels.paged_latent_attention.paged_attention_mgpu`) lowered for sm_90 at K3's widths (96 heads,
    C 512, Dr 64, 16-token pages), ``batch`` rows of ``max_pages`` table entries, a stacked pool read at a traced
    layer."""
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels import paged_latent_attention as pla  # noqa: PLC0415

    s = jax.ShapeDtypeStruct
    args = (s((batch, t, 96, 512), jnp.bfloat16), s((batch, t, 96, 64), jnp.bfloat16),
            s((2, max(40, max_pages), 16, 576), jnp.bfloat16), s((batch, max_pages), jnp.int32), s((batch,), jnp.int32),
            s((), jnp.int32))
    text, ints = lower_for_sm90(
        lambda ql, qr, p, tb, pos, lyr: pla.paged_attention_mgpu(ql, qr, p, None, tb, pos, 0.1, lyr, splits=splits),
        *args)
    return text.count("custom_call @mosaic_gpu"), ints
