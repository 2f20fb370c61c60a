"""Serving throughput on the local backend: engine decode tokens/s at several batch sizes, against a peer that
decodes without a cache (full forward over the padded sequence for every token) in the same run.

    python benchmarks/serve_decode.py --config configs/k3-tiny.json --batches 1,8,32 --gen 32

Prints one JSON line: per batch size the engine's prefill tokens/s (first step: all admissions) and decode
tokens/s (steady state), the no-cache peer's tokens/s, and the cache bytes per sequence (analytic vs held).
Random weights (the numbers do not depend on their values). On CPU the compute dtype is float32.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import load_config
from k3_jax.convert.fixture import random_params
from k3_jax.model import K3ForCausalLM
from k3_jax.serving.engine import Engine
from k3_jax.serving.paged_cache import cache_bytes_per_sequence
from k3_jax.serving.sampling import SamplingParams


def bench_engine(cfg, params, batch: int, prompt_len: int, gen: int) -> dict:
    max_len = prompt_len + gen + 1
    eng = Engine(cfg, params, max_batch=batch, max_len=max_len, prefill_chunk=prompt_len, eos_ids=())
    rs = np.random.RandomState(0)
    prompts = [rs.randint(3, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    sp = SamplingParams(max_tokens=gen, ignore_eos=True)

    def run() -> tuple[float, float, int]:
        for p in prompts:
            eng.add_request(p, sp)
        t0 = time.perf_counter()
        eng.step()  # admissions (prefill + first token) + one decode step
        t1 = time.perf_counter()
        n0 = eng.stats["decode_tokens"]
        while eng.has_work:
            eng.step()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, eng.stats["decode_tokens"] - n0

    run()  # compile
    first, rest, tokens = run()
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eng.cache)) // batch
    return {
        "prefill_plus_first_step_s": round(first, 4),
        "prefill_tok_s": round(batch * prompt_len / first, 1),
        "decode_tok_s": round(tokens / rest, 1),
        "decode_step_ms": round(1000 * rest / (gen - 2), 2),
        "cache_bytes_held_per_slot": int(held),
    }


def bench_nocache(cfg, params, batch: int, prompt_len: int, gen: int, steps: int) -> dict:
    model = K3ForCausalLM(cfg)
    length = prompt_len + gen
    fwd = jax.jit(lambda v, x: model.apply(v, x))
    seq = np.random.RandomState(0).randint(3, cfg.vocab_size, (batch, length)).astype(np.int32)
    variables = {"params": params}
    jax.block_until_ready(fwd(variables, jnp.asarray(seq)))
    t0 = time.perf_counter()
    for i in range(steps):
        logits = fwd(variables, jnp.asarray(seq))
        seq[:, prompt_len + i] = np.asarray(jnp.argmax(logits[:, prompt_len + i - 1], -1))
    dt = time.perf_counter() - t0
    return {"nocache_tok_s": round(batch * steps / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/k3-tiny.json")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--nocache-steps", type=int, default=4)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    cfg = load_config(args.config).replace(dtype=dtype)
    cast = np.float32 if dtype == "float32" else None
    params = random_params(cfg, seed=0)
    if cast is not None:
        params = jax.tree.map(lambda x: np.asarray(x, cast), params)
    params = jax.device_put(params)
    out = {
        "bench": "serve_decode",
        "config": args.config,
        "dtype": dtype,
        "backend": jax.default_backend(),
        "machine": platform.processor() or platform.machine(),
        "prompt_len": args.prompt_len,
        "gen": args.gen,
    }
    analytic = cache_bytes_per_sequence(cfg, args.prompt_len + args.gen + 1, latent_dtype=dtype, conv_dtype=dtype)
    out["cache_bytes_analytic_per_seq"] = analytic["total"]
    for b in (int(x) for x in args.batches.split(",")):
        r = bench_engine(cfg, params, b, args.prompt_len, args.gen)
        r.update(bench_nocache(cfg, params, b, args.prompt_len, args.gen, args.nocache_steps))
        r["speedup_vs_nocache"] = round(r["decode_tok_s"] / r["nocache_tok_s"], 2)
        out[f"batch_{b}"] = r
    print(json.dumps(out))


if __name__ == "__main__":
    main()
