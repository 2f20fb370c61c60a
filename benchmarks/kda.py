"""KDA kernel benchmark on a GPU: this repo's Pallas kernels (``--impls``: the Triton and the Mosaic GPU
backends of ``ops.CHUNK``) vs the pure-JAX reference vs flash-linear-attention's Triton kernels (``fla-core``),
in one run.

Prints one JSON line on stdout (progress goes to stderr). Times are milliseconds per call (median of
repeats, after warm-up); ``speed_vs_fla`` = fla time / our time (>= 1 means we are faster). The ``ours_*`` keys
are the first of ``--impls``; every implementation also gets ``<impl>_fwd_ms``, ``<impl>_fwdbwd_ms``,
``<impl>_vs_fla_rel_err`` (outputs) and ``<impl>_grads_vs_fla_rel_err`` (dq, dk, dv, dg, dbeta on the same
inputs and output cotangent as fla's).

    python benchmarks/kda.py                       # the issue-4 shapes + decode
    python benchmarks/kda.py --shapes 1x8192x96 --no-reference --configs 64:4:1,32:4:1,64:4:2:4:1:4,64:4:2:8:2:8:32

Shapes are ``BxTxH`` with K = V = 128, bf16 q/k/v/beta, fp32 log-decay from ``kda_gate`` (in (-5, 0)).
fla is called as ``chunk_kda(..., safe_gate=True, lower_bound=-5.0)`` and ``fused_recurrent_kda`` for
decode. Without torch/fla installed the fla columns are null.

fla's kernels autotune in each new process (its backward for minutes on an H200) and store the results on disk,
``*.autotune.json`` files under Triton's cache directory (``TRITON_CACHE_DIR``, default ``~/.triton/cache``; fla's
``FLA_CACHE_RESULTS``, on by default): keep that directory (or only those files) and a later process skips the
tuning; ``benchmarks/fla_autotune_h200.tar.gz`` holds them for the H200 at H = 96 and 32 (unpack it into that
directory; ``benchmarks/kda_h200.sh`` does). ``fla_autotune_results`` reports how many such files the directory
held before fla's first call and ``fla_first_call_s`` how long that call (forward, then forward + backward) took,
tuning included.
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
from pallas_kernels.kda import gpu as kgpu  # noqa: E402
from pallas_kernels.kda import ops  # noqa: E402
from pallas_kernels.kda import reference as ref  # noqa: E402
from pallas_kernels.registry import selections  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def make_inputs(B, T, H, K, V, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    bf = jnp.bfloat16
    q = ref.l2norm(jax.random.normal(ks[0], (B, T, H, K), bf))
    k = ref.l2norm(jax.random.normal(ks[1], (B, T, H, K), bf))
    v = jax.random.normal(ks[2], (B, T, H, V), bf)
    g = ref.kda_gate(jax.random.normal(ks[3], (B, T, H, K), jnp.float32), jnp.zeros((H,), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32)).astype(bf)
    return q, k, v, g, beta


def time_jax(fn, *args, iters=10, repeats=3, warmup=3, all_repeats=None):
    """Median over ``repeats`` of the mean ms per call over ``iters`` pipelined calls, after ``warmup`` blocked calls
    (first calls after a compile or a profiler session can be several times slower); ``all_repeats``, a list, gets
    every repeat's figure."""
    for _ in range(warmup):
        out = fn(*args)
        jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters * 1e3)
    if all_repeats is not None:
        all_repeats.extend(round(t, 3) for t in times)
    return float(np.median(times))


GPU_CFG_KEYS = ("block_v", "num_warps", "num_stages", "a_num_warps", "solve_num_warps", "wu_num_warps", "block_k")


def gpu_kwargs(cfg):
    """``--configs`` entry (ints, in ``GPU_CFG_KEYS`` order; trailing ones may be left out) -> keyword args of
    ``gpu.chunk_kda_fwd``."""
    if not 1 <= len(cfg) <= len(GPU_CFG_KEYS):
        raise ValueError(f"--configs entry {cfg}: expected 1..{len(GPU_CFG_KEYS)} ints ({':'.join(GPU_CFG_KEYS)})")
    return dict(zip(GPU_CFG_KEYS[: len(cfg)], cfg, strict=True))


