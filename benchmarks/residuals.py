"""What the train step's backward keeps: autodiff residuals of the loss, traced (never run) on this host.

Traces ``loss(params, batch)`` of :mod:`k3_jax.training.step` for ``--config`` at ``--batch-size × --seq-len``
with the GEMM-only weights in bf16 (as the train step passes them) and lists what ``jax.vjp`` saves for the
backward (``jax._src.ad_checkpoint.saved_residuals``): one JSON line ``{"config", "batch", "seq_len",
"implementation", "residual_gib", "parameter_gib", "activation_gib", "top": [[MiB, dtype, shape, source]...]}``.
``activation_gib`` = residuals that are not parameters — the per-micro-batch memory the backward holds.
``--implementation triton`` traces the GPU kernels' custom VJPs (tracing needs no GPU) with the target platform
set to GPU (``pallas_kernels.registry.platform_scope``), so the layer code takes its GPU path (bf16 GEMM operands)
as on the device.

    python benchmarks/residuals.py --config configs/k3-slice.json --batch-size 4 --seq-len 1024
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def residuals(config: str, batch: int, seq_len: int, implementation: str, top: int = 25) -> dict:
    from flax import linen as nn
    from jax._src.ad_checkpoint import saved_residuals

    from k3_jax.training.compute_cast import cast_for_compute, compute_cast_mask
    from k3_jax.training.loop import TrainConfig, Trainer
    from k3_jax.training.step import make_loss_fn

    platform = {"triton": "gpu", "mosaic_tpu": "tpu"}.get(implementation, "auto")
    tc = TrainConfig(config=config, model_overrides={"kda_implementation": implementation,
                                                     "moe_implementation": implementation, "platform": platform},
                     workdir="/tmp/k3-residuals", seq_len=seq_len, batch_size=batch, eval_every=0,
                     tensorboard=False, resume=False, mesh="none", optimizer="adamw")
    tr = Trainer(tc)
    params = nn.unbox(tr.abstract_params_boxed)
    dtype = jnp.dtype(tr.cfg.dtype)
    params = jax.eval_shape(lambda p: cast_for_compute(p, compute_cast_mask(p, tr.cfg.qat), dtype), params)
    rows = {k: jnp.ones((batch, seq_len + 1), jnp.int32) for k in ("tokens", "segment_ids")}
    loss_fn = make_loss_fn(tr.model, tr.step_cfg)
    from pallas_kernels.registry import platform_scope

    with platform_scope(platform):
        res = saved_residuals(lambda p: loss_fn(p, rows)[0], params)
    items = sorted(((int(np.prod(a.shape)) * a.dtype.itemsize, str(a.dtype), tuple(a.shape), src)
                    for a, src in res), key=lambda r: -r[0])
    total = sum(r[0] for r in items)
    param_bytes = sum(r[0] for r in items if r[3].startswith("from the argument"))
    return {"config": config, "batch": batch, "seq_len": seq_len, "implementation": implementation,
            "residual_gib": round(total / 2**30, 3), "parameter_gib": round(param_bytes / 2**30, 3),
            "activation_gib": round((total - param_bytes) / 2**30, 3),
            "top": [[round(b / 2**20, 1), dt, list(s), src[:120]] for b, dt, s, src in items[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3-slice.json")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--implementation", default="triton", choices=("triton", "mosaic_tpu", "xla"))
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    print(json.dumps(residuals(a.config, a.batch_size, a.seq_len, a.implementation, a.top)))


if __name__ == "__main__":
    main()
