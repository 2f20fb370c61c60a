"""One-call probe of the Mosaic GPU KDA forward on a GPU: correctness vs the fp32 reference at small shapes (both
state-pass splits), then forward time vs fla (and the Triton kernels) at the issue's shapes, with the two
kernels' times alone. One JSON line per check / shape on stdout.

``python3 benchmarks/kda_mosaic_probe.py CHECK_SHAPES BENCH_SHAPES [TRITON_SHAPES] [nofla]``: comma lists of
``BxTxH``; ``TRITON_SHAPES`` (default all): time the Triton kernels on the first N bench shapes only (their
compiles are slow); ``nofla`` leaves fla out. ``python3 benchmarks/kda_mosaic_probe.py intra``: the per-chunk
kernel against its reference at 1x128x2 and its time at 1x8192x96 (exit status 1 if an output is off)."""

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
from pallas_kernels.kda import mosaic_gpu as mg  # noqa: E402
from pallas_kernels.kda import mosaic_gpu_state  # noqa: E402
from pallas_kernels.kda import reference as ref  # noqa: E402
from pallas_kernels.kda.mosaic_gpu_intra import intra_chunks, intra_chunks_reference  # noqa: E402
from pallas_kernels.kda.mosaic_gpu_state import state_pass  # noqa: E402

SCALE = 128**-0.5


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check(B, T, H):
    q, k, v, g, beta = make_inputs(B, T, H, 128, 128, seed=T)
    h0 = jax.random.normal(jax.random.PRNGKey(3), (B, H, 128, 128), jnp.float32) * 0.1
    f = lambda x: x.astype(jnp.float32)
    ro, rh = ref.chunk_kda(f(q), f(k), f(v), g, f(beta), SCALE, h0, True)
    res = {"check": f"{B}x{T}x{H}"}
    for vs in (1, 2):
        t0 = time.perf_counter()
        o, ht = jax.jit(lambda *a, vs=vs: mg.chunk_kda_fwd(*a, SCALE, h0, v_split=vs))(q, k, v, g, beta)
        jax.block_until_ready(o)
        res[f"v_split{vs}"] = {"o_rel": rel(o, ro), "ht_rel": rel(ht, rh), "compile_run_s": round(
            time.perf_counter() - t0, 1), "o_finite": bool(np.isfinite(np.asarray(o, np.float32)).all())}
    return res


def check_parts(B, T, H):
    """Each kernel alone: the per-chunk kernel against its plain-JAX reference, the state pass on the reference's
    intermediates against the fp32 reference of the whole forward (with and without the register split)."""
    q, k, v, g, beta = make_inputs(B, T, H, 128, 128, seed=T + 1)
    h0 = jax.random.normal(jax.random.PRNGKey(4), (B, H, 128, 128), jnp.float32) * 0.1
    beta_t = jnp.swapaxes(beta.astype(jnp.float32), 1, 2)
    got = jax.jit(lambda *a: intra_chunks(*a, scale=SCALE))(q, k, g, beta_t)
    want = intra_chunks_reference(q, k, g, beta_t, scale=SCALE)
    res = {"check_parts": f"{B}x{T}x{H}"}
    for name, a, b in zip(("qg", "kd", "wn", "x", "aqk"), got[:5], want[:5], strict=True):
        res[f"intra_{name}_rel"] = rel(a, b)
    res["intra_decay_max_abs"] = float(jnp.max(jnp.abs(got[5] - want[5])))
    f = lambda x: x.astype(jnp.float32)
    ro, rh = ref.chunk_kda(f(q), f(k), f(v), g, f(beta), SCALE, h0, True)
    h0_t = jnp.swapaxes(h0, -1, -2)
    regs = dict(mosaic_gpu_state.REGISTERS)
    for vs, label in ((1, "v_split1"), (2, "v_split2"), (1, "v_split1_no_setmaxnreg")):
        if label.endswith("no_setmaxnreg"):
            mosaic_gpu_state.REGISTERS.update(memory=168, state=168)
        o, ht_t = jax.jit(lambda p, v, h, vs=vs: mosaic_gpu_state.state_pass(*p[:3], v, *p[3:], h, v_split=vs))(
            want, v.astype(jnp.bfloat16), h0_t)
        res[f"state_{label}_o_rel"] = rel(o, ro)
        res[f"state_{label}_ht_rel"] = rel(jnp.swapaxes(ht_t, -1, -2), rh)
    mosaic_gpu_state.REGISTERS.update(regs)
    return res