def jax_fns(impl, K, gpu_cfg=None):
    """``impl``: an ``ops.CHUNK`` backend, or ``backend/backward`` (``ops.BACKWARDS``, e.g. ``mosaic_gpu/mosaic_gpu``:
    the backward with every step on Mosaic GPU)."""
    name, _, backward = impl.partition("/")
    chunk = lambda *a: ops.chunk_kda(*a, output_final_state=True, implementation=name,  # noqa: E731
                                     backward=backward or "auto")

    def fwd(q, k, v, g, beta):
        if impl == "triton" and gpu_cfg is not None:
            return kgpu.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, None, None, 64, **gpu_kwargs(gpu_cfg))
        return chunk(q, k, v, g, beta)

    def loss(q, k, v, g, beta, do):
        o, _ = chunk(q, k, v, g, beta)
        return jnp.sum(o.astype(jnp.float32) * do)

    # value_and_grad, not grad: with grad alone the forward kernels' output is unused and the forward is dropped
    # (the custom VJPs recompute what they need from the inputs), so forward + backward would time the backward.
    return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def to_torch(x, dtype=None):
    import torch

    t = torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).cuda()
    return t.to(dtype) if dtype is not None else t


def bench_fla_chunk(q, k, v, g, beta, do, bwd: bool = True):
    """fla's ``chunk_kda`` timed: ``(fwd ms, fwd+bwd ms or None, o, grads or None, first_call)``; ``first_call``:
    fla's on-disk autotune results before its first call and that call's seconds (tuning included)."""
    try:
        import torch
        from fla.ops.kda import chunk_kda as fla_chunk_kda
        from triton.testing import do_bench
    except Exception as e:  # noqa: BLE001
        log("fla unavailable:", repr(e))
        return None, None, None, None, {}
    bf = torch.bfloat16
    tq, tk, tv, tb = (to_torch(x, bf) for x in (q, k, v, beta))
    tg = to_torch(g)
    tdo = to_torch(do, bf)
    cache = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    first_call = {"fla_autotune_results": sum(
        name.endswith(".autotune.json") for _, _, names in os.walk(cache) for name in names)}

    def fwd():
        return fla_chunk_kda(tq, tk, tv, tg, tb, output_final_state=True, safe_gate=True, lower_bound=-5.0)

    t0 = time.perf_counter()
    with torch.no_grad():
        o_fla, _ = fwd()
    torch.cuda.synchronize()
    first_call["fla_first_call_s"] = {"fwd": round(time.perf_counter() - t0, 1)}
    t_fwd = do_bench(lambda: fwd(), warmup=5, rep=50)
    if not bwd:
        return t_fwd, None, o_fla.float().cpu().numpy(), None, first_call
    leaves = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv, tg, tb)]

    def fwdbwd():
        for x in leaves:
            x.grad = None
        o, _ = fla_chunk_kda(*leaves, output_final_state=True, safe_gate=True, lower_bound=-5.0)
        o.backward(tdo)

    t0 = time.perf_counter()
    fwdbwd()
    torch.cuda.synchronize()
    first_call["fla_first_call_s"]["fwdbwd"] = round(time.perf_counter() - t0, 1)
    t_fb = do_bench(fwdbwd, warmup=3, rep=50)
    grads = [x.grad.float().cpu().numpy() for x in leaves]  # of the last fwdbwd() call
    return t_fwd, t_fb, o_fla.float().cpu().numpy(), grads, first_call


