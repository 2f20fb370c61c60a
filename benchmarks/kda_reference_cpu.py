"""CPU timing of the pure-JAX KDA reference: chunk_kda (UT/WY) vs recurrent_kda (token scan), one JSON line.

    python benchmarks/kda_reference_cpu.py [--B 1 --T 4096 --H 4 --D 64 --reps 3]

Reports compile (+first run) time, best wall and process-CPU time of the jitted forward and forward+backward
(grad of a sum of squares w.r.t. q, k, v, g, beta), and chunk-vs-recurrent rel. error of the output.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.reference import chunk_kda, kda_gate, l2norm, recurrent_kda


def _time(fn, args, reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"compile_s": round(first, 2), "wall_s": round(min(wall), 4), "cpu_s": round(min(cpu), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)

    def n(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    B, T, H, D = a.B, a.T, a.H, a.D
    q, k, v = l2norm(n(B, T, H, D)), l2norm(n(B, T, H, D)), n(B, T, H, D)
    g = kda_gate(2.0 * n(B, T, H, D), n(H), n(H * D))
    beta = jax.nn.sigmoid(n(B, T, H))
    args = (q, k, v, g, beta)
    out = {
        "bench": "kda_reference_cpu",
        "shape": {"B": B, "T": T, "H": H, "K": D, "V": D},
        "devices": str(jax.devices()[0].platform),
    }
    for name, f in (("chunk", chunk_kda), ("recurrent", recurrent_kda)):
        fwd = jax.jit(lambda *x, f=f: f(*x, output_final_state=True))
        bwd = jax.jit(jax.grad(lambda *x, f=f: jnp.sum(f(*x)[0] ** 2), argnums=(0, 1, 2, 3, 4)))
        out[f"{name}_fwd"] = _time(fwd, args, a.reps)
        out[f"{name}_fwd_bwd"] = _time(bwd, args, a.reps)
    oc, orr = chunk_kda(*args)[0], recurrent_kda(*args)[0]
    out["rel_err_chunk_vs_recurrent"] = float(jnp.linalg.norm(oc - orr) / jnp.linalg.norm(orr))
    out["chunk_over_recurrent_wall"] = {
        "fwd": round(out["chunk_fwd"]["wall_s"] / out["recurrent_fwd"]["wall_s"], 2),
        "fwd_bwd": round(out["chunk_fwd_bwd"]["wall_s"] / out["recurrent_fwd_bwd"]["wall_s"], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
