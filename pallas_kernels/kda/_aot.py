"""Ahead-of-time compile the KDA TPU kernels for a real TPU target on a CPU-only host.

    python -m pallas_kernels.kda._aot v5p v6e [--with-grad] [--kernels=fwd,bwd,decode]  # one JSON line per target

Needs ``libtpu`` (pyproject extra ``aot``). Compiles, at K3 shapes (H=96, K=V=128, bf16 activations):
the chunked forward kernel, the chunked backward kernels (:mod:`pallas_kernels.kda.tpu_bwd`: state sweep +
reverse sweep, at B=1, T=8192), the training path (``jax.grad`` through :func:`pallas_kernels.kda.chunk_kda`,
i.e. the Pallas forward plus the backward kernels, at B=1, T=1024, H=8 with ``--with-grad``), and the
in-place decode kernel. Reports XLA's memory analysis and the kernels' VMEM footprint (double-buffered
blocks + scratch), so a Mosaic lowering error or a VMEM overflow shows up before anyone rents a TPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on the host may hold libtpu

TOPOLOGIES = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "v5e": "v5e:2x2", "v4": "v4:2x2x1"}


def vmem_estimate(K: int, V: int, C: int, in_bytes: int, out_bytes: int) -> dict:
    """Bytes of VMEM the chunk kernel asks for: each pipelined block twice (double buffering) + scratch."""
    lane = lambda n: -(-n // 128) * 128  # last dim padded to 128 lanes
    blocks_in = (2 * C * lane(K) + C * lane(V)) * in_bytes + C * lane(K) * 4  # q, k, v, G
    blocks_in += 2 * C * lane(1) * 4 + 8 * lane(C) * 4 + V * lane(K) * 4  # beta, seg col/row, h0
    blocks_out = C * lane(V) * out_bytes + V * lane(K) * 4
    scratch = V * lane(K) * 4 + 2 * C * lane(C) * 4
    total = 2 * (blocks_in + blocks_out) + scratch
    return {"blocks_in": blocks_in, "blocks_out": blocks_out, "scratch": scratch, "total_double_buffered": total}


def bwd_vmem_estimate(K: int, V: int, C: int, in_bytes: int) -> dict:
    """Bytes of VMEM the two backward kernels ask for (double-buffered blocks + scratch), like
    :func:`vmem_estimate`. Backward: q, k, v, G, beta (col and row), seg col/row, h, dO, dS_T in; dq, dk, dv
    (input dtype), dg, dbeta (fp32), dh0 out; scratch dS [V, K], six [C, C] and three [C, K] fp32 tiles. State sweep:
    k, v, G, beta, seg, h0 in; h out; scratch S [V, K] + one [C, C]."""
    lane = lambda n: -(-n // 128) * 128
    st = V * lane(K) * 4
    b_in = (2 * C * lane(K) + C * lane(V)) * in_bytes + C * lane(K) * 4 + 2 * C * lane(1) * 4
    b_in += 2 * 8 * lane(C) * 4 + st + C * lane(V) * in_bytes + st  # beta/seg rows, h, dO, dS_T
    b_out = (2 * C * lane(K) + C * lane(V)) * in_bytes + (C * lane(K) + C * lane(1)) * 4 + st
    scratch = st + 6 * C * lane(C) * 4 + 3 * C * lane(K) * 4
    s_in = (C * lane(K) + C * lane(V)) * in_bytes + C * lane(K) * 4 + 2 * C * lane(1) * 4 + 8 * lane(C) * 4 + st
    s_scratch = st + C * lane(C) * 4
    return {"bwd": {"blocks_in": b_in, "blocks_out": b_out, "scratch": scratch,
                    "total_double_buffered": 2 * (b_in + b_out) + scratch},
            "states": {"blocks_in": s_in, "blocks_out": st, "scratch": s_scratch,
                       "total_double_buffered": 2 * (s_in + st) + s_scratch}}


def compile_bwd(target: str, T: int = 8192) -> dict:
    """AOT-compile :func:`pallas_kernels.kda.tpu_bwd.chunk_kda_bwd` (both kernels + layout) at B=1, H=96,
    K=V=128, bf16 activations, segment ids, for ``target``."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels.kda import tpu_bwd

    topo = topologies.get_topology_desc(TOPOLOGIES.get(target, target), platform="tpu")
    sh = SingleDeviceSharding(topo.devices[0])
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    bf, f32 = jnp.bfloat16, jnp.float32
    B, H, K, V = 1, 96, 128, 128
    args = [S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, H, V), bf), S((B, T, H, K), f32), S((B, T, H), bf),
            S((B, H, K, V), f32), S((B, T), jnp.int32), S((B, T, H, V), bf), S((B, H, K, V), f32)]
    t0 = time.perf_counter()
    fn = jax.jit(lambda q, k, v, g, b, h0, seg, do, dht: tpu_bwd.chunk_kda_bwd(q, k, v, g, b, K**-0.5, h0, seg,
                                                                               do, dht))
    c = fn.lower(*args).compile()
    m = c.memory_analysis()
    mem = None if m is None else {k: getattr(m, k) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                             "temp_size_in_bytes", "generated_code_size_in_bytes")}
    N = -(-T // 64)
    return {"shape": [B, T, H, K, V], "compile_s": round(time.perf_counter() - t0, 2), "memory": mem,
            "vmem_bytes": bwd_vmem_estimate(K, V, 64, 2), "h_states_bytes": B * H * N * K * V * 4}


def compile_all(target: str, with_grad: bool = False, kernels: tuple = ("fwd", "bwd", "decode")) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels.kda import ops, tpu

    topo = topologies.get_topology_desc(TOPOLOGIES.get(target, target), platform="tpu")
    dev = topo.devices[0]
    sh = SingleDeviceSharding(dev)
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    bf, f32 = jnp.bfloat16, jnp.float32
    out = {"target": target, "device_kind": dev.device_kind}

    def mem(c):
        m = c.memory_analysis()
        if m is None:
            return None
        return {k: getattr(m, k) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                                            "generated_code_size_in_bytes")}

    B, T, H, K, V = 1, 4096, 96, 128, 128
    tok = [S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, H, V), bf), S((B, T, H, K), f32), S((B, T, H), bf)]
    if "fwd" in kernels:
        t0 = time.perf_counter()
        fwd = jax.jit(lambda q, k, v, g, b, h0, seg: tpu.chunk_kda_fwd(q, k, v, g, b, K**-0.5, h0, seg))
        c = fwd.lower(*tok, S((B, H, K, V), f32), S((B, T), jnp.int32)).compile()
        out["fwd"] = {"shape": [B, T, H, K, V], "compile_s": round(time.perf_counter() - t0, 2), "memory": mem(c),
                      "vmem_bytes": vmem_estimate(K, V, 64, 2, 2)}
    if "bwd" in kernels:
        out["bwd"] = compile_bwd(target)

    if not with_grad:
        out["fwd_bwd"] = "skipped (pass --with-grad: jax.grad through ops.chunk_kda, forward + backward kernels)"
    Bg, Tg, Hg = 1, 1024, 8
    gtok = [S((Bg, Tg, Hg, K), bf), S((Bg, Tg, Hg, K), bf), S((Bg, Tg, Hg, V), bf), S((Bg, Tg, Hg, K), f32),
            S((Bg, Tg, Hg), bf)]

    def loss(q, k, v, g, b, h0, seg):
        o, ht = ops.chunk_kda(q, k, v, g, b, None, h0, True, seg, implementation="mosaic_tpu", platform="tpu")
        return jnp.sum(o.astype(f32)) + jnp.sum(ht)

    t0 = time.perf_counter()
    grad = None if not with_grad else jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
    if grad is not None:
        c = grad.lower(*gtok, S((Bg, Hg, K, V), f32), S((Bg, Tg), jnp.int32)).compile()
        out["fwd_bwd"] = {"shape": [Bg, Tg, Hg, K, V], "compile_s": round(time.perf_counter() - t0, 2),
                          "memory": mem(c), "backward": "tpu_bwd kernels (state sweep + reverse sweep)"}

    Bd, P = 64, 128
    if "decode" not in kernels:
        return out
    t0 = time.perf_counter()
    dec = jax.jit(lambda q, k, v, g, b, pool, slots: tpu.decode_step(q, k, v, g, b, K**-0.5, pool, slots),
                  donate_argnums=(5,))
    c = dec.lower(S((Bd, H, K), bf), S((Bd, H, K), bf), S((Bd, H, V), bf), S((Bd, H, K), f32), S((Bd, H), bf),
                  S((P, H, K, V), f32), S((Bd,), jnp.int32)).compile()
    hb = 8
    out["decode"] = {"shape": [Bd, H, K, V, P], "compile_s": round(time.perf_counter() - t0, 2), "memory": mem(c),
                     "vmem_bytes": {"state_block_double_buffered_in_out": 2 * 2 * hb * K * V * 4}}
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    targets = [a for a in argv if not a.startswith("--")] or ["v5p"]
    kernels = ("fwd", "bwd", "decode")
    for a in argv:
        if a.startswith("--kernels="):
            kernels = tuple(a.split("=", 1)[1].split(","))
    for target in targets:
        print(json.dumps(compile_all(target, with_grad="--with-grad" in argv, kernels=kernels)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
