"""LatentMoE expert benchmark on one GPU: full expert FFN (bf16) and the MXFP4 decode path, against peers.

Parts (``--parts``, in this order; each under its own wall-clock budget, one JSON line per measurement, flushed):

- ``decode``: MXFP4 experts (packed E2M1 codes + E8M0 scales, HF layout) with few rows per expert. Measures an
  HBM copy (read + write bytes / s) first, then ``pallas_kernels.moe`` with ``implementation="triton"``
  (Triton kernels decoding the codes in registers) on each ``--decode-cases`` case (``ExR``: E local experts x R
  rows; default 64 x 8): one w1 grouped matmul swept over tiles (``--mx-tiles`` ``tm,tq,tn,warps,stages``) and
  the fused w1/w3 + SiTU-GLU kernel over ``--mx-glu-tiles``, each tile only where its row tile suits the case
  (``R/2 < tm <= 2R``) and checked against the f32 XLA reference (``rel_err_vs_ref``), then with the kernels' own tiles
  (``gpu.mxfp4_tiles``): the expert FFN (fused w1/w3 + SiTU-GLU, then w2), the reference (dequantize to bf16 +
  ``jax.lax.ragged_dot``) on the same, and routed decode steps (``--routing`` ``tokens:topk:experts``, uniform
  random top-k: dispatch + FFN + combine; K3's 64 tokens top-16 of 896 and k3-slice's 64 tokens top-4 of 16).
  Peers ``mgpu_gmm_w1``, ``mgpu_glu_w1w3`` and ``mgpu_ffn``: the same on the Pallas Mosaic GPU MXFP4 kernel
  (:mod:`pallas_kernels.moe.mosaic_gpu_mxfp4`, TMA + wgmma; tiles ``--mx-mgpu-tiles`` ``tm,stages,mode``; the FFN
  through ``expert_ffn(implementation="mosaic_gpu")``), in the same run.
  ``gbps`` = weight bytes of the experts that received rows (codes + scales) / time; ``pct_hbm`` = that / the copy
  bandwidth.
- ``ffn``: the routed expert FFN ``w2(SiTU-GLU(x w1, x w3))`` at K3 shapes (L = 3584, I = 3072; 65,536 rows over 64
  local experts, balanced and skewed), forward and forward+backward (grads of x, w1, w3, w2), peers: ``ours``
  (``expert_ffn(implementation="triton")``: two grouped matmuls + XLA SiTU-GLU, then w2), ``mosaic_gpu`` (the same
  with the Pallas Mosaic GPU kernels, ``implementation="mosaic_gpu"``: the fused w1/w3 + SiTU-GLU kernel, then w2;
  ``mosaic_gpu_unfused``: three Mosaic GPU grouped matmuls, SiTU-GLU in XLA), ``ours_unfused``
  (the same products through ``gpu.gmm`` directly, forward), ``tokamax``
  (``tokamax.ragged_dot(implementation="mosaic")`` for the three products), ``reference``
  (``jax.lax.ragged_dot``), ``dense`` (bf16 matmuls [M,L]x[L,I] x2 and [M,I]x[I,L]: the same FLOPs).
  FLOPs = 6 M L I (x3 with backward); ``pct_dense`` vs the dense peer of the same pass.
- ``glu`` (not run by default): the fused w1/w3 + SiTU-GLU forward, ``situ_glu(x w1, x w3)`` per group, at the
  ``ffn`` shapes: the Mosaic GPU kernel (:mod:`pallas_kernels.moe.mosaic_gpu_glu`) over ``--glu-blocks`` against
  the unfused products on the Mosaic GPU and Triton grouped matmuls, the reference and dense matmuls (FLOPs
  4 M L I).
- ``gmm`` (not run by default): one grouped matmul [M, L] x [E, L, I] with a tile sweep of ``gpu.gmm`` and a block
  sweep of the Mosaic GPU kernel behind ``mosaic_gpu`` (``--mgpu-blocks``).

Timing: a compile+run call, one warm call, then ``n`` back-to-back calls (``n`` <= ``--iters``, cut to fit the
budget) with one block at the end: ``ms`` = their mean (the device queue stays full, so host dispatch is hidden).

    python benchmarks/moe.py [--parts decode,ffn] [--budget-decode 60 --budget-ffn 150]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import gpu, ops
from pallas_kernels.moe import mosaic_gpu_mxfp4 as mgpu_mx
from pallas_kernels.moe import reference as ref
from pallas_kernels.registry import selections

T0 = time.perf_counter()


def emit(rec: dict) -> None:
    rec = {"bench": "moe", "t": round(time.perf_counter() - T0, 1), **rec}
    print(json.dumps(rec), flush=True)


class Budget:
    """Wall-clock budget of one part."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def timeit(fn, *args, iters: int, budget: Budget, min_left: float = 2.0):
    """-> (first output, {"ms", "n", "compile_s"}) or raises TimeoutError when the budget is spent."""
    if budget.left() < min_left:
        raise TimeoutError("part budget spent")
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    warm = time.perf_counter() - t
    n = int(max(1, min(iters, (budget.left() - 1.0) / max(warm, 1e-6) / 2)))
    t = time.perf_counter()
    res = None
    for _ in range(n):
        res = fn(*args)
    jax.block_until_ready(res)
    ms = (time.perf_counter() - t) / n * 1e3
    return out, {"ms": round(ms, 4), "n": n, "compile_s": round(max(first - warm, 0.0), 1)}


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| over all leaves (on device, f32)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    sq = lambda v: float(jnp.sum(jnp.square(v.astype(jnp.float32))))
    num = sum(sq(x.astype(jnp.float32) - y.astype(jnp.float32)) for x, y in zip(la, lb, strict=True))
    den = sum(sq(y) for y in lb)
    return float(np.sqrt(num / max(den, 1e-30)))


