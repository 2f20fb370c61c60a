r"""KDA chunked backward alone on a GPU: this repo's Triton backward (``pallas_kernels.kda.gpu_bwd``) vs
flash-linear-attention's backward (``fla-core`` ``chunk_kda``; timed as ``torch.autograd.grad`` on a saved
forward graph, so its forward is excluded), in one run.

Prints one JSON line on stdout (progress on stderr). Times are ms per call (median of repeats after warm-up);
``speed_vs_fla_bwd`` = fla time / our time.

    python benchmarks/kda_bwd.py        # T=8192, H=96: all-Triton and the mosaic_gpu backend's steps, vs fla
    python benchmarks/kda_bwd.py --configs 64:128,64:64,64:128:abk=128,64:64:8 --profile-dir /tmp/prof

Example sweep of the launch parameters (each config costs its compile plus ~1 s of timing):

    python benchmarks/kda_bwd.py --no-fla --configs 64:128,64:128:wdx=4,64:128:dabk=64,64:128:wda=8:wdq=4 \
        --profile-dir /tmp/prof

``--configs``: comma list of ``block_v:block_k[:warps][:key=value...]`` (``warps`` = num_warps of the per-chunk
gradient kernels dqkw / wy_dx / wy_dl / da; the others keep ``gpu_bwd.DEFAULT_WARPS``); keys: ``dabk``
(``da_block_k``), ``abk`` (``a_block_k``), ``mgpu`` (``mosaic_gpu_steps``: the steps on Mosaic GPU kernels,
``+``-joined, e.g. ``mgpu=sweeps+dqkw+wy+da``) and per-kernel warps ``wda``, ``wdx``, ``wdl``, ``wdq`` (da, wy_dx,
wy_dl, dqkw). A config that fails prints its error in the sweep and the sweep goes on; the fastest on the first
shape is used for the rest.
bf16 q/k/v/beta, fp32 log-decay in (-5, 0), K = V = 128, random output and final-state cotangents.
``rel_err_vs_ref`` compares our gradients with the fp32 VJP of the pure-JAX reference (first shape only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._profile import device_op_times  # noqa: E402
from benchmarks.kda import log, make_inputs, time_jax, to_torch  # noqa: E402
from pallas_kernels.kda import gpu_bwd  # noqa: E402
from pallas_kernels.kda import reference as ref  # noqa: E402

PER_CHUNK = ("kda_bwd_dqkw_gpu", "kda_bwd_wy_dx_gpu", "kda_bwd_wy_dl_gpu", "kda_bwd_da_gpu")
WARP_KEYS = {"wda": "kda_bwd_da_gpu", "wdx": "kda_bwd_wy_dx_gpu", "wdl": "kda_bwd_wy_dl_gpu", "wdq": "kda_bwd_dqkw_gpu"}
VARIANT_KEYS = {"dabk": ("da_block_k", int), "abk": ("a_block_k", int),
                "mgpu": ("mosaic_gpu_steps", lambda s: tuple(filter(None, s.split("+"))))}


def bwd_kwargs(cfg: str) -> dict:
    """``block_v:block_k[:warps][:key=value...]`` -> keyword arguments of ``gpu_bwd.chunk_kda_bwd``."""
    fields = cfg.split(":")
    pos = [f for f in fields if "=" not in f]
    if not 2 <= len(pos) <= 3 or any("=" not in f for f in fields[len(pos):]):
        raise ValueError(f"--configs entry {cfg!r}: expected block_v:block_k[:warps][:key=value...]")
    kw = {"block_v": int(pos[0]), "block_k": int(pos[1])}
    warps = dict.fromkeys(PER_CHUNK, int(pos[2])) if len(pos) == 3 else {}
    for f in fields[len(pos):]:
        key, val = f.split("=", 1)
        if key in WARP_KEYS:
            warps[WARP_KEYS[key]] = int(val)
        elif key in VARIANT_KEYS:
            arg, conv = VARIANT_KEYS[key]
            kw[arg] = conv(val)
        else:
            raise ValueError(f"--configs entry {cfg!r}: unknown key {key!r} (known: {[*WARP_KEYS, *VARIANT_KEYS]})")
    if warps:
        kw["num_warps"] = warps
    return kw


def ours_fn(K: int, cfg: str):
    kw = bwd_kwargs(cfg)
    return jax.jit(lambda q, k, v, g, beta, do, dht: gpu_bwd.chunk_kda_bwd(
        q, k, v, g, beta, K**-0.5, None, None, do, dht, **kw))


def rel_errs(got, q, k, v, g, beta, do, dht) -> dict:
    f32 = jnp.float32

    def f(q, k, v, g, beta):
        return ref.chunk_kda(q, k, v, g, beta, None, None, True)

    _, vjp = jax.vjp(f, *(x.astype(f32) for x in (q, k, v, g, beta)))
    want = jax.jit(lambda do, dht: vjp((do.astype(f32), dht)))(do, dht)
    out = {}
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got[:5], want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        out[name] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    return out


def bench_fla_bwd(q, k, v, g, beta, do, dht):
    try:
        import torch
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from triton.testing import do_bench
    except Exception as e:  # noqa: BLE001
        log("fla unavailable:", repr(e))
        return None
    bf = torch.bfloat16
    leaves = [to_torch(x, bf).requires_grad_(True) for x in (q, k, v)] + [
        to_torch(g).requires_grad_(True), to_torch(beta, bf).requires_grad_(True)]
    o, ht = fla_chunk_kda(*leaves, output_final_state=True, safe_gate=True, lower_bound=-5.0)
    tdo, tdht = to_torch(do, bf), to_torch(dht)
    return do_bench(lambda: torch.autograd.grad((o, ht), leaves, (tdo, tdht), retain_graph=True), warmup=3, rep=50)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x8192x96")
    p.add_argument("--configs", default="64:128,64:128:mgpu=sweeps+dqkw+wy")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--profile-dir", default=None)
    args = p.parse_args()
    K = V = 128
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    cfgs = [c.strip() for c in args.configs.split(",") if c.strip()]
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "results": []}
    for i, (B, T, H) in enumerate(shapes):
        q, k, v, g, beta = make_inputs(B, T, H, K, V)
        do = jax.random.normal(jax.random.PRNGKey(7), (B, T, H, V), jnp.bfloat16)
        dht = 0.1 * jax.random.normal(jax.random.PRNGKey(8), (B, H, K, V), jnp.float32)
        a = (q, k, v, g, beta, do, dht)
        res = {"shape": f"B={B},T={T},H={H},K={K},V={V}", "dtype": "bf16"}
        if i == 0 and len(cfgs) > 1:
            sweep = {}
            for cfg in cfgs:
                try:
                    sweep[cfg] = time_jax(ours_fn(K, cfg), *a)
                except Exception as e:  # noqa: BLE001
                    sweep[cfg] = repr(e)[:300]
                log("sweep", cfg, sweep[cfg])
            out["config_sweep_bwd_ms"] = sweep
            ok = {c: t for c, t in sweep.items() if isinstance(t, float)}
            if not ok:
                print(json.dumps(out))
                raise SystemExit("every --configs entry failed")
            cfgs = [min(ok, key=ok.get)]
        out["bwd_config"] = cfgs[0]
        fn = ours_fn(K, cfgs[0])
        t0 = time.perf_counter()
        got = jax.block_until_ready(fn(*a))
        res["ours_compile_s"] = round(time.perf_counter() - t0, 1)
        res["ours_bwd_ms"] = time_jax(fn, *a)
        if args.profile_dir:
            res["ours_bwd_profile"] = device_op_times(fn, *a, top=12,
                                                      out_dir=os.path.join(args.profile_dir, f"bwd_{B}x{T}x{H}"))
        if i == 0 and not args.no_check:
            res["rel_err_vs_ref"] = rel_errs(got, *a)
        log(res)
        if not args.no_fla:
            t_fla = bench_fla_bwd(*a)
            res["fla_bwd_ms"] = t_fla
            if t_fla is not None:
                res["speed_vs_fla_bwd"] = t_fla / res["ours_bwd_ms"]
        log(res)
        out["results"].append(res)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