def check_intra(B, T, H, time_shape=None):
    """The per-chunk kernel alone against its reference (two gate scales: the benchmark's and 100x milder, where
    the chunk decay is not 0), and its time at ``time_shape``."""
    q, k, v, g, beta = make_inputs(B, T, H, 128, 128, seed=T + 2)
    beta_t = jnp.swapaxes(beta.astype(jnp.float32), 1, 2)
    fn = jax.jit(lambda *a: intra_chunks(*a, scale=SCALE))
    res = {"check_intra": f"{B}x{T}x{H}"}
    for label, gs in (("", g), ("mild_", g * 0.01)):
        got, want = fn(q, k, gs, beta_t), intra_chunks_reference(q, k, gs, beta_t, scale=SCALE)
        for name, a, b in zip(("qg", "kd", "wn", "x", "aqk", "decay"), got, want, strict=True):
            res[f"{label}{name}_rel"] = rel(a, b) if float(jnp.max(jnp.abs(b))) > 0 else float(jnp.max(jnp.abs(a)))
        res[f"{label}qg_rel_by_chunk"] = [rel(got[0][:, c * 64:(c + 1) * 64], want[0][:, c * 64:(c + 1) * 64])
                                          for c in range(T // 64)]
    if time_shape is not None:
        q, k, v, g, beta = make_inputs(*time_shape, 128, 128)
        args = (q, k, g, jnp.swapaxes(beta.astype(jnp.float32), 1, 2))
        res["intra_kernel_ms"] = time_jax(fn, *args, iters=20, repeats=5)
    return res


def bench(B, T, H, triton: bool, no_fla: bool = False):
    q, k, v, g, beta = make_inputs(B, T, H, 128, 128)
    res = {"shape": f"{B}x{T}x{H}", "v_split_auto": mg.default_v_split(B, H)}
    fns = {"mosaic_gpu": jax.jit(lambda *a: mg.chunk_kda_fwd(*a, SCALE))}
    other = 3 - res["v_split_auto"]
    fns[f"mosaic_gpu_v_split{other}"] = jax.jit(lambda *a: mg.chunk_kda_fwd(*a, SCALE, v_split=other))
    if triton:
        from pallas_kernels.kda import gpu as kgpu

        fns["triton"] = jax.jit(lambda *a: kgpu.chunk_kda_fwd(*a, SCALE, None, None, 64))
    outs = {}
    for name, fn in fns.items():
        o, ht = fn(q, k, v, g, beta)
        outs[name] = (np.asarray(o, np.float32), np.asarray(ht))
        res[f"{name}_fwd_ms"] = time_jax(fn, q, k, v, g, beta, iters=20, repeats=5)
    # the two kernels alone (inputs already in the kernels' layout)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    beta_t = jnp.swapaxes(beta.astype(jnp.float32), 1, 2)
    intra = jax.jit(lambda q, k, g, b: intra_chunks(q, k, g, b, scale=SCALE))
    parts = intra(qb, kb, g, beta_t)
    h0_t = jnp.zeros((B, H, 128, 128), jnp.float32)
    state = jax.jit(lambda p, v, h: state_pass(*p[:3], v, *p[3:], h, v_split=res["v_split_auto"]))
    res["intra_kernel_ms"] = time_jax(intra, qb, kb, g, beta_t, iters=20, repeats=5)
    res["state_kernel_ms"] = time_jax(state, parts, vb, h0_t, iters=20, repeats=5)
    print(json.dumps(res), flush=True)
    names = list(fns)
    for name in names[1:]:
        res[f"mosaic_gpu_vs_{name}_o_rel"] = rel(outs["mosaic_gpu"][0], outs[name][0])
    try:
        if no_fla:
            raise RuntimeError("fla left out")
        import torch
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from triton.testing import do_bench

        bf = torch.bfloat16
        tq, tk, tv, tb = (to_torch(x, bf) for x in (q, k, v, beta))
        tg = to_torch(g)

        def fwd():
            return fla_chunk_kda(tq, tk, tv, tg, tb, output_final_state=True, safe_gate=True, lower_bound=-5.0)

        with torch.no_grad():
            o_fla, ht_fla = (x.float().cpu().numpy() for x in fwd())
            res["fla_fwd_ms"] = do_bench(fwd, warmup=5, rep=100, return_mode="median")
        for name in names:
            res[f"{name}_vs_fla_o_rel"] = rel(outs[name][0], o_fla)
            res[f"{name}_vs_fla_ht_rel"] = rel(outs[name][1], ht_fla)
            res[f"{name}_speed_vs_fla"] = res["fla_fwd_ms"] / res[f"{name}_fwd_ms"]
    except Exception as e:  # noqa: BLE001
        res["fla_error"] = repr(e)[:300]
    if triton:
        res["mosaic_gpu_speed_vs_triton"] = res["triton_fwd_ms"] / res["mosaic_gpu_fwd_ms"]
    return res


if __name__ == "__main__":
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                      "sms": getattr(jax.devices()[0], "core_count", None)}), flush=True)
    if sys.argv[1] == "intra":  # quick: the per-chunk kernel alone; exit status 1 when an output is off
        res = check_intra(1, 128, 2, (1, 8192, 96))
        print(json.dumps(res), flush=True)
        sys.exit(0 if all(v < 1e-2 for k, v in res.items() if k.endswith("_rel")) else 1)
    for s in filter(None, sys.argv[1].split(",")):
        shape = tuple(int(x) for x in s.split("x"))
        print(json.dumps(check_parts(*shape)), flush=True)
        print(json.dumps(check(*shape)), flush=True)
    n_triton = int(sys.argv[3]) if len(sys.argv) > 3 else 99
    no_fla = len(sys.argv) > 4 and sys.argv[4] == "nofla"
    for i, s in enumerate(filter(None, sys.argv[2].split(","))):
        print(json.dumps(bench(*(int(x) for x in s.split("x")), triton=i < n_triton, no_fla=no_fla)), flush=True)