GRAD_NAMES = ("q", "k", "v", "g", "beta")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bench_impl(impl, inputs, do, args, gpu_cfg, res, key, profile_tag=None):
    """Time ``impl``'s forward (and forward+backward) into ``res[f"{key}_..."]``; returns its output and grads."""
    B, T, H = profile_tag or (0, 0, 0)
    t0 = time.perf_counter()
    fwd, grad = jax_fns(impl, 128, gpu_cfg if impl == "triton" else None)
    o = fwd(*inputs)[0]
    res[f"{key}_compile_s"] = round(time.perf_counter() - t0, 1)
    res[f"{key}_fwd_ms"] = time_jax(fwd, *inputs)
    if args.profile_dir and profile_tag:
        res[f"{key}_fwd_profile"] = device_op_times(fwd, *inputs, top=8,
                                                    out_dir=os.path.join(args.profile_dir, f"fwd_{key}_{B}x{T}x{H}"))
    log(res)
    grads = None
    if not args.no_bwd:
        t0 = time.perf_counter()
        jax.block_until_ready(grad(*inputs, do))
        res[f"{key}_fwdbwd_compile_s"] = round(time.perf_counter() - t0, 1)
        log(res)
        res[f"{key}_fwdbwd_repeats_ms"] = []
        res[f"{key}_fwdbwd_ms"] = time_jax(grad, *inputs, do, iters=5, repeats=3,
                                           all_repeats=res[f"{key}_fwdbwd_repeats_ms"])
        grads = [np.asarray(x, np.float32) for x in grad(*inputs, do)[1]]
        if args.profile_dir and profile_tag:
            res[f"{key}_fwdbwd_profile"] = device_op_times(
                grad, *inputs, do, top=20, timeline=True,
                out_dir=os.path.join(args.profile_dir, f"fb_{key}_{B}x{T}x{H}"))
        log(res)
    return np.asarray(o, np.float32), grads


def bench_shape(B, T, H, args, gpu_cfg):
    K = V = 128
    inputs = make_inputs(B, T, H, K, V)
    do = jax.random.normal(jax.random.PRNGKey(7), (B, T, H, V), jnp.float32)
    res = {"shape": f"B={B},T={T},H={H},K={K},V={V}", "dtype": "bf16"}
    impls = [i for i in args.impls.split(",") if i]
    outs = {}
    for n, impl in enumerate(impls):
        profile = n == 0 or args.profile_all
        outs[impl] = bench_impl(impl, inputs, do, args, gpu_cfg, res, impl, (B, T, H) if profile else None)
        for suffix in ("compile_s", "fwd_ms", "fwdbwd_ms", "fwd_profile", "fwdbwd_profile"):
            if n == 0 and f"{impl}_{suffix}" in res:
                res[f"ours_{suffix}"] = res[f"{impl}_{suffix}"]
    first = impls[0] if impls else None
    for impl in impls[1:]:  # every implementation's gradients against the first's, on the same inputs
        if outs[impl][1] is not None and outs[first][1] is not None:
            res[f"{impl}_grads_vs_{first}_rel_err"] = {
                name: rel_err(a, b) for name, a, b in zip(GRAD_NAMES, outs[impl][1], outs[first][1], strict=True)}
    if not args.no_reference:
        rfwd, rgrad = jax_fns("reference", K)
        o_ref = rfwd(*inputs)[0]
        res["ref_fwd_ms"] = time_jax(rfwd, *inputs, iters=3, repeats=2, warmup=1)
        if not args.no_bwd:
            res["ref_fwdbwd_ms"] = time_jax(rgrad, *inputs, do, iters=2, repeats=2, warmup=1)
        for impl in impls:
            res[f"{impl}_vs_ref_rel_err"] = rel_err(outs[impl][0], o_ref)
        res["ours_vs_ref_rel_err"] = res[f"{impls[0]}_vs_ref_rel_err"]
        log(res)
    if not args.no_fla:
        t_fwd, t_fb, o_fla, g_fla, first_call = bench_fla_chunk(*inputs, do, bwd=not args.no_bwd)
        res["fla_fwd_ms"], res["fla_fwdbwd_ms"] = t_fwd, t_fb
        res.update(first_call)
        if o_fla is not None:
            for n, impl in enumerate(impls):
                o, grads = outs[impl]
                res[f"{impl}_vs_fla_rel_err"] = rel_err(o, o_fla)
                res[f"speed_vs_fla_fwd_{impl}"] = t_fwd / res[f"{impl}_fwd_ms"]
                if grads is not None:
                    res[f"{impl}_grads_vs_fla_rel_err"] = {
                        name: rel_err(a, b) for name, a, b in zip(GRAD_NAMES, grads, g_fla, strict=True)}
                    res[f"speed_vs_fla_fwdbwd_{impl}"] = t_fb / res[f"{impl}_fwdbwd_ms"]
                if n == 0:
                    res["ours_vs_fla_rel_err"] = res[f"{impl}_vs_fla_rel_err"]
                    res["speed_vs_fla_fwd"] = res[f"speed_vs_fla_fwd_{impl}"]
                    if grads is not None:
                        res["speed_vs_fla_fwdbwd"] = res[f"speed_vs_fla_fwdbwd_{impl}"]
    log(res)
    return res


