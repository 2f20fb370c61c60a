"""Default XLA flags for the training entry point, applied before JAX initialises a backend.

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
