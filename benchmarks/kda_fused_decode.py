"""A KDA layer's decode step from its projections on a GPU: the short conv over q | k | v, SiLU, q / k L2 norm, gate,
beta and the state update, three ways on the same inputs, one process.

    python benchmarks/kda_fused_decode.py --batches 64,1 --heads 96

One JSON line per batch:

* ``fused_us``: ``pallas_kernels.kda.ops.fused_decode_step`` on ``triton`` (one kernel: the prologue inside the
  decode kernel, stacked states and conv tails read at a layer), jitted, the states donated;
* ``composed_us``: the prologue in XLA (``reference.decode_prologue``) then the plain Triton decode kernel
  (``recurrent_kda(implementation="triton")``): the layer's decode path before the fused kernel;
* ``fla_us``: fla's two kernels as the serving engines run Kimi-Linear's decode: ``causal_conv1d_update`` (SiLU)
  over the concatenated projections with its ``[B, C, W]`` cache, then ``fused_recurrent_kda`` with the gate, the
  q / k L2 norm and the beta sigmoid in the kernel (``triton.testing.do_bench``);
* ``bytes``: what the step must move (states read and written, conv tails read and written, projections read,
  output written) and ``*_TBps`` = bytes / time; ``copy_gbps``: a 2 GiB device copy measured in the same process
  (``benchmarks/decode.py``'s); ``*_rel_err``: outputs and the layer's states against the fp32-state reference
  composition (the fused path's tails must equal the reference's: ``tail_equal``).

ms are wall time per call of ``--iters`` back-to-back calls (each call's dispatch included, as the engine's
steps are chained on the device this is an upper bound on device time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.decode import copy_bandwidth_gbps  # noqa: E402
from pallas_kernels.kda import ops  # noqa: E402
from pallas_kernels.kda import reference as ref  # noqa: E402

K = V = 128
W = 4
LAYERS = 2
LAYER = 1


def make_inputs(b: int, h: int, seed: int = 0):
    """Projections (bf16), states ``[LAYERS, B, H, K, V]`` f32, conv tails ``[LAYERS, B, W-1, 3HK]`` bf16, conv
    weights ``[LAYERS, W, ·]``, A_log ``[LAYERS, H]``, dt_bias ``[LAYERS, HK]``."""
    ks = jax.random.split(jax.random.key(seed), 12)
    n = lambda key, shape, s=1.0: jax.random.normal(key, shape, jnp.float32) * s
    bf = jnp.bfloat16
    hk = h * K
    proj = (n(ks[0], (b, hk)).astype(bf), n(ks[1], (b, hk)).astype(bf), n(ks[2], (b, hk)).astype(bf),
            n(ks[3], (b, hk), 2.0).astype(bf), n(ks[4], (b, h)).astype(bf))
    state = n(ks[5], (LAYERS, b, h, K, V), 0.1)
    conv = n(ks[6], (LAYERS, b, W - 1, 3 * hk)).astype(bf)
    weights = tuple(n(key, (LAYERS, W, hk), 0.5) for key in ks[7:10])
    a_log = jnp.log(jax.random.uniform(ks[10], (LAYERS, h), minval=1.0, maxval=16.0))
    dt_bias = n(ks[11], (LAYERS, hk), 0.5)
    return proj, state, conv, weights, a_log, dt_bias


def composed_step(proj, state, conv, weights, a_log, dt_bias, layer):
    """The prologue in XLA, then the plain Triton decode kernel on the stacked states (in place)."""
    lb, b = state.shape[:2]
    at = lambda x: jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
    q, k, v, g, beta, tail = ref.decode_prologue(*proj, at(conv), tuple(at(w) for w in weights), at(a_log),
                                                 at(dt_bias))
    o, pool = ops.recurrent_kda(q, k, v, g, beta, initial_state=state.reshape(lb * b, *state.shape[2:]),
                                state_slots=layer * b + jnp.arange(b, dtype=jnp.int32), implementation="triton")
    return o[:, 0], pool.reshape(state.shape), tail


def _time(step, args, state, iters: int) -> tuple[float, tuple]:
    """``(us per call, the first call's outputs as host arrays)``; each call donates the previous one's states."""
    out = step(*args[:1], state, *args[1:])
    first = tuple(np.asarray(x) for x in out)
    for _ in range(5):
        out = step(*args[:1], out[1], *args[1:])
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = step(*args[:1], out[1], *args[1:])
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6, first


def bench(b: int, h: int, iters: int, fla: bool) -> dict:
    proj, state, conv, weights, a_log, dt_bias = make_inputs(b, h)
    state_host = np.asarray(state)
    layer = jnp.int32(LAYER)
    at = lambda x: x[LAYER]
    q, k, v, g, beta, want_tail = ref.decode_prologue(*proj, at(conv), tuple(at(w) for w in weights), at(a_log),
                                                      at(dt_bias))
    want_o, want_state = ref.recurrent_kda(q, k, v, g, beta, None, state[LAYER], True)
    want_o = want_o[:, 0]
    rel = lambda x, y: float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                             / np.linalg.norm(np.asarray(y, np.float64)))
    hk = h * K
    nbytes = 2 * b * h * K * V * 4 + 2 * b * (W - 1) * 3 * hk * 2 + b * (4 * hk + h) * 2 + b * h * V * 2
    res: dict = {"bench": "kda_fused_decode", "batch": b, "heads": h, "K": K, "V": V, "conv_taps": W,
                 "bytes": nbytes, "device": jax.devices()[0].device_kind}
    steps = {
        "fused": lambda p, s, c, w, a, d, l: ops.fused_decode_step(*p, s, c, w, a, d, l, implementation="triton"),
        "composed": composed_step,
    }
    for name, fn in steps.items():
        step = jax.jit(lambda p, s, *rest, fn=fn: fn(p, s, *rest), donate_argnums=(1,))
        t_us, (o, new_state, tail) = _time(step, (proj, conv, weights, a_log, dt_bias, layer),
                                           jnp.asarray(state_host), iters)
        res.update({f"{name}_us": round(t_us, 2), f"{name}_TBps": round(nbytes / t_us / 1e6, 3),
                    f"{name}_o_rel_err": rel(o, want_o), f"{name}_state_rel_err": rel(new_state[LAYER], want_state),
                    f"{name}_tail_equal": bool(np.array_equal(tail, np.asarray(want_tail)))})
    res["fused_vs_composed"] = round(res["composed_us"] / res["fused_us"], 3)
    if fla:
        try:
            res.update(bench_fla(proj, state_host, conv, weights, a_log, dt_bias, want_o, rel))
            res["fused_vs_fla"] = round(res["fla_us"] / res["fused_us"], 3)
        except Exception as e:  # noqa: BLE001 - report and go on
            res["fla_error"] = repr(e)[:300]
    return res


def bench_fla(proj, state_host, conv, weights, a_log, dt_bias, want_o, rel) -> dict:
    import torch
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.ops.kda import fused_recurrent_kda
    from triton.testing import do_bench

    def tt(x, dtype=None):
        t = torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).cuda()
        return t.to(dtype) if dtype is not None else t

    bf = torch.bfloat16
    qp, kp, vp, fp, bp = proj
    b, hk = qp.shape
    h = bp.shape[1]
    x = tt(jnp.concatenate([qp, kp, vp], axis=-1), bf)  # [B, 3HK]
    # fla's cache [B, C, W]: the last W-1 inputs at positions 1..W-1 (position 0 is dropped by the shift)
    tail = np.asarray(jnp.asarray(conv[LAYER], jnp.float32))  # [B, W-1, C]
    cache = torch.zeros((b, 3 * hk, W), dtype=bf, device="cuda")
    cache[:, :, 1:] = torch.from_numpy(tail).cuda().transpose(1, 2).to(bf)
    weight = tt(jnp.concatenate([w[LAYER] for w in weights], axis=-1).T)  # [C, W]
    f, beta = tt(fp, bf).view(b, 1, h, K), tt(bp, bf).view(b, 1, h)
    a, d = tt(a_log[LAYER]), tt(dt_bias[LAYER])
    s0 = torch.from_numpy(state_host[LAYER]).cuda()

    def step():
        y, _ = causal_conv1d_update(x, cache, weight=weight, activation="silu")
        q, k, v = (t.contiguous().view(b, 1, h, K) for t in y.split(hk, dim=-1))
        return fused_recurrent_kda(q, k, v, f, beta, A_log=a, dt_bias=d, initial_state=s0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)

    with torch.no_grad():
        cache_copy = cache.clone()
        o, _ = step()
        cache.copy_(cache_copy)
        err = rel(jnp.asarray(o[:, 0].float().cpu().numpy()), want_o)
        t_ms = do_bench(step, warmup=10, rep=100)
    return {"fla_us": round(t_ms * 1e3, 2), "fla_o_rel_err": err}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="64,1")
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--no-fla", action="store_true")
    args = ap.parse_args(argv)
    gbps = copy_bandwidth_gbps()
    for b in (int(x) for x in args.batches.split(",")):
        res = bench(b, args.heads, args.iters, not args.no_fla)
        res["copy_gbps"] = round(gbps, 1)
        for name in ("fused", "composed", "fla"):
            if f"{name}_us" in res:
                res[f"{name}_copy_fraction"] = round(res["bytes"] / (res[f"{name}_us"] * 1e-6) / (gbps * 1e9), 3)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
