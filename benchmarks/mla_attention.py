"""MLA training attention, forward + backward: cuDNN flash attention vs the blocked XLA path (GPU).

Times ``grad(sum(attention(q, k, v) * do))`` for both implementations of
:func:`k3_jax.layers.mla.causal_attention` at K3's MLA shapes (96 heads, Dqk 192, Dv 128, bf16) and prints one
JSON line per shape and document layout: ``{"shape", "docs", "xla_ms", "cudnn_ms", "speedup", "out_rel",
"grad_rel"}`` (relative L2 differences of the output and of the q/k/v gradients, cuDNN vs XLA); documents enter both as
segment ids (cuDNN: a ``[B, 1, T, T]`` same-document mask).

    python benchmarks/mla_attention.py                 # H200: B=8 T=1024 and B=2 T=4096
    python benchmarks/mla_attention.py --shapes 1x256 --heads 4   # quick check
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

from k3_jax.layers.mla import blocked_causal_attention  # noqa: E402
from pallas_kernels.attention import cudnn_causal_attention  # noqa: E402


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run(b: int, t: int, h: int, docs: int, iters: int) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, 192), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, h, 192), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, h, 128), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, t, h, 128), jnp.bfloat16)
    seg = jnp.tile((jnp.arange(t, dtype=jnp.int32) * docs) // t, (b, 1))  # `docs` equal documents per row
    scale = 192 ** -0.5
    impls = {"xla": lambda q, k, v: blocked_causal_attention(q, k, v, scale, seg),
             "cudnn": lambda q, k, v: cudnn_causal_attention(q, k, v, scale, seg)}
    res = {"shape": f"{b}x{t}x{h}", "docs": docs}
    outs, grads = {}, {}
    for name, fn in impls.items():
        step = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * do),
                                          argnums=(0, 1, 2)))
        res[f"{name}_ms"] = round(_time(step, q, k, v, iters=iters), 3)
        outs[name] = jax.jit(fn)(q, k, v)
        grads[name] = step(q, k, v)[1]
    res["speedup"] = round(res["xla_ms"] / res["cudnn_ms"], 2)
    res["out_rel"] = round(_rel(outs["cudnn"], outs["xla"]), 5)
    res["grad_rel"] = [round(_rel(a, r), 5) for a, r in zip(grads["cudnn"], grads["xla"], strict=True)]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x1024,2x4096", help="BxT list")
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--docs", default="1,3", help="documents per row")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))
        for docs in (int(d) for d in args.docs.split(",")):
            try:
                r = run(b, t, args.heads, docs, args.iters)
            except Exception as e:  # noqa: BLE001 - report and go on with the next shape
                r = {"shape": shape, "docs": docs, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
