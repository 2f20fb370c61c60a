"""One-call probe of the Mosaic GPU KDA forward on a GPU: correctness vs the reference at small shapes, then
forward time vs the Triton kernels and fla at the issue's shapes (one JSON line per shape on stdout)."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kda import make_inputs, time_jax, to_torch  # noqa: E402
from pallas_kernels.kda import gpu as kgpu  # noqa: E402
from pallas_kernels.kda import mosaic_gpu as mg  # noqa: E402
from pallas_kernels.kda import reference as ref  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(B, T, H):
    q, k, v, g, beta = make_inputs(B, T, H, 128, 128, seed=T)
    h0 = jax.random.normal(jax.random.PRNGKey(3), (B, H, 128, 128), jnp.float32) * 0.1
    t0 = time.perf_counter()
    o, ht = jax.jit(lambda *a: mg.chunk_kda_fwd(*a, 128**-0.5, h0))(q, k, v, g, beta)
    jax.block_until_ready(o)
    dt = time.perf_counter() - t0
    f = lambda x: x.astype(jnp.float32)
    ro, rh = ref.chunk_kda(f(q), f(k), f(v), g, f(beta), 128**-0.5, h0, True)
    return {"check": f"{B}x{T}x{H}", "o_rel": rel(o, ro), "ht_rel": rel(ht, rh), "compile_run_s": round(dt, 1),
            "o_finite": bool(np.isfinite(np.asarray(o, np.float32)).all())}


def bench(B, T, H):
    q, k, v, g, beta = make_inputs(B, T, H, 128, 128)
    res = {"shape": f"{B}x{T}x{H}"}
    fns = {"mosaic_gpu": jax.jit(lambda *a: mg.chunk_kda_fwd(*a, 128**-0.5)),
           "triton": jax.jit(lambda *a: kgpu.chunk_kda_fwd(*a, 128**-0.5, None, None, 64))}
    outs = {}
    for name, fn in fns.items():
        outs[name] = np.asarray(fn(q, k, v, g, beta)[0], np.float32)
        res[f"{name}_fwd_ms"] = time_jax(fn, q, k, v, g, beta, iters=20, repeats=5)
    res["mosaic_vs_triton_rel"] = rel(outs["mosaic_gpu"], outs["triton"])
    try:
        import torch
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from triton.testing import do_bench

        bf = torch.bfloat16
        tq, tk, tv, tb = (to_torch(x, bf) for x in (q, k, v, beta))
        tg = to_torch(g)

        def fwd():
            return fla_chunk_kda(tq, tk, tv, tg, tb, output_final_state=True, safe_gate=True, lower_bound=-5.0)

        with torch.no_grad():
            o_fla = fwd()[0].float().cpu().numpy()
            res["fla_fwd_ms"] = do_bench(fwd, warmup=5, rep=100, return_mode="median")
        for name in fns:
            res[f"{name}_vs_fla_rel"] = rel(outs[name], o_fla)
            res[f"{name}_speed_vs_fla"] = res["fla_fwd_ms"] / res[f"{name}_fwd_ms"]
    except Exception as e:  # noqa: BLE001
        res["fla_error"] = repr(e)[:300]
    return res


if __name__ == "__main__":
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    for s in filter(None, sys.argv[1].split(",")):
        print(json.dumps(check(*(int(x) for x in s.split("x")))), flush=True)
    for s in filter(None, sys.argv[2].split(",")):
        print(json.dumps(bench(*(int(x) for x in s.split("x")))), flush=True)