def err_line(part: str, peer: str, exc: BaseException, **kw) -> None:
    status = "skipped" if isinstance(exc, TimeoutError) else "error"
    emit({"part": part, "peer": peer, **kw, status: f"{type(exc).__name__}: {str(exc)[:300]}"})


def skewed_sizes(m: int, e: int) -> np.ndarray:
    """Zipf(1.2) group sizes summing to m, with the last 4 experts (e // 4 when e < 16) empty."""
    p = 1.0 / np.arange(1, e + 1) ** 1.2
    p[e - min(4, e // 4):] = 0.0
    s = np.floor(p / p.sum() * m).astype(np.int64)
    s[0] += m - s.sum()
    return s.astype(np.int32)


def load_tokamax():
    """``tokamax.ragged_dot`` (Mosaic GPU) or raise. Its ``xprof`` import serves only its own profiler: stubbed."""
    if "xprof" not in sys.modules and importlib.util.find_spec("xprof") is None:
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    import tokamax

    return lambda x, w, g: tokamax.ragged_dot(x, w, g, implementation="mosaic")


# ------------------------------------------------------------------------------------------ MXFP4 decode
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def random_mxfp4(key, e: int, n: int, k: int) -> dict[str, jax.Array]:
    """Random HF-layout MXFP4 weight: codes u8 [E, N, K/2], E8M0 scales u8 [E, N, K/32] in 2^-9..2^-5.

    One expert at a time (``lax.map``): drawing the whole ``[E, N, K/2]`` array at once makes XLA hold the
    threefry counters and words as u32 arrays of that shape (73.5 GiB of temporaries for K3's 896 x 3072 x 1792
    codes, 15x the 4.6 GiB result), which is what ran the K3-routing case out of memory.
    """

    def one(key_e):
        k1, k2 = jax.random.split(key_e)
        return (jax.random.bits(k1, (n, k // 2), jnp.uint8),
                jax.random.randint(k2, (n, k // 32), 118, 123, jnp.int32).astype(jnp.uint8))

    codes, scales = jax.lax.map(one, jax.random.split(key, e))
    return {"weight_packed": codes, "weight_scale": scales}


#: tiles (tm, tq, tn, warps, stages) of the w1 sweep: 8 rows (mma.sync; the 8-row defaults first), then a shorter K
#: step, 2 warps, 16 / 32 rows (wgmma) with the 16+-row defaults and a longer K step.
MX_TILES = "8,128,64,4,3;8,64,64,4,3;8,128,64,2,3;16,64,64,4,3;16,128,64,4,3;32,64,64,4,3"
#: tiles of the fused w1/w3 + SiTU-GLU sweep (two weights): the defaults for 8 and 16+ rows, then half their K step.
MX_GLU_TILES = "8,128,64,4,3;16,64,64,4,3;8,64,64,4,3;16,32,64,4,3"


def mx_bytes(w: dict[str, jax.Array], live_experts: int) -> int:
    e = w["weight_packed"].shape[0]
    return (w["weight_packed"].size + w["weight_scale"].size) // e * live_experts


def _decode_case(a, e: int, rows: int, report, budget: Budget) -> None:
    """``e`` local experts x ``rows`` rows each: the w1 and fused w1/w3 sweeps (the tiles whose row tile suits the
    case, ``rows / 2 < tm <= 2 * rows``), then the expert FFN with the kernels' own tiles, and the reference."""
    lat, inter, part = a.lat, a.inter, "decode"
    m = e * rows
    ks = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(ks[0], (m, lat), jnp.bfloat16)
    gs = jnp.full((e,), rows, jnp.int32)
    w1, w3 = random_mxfp4(ks[1], e, inter, lat), random_mxfp4(ks[2], e, inter, lat)
    w2 = random_mxfp4(ks[3], e, lat, inter)
    case = f"E{e}x{rows}"
    try:  # every combo is checked against the f32 XLA reference (dequantised f32 weights, HIGHEST precision)
        refs = jax.jit(lambda x, w1, w3, g: (
            ref.grouped_matmul(x.astype(jnp.float32), ref.dense_expert_weight(w1, jnp.float32), g),
            ref.grouped_matmul(x.astype(jnp.float32), ref.dense_expert_weight(w3, jnp.float32), g)))(x, w1, w3, gs)
        base, glu_base = refs[0], ref.situ_glu(*refs)
    except Exception as exc:  # noqa: BLE001
        err_line(part, "reference_gmm_w1", exc, case=case)
        base = glu_base = None
    glu = ref.situ_epilogue(4.0, 25.0, jnp.float32)
    sweeps = [("ours_gmm_w1", a.mx_tiles, mx_bytes(w1, e), base,
               lambda x, w1, w3, g, t: gpu.gmm_mxfp4(x, [(w1["weight_packed"], w1["weight_scale"])], g, tiles=t,
                                                     interpret=a.interpret)),
              ("ours_glu_w1w3", a.mx_glu_tiles, mx_bytes(w1, e) + mx_bytes(w3, e), glu_base,
               lambda x, w1, w3, g, t: gpu.gmm_mxfp4(x, [(w["weight_packed"], w["weight_scale"]) for w in (w1, w3)],
                                                     g, epilogue=glu, out_dtype=jnp.float32, tiles=t,
                                                     interpret=a.interpret)),
              ("mgpu_gmm_w1", a.mx_mgpu_tiles, mx_bytes(w1, e), base,
               lambda x, w1, w3, g, t: mgpu_mx.gmm_mxfp4(x, [(w1["weight_packed"], w1["weight_scale"])], g,
                                                         out_dtype=jnp.float32, tiles=t, interpret=a.interpret)),
              ("mgpu_glu_w1w3", a.mx_mgpu_tiles, mx_bytes(w1, e) + mx_bytes(w3, e), glu_base,
               lambda x, w1, w3, g, t: mgpu_mx.gmm_mxfp4(
                   x, [(w["weight_packed"], w["weight_scale"]) for w in (w1, w3)], g, epilogue=glu,
                   out_dtype=jnp.float32, tiles=t, interpret=a.interpret))]
    for peer, cfgs, nbytes, want, call in sweeps:
        for cfg in filter(None, cfgs.split(";")):
            tiles = tuple(int(v) for v in cfg.split(","))
            if not rows / 2 < tiles[0] <= 2 * rows:
                continue
            try:
                f = jax.jit(functools.partial(call, t=tiles))
                out, tm = timeit(f, x, w1, w3, gs, iters=a.decode_iters, budget=budget)
                err = rel_err(out, want) if want is not None else None  # None: the reference failed (its line)
                report(peer, case, tm, nbytes, tiles=list(tiles), rel_err_vs_ref=err,
                       finite=bool(jnp.all(jnp.isfinite(out))))
                del out
            except Exception as exc:  # noqa: BLE001
                err_line(part, peer, exc, case=case, tiles=list(tiles))
    del base, glu_base
    ffn_bytes = mx_bytes(w1, e) + mx_bytes(w3, e) + mx_bytes(w2, e)
    ours = jax.jit(lambda x, g, w1, w3, w2: ops.expert_ffn(x, g, w1, w3, w2, implementation="triton",
                                                            interpret=a.interpret))
    mgpu = jax.jit(lambda x, g, w1, w3, w2: ops.expert_ffn(x, g, w1, w3, w2, implementation="mosaic_gpu",
                                                            interpret=a.interpret))
    refn = jax.jit(lambda x, g, w1, w3, w2: ref.expert_ffn(x, g, w1, w3, w2))
    out_ours = out_mgpu = None
    try:
        out_ours, tm = timeit(ours, x, gs, w1, w3, w2, iters=a.decode_iters, budget=budget)
        report("ours_ffn", case, tm, ffn_bytes, tiles=list(gpu.mxfp4_tiles(m, e)))
    except Exception as exc:  # noqa: BLE001
        err_line(part, "ours_ffn", exc, case=case)
    try:
        out_mgpu, tm = timeit(mgpu, x, gs, w1, w3, w2, iters=a.decode_iters, budget=budget)
        report("mgpu_ffn", case, tm, ffn_bytes, tiles=list(mgpu_mx.mxfp4_tiles(m, e, 2)),
               tiles_w2=list(mgpu_mx.mxfp4_tiles(m, e, 1)))
    except Exception as exc:  # noqa: BLE001
        err_line(part, "mgpu_ffn", exc, case=case)
    try:
        out_ref, tm = timeit(refn, x, gs, w1, w3, w2, iters=a.decode_iters, budget=budget)
        extra = {f"rel_err_{name}_vs_ref": rel_err(out, out_ref)
                 for name, out in (("ours", out_ours), ("mgpu", out_mgpu)) if out is not None}
        report("reference_ffn", case, tm, ffn_bytes, **extra)
    except Exception as exc:  # noqa: BLE001
        err_line(part, "reference_ffn", exc, case=case)
    del x, w1, w3, w2, out_ours, out_mgpu


def part_decode(a, budget: Budget) -> None:
    lat, inter = a.lat, a.inter
    part = "decode"
    try:  # HBM bandwidth: read + write of a 2 GiB f32 array
        buf = jnp.ones((2**29,), jnp.float32)
        _, tm = timeit(jax.jit(lambda v: v * 2.0), buf, iters=20, budget=budget)
        hbm = 2 * buf.nbytes / (tm["ms"] * 1e-3) / 1e9
        emit({"part": part, "peer": "hbm_copy", "bytes": 2 * buf.nbytes, **tm, "gbps": round(hbm, 1)})
        del buf
    except Exception as exc:  # noqa: BLE001
        err_line(part, "hbm_copy", exc)
        hbm = float("nan")

    def report(peer, case, tm, nbytes, **kw):
        gbps = nbytes / (tm["ms"] * 1e-3) / 1e9
        emit({"part": part, "case": case, "peer": peer, **tm, "weight_bytes": nbytes, "gbps": round(gbps, 1),
              "pct_hbm": round(100 * gbps / hbm, 1), **kw})

    for spec in filter(None, a.decode_cases.split(",")):
        e, rows = (int(v) for v in spec.split("x"))
        _decode_case(a, e, rows, report, budget)
        gc.collect()

    # Routed decode steps: T tokens x top-k of E experts, full dispatch + FFN + combine.
    for n_case, spec in enumerate(filter(None, a.routing.split(","))):
        t, k, e = (int(v) for v in spec.split(":"))
        ks = jax.random.split(jax.random.key(2 + n_case), 6)
        name = f"T{t}_top{k}_of_{e}"
        try:
            if budget.left() < 5:
                raise TimeoutError("part budget spent")
            z = jax.random.normal(ks[0], (t, lat), jnp.bfloat16)
            ids = jax.lax.top_k(jax.random.normal(ks[1], (t, e)), k)[1].astype(jnp.int32)
            wts = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1)
            experts = {"w1": random_mxfp4(ks[3], e, inter, lat), "w3": random_mxfp4(ks[4], e, inter, lat),
                       "w2": random_mxfp4(ks[5], e, lat, inter)}
            live = int(np.unique(np.asarray(ids)).size)
            nbytes = sum(mx_bytes(w, live) for w in experts.values())
            f = jax.jit(lambda z, ids, wts, ex: ops.moe_dispatch_combine(z, ids, wts, ex, implementation="triton",
                                                                           interpret=a.interpret))
            _, tm = timeit(f, z, ids, wts, experts, iters=a.decode_iters, budget=budget)
            report("ours_dispatch_ffn_combine", name, tm, nbytes, live_experts=live,
                   tiles=list(gpu.mxfp4_tiles(t * k, e)))
            del experts
        except Exception as exc:  # noqa: BLE001
            err_line(part, "ours_dispatch_ffn_combine", exc, case=name)
        gc.collect()


# ----------------------------------------------------------------------------------------- bf16 expert FFN
def _mosaic_gpu_gmm():
    from pallas_kernels.moe import mosaic_gpu  # noqa: PLC0415 (the Mosaic GPU toolchain, GPU runs only)

    return mosaic_gpu.gmm


def part_ffn(a, budget: Budget) -> None:
    m, e, lat, inter = a.m, a.e, a.lat, a.inter
    part = "ffn"
    flops = 6.0 * m * lat * inter
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (m, lat), jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (e, lat, inter), jnp.float32) / np.sqrt(lat)).astype(jnp.bfloat16)
    w3 = (jax.random.normal(ks[2], (e, lat, inter), jnp.float32) / np.sqrt(lat)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (e, inter, lat), jnp.float32) / np.sqrt(inter)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[4], (m, lat), jnp.bfloat16)
    dists = {"balanced": jnp.full((e,), m // e, jnp.int32), "skewed": jnp.asarray(skewed_sizes(m, e))}

    def glu_ffn(mm):
        def f(x, w1, w3, w2, g):
            h = ref.situ_glu(mm(x, w1, g), mm(x, w3, g))
            return mm(h, w2, g)

        return f

    def dense(x, w1, w3, w2, g):
        del g
        h = ref.situ_glu(x @ w1[0], x @ w3[0])
        return h @ w2[0]

    peers: dict[str, object] = {
        "dense": dense,
        "ours": lambda x, w1, w3, w2, g: ops.expert_ffn(x, g, w1, w3, w2, implementation="triton",
                                                        interpret=a.interpret),
        "mosaic_gpu": lambda x, w1, w3, w2, g: ops.expert_ffn(x, g, w1, w3, w2, implementation="mosaic_gpu"),
        "ours_unfused": glu_ffn(lambda x, w, g: gpu.gmm(x, w, g, interpret=a.interpret)),
        # the mosaic_gpu backend before its fused w1/w3 + SiTU-GLU kernel: three grouped matmuls, SiTU-GLU in XLA
        "mosaic_gpu_unfused": glu_ffn(lambda x, w, g: _mosaic_gpu_gmm()(x, w, g)),
        "reference": lambda x, w1, w3, w2, g: ref.expert_ffn(x, g, w1, w3, w2),
    }
    try:
        peers["tokamax"] = glu_ffn(load_tokamax())
    except Exception as exc:  # noqa: BLE001
        err_line(part, "tokamax", exc, note="import")

    def fwdbwd(f):
        def g(x, w1, w3, w2, gs):
            _, vjp = jax.vjp(lambda *p: f(*p, gs), x, w1, w3, w2)
            return vjp(dy)

        return g

    # (peer, pass) in priority order; each compiled once, then timed on both distributions.
    plan = [("dense", "fwd"), ("ours", "fwd"), ("mosaic_gpu", "fwd"), ("dense", "fwdbwd"), ("ours", "fwdbwd"),
            ("mosaic_gpu", "fwdbwd"), ("mosaic_gpu_unfused", "fwd"), ("mosaic_gpu_unfused", "fwdbwd"),
            ("tokamax", "fwd"), ("tokamax", "fwdbwd"), ("reference", "fwd"), ("reference", "fwdbwd"),
            ("ours_unfused", "fwd")]
    dense_tf: dict[str, float] = {}
    outs: dict[tuple[str, str, str], object] = {}
    for peer, pas in plan:
        if peer not in peers:
            continue
        fn = jax.jit(peers[peer] if pas == "fwd" else fwdbwd(peers[peer]))
        for dist, gs in dists.items():
            if peer == "dense" and dist != "balanced":
                continue
            iters = 2 if peer == "reference" else a.iters
            try:
                # a first (compiling) call needs more room than a re-timing on another distribution
                out, tm = timeit(fn, x, w1, w3, w2, gs, iters=iters, budget=budget,
                                 min_left=8.0 if dist == "balanced" else 2.0)
            except Exception as exc:  # noqa: BLE001
                err_line(part, peer, exc, **{"dist": dist, "pass": pas})
                continue
            tf = (3.0 if pas == "fwdbwd" else 1.0) * flops / (tm["ms"] * 1e-3) / 1e12
            rec = {"part": part, "dist": dist, "peer": peer, "pass": pas, **tm, "tflops": round(tf, 1)}
            if peer == "dense":
                dense_tf[pas] = tf
            if pas in dense_tf:
                rec["pct_dense"] = round(100 * tf / dense_tf[pas], 1)
            if "fwd" in dense_tf:
                rec["pct_dense_fwd"] = round(100 * tf / dense_tf["fwd"], 1)
            if peer in ("ours", "mosaic_gpu", "mosaic_gpu_unfused", "reference"):
                outs[(peer, pas, dist)] = out
            for mine in ("ours", "mosaic_gpu", "mosaic_gpu_unfused"):
                if peer == "reference" and (mine, pas, dist) in outs:
                    rec[f"rel_err_{mine}_vs_ref"] = rel_err(outs[(mine, pas, dist)], out)
            emit(rec)
            del out
        gc.collect()


# ------------------------------------------------------------------------------------ single grouped matmul
def part_gmm(a, budget: Budget) -> None:
    m, e, k, n = a.m, a.e, a.lat, a.inter
    part = "gmm"
    flops = 2.0 * m * k * n
    ks = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    gs = jnp.full((e,), m // e, jnp.int32)
    runs = [("dense", jax.jit(lambda x, w, g: x @ w[0]), None)]
    runs += [("ragged_dot", jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g)), None)]
    for cfg in a.gmm_tiles.split(";"):
        t = tuple(int(v) for v in cfg.split(","))
        runs.append(("ours", jax.jit(lambda x, w, g, t=t: gpu.gmm(x, w, g, tiles=t, interpret=a.interpret)), list(t)))
    for cfg in filter(None, a.mgpu_blocks.split(";")):  # the Mosaic GPU kernel of the mosaic_gpu backend
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415

        names = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
        kw = dict(zip(names, (int(v) for v in cfg.split(",")), strict=True))
        runs.append(("mosaic_gpu", jax.jit(lambda x, w, g, kw=kw: ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=g, **kw)), list(kw.values())))
    try:
        tok = load_tokamax()
        runs.append(("tokamax", jax.jit(tok), None))
    except Exception as exc:  # noqa: BLE001
        err_line(part, "tokamax", exc, note="import")
    for peer, fn, tiles in runs:
        try:
            _, tm = timeit(fn, x, w, gs, iters=2 if peer == "ragged_dot" else a.iters, budget=budget)
            emit({"part": part, "peer": peer, "tiles": tiles, **tm,
                  "tflops": round(flops / (tm["ms"] * 1e-3) / 1e12, 1)})
        except Exception as exc:  # noqa: BLE001
            err_line(part, peer, exc, tiles=tiles)


# --------------------------------------------------------------------------- fused w1/w3 + SiTU-GLU (forward)
def part_glu(a, budget: Budget) -> None:
    """``situ_glu(x w1, x w3)`` per group: the Mosaic GPU fused kernel over ``--glu-blocks`` against the unfused
    products (two grouped matmuls + XLA SiTU-GLU) on the Mosaic GPU and Triton kernels and dense matmuls of the
    same FLOPs; each checked against the ``reference`` output (``jax.lax.ragged_dot``) of its distribution."""
    from pallas_kernels.moe import mosaic_gpu_glu  # noqa: PLC0415 (the Mosaic GPU toolchain, GPU runs only)

    m, e, k, n = a.m, a.e, a.lat, a.inter
    part = "glu"
    flops = 4.0 * m * k * n
    ks = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w1, w3 = ((jax.random.normal(kk, (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16) for kk in ks[1:])
    dists = {"balanced": jnp.full((e,), m // e, jnp.int32), "skewed": jnp.asarray(skewed_sizes(m, e))}
    unfused = lambda mm: lambda x, w1, w3, g: ref.situ_glu(mm(x, w1, g), mm(x, w3, g))
    runs = [("dense", lambda x, w1, w3, g: ref.situ_glu(x @ w1[0], x @ w3[0]), None),
            ("reference", unfused(ref.grouped_matmul), None),
            ("triton_unfused", unfused(lambda x, w, g: gpu.gmm(x, w, g, interpret=a.interpret)), None),
            ("mosaic_gpu_unfused", unfused(lambda x, w, g: _mosaic_gpu_gmm()(x, w, g)), None)]
    for cfg in filter(None, a.glu_blocks.split(";")):
        bn, stages, gbn = (int(v) for v in cfg.split(","))
        blocks = mosaic_gpu_glu.Blocks(block_n=bn, stages=stages, grid_block_n=gbn)
        runs.append(("mosaic_gpu_glu", functools.partial(mosaic_gpu_glu.gmm_glu, blocks=blocks, interpret=a.interpret),
                     [bn, stages, gbn]))
    want: dict[str, object] = {}
    for peer, f, blocks in runs:
        fn = jax.jit(f)
        for dist, gs in dists.items():
            if peer == "dense" and dist != "balanced":
                continue
            try:
                out, tm = timeit(fn, x, w1, w3, gs, iters=2 if peer == "reference" else a.iters, budget=budget)
            except Exception as exc:  # noqa: BLE001
                err_line(part, peer, exc, dist=dist, blocks=blocks)
                continue
            rec = {"part": part, "peer": peer, "dist": dist, "blocks": blocks, **tm,
                   "tflops": round(flops / (tm["ms"] * 1e-3) / 1e12, 1)}
            if peer == "reference":
                want[dist] = out
            elif dist in want and peer != "dense":
                rec["rel_err_vs_ref"] = rel_err(out, want[dist])
            emit(rec)
            del out
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="decode,ffn")
    ap.add_argument("--m", type=int, default=65536, help="routed rows (ffn, gmm)")
    ap.add_argument("--e", type=int, default=64, help="local experts")
    ap.add_argument("--lat", type=int, default=3584, help="latent width L")
    ap.add_argument("--inter", type=int, default=3072, help="expert hidden width I")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--decode-iters", type=int, default=50)
    ap.add_argument("--decode-cases", default="64x8",
                    help="'EXR,...': MXFP4 decode cases of E local experts x R rows each (tile sweeps, expert FFN)")
    ap.add_argument("--routing", default="64:16:896,64:4:16",
                    help="'tokens:topk:experts,...' routed decode steps (K3's, k3-slice's)")
    ap.add_argument("--mx-tiles", default=MX_TILES,
                    help="'tm,tq,tn,warps,stages;...' MXFP4 tiles for the w1 sweep (each checked against the f32 "
                         "reference)")
    ap.add_argument("--mx-glu-tiles", default=MX_GLU_TILES, help="the same for the fused w1/w3 + SiTU-GLU kernel")
    ap.add_argument("--mx-mgpu-tiles", default="8,2,1;8,4,1;8,2,0;8,2,2;16,2,1;16,3,1;16,2,2;32,2,1",
                    help="'tm,stages,mode;...' of the Mosaic GPU MXFP4 kernel (w1 and fused w1/w3 sweeps; mode: "
                         "0 JAX-op decode, 1 inline-PTX decode, 2 PTX with the operand staged in shared memory)")
    ap.add_argument("--gmm-tiles", default="128,64,256,8,3;128,64,128,8,4")
    ap.add_argument("--mgpu-blocks", default="128,128,64,4,1;128,128,64,6,4;64,256,64,4,1;128,192,64,4,1",
                    help="'block_m,block_n,block_k,stages,grid_block_n;...' of the Mosaic GPU kernel (gmm part)")
    ap.add_argument("--glu-blocks", default="128,4,8;128,3,8;128,4,1;128,4,16;64,4,8;192,2,8",
                    help="'block_n,stages,grid_block_n;...' of the Mosaic GPU fused w1/w3 + SiTU-GLU kernel (glu part)")
    ap.add_argument("--budget-glu", type=float, default=90.0)
    ap.add_argument("--budget-decode", type=float, default=60.0)
    ap.add_argument("--budget-ffn", type=float, default=150.0)
    ap.add_argument("--budget-gmm", type=float, default=90.0)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke run, tiny shapes)")
    a = ap.parse_args()
    emit({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "args": vars(a)})
    parts = {"decode": (part_decode, a.budget_decode), "ffn": (part_ffn, a.budget_ffn),
             "gmm": (part_gmm, a.budget_gmm), "glu": (part_glu, a.budget_glu)}
    for name in a.parts.split(","):
        fn, seconds = parts[name]
        try:
            fn(a, Budget(seconds))
        except Exception as exc:  # noqa: BLE001
            err_line(name, "part", exc)
        gc.collect()
        emit({"part": name, "done": True})
    emit({"kernels": [sel.describe() for sel in selections()]})  # what each implementation choice ran


if __name__ == "__main__":
    main()
