"""Small ops of the decode step's tail, timed alone: the top-k of the log-probs and the lm_head at decode batches.

    python benchmarks/decode_small_ops.py --batches 1,64 --vocab 32768 --hidden 7168 --k 5

One JSON line per (op, variant, batch): median µs of ``--iters`` back-to-back calls (after a warm-up), each call
on its own jitted function of fresh random inputs (f32 log-probs ``[B, V]``; bf16 hidden ``[B, D]`` and weight
``[D, V]``).

* ``topk``: ``jax.lax.top_k`` over the whole row (``single``) vs the two passes of
  :func:`k3_jax.serving.sampling.top_k_in_chunks` forced on with chunks of ``c`` (``chunk{c}``); every variant's
  values and ids are checked equal to ``single``'s. (Wall time per call: it includes the call's dispatch.)
* ``lm_head``: the model's product (``einsum_f32``: bf16 × bf16 accumulated and returned in f32) as it is
  (``plain``) and through :func:`k3_jax.model.lm_head_logits` (``model``); ``bytes_gbps``: the weight's bytes /
  the time. The variants' logits are compared (max abs difference to ``plain``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _median_us(fn, args, iters: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--chunks", default="128,512,1024,2048,4096")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3_jax.layers.common import einsum_f32
    from k3_jax.model import lm_head_logits
    from k3_jax.serving import sampling

    key = jax.random.PRNGKey(0)
    w = (0.02 * jax.random.normal(key, (args.hidden, args.vocab), jnp.float32)).astype(jnp.bfloat16)
    for b in [int(x) for x in args.batches.split(",")]:
        logp = jax.nn.log_softmax(jax.random.normal(jax.random.fold_in(key, b), (b, args.vocab), jnp.float32))
        single = jax.jit(lambda x: jax.lax.top_k(x, args.k))
        want = single(logp)
        variants = {"single": single}
        for c in [int(x) for x in args.chunks.split(",")]:
            def chunked(x, c=c):
                saved = sampling.TOP_K_CHUNK, sampling.TOP_K_CHUNKED_MAX_ROWS
                sampling.TOP_K_CHUNK, sampling.TOP_K_CHUNKED_MAX_ROWS = c, x.size // c  # always chunked here
                try:
                    return sampling.top_k_in_chunks(x, args.k)
                finally:
                    sampling.TOP_K_CHUNK, sampling.TOP_K_CHUNKED_MAX_ROWS = saved
            variants[f"chunk{c}"] = jax.jit(chunked)
        for name, fn in variants.items():
            got = fn(logp)
            same = bool(np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                        and np.array_equal(np.asarray(got[1]), np.asarray(want[1])))
            print(json.dumps({"bench": "decode_small_ops", "op": "topk", "variant": name, "batch": b,
                              "vocab": args.vocab, "k": args.k, "us": round(_median_us(fn, (logp,), args.iters), 2),
                              "same_as_single": same}), flush=True)
        h = jax.random.normal(jax.random.fold_in(key, 100 + b), (b, 1, args.hidden), jnp.float32).astype(jnp.bfloat16)
        heads = {"plain": jax.jit(functools.partial(einsum_f32, "btd,dv->btv")), "model": jax.jit(lm_head_logits)}
        ref = heads["plain"](h, w)
        for name, fn in heads.items():
            out = fn(h, w)
            us = _median_us(fn, (h, w), args.iters)
            print(json.dumps({"bench": "decode_small_ops", "op": "lm_head", "variant": name, "batch": b,
                              "hidden": args.hidden, "vocab": args.vocab, "us": round(us, 2),
                              "bytes_gbps": round(w.size * 2 / us / 1e3, 1),
                              "max_abs_diff_vs_plain": float(jnp.max(jnp.abs(out - ref)))}), flush=True)


if __name__ == "__main__":
    main()
