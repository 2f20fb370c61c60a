"""Compile time of the routed-expert FFN alone for one TPU chip, ahead of time on this host (needs ``libtpu``).

Lowers and compiles ``pallas_kernels.moe.ops.expert_ffn`` (``implementation="mosaic_tpu"``) on abstract inputs of
one chip's shapes — ``--rows`` expert-sorted rows of the latent width, ``--experts`` local experts, ``--inter`` the
intermediate width per chip — with MXFP4 or bf16 weights, forward only or under ``jax.grad`` (for MXFP4: the
forward kernels plus the bf16 kernels of the tokens' gradient), and prints one JSON line: lower and compile seconds,
Mosaic kernels in the program, the compiler's temp bytes. The defaults are K3's per-chip shapes of the LoRA step on
v5p-128 (``fsdp=4,expert=4,tensor=4``, 16×2048 tokens: 2,048 tokens × 4 gathered × top-16 rows, 224 experts,
I/4 = 768), to tell the kernels' share of the step's compile time from the rest.

    python benchmarks/compile_expert_ffn.py --weights mxfp4 --mode grad
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def compile_ffn(weights: str, mode: str, rows: int, latent: int, inter: int, experts: int,
                topology: str = "v5p:1x1x1") -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pallas_kernels.moe import ops

    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    rep = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), PartitionSpec())

    def shape(dims, dtype):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=rep)

    if weights == "mxfp4":  # release layout [E, out, in/2] codes + [E, out, in/32] scales
        w13 = {"weight_packed": shape((experts, inter, latent // 2), jnp.uint8),
               "weight_scale": shape((experts, inter, latent // 32), jnp.uint8)}
        w2 = {"weight_packed": shape((experts, latent, inter // 2), jnp.uint8),
              "weight_scale": shape((experts, latent, inter // 32), jnp.uint8)}
    else:
        w13, w2 = shape((experts, latent, inter), jnp.bfloat16), shape((experts, inter, latent), jnp.bfloat16)

    def loss(x, gs, w1, w3, w2):
        y = ops.expert_ffn(x, gs, w1, w3, w2, implementation="mosaic_tpu", platform="tpu")
        return jnp.sum(y.astype(jnp.float32))

    fn = loss if mode == "fwd" else jax.grad(loss)
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(shape((rows, latent), jnp.bfloat16), shape((experts,), jnp.int32), w13, w13, w2)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return {"bench": "compile_expert_ffn", "weights": weights, "mode": mode, "rows": rows, "latent": latent,
            "inter": inter, "experts": experts, "topology": topology, "lower_s": round(t1 - t0, 1),
            "compile_s": round(t2 - t1, 1),
            "mosaic_kernels": compiled.as_text().count('custom_call_target="tpu_custom_call"'),
            "temp_gb": round(compiled.memory_analysis().temp_size_in_bytes / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", choices=("mxfp4", "bf16"), default="mxfp4")
    ap.add_argument("--mode", choices=("fwd", "grad"), default="grad")
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--latent", type=int, default=3584)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=224)
    a = ap.parse_args()
    print(json.dumps(compile_ffn(a.weights, a.mode, a.rows, a.latent, a.inter, a.experts)), flush=True)


if __name__ == "__main__":
    main()