def _time_decode(step, a, pool_host, slots, ro, rh, iters: int = 200):
    """``(us per step, o rel. err vs the reference, state rel. err, the last pool)`` of a jitted decode step that
    donates its pool."""
    o, p = step(*a, jnp.asarray(pool_host), slots)
    err = float(jnp.linalg.norm(o - ro[:, 0].astype(o.dtype)) / jnp.linalg.norm(ro))
    state_err = float(jnp.linalg.norm(p[slots] - rh) / jnp.linalg.norm(rh))
    for _ in range(5):
        o, p = step(*a, p, slots)
    jax.block_until_ready(p)
    t0 = time.perf_counter()
    for _ in range(iters):
        o, p = step(*a, p, slots)
    jax.block_until_ready(p)
    return (time.perf_counter() - t0) / iters * 1e6, err, state_err, p


def bench_decode(B, H, args):
    """Decode step at ``B`` sequences x ``H`` heads: ours for each ``--decode-configs`` entry
    (``block_v:num_warps`` of ``gpu.decode_step``; the fastest is reported as ``ours_us``), the Mosaic GPU decode
    (``mosaic_gpu_decode.decode_step``) for each ``--mosaic-decode-configs`` entry (fastest as ``mosaic_gpu_us``), then
    fla's ``fused_recurrent_kda`` on the same inputs."""
    K = V = 128
    q, k, v, g, beta = make_inputs(B, 1, H, K, V, seed=3)
    pool = jax.random.normal(jax.random.PRNGKey(5), (B, H, K, V), jnp.float32) * 0.1
    slots = jnp.arange(B, dtype=jnp.int32)[::-1]
    a = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    pool_host = np.asarray(pool)  # the jitted step donates ``pool``: fla's copy is taken from this one
    ro, rh = ref.recurrent_kda(q, k, v, g, beta, None, pool[slots], True)
    res = {"shape": f"decode B={B},H={H},K={K},V={V}", "configs_us": {}}
    state_bytes = 2 * B * H * K * V * 4
    for cfg in args.decode_configs.split(","):
        block_v, num_warps = (int(x) for x in cfg.split(":"))
        step = jax.jit(
            lambda q, k, v, g, b, pool, slots, bv=block_v, nw=num_warps: kgpu.decode_step(
                q, k, v, g, b, K**-0.5, pool, slots, block_v=bv, num_warps=nw),
            donate_argnums=(5,),
        )
        try:
            t_us, err, state_err, p = _time_decode(step, a, pool_host, slots, ro, rh)
            res["configs_us"][cfg] = round(t_us, 1)
            if t_us < res.get("ours_us", float("inf")):
                res.update(ours_us=t_us, ours_config=cfg, ours_vs_ref_rel_err=err, state_rel_err=state_err,
                           ours_state_TBps=state_bytes / (t_us * 1e-6) / 1e12)
                if args.profile_dir:  # device time of the kernel and of anything XLA adds around it
                    box = [p]

                    def one(*xs, step=step, box=box):
                        o, box[0] = step(*xs, box[0], slots)
                        return o

                    res["ours_profile"] = device_op_times(one, *a, top=6, iters=20,
                                                          out_dir=os.path.join(args.profile_dir, f"decode_{cfg}"))
        except Exception as e:  # noqa: BLE001 - report the config and go on
            res["configs_us"][cfg] = repr(e)[:200]
        log("decode", res["configs_us"])
    for entry in (x for x in args.mosaic_decode_configs.split(",") if x):
        from pallas_kernels.kda import mosaic_gpu_decode  # noqa: PLC0415

        bv, stages, ahead, per_sm = (int(x) for x in entry.split(":"))
        ctas = per_sm * (getattr(jax.devices()[0], "core_count", None) or 132)
        cfg = f"mosaic_gpu:{entry}"
        step = jax.jit(
            lambda q, k, v, g, b, pool, slots, bv=bv, st=stages, la=ahead, n=ctas: mosaic_gpu_decode.decode_step(
                q, k, v, g, b, K**-0.5, pool, slots, block_v=bv, stages=st, lookahead=la, num_ctas=n),
            donate_argnums=(5,),
        )
        try:
            t_us, err, state_err, _ = _time_decode(step, a, pool_host, slots, ro, rh)
            res["configs_us"][cfg] = round(t_us, 1)
            if t_us < res.get("mosaic_gpu_us", float("inf")):
                res.update(mosaic_gpu_us=t_us, mosaic_gpu_config=cfg, mosaic_gpu_vs_ref_rel_err=err,
                           mosaic_gpu_state_rel_err=state_err,
                           mosaic_gpu_state_TBps=state_bytes / (t_us * 1e-6) / 1e12,
                           mosaic_gpu_vs_triton=res.get("ours_us", float("nan")) / t_us)
        except Exception as e:  # noqa: BLE001 - report the config and go on
            res["configs_us"][cfg] = repr(e)[:200]
        log("decode", res["configs_us"])
    t_ours = res.get("ours_us", float("nan")) / 1e3
    if not args.no_fla:
        try:
            import torch
            from fla.ops.kda import fused_recurrent_kda
            from triton.testing import do_bench

            bf = torch.bfloat16
            tq, tk, tv, tb = (to_torch(x, bf) for x in (q, k, v, beta))
            tg = to_torch(g)
            th = to_torch(pool_host)
            with torch.no_grad():
                t_fla = do_bench(
                    lambda: fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=th, output_final_state=True),
                    warmup=10, rep=100,
                )
            res["fla_us"] = t_fla * 1e3
            res["speed_vs_fla"] = t_fla / t_ours
            if "mosaic_gpu_us" in res:
                res["mosaic_gpu_vs_fla"] = t_fla / (res["mosaic_gpu_us"] / 1e3)
        except Exception as e:  # noqa: BLE001
            log("fla decode unavailable:", repr(e))
    log(res)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x8192x96,1x32768x32,8x4096x32")
    p.add_argument("--configs", default="64:4:3", help="GPU kernel configs, comma list of ints in the order "
                   + ":".join(GPU_CFG_KEYS) + " (state kernel, then the A / solve / W-U kernels; trailing ones "
                   "left out = defaults of gpu.chunk_kda_fwd); the fastest on the first shape is used for the rest")
    p.add_argument("--impls", default="triton,mosaic_gpu",
                   help="comma list of ops.CHUNK backends to time, each optionally /backward (ops.BACKWARDS, e.g. "
                        "mosaic_gpu/mosaic_gpu: every backward step on Mosaic GPU); the first fills the ours_* keys")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--no-bwd", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--reference-shapes", type=int, default=1, help="time the reference on the first N shapes")
    p.add_argument("--fla-shapes", type=int, default=99, help="time fla's chunk_kda on the first N shapes only")
    p.add_argument("--decode-first", action="store_true", help="run the decode comparison before the chunk shapes")
    p.add_argument("--decode-configs", default="64:8", help="comma list of block_v:num_warps for gpu.decode_step")
    p.add_argument("--mosaic-decode-configs", default="64:3:1:2,64:4:2:1,64:2:1:3,128:2:1:1",
                   help="comma list of block_v:stages:lookahead:CTAs per SM for mosaic_gpu_decode.decode_step "
                        "(empty: skip it)")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip remaining shapes once this much time passed")
    p.add_argument("--profile-dir", default=None, help="add per-kernel device times (JAX profiler) of our calls")
    p.add_argument("--profile-all", action="store_true", help="profile every implementation, not only the first")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="also write a summary plot: time vs sequence length, ours vs fla (needs matplotlib)")
    args = p.parse_args()
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "results": []}
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    cfgs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    if len(cfgs) > 1 and shapes:
        B, T, H = shapes[0]
        q, k, v, g, beta = make_inputs(B, T, H, 128, 128)
        sweep = {}
        for cfg in cfgs:
            try:
                fwd, _ = jax_fns("triton", 128, cfg)
                sweep[":".join(map(str, cfg))] = time_jax(fwd, q, k, v, g, beta)
            except Exception as e:  # noqa: BLE001
                sweep[":".join(map(str, cfg))] = repr(e)[:200]
            log("sweep", sweep)
        out["config_sweep_fwd_ms"] = sweep
        ok = {c: t for c, t in sweep.items() if isinstance(t, float)}
        best = min(ok, key=ok.get)
        cfgs = [tuple(int(x) for x in best.split(":"))]
    out["gpu_config"] = ":".join(map(str, cfgs[0]))
    start = time.perf_counter()
    if args.decode_first and not args.no_decode:
        try:
            out["decode"] = bench_decode(64, 96, args)
        except Exception as e:  # noqa: BLE001
            out["decode"] = {"error": repr(e)[:500]}
    for i, (B, T, H) in enumerate(shapes):
        if time.perf_counter() - start > args.budget_s:
            out["results"].append({"shape": f"{B}x{T}x{H}", "skipped": "time budget"})
            continue
        no_ref = args.no_reference or i >= args.reference_shapes
        no_fla = args.no_fla or i >= args.fla_shapes
        a = argparse.Namespace(**{**vars(args), "no_reference": no_ref, "no_fla": no_fla})
        try:
            out["results"].append(bench_shape(B, T, H, a, cfgs[0]))
        except Exception as e:  # noqa: BLE001
            out["results"].append({"shape": f"{B}x{T}x{H}", "error": repr(e)[:500]})
            log("error", repr(e))
    if not args.no_decode and not args.decode_first and time.perf_counter() - start <= args.budget_s:
        try:
            out["decode"] = bench_decode(64, 96, args)
        except Exception as e:  # noqa: BLE001
            out["decode"] = {"error": repr(e)[:500]}
    out["kernels"] = [sel.describe() for sel in selections()]  # what each implementation="auto"/name ran
    print(json.dumps(out))
    if args.plot:
        log("plot:", plot_results(out, args.plot))


