"""Default XLA flags for the training entry point, applied before JAX initialises a backend, and the XLA
compile options of the serving engine's model steps (:func:`serving_compiler_options`).

``--xla_gpu_enable_triton_gemm=false`` sends XLA:GPU's matmuls to cuBLAS instead of its Triton GEMM emitter,
which needs no GEMM autotuning (the measurement is in ``benchmarks/RESULTS.md``). GPU-only flags are parsed but
unused on CPU and TPU.

A flag the user already set in ``XLA_FLAGS`` (same name, any value) is left alone; ``K3_XLA_DEFAULTS=off``
disables the defaults.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

TRAIN_DEFAULTS: tuple[str, ...] = ("--xla_gpu_enable_triton_gemm=false",)


def apply_defaults(flags: Sequence[str] = TRAIN_DEFAULTS, env: MutableMapping[str, str] | None = None) -> list[str]:
    """Append each of ``flags`` to ``env["XLA_FLAGS"]`` unless a flag of that name is already there.

    Returns the flags added. Call it before the first JAX computation (XLA reads the variable when it creates
    a backend); ``env`` defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    if env.get("K3_XLA_DEFAULTS", "").lower() in ("off", "0", "false", "none"):
        return []
    current = env.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    if added:
        env["XLA_FLAGS"] = " ".join(current + added)
    return added


SERVING_GPU_COMPILER_OPTIONS: dict[str, int] = {"xla_gpu_dot_merger_threshold_mb": 0}
"""XLA:GPU options of the serving engine's jitted model steps (decode, prefill).

``xla_gpu_dot_merger_threshold_mb=0`` turns off XLA's ``DotMerger``: it merges two matmuls that share an operand
into one over the *concatenated* other operands as soon as one of the two is small (operands + output within the
threshold, 32 MiB by default). In a decode step the shared operand is the layer's few activation rows and the
concatenated operands are weights: a small projection of a layer's input (KDA ``f_a_proj`` and ``b_proj``, MLA
``q_a_proj`` and ``kv_a_proj_with_mqa`` are small) can pull a large one (``q_proj``: 176 MB at K3's widths) into a
concatenation that copies the weights on every step, inside the layer scan, where XLA cannot hoist it."""


def serving_compiler_options(platform: str) -> dict[str, int]:
    """``jax.jit(compiler_options=...)`` for the serving engine's model steps on ``platform`` (``cpu`` | ``gpu``
    | ``tpu``): :data:`SERVING_GPU_COMPILER_OPTIONS` on ``gpu``, none elsewhere."""
    return dict(SERVING_GPU_COMPILER_OPTIONS) if platform == "gpu" else {}