def plot_results(out: dict, path: str) -> str:
    """Time per call vs sequence length for each implementation of ``out["results"]`` (the JSON line's)."""
    from benchmarks._plot import save_lines

    series = {f"{who} {what}": [] for what in ("fwd", "fwd+bwd") for who in ("ours", "fla", "reference")}
    keys = {"ours": "ours", "fla": "fla", "reference": "ref"}
    labels = {}
    for r in out["results"]:
        dims = dict(kv.split("=") for kv in r["shape"].split(",")) if "=" in r["shape"] else {}
        if "T" not in dims:
            continue
        t = int(dims["T"])
        labels[t] = f"T={t}\nB={dims['B']} H={dims['H']}"
        for who, k in keys.items():
            series[f"{who} fwd"].append((t, r.get(f"{k}_fwd_ms")))
            series[f"{who} fwd+bwd"].append((t, r.get(f"{k}_fwdbwd_ms")))
    return save_lines(path, series, title=f"KDA chunked attention on {out['device']} (bf16, K=V=128)",
                      xlabel="sequence length (shape per point)", ylabel="ms per call", logx=True, logy=True,
                      point_labels=labels,
                      styles={f"{who} {what}": {"color": f"C{i}", "ls": "-" if what == "fwd" else "--"}
                              for i, who in enumerate(keys) for what in ("fwd", "fwd+bwd")})


if __name__ == "__main__":
    main()
